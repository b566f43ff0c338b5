"""Per-pool scaling policy: how many engines each pool should have next.

Pure: `decide(signals, state, ...)` takes plain values (the pool's size, its observed
percentiles, its load) and the pool's previous `ScalingState`, and returns a `ScalingDecision`
and the next state. The frontend's controller, the unit tests and the simulator call it alike.

Each pool is scaled on its own signals:
- prefill: TTFT above target at the SLO percentile, or prefill load (arriving prompt tokens over
  the pool's prefill capacity) above `target_utilization`;
- decode: TPOT above target, or KV usage above `kv_high`. Decode load (the batch the pool runs
  over the batch that the fitted model says still meets the TPOT target) sizes a scale-up and
  gates a scale-down, but does not trigger a scale-up by itself: a model extrapolated from
  noisy inter-token gaps is not evidence enough to buy an engine, a measured TPOT breach is;
- colocated: any of the above.

Against flapping: a pressure must hold for `upscale_intervals` consecutive evaluations before a
scale-up, and comfort (latency under `downscale_latency_ratio` x target and load that would stay
under `downscale_utilization` with one engine fewer) for `downscale_intervals` before a
scale-down; each direction has a cooldown after any change; engines still starting count as
present (no double scale-up while the first is booting). A scale-up adds enough engines to bring
the load back to `target_utilization` (at most `max_step`; a latency breach alone adds one);
a scale-down removes one. Bounds win
over everything. Every decision carries a reason (a fixed set, used as a metric label) and a
human-readable detail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.scheduler.types import PoolSignals

# Reasons (metric label values).
TTFT_BREACH = "ttft_breach"
PREFILL_LOAD = "prefill_load"
TPOT_BREACH = "tpot_breach"
KV_PRESSURE = "kv_pressure"
IDLE = "idle"
BELOW_MIN = "below_min"
ABOVE_MAX = "above_max"
STEADY = "steady"
COOLDOWN = "cooldown"
AT_MAX = "at_max"
AT_MIN = "at_min"
PENDING = "pending"  # pressure seen, waiting for it to persist
AT_BUDGET = "at_budget"  # pressure, but the shared GPU budget (autoscale.max_gpus) is spent
REBALANCE = "rebalance"  # one engine fewer here, so a pool at the budget with a breach gets its GPU
# Reasons that come from measured SLO breaches (served first when GPUs are short).
LATENCY_REASONS = frozenset({TTFT_BREACH, TPOT_BREACH})


@dataclass(frozen=True, slots=True)
class PoolBounds:
    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"invalid pool bounds {self.min_replicas}..{self.max_replicas}")


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    upscale_intervals: int = 2
    downscale_intervals: int = 6
    upscale_cooldown_s: float = 15.0
    downscale_cooldown_s: float = 60.0
    target_utilization: float = 0.8
    downscale_utilization: float = 0.5
    downscale_latency_ratio: float = 0.6
    kv_high: float = 0.85
    kv_low: float = 0.5
    max_step: int = 4
    min_samples: int = 5  # fewer requests in the window: latency percentiles are not trusted


@dataclass(frozen=True, slots=True)
class ScalingState:
    up_streak: int = 0
    down_streak: int = 0
    last_change_s: float = -math.inf


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    pool: str
    current: int
    target: int
    reason: str
    detail: str

    @property
    def delta(self) -> int:
        return self.target - self.current

    @property
    def direction(self) -> str:
        return "up" if self.delta > 0 else "down" if self.delta < 0 else "none"


def decide(signals: PoolSignals, state: ScalingState, bounds: PoolBounds, ttft_target_s: float,
           tpot_target_s: float, now: float,
           policy: ScalingPolicy = ScalingPolicy()) -> tuple[ScalingDecision, ScalingState]:
    n = signals.replicas

    def result(target: int, reason: str, detail: str, next_state: ScalingState):
        return ScalingDecision(signals.pool, n, target, reason, detail), next_state

    if n < bounds.min_replicas:
        return result(bounds.min_replicas, BELOW_MIN, f"{n} < min {bounds.min_replicas}",
                      ScalingState(last_change_s=now))
    if n > bounds.max_replicas:
        return result(bounds.max_replicas, ABOVE_MAX, f"{n} > max {bounds.max_replicas}",
                      ScalingState(last_change_s=now))

    pressure = _pressure(signals, ttft_target_s, tpot_target_s, policy)
    if pressure is not None:
        reason, detail, load = pressure
        streak = state.up_streak + 1
        waiting = replace(state, up_streak=streak, down_streak=0)
        if n >= bounds.max_replicas:
            return result(n, AT_MAX, f"{detail}; at max {bounds.max_replicas}", waiting)
        if signals.starting:
            return result(n, PENDING, f"{detail}; {signals.starting} engine(s) still starting",
                          waiting)
        if streak < policy.upscale_intervals:
            return result(n, PENDING, f"{detail} ({streak}/{policy.upscale_intervals})", waiting)
        if now - state.last_change_s < policy.upscale_cooldown_s:
            return result(n, COOLDOWN, f"{detail}; cooling down", waiting)
        wanted = math.ceil(n * load / policy.target_utilization) if load > 0 else n + 1
        step = min(max(wanted - n, 1), policy.max_step)
        target = min(n + step, bounds.max_replicas)
        return result(target, reason, detail, ScalingState(last_change_s=now))

    comfort = _comfort(signals, ttft_target_s, tpot_target_s, policy)
    if comfort is None:
        return result(n, STEADY, "within targets", replace(state, up_streak=0, down_streak=0))
    streak = state.down_streak + 1
    waiting = replace(state, up_streak=0, down_streak=streak)
    if n <= bounds.min_replicas:
        return result(n, AT_MIN, f"{comfort}; at min {bounds.min_replicas}", waiting)
    if streak < policy.downscale_intervals:
        return result(n, STEADY, f"{comfort} ({streak}/{policy.downscale_intervals})", waiting)
    if now - state.last_change_s < policy.downscale_cooldown_s:
        return result(n, COOLDOWN, f"{comfort}; cooling down", waiting)
    return result(n - 1, IDLE, comfort, ScalingState(last_change_s=now))


def latency_breaches(s: PoolSignals, ttft_t: float, tpot_t: float,
                     p: ScalingPolicy) -> tuple[bool, bool]:
    """(TTFT, TPOT) over target at the SLO percentile, each only for a pool that serves that
    phase and only with enough samples to trust the percentile."""
    if s.samples < p.min_samples:
        return False, False
    ttft = s.pool in ("prefill", "colocated") and s.ttft_s is not None and s.ttft_s > ttft_t
    tpot = s.pool in ("decode", "colocated") and s.tpot_s is not None and s.tpot_s > tpot_t
    return ttft, tpot


def _pressure(s: PoolSignals, ttft_t: float, tpot_t: float,
              p: ScalingPolicy) -> tuple[str, str, float] | None:
    """(reason, detail, load as a multiple of capacity) of the strongest pressure, or None."""
    ttft_breach, tpot_breach = latency_breaches(s, ttft_t, tpot_t, p)
    # A latency breach says "more", not "how many": a backlog keeps latency high for a while
    # after capacity is back. Its load is one engine more than now, unless the measured load
    # (arrivals over capacity) asks for more.
    one_more = p.target_utilization * (s.replicas + 1) / max(s.replicas, 1)
    found: list[tuple[str, str, float]] = []
    if s.pool in ("prefill", "colocated"):
        if ttft_breach:
            found.append((TTFT_BREACH, f"TTFT {s.ttft_s * 1e3:.0f} ms > {ttft_t * 1e3:.0f} ms",
                          max(s.prefill_utilization, one_more)))
        if s.prefill_utilization > p.target_utilization:
            found.append((PREFILL_LOAD, f"prefill load {s.prefill_utilization:.2f}",
                          s.prefill_utilization))
    if s.pool in ("decode", "colocated"):
        if tpot_breach:
            found.append((TPOT_BREACH, f"TPOT {s.tpot_s * 1e3:.1f} ms > {tpot_t * 1e3:.1f} ms",
                          max(s.decode_utilization, one_more)))
        if s.kv_usage > p.kv_high:
            found.append((KV_PRESSURE, f"KV usage {s.kv_usage:.2f}",
                          s.kv_usage / p.kv_high * p.target_utilization))
    if not found:
        return None
    return max(found, key=lambda f: f[2])


def _comfort(s: PoolSignals, ttft_t: float, tpot_t: float, p: ScalingPolicy) -> str | None:
    """Why one engine fewer would still be fine, or None when it might not."""
    if s.replicas <= 1 or s.starting:
        return None
    shrink = s.replicas / (s.replicas - 1)  # load per engine grows by this with one fewer
    low = p.downscale_latency_ratio
    if s.pool in ("prefill", "colocated"):
        if s.ttft_s is not None and s.samples and s.ttft_s > ttft_t * low:
            return None
        if s.prefill_utilization * shrink > p.downscale_utilization:
            return None
    if s.pool in ("decode", "colocated"):
        if s.tpot_s is not None and s.samples and s.tpot_s > tpot_t * low:
            return None
        if s.kv_usage * shrink > p.kv_low or s.decode_utilization * shrink > p.downscale_utilization:
            return None
    return (f"load would stay low with {s.replicas - 1} engine(s) "
            f"(prefill {s.prefill_utilization:.2f}, decode {s.decode_utilization:.2f}, "
            f"KV {s.kv_usage:.2f})")
