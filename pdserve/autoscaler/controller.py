"""The autoscaling loop's decision step, shared by the Ray service and the simulator.

`Autoscaler.evaluate(source, now)` reads each pool's signals from a `SignalSource` (the
`RequestLedger`; the controller of several ingress replicas merges theirs),
runs the pure policy (`policy.decide`) per pool with that pool's bounds and remembered state,
fits the scale-ups into a shared device budget when one is set (`max_gpus`: a fixed cluster, so
the pools compete for its GPUs and the autoscaler picks the prefill:decode ratio; a pool that
breaches its latency target at the budget takes a GPU from a pool that can spare one), and
returns the decisions. Whoever calls it applies them: `RayBackend` adds or drains engine
actors, the simulator adds or removes simulated engines. A log of recent decisions is kept for
/metrics and for the benchmark plots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from pdserve.autoscaler.policy import (
    AT_BUDGET, LATENCY_REASONS, REBALANCE, PoolBounds, ScalingDecision, ScalingPolicy, ScalingState,
    decide, latency_breaches,
)
from pdserve.scheduler.types import PoolSignals
from pdserve.slo import SloTargets


class SignalSource(Protocol):
    def signals(self, pool: str, now: float) -> PoolSignals:
        """What the policy sees of one pool now (`RequestLedger.signals`)."""
        ...


class Autoscaler:
    def __init__(self, bounds: Mapping[str, PoolBounds], slo: SloTargets,
                 policy: ScalingPolicy = ScalingPolicy(),
                 history: int = 10_000, max_gpus: int | None = None,
                 gpus_per_engine: Mapping[str, int] | None = None) -> None:
        self.bounds = dict(bounds)
        self.max_gpus = max_gpus
        self.gpus_per_engine = {pool: 1 for pool in self.bounds} | dict(gpus_per_engine or {})
        self.ttft_target_s = slo.ttft_s
        self.tpot_target_s = slo.tpot_s
        self.policy = policy
        self._states = {pool: ScalingState() for pool in self.bounds}
        self.history: deque[tuple[float, ScalingDecision]] = deque(maxlen=history)

    def evaluate(self, ledger: SignalSource, now: float) -> list[ScalingDecision]:
        proposed, signals = {}, {}
        for pool, bounds in self.bounds.items():
            signals[pool] = ledger.signals(pool, now)
            proposed[pool] = decide(
                signals[pool], self._states[pool], bounds, self.ttft_target_s,
                self.tpot_target_s, now, self.policy)
        if self.max_gpus is not None:
            proposed, starved = self._within_budget(proposed)
            if starved:
                proposed = self._rebalance(proposed, starved, signals, now)
        decisions = []
        for pool, (decision, state) in proposed.items():
            self._states[pool] = state
            decisions.append(decision)
            self.history.append((now, decision))
        return decisions

    def _within_budget(self, proposed: dict[str, tuple[ScalingDecision, ScalingState]]):
        """Trims scale-ups to the GPUs left under `max_gpus` after every other pool's target.
        Latency breaches are served before load forecasts, then the larger shortfall; a trimmed
        pool keeps its pressure streak (not a cooldown), so it scales as soon as GPUs free up,
        e.g. when the other pool's idle engine has drained. Also returns the pools that got
        nothing for a latency breach."""
        gpus = self.gpus_per_engine
        used = sum(min(d.current, d.target) * gpus[pool] for pool, (d, _) in proposed.items())
        ups = sorted((pool for pool, (d, _) in proposed.items() if d.delta > 0),
                     key=lambda pool: (proposed[pool][0].reason not in LATENCY_REASONS,
                                       -proposed[pool][0].delta))
        out, starved = dict(proposed), []
        for pool in ups:
            decision, state = proposed[pool]
            fits = max(0, (self.max_gpus - used) // gpus[pool])
            granted = min(decision.delta, fits)
            used += granted * gpus[pool]
            if granted == decision.delta:
                continue
            detail = f"{decision.detail}; {self.max_gpus} GPUs in use or promised"
            if granted > 0:
                out[pool] = (replace(decision, target=decision.current + granted, detail=detail), state)
            else:  # nothing fits: no change, and no cooldown started
                if decision.reason in LATENCY_REASONS:
                    starved.append(pool)
                waiting = ScalingState(up_streak=self.policy.upscale_intervals, down_streak=0,
                                       last_change_s=self._states[pool].last_change_s)
                out[pool] = (replace(decision, target=decision.current, reason=AT_BUDGET,
                                     detail=detail), waiting)
        return out, starved

    def _rebalance(self, proposed: dict[str, tuple[ScalingDecision, ScalingState]],
                   hungry: list[str], signals: Mapping[str, PoolSignals], now: float):
        """A pool held at the budget with a measured latency breach takes a GPU from a pool that
        can spare one: no breach of its own, no change of its own this round, out of its
        cooldown, above its minimum, and its measured load still under `target_utilization`
        with one engine fewer. The donor drains one engine; the breaching pool keeps its
        pressure streak and scales up once that GPU is free (the next evaluations).

        Seen on 4 x H100 (2026-11-27): a ramp's backlog pushed prefill to 3 of 4 GPUs; the one
        decode engine then breached TPOT at the budget while the three prefill engines ran at
        ~45% of capacity, and nothing moved; the static runs say 2P2D was the ratio."""
        p, out = self.policy, dict(proposed)
        # The pool whose load would stay lowest with one engine fewer gives first.
        for pool in sorted(self.bounds, key=lambda name: _load_with_one_fewer(signals[name])):
            decision, state = proposed[pool]
            s, bounds = signals[pool], self.bounds[pool]
            after = _load_with_one_fewer(s)
            if (pool in hungry or decision.delta != 0 or s.starting
                    or s.replicas - 1 < max(bounds.min_replicas, 1)
                    or now - state.last_change_s < p.upscale_cooldown_s
                    or any(latency_breaches(s, self.ttft_target_s, self.tpot_target_s, p))
                    or after > p.target_utilization):
                continue
            detail = (f"{', '.join(hungry)} at the {self.max_gpus}-GPU budget with a latency breach; "
                      f"load {_load(s):.2f} here would be {after:.2f} with {s.replicas - 1}")
            out[pool] = (replace(decision, target=decision.current - 1, reason=REBALANCE,
                                 detail=detail), ScalingState(last_change_s=now))
            break
        return out


def _load(s: PoolSignals) -> float:
    """The pool's measured load against its capacity (the larger of its kinds of work)."""
    if s.pool == "prefill":
        return s.prefill_utilization
    if s.pool == "decode":
        return max(s.decode_utilization, s.kv_usage)
    return max(s.prefill_utilization, s.decode_utilization, s.kv_usage)


def _load_with_one_fewer(s: PoolSignals) -> float:
    """The load each engine would carry with one engine fewer (a lone engine: its own load)."""
    return _load(s) * s.replicas / max(s.replicas - 1, 1)


def scaling_policy_from_config(autoscale) -> ScalingPolicy:
    """`ScalingPolicy` from the `autoscale` section of the config."""
    return ScalingPolicy(
        upscale_intervals=autoscale.upscale_intervals,
        downscale_intervals=autoscale.downscale_intervals,
        upscale_cooldown_s=autoscale.upscale_cooldown_s,
        downscale_cooldown_s=autoscale.downscale_cooldown_s,
        target_utilization=autoscale.target_utilization,
        downscale_utilization=autoscale.downscale_utilization,
        kv_high=autoscale.kv_high, max_step=autoscale.max_step,
    )
