"""The autoscaling loop's decision step, shared by the Ray service and the simulator.

`Autoscaler.evaluate(scheduler, now)` reads each pool's signals from the `GlobalScheduler`,
runs the pure policy (`policy.decide`) per pool with that pool's bounds and remembered state,
and returns the decisions. Whoever calls it applies them: `RayBackend` adds or drains engine
actors, the simulator adds or removes simulated engines. A log of recent decisions is kept for
/metrics and for the benchmark plots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from pdserve.autoscaler.policy import (
    PoolBounds, ScalingDecision, ScalingPolicy, ScalingState, decide,
)
from pdserve.scheduler.scheduler import GlobalScheduler


class Autoscaler:
    def __init__(self, bounds: Mapping[str, PoolBounds], ttft_target_s: float,
                 tpot_target_s: float, policy: ScalingPolicy = ScalingPolicy(),
                 history: int = 10_000) -> None:
        self.bounds = dict(bounds)
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.policy = policy
        self._states = {pool: ScalingState() for pool in self.bounds}
        self.history: deque[tuple[float, ScalingDecision]] = deque(maxlen=history)

    def evaluate(self, scheduler: GlobalScheduler, now: float) -> list[ScalingDecision]:
        decisions = []
        for pool, bounds in self.bounds.items():
            signals = scheduler.signals(pool, now)
            decision, self._states[pool] = decide(
                signals, self._states[pool], bounds, self.ttft_target_s, self.tpot_target_s,
                now, self.policy)
            decisions.append(decision)
            self.history.append((now, decision))
        return decisions


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
