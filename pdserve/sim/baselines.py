"""Scaling policies pdserve is compared against (studies only; production uses policy.decide).

`TtftOnlyAutoscaler` is a reactive rule in the spirit of Ray Serve's latency-driven
autoscaling: every interval, look at the pool's p99 TTFT over the window; above the target, add
one engine (after `upscale_intervals` in a row and a cooldown); below `downscale_ratio` x target
for `downscale_intervals` in a row, remove one. It sees no load, KV or TPOT signal and scales a
single pool. It reads the same `RequestLedger` books and returns the same
`ScalingDecision`s as `pdserve.autoscaler.controller.Autoscaler`, so the simulator applies
either one the same way.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pdserve.autoscaler.policy import PoolBounds, ScalingDecision
from pdserve.scheduler.ledger import RequestLedger


@dataclass(frozen=True, slots=True)
class _State:
    up: int = 0
    down: int = 0
    last_change_s: float = -math.inf


class TtftOnlyAutoscaler:
    def __init__(self, bounds: Mapping[str, PoolBounds], ttft_target_s: float,
                 percentile: float = 99.0, upscale_intervals: int = 1,
                 downscale_intervals: int = 6, cooldown_s: float = 60.0,
                 downscale_ratio: float = 0.5, history: int = 10_000) -> None:
        self.bounds = dict(bounds)
        self.ttft_target_s = ttft_target_s
        self.percentile = percentile
        self.upscale_intervals = upscale_intervals
        self.downscale_intervals = downscale_intervals
        self.cooldown_s = cooldown_s
        self.downscale_ratio = downscale_ratio
        self._states = {pool: _State() for pool in self.bounds}
        self.history: deque[tuple[float, ScalingDecision]] = deque(maxlen=history)

    def evaluate(self, ledger: RequestLedger, now: float) -> list[ScalingDecision]:
        decisions = []
        for pool, bounds in self.bounds.items():
            engines = [e for e in ledger.engines.engines(pool) if not e.draining and e.healthy]
            n = len(engines)
            summary = ledger.tracker.summary(pool, now, self.percentile)
            ttft = summary.ttft_p_s
            state = self._states[pool]
            target, reason, detail = n, "steady", "within target"
            cooled = now - state.last_change_s >= self.cooldown_s
            if ttft is not None and ttft > self.ttft_target_s:
                state = replace(state, up=state.up + 1, down=0)
                detail = f"p{self.percentile:g} TTFT {ttft * 1e3:.0f} ms > target"
                if state.up >= self.upscale_intervals and cooled and n < bounds.max_replicas:
                    target, reason = n + 1, "ttft_breach"
            elif ttft is None or ttft < self.ttft_target_s * self.downscale_ratio:
                state = replace(state, up=0, down=state.down + 1)
                if state.down >= self.downscale_intervals and cooled and n > bounds.min_replicas:
                    target, reason, detail = n - 1, "idle", "TTFT well under target"
            else:
                state = replace(state, up=0, down=0)
            if target != n:
                state = _State(last_change_s=now)
            self._states[pool] = state
            decision = ScalingDecision(pool, n, target, reason, detail)
            decisions.append(decision)
            self.history.append((now, decision))
        return decisions
