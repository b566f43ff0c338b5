"""Rolling SLO tracker: TTFT and TPOT percentiles per pool over a time window.

Fed with each finished request's real timings by the frontend (and by the simulator with
virtual times); read by the autoscaler and the metrics. The caller passes `now` in, so there is
no clock inside and the same tracker runs on wall time and on simulated time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowSummary:
    count: int
    ttft_p_s: float | None  # percentile over the window (None: no samples)
    tpot_p_s: float | None
    ttft_attainment: float | None  # share of samples within the target
    tpot_attainment: float | None
    prompt_tokens_per_s: float  # prompt tokens of requests that arrived in the window, per second
    requests_per_s: float


class SloTracker:
    def __init__(self, window_s: float = 30.0, max_samples: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._max = max_samples
        self._ttft: dict[str, deque[tuple[float, float]]] = {}
        self._tpot: dict[str, deque[tuple[float, float]]] = {}
        self._arrivals: dict[str, deque[tuple[float, int]]] = {}

    def record_arrival(self, pool: str, now: float, prompt_tokens: int) -> None:
        """A request (or its prefill leg) was dispatched to `pool` with this many prompt tokens."""
        self._push(self._arrivals, pool, (now, prompt_tokens))

    def record_ttft(self, pool: str, now: float, ttft_s: float) -> None:
        self._push(self._ttft, pool, (now, ttft_s))

    def record_tpot(self, pool: str, now: float, tpot_s: float) -> None:
        self._push(self._tpot, pool, (now, tpot_s))

    def summary(self, pool: str, now: float, percentile: float = 90.0,
                ttft_target_s: float | None = None, tpot_target_s: float | None = None,
                pending_ttft_s: list[float] | None = None) -> WindowSummary:
        """The window's percentiles and attainment. `pending_ttft_s`: ages of requests still
        waiting for their first token, counted as TTFT samples (lower bounds) so that a queue
        that is already late shows before its requests finish."""
        ttft = self._values(self._ttft, pool, now) + list(pending_ttft_s or ())
        tpot = self._values(self._tpot, pool, now)
        arrivals = self._values(self._arrivals, pool, now)
        span = self.window_s
        return WindowSummary(
            count=max(len(ttft), len(tpot)),
            ttft_p_s=percentile_of(ttft, percentile),
            tpot_p_s=percentile_of(tpot, percentile),
            ttft_attainment=_attainment(ttft, ttft_target_s),
            tpot_attainment=_attainment(tpot, tpot_target_s),
            prompt_tokens_per_s=sum(arrivals) / span,
            requests_per_s=len(arrivals) / span,
        )

    def _push(self, table: dict, pool: str, item: tuple) -> None:
        q = table.setdefault(pool, deque())
        q.append(item)
        if len(q) > self._max:
            q.popleft()

    def _values(self, table: dict, pool: str, now: float) -> list[float]:
        q = table.get(pool)
        if not q:
            return []
        horizon = now - self.window_s
        while q and q[0][0] < horizon:
            q.popleft()
        return [v for _, v in q]


def percentile_of(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _attainment(values: list[float], target: float | None) -> float | None:
    if target is None or not values:
        return None
    return sum(v <= target for v in values) / len(values)
