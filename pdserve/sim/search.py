"""Placement search: the cheapest deployment that meets an SLO attainment goal on a workload.

As DistServe searches placements with a simulator: for n = 1, 2, ... GPUs (engines x the
profile's GPUs per engine), simulate every static candidate with n engines (colocated x n and
every xPyD with x + y = n) on the same workload and stop at the first n where some candidate's
attainment (share of all requests meeting every target, failures included) reaches the goal;
among those, the highest attainment wins. Optionally the autoscaler is then tuned around the
winner: bounds up to the winner's size per pool and a few target utilisations, scored by
GPU-hours among those that still meet the goal.

Every candidate runs the full simulator (production routing and scaling), so this is as
trustworthy as the simulator and as slow as n x candidates simulations; pass a short
representative workload (minutes of traffic) or use cells for big ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from pdserve.autoscaler.policy import PoolBounds
from pdserve.slo import SloTargets
from pdserve.sim.results import LatencyRecorder
from pdserve.sim.runner import SimConfig, Simulation, Topology
from pdserve.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Trial:
    topology: Topology
    attainment: float
    gpu_hours: float
    goodput: float
    p90_ttft_ms: float
    p90_tpot_ms: float
    target_utilization: float | None = None

    def as_dict(self) -> dict:
        return {"topology": self.topology.name, "pools": dict(self.topology.pools),
                "bounds": ({p: [b.min_replicas, b.max_replicas]
                            for p, b in self.topology.bounds.items()}
                           if self.topology.bounds else None),
                "target_utilization": self.target_utilization,
                "attainment": self.attainment, "gpu_hours": self.gpu_hours,
                "request_goodput": self.goodput, "p90_ttft_ms": self.p90_ttft_ms,
                "p90_tpot_ms": self.p90_tpot_ms}


def evaluate(config: SimConfig, workload: Workload, goodput: SloTargets) -> Trial:
    """Simulate one candidate and score it with the harness's attainment rule."""
    sim = Simulation(replace(config, record_itls=False, keep_requests=False))
    recorder = LatencyRecorder(len(workload), config.profile.response_of)
    sim.on_request_done = recorder
    run = sim.run(workload)
    duration = max(run.end_s - float(workload.arrivals[0]), 1e-9)
    summary = recorder.summary(duration, goodput, (90.0,))
    return Trial(config.topology, summary["slo_attainment"]["all"], run.gpu_hours(),
                 summary["request_goodput"], summary["p90_ttft_ms"], summary["p90_tpot_ms"],
                 config.scaling.target_utilization if config.topology.bounds else None)


def candidates(engines: int, colocated: bool = True, disaggregated: bool = True
               ) -> Iterable[Topology]:
    if colocated:
        yield Topology.colocated(engines)
    if disaggregated:
        for prefill in range(1, engines):
            yield Topology.disaggregated(prefill, engines - prefill)


def search_static(base: SimConfig, workload: Workload, goodput: SloTargets, goal: float,
                  max_engines: int, colocated: bool = True, disaggregated: bool = True,
                  log: Callable[[Trial], None] | None = None) -> tuple[Trial | None, list[Trial]]:
    """The cheapest static topology reaching `goal` attainment, and every trial run."""
    trials: list[Trial] = []
    for n in range(1, max_engines + 1):
        meeting = []
        for topology in candidates(n, colocated, disaggregated):
            trial = evaluate(replace(base, topology=topology), workload, goodput)
            trials.append(trial)
            if log:
                log(trial)
            if trial.attainment >= goal:
                meeting.append(trial)
        if meeting:
            return max(meeting, key=lambda t: (t.attainment, t.goodput)), trials
    return None, trials


def search_autoscaled(base: SimConfig, workload: Workload, goodput: SloTargets, goal: float,
                      static: Trial, utilizations: Iterable[float] = (0.6, 0.7, 0.8),
                      log: Callable[[Trial], None] | None = None
                      ) -> tuple[Trial | None, list[Trial]]:
    """Autoscaler settings around a static winner: start at its size, bounds [1, 2 x size] per
    pool, a few target utilisations; the cheapest in GPU-hours that still meets the goal."""
    pools = static.topology.pools
    bounds = {p: PoolBounds(1, 2 * n) for p, n in pools.items()}
    start = dict(pools)
    trials = []
    for util in utilizations:
        config = replace(base, topology=Topology(start, bounds),
                         scaling=replace(base.scaling, target_utilization=util))
        trial = evaluate(config, workload, goodput)
        trials.append(trial)
        if log:
            log(trial)
    meeting = [t for t in trials if t.attainment >= goal]
    return (min(meeting, key=lambda t: t.gpu_hours) if meeting else None), trials
