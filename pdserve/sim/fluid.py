"""The fluid simulation: production routing and autoscaling over engine groups in fixed time steps.

The per-request simulator (runner.py) costs one routing call over every engine per request and a
few events per request: ~8k requests per CPU-second, ~170/s behind 1000 engines. A day at 10k
requests/s (864M requests) needs something else. Here time advances in steps of `step_s`;
each step's arrivals are grouped into cohorts and each cohort is placed once; engines advance
by batch; latencies go into histograms. Lifecycle of `FluidSimulation.run(arrivals)`:

1. each pool's engines are split into at most `max_groups` `EngineGroup`s (fluid_group.py);
   a group is what the router sees as one engine. Two `RequestLedger`s hold the books:
   `router` has one engine per group, with per-engine values (queued prompt tokens, decode
   batch, KV usage; fractional, since a group's load is spread over its engines), and routes
   through the production `RequestLedger.place` -> `routing.place` / `place_colocated` and
   books each cohort with `admit_cohort`, then `resync`s each group's books once per step;
   `census` has one engine per real engine and feeds `Autoscaler.evaluate` -> `policy.decide`
   the same signals the per-request simulator gives it (pool size, starting engines, KV usage,
   decode batch, the SLO tracker's windowed TTFT/TPOT and arriving prompt tokens);
2. per step: arrivals in [t, t + step_s) are bucketed by shape (prompt length to a factor of
   2, output to a factor of 16) and each bucket is cut into cohorts of at most
   `cohort_per_engine` x (smallest group's engines) requests, so a cohort never asks more of a
   group than its engines can share out evenly; each cohort is routed once (its mean lengths)
   and the router's books are updated by its totals before the next is routed. A `Rejection`
   fails the whole cohort (as 429s);
3. each group prefills its step's arrivals (exact arrival times and lengths), which gives every
   request's first token; decode legs join their decode group (after the KV pull for remote
   prefills) and the groups advance (see fluid_group.py);
4. every `autoscale_interval_s`, the census is brought up to date and the autoscaler's decisions
   applied like `Simulation.scale_to`: new engines start (ready after the profile's start-up),
   a scale-down drains an engine of the largest group (a group of one drains like an engine
   and is removed once idle; a larger group hands its load to its other engines);
5. finished requests' TTFT / TPOT / E2EL and SLO verdicts go into an `OutcomeTally`
   (histogram.py), summarised under the harness's keys.

At small scale (engines <= max_groups, sparse arrivals) every group is one engine and every
cohort one request: it routes request by request like the per-request simulator, and differs
only in the engine model (a pooled FIFO prefill queue, batches updated once per step).
`benchmarks/sim_fluid_agreement.py` measures the agreement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.autoscaler.policy import ScalingDecision
from pdserve.slo import SloTargets
from pdserve.scheduler.ledger import RequestLedger
from pdserve.scheduler.routing import Rejection
from pdserve.scheduler.types import COLOCATED, DECODE, PREFILL
from pdserve.sim.fluid_group import EngineGroup
from pdserve.sim.histogram import OutcomeTally
from pdserve.sim.results import config_section
from pdserve.sim.runner import PoolSample, SimConfig, build_autoscaler


@dataclass(frozen=True, slots=True)
class FluidConfig:
    step_s: float = 0.1  # one fluid step of virtual time
    max_groups: int = 16  # per pool: engines are grouped beyond this
    cohort_per_engine: float = 1.0  # cohort size cap, in requests per engine of the smallest group
    resolve_every_s: float = 1.0  # how often finished requests are turned into latencies
    # TTFT and TPOT samples per second per pool given to the autoscaler's SLO tracker (a
    # windowed percentile needs a few thousand per window, not every request).
    tracker_samples_per_s: float = 100.0

    def __post_init__(self) -> None:
        if self.step_s <= 0 or self.max_groups < 1 or self.cohort_per_engine <= 0:
            raise ValueError("fluid step, groups and cohort size must be positive")


@dataclass(slots=True)
class FluidRun:
    """What happened, in totals: the tally, the groups' lives, the scaling decisions."""

    config: SimConfig
    fluid: FluidConfig
    tally: OutcomeTally
    groups: list[EngineGroup]
    decisions: list[tuple[float, ScalingDecision]]
    samples: list[PoolSample]
    first_s: float
    end_s: float
    wall_s: float
    requests: int
    steps: int
    route_calls: int
    gpu_hours_by_pool: dict[str, float]
    engines_started: int
    rejected: dict[str, int] = field(default_factory=dict)

    def gpu_hours(self) -> float:
        return sum(self.gpu_hours_by_pool.values())

    def summary(self, percentiles: Sequence[float] = (50.0, 90.0, 99.0)) -> dict[str, Any]:
        """Harness keys (as `results.run_json` with a `LatencyRecorder`) plus `simulation`."""
        body = {"label": "sim-fluid", "num_prompts": self.requests,
                **self.tally.summary(self.end_s - self.first_s, percentiles)}
        cfg = self.config
        body["simulation"] = {
            "mode": "fluid",
            **config_section(cfg),
            "fluid": {"step_s": self.fluid.step_s, "max_groups": self.fluid.max_groups,
                      "cohort_per_engine": self.fluid.cohort_per_engine,
                      "steps": self.steps, "route_calls": self.route_calls,
                      "groups": len(self.groups),
                      "overcommit_group_steps": sum(g.overcommit_steps for g in self.groups)},
            "simulated_s": self.end_s,
            "gpu_hours": self.gpu_hours(),
            "gpu_hours_by_pool": dict(self.gpu_hours_by_pool),
            "engines_started": self.engines_started,
            "rejected": dict(self.rejected),
            "scaling_decisions": [
                {"t_s": t, "pool": d.pool, "from": d.current, "to": d.target, "reason": d.reason,
                 "detail": d.detail} for t, d in self.decisions],
            "pool_sizes": [
                {"t_s": s.t, "pool": s.pool, "ready": s.ready, "starting": s.starting,
                 "draining": s.draining, "kv_usage": round(s.kv_usage, 4),
                 "busy": round(s.busy, 4)} for s in self.samples],
            "wall_s": self.wall_s,
            "simulated_requests_per_wall_s": self.requests / self.wall_s if self.wall_s else None,
        }
        return body


def _buckets(prompts: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Cohort shape key: prompt to a factor of 2 (it decides local vs remote prefill and the
    TTFT admission), output to a factor of 16 (it only enters the KV-room check). int16, so a
    stable argsort is a radix sort; `frexp`'s exponent is floor(log2) + 1, exactly."""
    return ((np.frexp(prompts)[1] << 8) | ((np.frexp(outputs)[1] - 1) >> 2)).astype(np.int16)


class FluidSimulation:
    def __init__(self, config: SimConfig, fluid: FluidConfig = FluidConfig(),
                 goodput: SloTargets | None = None) -> None:
        self.config = config
        self.fluid = fluid
        perf = config.profile.perf
        pools = list(config.topology.pools)
        self.router = RequestLedger(pools, perf, config.slo, config.routing,
                                    window_s=config.window_s, prefix_aware=False)
        self.census = RequestLedger(pools, perf, config.slo, config.routing,
                                    window_s=config.window_s, prefix_aware=False)
        self.autoscaler = build_autoscaler(config)
        self.tally = OutcomeTally(goodput)
        self.groups: dict[str, dict[str, EngineGroup]] = {p: {} for p in pools}
        self._all_groups: list[EngineGroup] = []
        self._group_index = {p: 0 for p in pools}
        self._engine_index = {p: 0 for p in pools}
        self._draining_engines: dict[str, int] = {p: 0 for p in pools}  # census: whole-group drains
        self.decisions: list[tuple[float, ScalingDecision]] = []
        self.samples: list[PoolSample] = []
        self.rejected: dict[str, int] = {}
        self.route_calls = 0
        self._gpu_s = {p: 0.0 for p in pools}
        self._response = config.profile.response_of
        self._disaggregated = config.topology.disaggregated_mode
        self._end_s = 0.0
        self._rng = np.random.default_rng(0)  # tracker subsampling only
        self._sample_p = 1.0

    # --- engines (the actuator) -------------------------------------------------------------

    def _new_group(self, pool: str, now: float) -> EngineGroup:
        gid = f"{pool}-g{self._group_index[pool]}"
        self._group_index[pool] += 1
        group = EngineGroup(gid, pool, self.config.profile, now)
        group.free_at = now
        self.groups[pool][gid] = group
        self._all_groups.append(group)
        p = self.config.profile
        self.router.engines.add(pool, gid, p.block_size, p.num_kv_blocks, ready=False)
        return group

    def _add_engine(self, pool: str, now: float, ready: bool) -> None:
        live = [g for g in self.groups[pool].values() if not g.draining]
        if len(live) < self.fluid.max_groups:
            group = self._new_group(pool, now)
        else:
            group = min(live, key=lambda g: (g.engines, g.group_id))
        rid = f"{pool}-{self._engine_index[pool]}"
        self._engine_index[pool] += 1
        p = self.config.profile
        self.census.engines.add(pool, rid, p.block_size, p.num_kv_blocks, ready=ready)
        if ready:
            group.ready.append(rid)
            self.router.engines.mark_ready(pool, group.group_id)
        else:
            group.starting.append((now + p.startup_s, rid))

    def scale_to(self, pool: str, target: int, now: float) -> None:
        """Add or drain engines so the pool heads for `target` serving engines."""
        live = [g for g in self.groups[pool].values() if not g.draining]
        serving = sum(g.engines for g in live)
        for _ in range(target - serving):
            self._add_engine(pool, now, ready=False)
        for _ in range(serving - target):
            # Only started engines drain; a group keeps one while others are still starting.
            started = [g for g in live if not g.draining
                       and (len(g.ready) > 1 or (len(g.ready) == 1 and not g.starting))]
            if not started:
                break
            # The least busy first, as Simulation.scale_to: a lone idle engine, else the group
            # whose engines have the smallest batch (its load spreads over the rest).
            group = min(started, key=lambda g: (len(g.ready) > 1 or not g.idle(now),
                                                g.batch, -len(g.ready), g.group_id))
            if len(group.ready) == 1 and not group.starting:
                group.draining = True
                self.router.engines.drain(pool, group.group_id)
                self.census.engines.drain(pool, group.ready[0])
                self._draining_engines[pool] += 1
            else:
                self.census.remove_engine(pool, group.ready.pop())

    def _retire_idle(self, now: float) -> None:
        for pool, groups in self.groups.items():
            for gid in [g for g, grp in groups.items() if grp.draining and grp.idle(now)]:
                group = groups.pop(gid)
                group.removed = now
                self.router.remove_engine(pool, gid)
                for rid in group.ready:
                    self.census.remove_engine(pool, rid)
                self._draining_engines[pool] -= len(group.ready)

    # --- one step ---------------------------------------------------------------------------

    def _step(self, t0: float, t1: float, arrivals) -> None:
        for pool, groups in self.groups.items():
            for group in groups.values():
                for rid in group.begin_step(t0, t1):
                    self.census.engines.mark_ready(pool, rid)
                    self.router.engines.mark_ready(pool, group.group_id)
        times, prompts, outputs = arrivals
        if len(times):
            self._route(times, prompts, outputs, t0, t1)
        for groups in self.groups.values():
            for group in groups.values():
                group.advance(t0, t1)
        dt = t1 - t0
        for pool, groups in self.groups.items():
            engines = sum(g.engines for g in groups.values())
            self._gpu_s[pool] += engines * dt * self.config.profile.gpus
            for group in groups.values():
                ready = max(len(group.ready), 1)
                self.router.resync(
                    pool, group.group_id, queued_prefill_tokens=group.queued_tokens(t1) / ready,
                    num_decoding=(group.decoding + group.joining.count()) / ready,
                    kv_usage=group.kv_used / (ready * self.config.profile.num_kv_blocks))

    def _route(self, times, prompts, outputs, t0: float, t1: float) -> None:
        """Place the step's arrivals cohort by cohort, then prefill them in their groups."""
        count = len(times)
        keys = _buckets(prompts, outputs)
        order = np.argsort(keys, kind="stable")  # int16 keys: a radix sort
        starts, sizes = self._cohorts(keys[order])
        # Cohort totals in one pass: tokens in and out per cohort.
        tokens = np.add.reduceat(prompts[order], starts).tolist()
        outs = np.add.reduceat(outputs[order], starts).tolist()
        slots: dict[int, int] = {}  # id(group) -> its number in `groups` for this step
        groups: list[EngineGroup] = []
        prefill_of = np.empty(len(sizes), np.intp)  # per cohort; -1: rejected
        decode_of = np.empty(len(sizes), np.intp)
        prof = self.config.profile
        for i, (size, tok, out) in enumerate(zip(sizes.tolist(), tokens, outs)):
            placed = self._place(size, tok, out, t0, prof)
            if placed is None:
                prefill_of[i] = decode_of[i] = -1
                continue
            for g in placed:
                if id(g) not in slots:
                    slots[id(g)] = len(groups)
                    groups.append(g)
            prefill_of[i], decode_of[i] = slots[id(placed[0])], slots[id(placed[1])]
        # Per request, in arrival order: the cohorts' groups scattered back through `order`.
        request_prefill = np.empty(count, np.intp)
        request_prefill[order] = np.repeat(prefill_of, sizes)
        request_decode = np.empty(count, np.intp)
        request_decode[order] = np.repeat(decode_of, sizes)
        # The autoscaler's tracker gets about `tracker_samples_per_s` of the latencies.
        self._sample_p = min(1.0, self.fluid.tracker_samples_per_s * (t1 - t0) / count)
        for slot in np.unique(prefill_of[prefill_of >= 0]).tolist():
            group = groups[slot]
            idx = np.flatnonzero(request_prefill == slot)  # arrival (time) order
            ft = group.admit_prefill(times[idx], prompts[idx].astype(float), t0, t1)
            self._after_prefill(group, groups, request_decode[idx], idx, ft, times, prompts,
                                outputs)

    def _cohorts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start and size of each cohort over bucket keys in sorted order: a bucket cut into
        runs of at most the cohort cap."""
        bounds = [0, *(np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist(), len(keys)]
        cap = self._cohort_cap()
        starts = np.asarray([s for a, b in zip(bounds, bounds[1:]) for s in range(a, b, cap)])
        return starts, np.diff(starts, append=len(keys))

    def _cohort_cap(self) -> int:
        sizes = [len(g.ready) for gs in self.groups.values() for g in gs.values()
                 if g.ready and not g.draining]
        return max(1, int(self.fluid.cohort_per_engine * min(sizes, default=1)))

    def _place(self, count: int, tokens: int, outputs: int, now: float,
               prof) -> tuple[EngineGroup, EngineGroup] | None:
        """Route one cohort and book it; its (prefilling, decoding) groups, None if rejected."""
        placement = self.router.place(max(1, tokens // count), max(1, outputs // count))
        self.route_calls += 1
        if isinstance(placement, Rejection):
            self.rejected[placement.reason] = self.rejected.get(placement.reason, 0) + count
            self.tally.add_failed(count)
            return None
        if placement.prefill is None:
            pool = COLOCATED if not self._disaggregated else DECODE
            group = self.groups[pool][placement.decode]
            decode = group
        else:
            group = self.groups[PREFILL][placement.prefill]
            decode = self.groups[DECODE][placement.decode]
        self.router.admit_cohort(
            placement, prefill_tokens=tokens / len(group.ready),
            decode_requests=count / len(decode.ready),
            kv_usage=prof.blocks(tokens + outputs) / (len(decode.ready) * prof.num_kv_blocks))
        self.census.observe_arrival(group.pool, now, tokens)
        return group, decode

    def _after_prefill(self, group: EngineGroup, groups: list[EngineGroup],
                       decode_of: np.ndarray, idx: np.ndarray, ft: np.ndarray,
                       times, prompts, outputs) -> None:
        """First tokens are known: count one-token requests done, send the rest to decode
        (`decode_of`: per request, its decode group's index in `groups`)."""
        prof = self.config.profile
        arrival, prompt, out = times[idx], prompts[idx], outputs[idx]
        ttft = ft + self._response(prompt) - arrival
        self._track(group.pool, arrival[0], ttft, self.census.observe_ttft)
        full = -(-(prompt + out) // prof.block_size)
        remote = group.pool == PREFILL
        if remote:  # the prompt's blocks stay on the prefill engine until pulled
            perf = prof.perf  # PerfModel.transfer_s, vectorised (prompts are >= 1 token)
            pull = perf.transfer_overhead_s + prompt * (perf.kv_bytes_per_token
                                                        / perf.transfer_bytes_per_s)
            pblocks = -(-prompt // prof.block_size)
            group.kv_used += float(pblocks.sum())
            group.releases.push(np.where(out > 1, ft + pull, ft), pblocks.astype(float))
        else:
            group.kv_used += float(full[out > 1].sum())
        one = out == 1
        if one.any():
            e2el = ttft[one]
            self.tally.add_done(ttft[one], np.full(int(one.sum()), np.nan), e2el,
                                prompt[one], out[one])
            self._end_s = max(self._end_s, float(ft[one].max()))
            many = ~one
        else:
            many = None  # every request decodes (the common case: skip the masks)
        first, last = int(decode_of[0]), int(decode_of[-1])
        if first == last and (len(decode_of) < 3 or (decode_of == first).all()):
            self._join(groups[first], many, remote, ft, pull if remote else None, arrival, out,
                       prompt, full)
            return
        for slot in np.unique(decode_of).tolist():
            sel = decode_of == slot
            if many is not None:
                sel &= many
            if sel.any():
                self._join(groups[slot], sel, remote, ft, pull if remote else None, arrival,
                           out, prompt, full)

    @staticmethod
    def _join(decode: EngineGroup, sel, remote: bool, ft, pull, arrival, out, prompt,
              full) -> None:
        """The selected requests (`sel`: a mask, None for all) join `decode`'s batch, once
        their KV is pulled when prefilled elsewhere."""
        if sel is not None:
            ft, arrival, out, prompt, full = ft[sel], arrival[sel], out[sel], prompt[sel], full[sel]
            pull = pull[sel] if remote else None
        if not len(ft):
            return
        blocks = full.astype(float)
        decode.join(ft + pull if remote else ft, ft, arrival, out, prompt, blocks,
                    blocks if remote else np.zeros(len(ft)))

    def _track(self, pool: str, now: float, values: np.ndarray, record) -> None:
        """Give the SLO tracker a sample of `values` (its percentiles need a few per second)."""
        if self._sample_p < 1.0:  # a binomial count of them, drawn with replacement
            picks = self._rng.binomial(len(values), self._sample_p)
            values = values[self._rng.integers(0, len(values), picks)]
        for v in values.tolist():
            record(pool, now, v)

    def _resolve(self, everything: bool = False) -> None:
        for pool, groups in self.groups.items():
            for group in groups.values():
                done = group.resolve(everything)
                if done is None:
                    continue
                t_finish, ft, arrival, out, prompt = done
                response = self._response(prompt)
                ttft = ft + response - arrival
                tpot = (t_finish - ft) / (out - 1)
                e2el = t_finish + response - arrival
                self.tally.add_done(ttft, tpot, e2el, prompt, out)
                self._end_s = max(self._end_s, float(t_finish.max()))
                self._track(group.pool, float(t_finish.max()), tpot,
                            self.census.observe_tpot)

    # --- control loops ----------------------------------------------------------------------

    def _sync_census(self) -> None:
        for pool, groups in self.groups.items():
            for group in groups.values():
                kv = group.kv_used / (max(len(group.ready), 1) * self.config.profile.num_kv_blocks)
                batch = group.batch
                for rid in group.ready:
                    self.census.resync(pool, rid, num_decoding=batch, kv_usage=kv)

    def _autoscale(self, now: float) -> None:
        self._sync_census()
        for decision in self.autoscaler.evaluate(self.census, now):
            if decision.delta:
                self.decisions.append((now, decision))
                self.scale_to(decision.pool, decision.target, now)

    def _sample(self, now: float) -> None:
        for pool, groups in self.groups.items():
            live = [g for g in groups.values()]
            ready = sum(len(g.ready) for g in live if not g.draining)
            engines = max(sum(g.engines for g in live), 1)
            self.samples.append(PoolSample(
                now, pool, ready, sum(len(g.starting) for g in live),
                sum(len(g.ready) for g in live if g.draining),
                sum(g.kv_used for g in live) / (engines * self.config.profile.num_kv_blocks),
                sum(min(g.batch, 1.0) * len(g.ready) for g in live) / engines))

    # --- run --------------------------------------------------------------------------------

    def run(self, arrivals) -> FluidRun:
        """Simulate until the arrivals are over and every request has finished."""
        started = time.perf_counter()
        cfg, fl = self.config, self.fluid
        t = math.floor(arrivals.first_s / fl.step_s) * fl.step_s
        for pool, count in cfg.topology.pools.items():
            for _ in range(count):
                self._add_engine(pool, t, ready=True)
        next_scale = t + cfg.autoscale_interval_s
        next_sample = t
        next_resolve = t + fl.resolve_every_s
        steps = requests = 0
        while True:
            t1 = t + fl.step_s
            batch = arrivals.take(t, t1)
            requests += len(batch[0])
            self._step(t, t1, batch)
            steps += 1
            busy = not arrivals.done or any(not g.idle(t1) for gs in self.groups.values()
                                            for g in gs.values())
            if t1 >= next_resolve or not busy:
                self._resolve()
                next_resolve = t1 + fl.resolve_every_s
            if t1 >= next_sample:
                self._sample(t1)
                next_sample += cfg.sample_interval_s
            if self.autoscaler is not None and t1 >= next_scale and busy:
                self._autoscale(t1)
                next_scale += cfg.autoscale_interval_s
            self._retire_idle(t1)
            t = t1
            if not busy:
                break
        self._resolve(everything=True)
        return FluidRun(cfg, fl, self.tally, self._all_groups, self.decisions, self.samples,
                        arrivals.first_s, max(self._end_s, arrivals.first_s),
                        time.perf_counter() - started, requests, steps, self.route_calls,
                        {p: s / 3600.0 for p, s in self._gpu_s.items()},
                        self._engine_index_total(), dict(self.rejected))

    def _engine_index_total(self) -> int:
        return sum(self._engine_index.values())
