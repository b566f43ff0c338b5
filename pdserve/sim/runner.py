"""The simulation: production routing and autoscaling driving simulated engines on virtual time.

Lifecycle of `Simulation.run(workload)`:
1. build a `RequestLedger` (the object the Ray backend routes through) and, when the topology
   has bounds, an `Autoscaler`; add the initial engines (ready at t=0);
2. feed arrivals one event at a time; each arrival asks `RequestLedger.admit` (which calls the
   pure `routing.place` / `place_colocated`) for an admission, and the request goes where it
   says: a colocated or local prefill runs whole on one engine, a remote one runs its prefill
   leg on a prefill engine, streams its first token, and its decode leg pulls the KV and
   decodes on the decode engine. A `Rejection` is a failed request, as the client sees a 429;
3. drive the request ledger with the lifecycle events the Ray backend's request flow sends
   (`admit`, `leg_started`, `leg_output`, `leg_finished`, `request_finished`; engine KV usage
   as engine reports), in virtual time: the same books, the same routing inputs;
4. every `autoscale_interval_s`, `Autoscaler.evaluate` (the pure `policy.decide` per pool) and
   apply its decisions like `RayBackend.scale_to`: a new engine is added not ready and becomes
   ready after the profile's `startup_s`; a drained one (least busy first) takes no new
   requests and is removed once idle. Every decision is logged with its reason, and pool sizes
   are sampled at every evaluation;
5. turn each request's timeline into the harness's `RequestOutcome`, so `compute_metrics` gives
   the same metrics, names and goodput as a measured run (see results.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pdserve.autoscaler.controller import Autoscaler
from pdserve.autoscaler.policy import PoolBounds, ScalingDecision, ScalingPolicy
from pdserve.engine.types import Leg
from pdserve.scheduler.ledger import LedgerEvent, RequestLedger
from pdserve.scheduler.routing import Rejection, RoutingPolicy
from pdserve.scheduler.types import COLOCATED, DECODE, PREFILL
from pdserve.slo import SloTargets
from pdserve.sim.baselines import TtftOnlyAutoscaler
from pdserve.sim.engine import SimEngine, SimRequest
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.events import EventQueue
from pdserve.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Topology:
    """Initial engines per pool and, for autoscaled pools, their bounds.

    `Topology.colocated(4)`, `Topology.disaggregated(2, 6)` (2P6D); `bounds` maps pool ->
    PoolBounds and turns the autoscaler on.
    """

    pools: Mapping[str, int]
    bounds: Mapping[str, PoolBounds] | None = None

    def __post_init__(self) -> None:
        names = set(self.pools)
        if names not in ({COLOCATED}, {PREFILL, DECODE}):
            raise ValueError(f"pools must be {{colocated}} or {{prefill, decode}}, got {names}")
        if self.bounds is not None and set(self.bounds) - names:
            raise ValueError("bounds name pools the topology does not have")

    @classmethod
    def colocated(cls, replicas: int, bounds: PoolBounds | None = None) -> Topology:
        return cls({COLOCATED: replicas}, {COLOCATED: bounds} if bounds else None)

    @classmethod
    def disaggregated(cls, prefill: int, decode: int, prefill_bounds: PoolBounds | None = None,
                      decode_bounds: PoolBounds | None = None) -> Topology:
        bounds = {k: b for k, b in ((PREFILL, prefill_bounds), (DECODE, decode_bounds)) if b}
        return cls({PREFILL: prefill, DECODE: decode}, bounds or None)

    @property
    def disaggregated_mode(self) -> bool:
        return PREFILL in self.pools

    @property
    def name(self) -> str:
        if self.disaggregated_mode:
            return f"{self.pools[PREFILL]}P{self.pools[DECODE]}D"
        return f"colocated x{self.pools[COLOCATED]}"


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: EngineProfile
    topology: Topology
    slo: SloTargets | None = None  # what the router and autoscaler hold (seconds)
    routing: RoutingPolicy = RoutingPolicy()
    scaling: ScalingPolicy = ScalingPolicy()
    autoscale_interval_s: float = 10.0
    sample_interval_s: float = 10.0  # pool sizes are recorded this often
    window_s: float = 30.0  # the SLO tracker's window
    record_itls: bool = True  # per-token gaps (memory grows with steps; off for large runs)
    skip_steps: bool = True  # one event per decode-only run of steps (same timeline, faster)
    # The engines' steps wander as the profile's trace showed (EngineProfile.step_noise), drawn
    # from this seed; None: every step takes the model's time (deterministic, the default).
    step_noise: int | None = None
    # Every engine on one host (the CPU box): where the profile measured engines of a host
    # slowing each other (EngineProfile.interference), a step started while another engine runs
    # one takes longer. False: each engine has its host to itself (GPUs, the default).
    shared_host: bool = False
    keep_requests: bool = True  # per-request outcomes (off: only streaming summaries)
    # "pdserve": the production Autoscaler; "ttft_only": the reactive baseline (baselines.py).
    autoscaler: str = "pdserve"
    # A fixed cluster: the autoscaler's shared GPU budget (`autoscale.max_gpus`); None: unbounded.
    max_gpus: int | None = None


@dataclass(slots=True)
class PoolSample:
    t: float
    pool: str
    ready: int
    starting: int
    draining: int
    kv_usage: float
    busy: float  # share of the pool's engines stepping


@dataclass(slots=True)
class SimRun:
    """What happened: per-request timelines, the engines' lives, scaling decisions."""

    config: SimConfig
    workload: Workload
    requests: list[SimRequest]
    engines: list[SimEngine]
    decisions: list[tuple[float, ScalingDecision]]
    samples: list[PoolSample]
    end_s: float
    wall_s: float
    events: int
    rejected: dict[str, int] = field(default_factory=dict)

    def gpu_hours(self) -> float:
        return sum(((e.removed if e.removed is not None else self.end_s) - e.created)
                   * e.profile.gpus for e in self.engines) / 3600.0

    def gpu_hours_by_pool(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.engines:
            end = e.removed if e.removed is not None else self.end_s
            out[e.pool] = out.get(e.pool, 0.0) + (end - e.created) * e.profile.gpus / 3600.0
        return out


class Simulation:
    def __init__(self, config: SimConfig,
                 observer: Callable[[LedgerEvent], None] | None = None) -> None:
        """`observer`: sees every lifecycle event the simulation books (tests, tracing)."""
        self.config = config
        self.queue = EventQueue()
        perf = config.profile.perf
        self.ledger = RequestLedger(list(config.topology.pools), perf, config.slo,
                                    config.routing, window_s=config.window_s, prefix_aware=False,
                                    observer=observer)
        self.autoscaler = build_autoscaler(config)
        self._engines: dict[str, dict[str, SimEngine]] = {p: {} for p in config.topology.pools}
        self._all_engines: list[SimEngine] = []
        self._next_index = {p: 0 for p in config.topology.pools}
        self.decisions: list[tuple[float, ScalingDecision]] = []
        self.samples: list[PoolSample] = []
        self.rejected: dict[str, int] = {}
        self.requests: list[SimRequest] = []
        self.on_request_done = None  # optional callback(SimRequest) for streaming summaries
        self._pending = 0
        self._response = config.profile.response_of

    # --- engines (the actuator) -------------------------------------------------------------

    def add_engine(self, pool: str, ready: bool) -> SimEngine:
        index = self._next_index[pool]
        self._next_index[pool] += 1
        rid = f"{pool}-{index}"
        p = self.config.profile
        engine = SimEngine(rid, pool, p, self.queue, self._first_token, self._finished,
                           self._kv_changed, self._stepped, self._pulled, self._maybe_remove,
                           self.config.record_itls, self.config.skip_steps, self.config.step_noise,
                           host=self._all_engines if self.config.shared_host else None)
        engine.draining = False
        self._engines[pool][rid] = engine
        self._all_engines.append(engine)
        self.ledger.engines.add(pool, rid, p.block_size, p.num_kv_blocks, ready=ready)
        if not ready:
            self.queue.after(p.startup_s, self._engine_ready, engine)
        return engine

    def _engine_ready(self, engine: SimEngine) -> None:
        if engine.replica_id in self._engines[engine.pool] and not engine.draining:
            # As the Ray actuator: the started engine is routed to from now on.
            self.ledger.engines.mark_ready(engine.pool, engine.replica_id)

    def scale_to(self, pool: str, target: int) -> None:
        """Add or drain engines so the pool heads for `target` serving engines."""
        serving = [e for e in self._engines[pool].values() if not e.draining]
        for _ in range(target - len(serving)):
            self.add_engine(pool, ready=False)
        if target < len(serving):
            started = [e for e in serving if self.ledger.engine(pool, e.replica_id).ready]
            started.sort(key=lambda e: (not self.ledger.engine(pool, e.replica_id).idle,
                                        e.batch + len(e.waiting), e.replica_id))
            for engine in started[: len(serving) - target]:
                engine.draining = True
                self.ledger.engines.drain(pool, engine.replica_id)
                self._maybe_remove(engine)

    def _maybe_remove(self, engine: SimEngine) -> None:
        if engine.draining and engine.removed is None and engine.idle:
            if self.ledger.engine(engine.pool, engine.replica_id).idle:
                engine.removed = self.queue.now
                del self._engines[engine.pool][engine.replica_id]
                self.ledger.remove_engine(engine.pool, engine.replica_id)

    def _autoscale(self, _: object = None) -> None:
        now = self.queue.now
        for decision in self.autoscaler.evaluate(self.ledger, now):
            if decision.delta:
                self.decisions.append((now, decision))
                self.scale_to(decision.pool, decision.target)
        if self._pending:
            self.queue.after(self.config.autoscale_interval_s, self._autoscale)

    def _sample(self, _: object = None) -> None:
        now = self.queue.now
        for pool, engines in self._engines.items():
            states = [self.ledger.engine(pool, rid) for rid in engines]
            n = max(len(engines), 1)
            self.samples.append(PoolSample(
                now, pool, sum(s.ready and not s.draining for s in states),
                sum(not s.ready and not s.draining for s in states),
                sum(s.draining for s in states),
                sum(e.kv_usage for e in engines.values()) / n,
                sum(e.busy for e in engines.values()) / n))
        if self._pending:
            self.queue.after(self.config.sample_interval_s, self._sample)

    # --- request path -----------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        wl = self._workload
        if i + 1 < len(wl):
            self.queue.schedule(float(wl.arrivals[i + 1]), self._arrive, i + 1)
        now = self.queue.now
        req = SimRequest(i, now, int(wl.prompts[i]), int(wl.outputs[i]))
        if self.config.keep_requests:
            self.requests.append(req)
        admission = self.ledger.admit(str(i), range(req.prompt), req.output, now)
        if isinstance(admission, Rejection):
            req.error = f"rejected: {admission.reason}"
            self.rejected[admission.reason] = self.rejected.get(admission.reason, 0) + 1
            self._done(req)
            return
        req.admission = admission
        placement = admission.placement
        req.ttft_pool, req.decode_pool = admission.ttft_pool, admission.decode_pool
        req.decode_engine = self._engines[admission.decode_pool][placement.decode]
        if placement.prefill is None:
            engine = req.decode_engine
        else:
            engine = req.prefill_engine = self._engines[PREFILL][placement.prefill]
            req.leg = "prefill"
        self.ledger.leg_started(admission, admission.first_leg, now)
        engine.submit_prefill(req)

    def _first_token(self, req: SimRequest, engine: SimEngine) -> None:
        now = self.queue.now
        # The client sees the first token after the way out (the response path).
        visible = now + self._response(req.prompt)
        ledger, admission = self.ledger, req.admission
        leg = Leg(req.leg)
        ends = req.output == 1
        ledger.leg_output(admission, leg, visible, 1, finished=ends)
        if leg is Leg.FULL and not ends:
            return  # it decodes here
        ledger.leg_finished(admission, leg, visible, "length")
        if ends:
            if leg is Leg.PREFILL:  # nothing to pull: the prefill engine frees the prompt's blocks
                engine.release_prefill(req)
            self._done(req)
            return
        # Prefill leg done: the decode leg starts (KV pull, then decode).
        req.leg = "decode"
        ledger.leg_started(admission, Leg.DECODE, now)
        req.decode_engine.submit_decode(req)

    def _finished(self, req: SimRequest, engine: SimEngine) -> None:
        self.ledger.leg_finished(req.admission, Leg(req.leg), self.queue.now, "length")
        self._done(req)

    def _done(self, req: SimRequest) -> None:
        self._pending -= 1
        self._last_done = self.queue.now
        if not req.error:
            visible = req.finish + self._response(req.prompt)
            self.ledger.request_finished(req.admission, visible, req.output, "length")
            for engine in (req.prefill_engine, req.decode_engine):
                if engine is not None and engine.draining:
                    self._maybe_remove(engine)
        if self.on_request_done is not None:
            self.on_request_done(req)

    def _kv_changed(self, engine: SimEngine) -> None:
        self.ledger.engines.report(engine.pool, engine.replica_id, kv_usage=engine.kv_usage)

    def _pulled(self, req: SimRequest, engine: SimEngine) -> None:
        # The decode leg's first output: the KV is here (the pin on the prefill engine goes).
        self.ledger.leg_output(req.admission, Leg.DECODE, self.queue.now, 0)
        self._maybe_remove(req.prefill_engine)

    def _stepped(self, engine: SimEngine, seconds: float) -> None:
        self.ledger.decode_gap(engine.pool, engine.replica_id, seconds, 1)

    # --- run --------------------------------------------------------------------------------

    def run(self, workload: Workload) -> SimRun:
        started = time.perf_counter()
        self._workload = workload
        for pool, count in self.config.topology.pools.items():
            for _ in range(count):
                self.add_engine(pool, ready=True)
        self._pending = len(workload)
        if len(workload):
            self.queue.schedule(float(workload.arrivals[0]), self._arrive, 0)
            self.queue.schedule(0.0, self._sample)
            if self.autoscaler is not None:
                self.queue.schedule(self.config.autoscale_interval_s, self._autoscale)
        self._last_done = 0.0
        self.queue.run()
        end = self._last_done
        return SimRun(self.config, workload, self.requests, self._all_engines, self.decisions,
                      self.samples, end, time.perf_counter() - started, self.queue.processed,
                      dict(self.rejected))


def build_autoscaler(config: SimConfig) -> Autoscaler | TtftOnlyAutoscaler | None:
    """The run's autoscaler (production or the TTFT-only baseline), None for a static topology;
    shared by the per-request and the fluid simulators."""
    if not config.topology.bounds:
        return None
    if config.slo is None:
        raise ValueError("an autoscaled topology needs SLO targets")
    if config.autoscaler == "ttft_only":
        return TtftOnlyAutoscaler(config.topology.bounds, config.slo.ttft_s)
    return Autoscaler(config.topology.bounds, config.slo, config.scaling,
                      max_gpus=config.max_gpus,
                      gpus_per_engine={pool: config.profile.gpus for pool in config.topology.bounds})


def simulate(config: SimConfig, workload: Workload) -> SimRun:
    return Simulation(config).run(workload)

