"""Arrival schedules: when each request of a run is sent, as offsets from the start of the run.

A schedule is computed whole before the run starts (as `vllm bench serve` does since it precomputes its
delays), so sending never waits on random-number generation and the same seed gives the same schedule.
The runner sleeps until each offset, then hands the request to a task that may still wait on the
max-concurrency semaphore: the schedule says when a request *arrives*, the cap says when it may *start*.

Semantics follow vllm/benchmarks/serve.py `get_request`:
- rate = inf: every request arrives at t = 0;
- otherwise gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, coefficient of
  variation 1/sqrt(burstiness); burstiness = 1 is a Poisson process, < 1 burstier, > 1 more regular,
  inf a constant gap;
- the cumulative offsets are rescaled so the last arrival lands at exactly num_requests / rate, which
  vllm does to remove the 1-2% run-to-run spread in offered load between seeds.
Trace replay uses the recorded timestamps instead, optionally sped up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """How requests arrive: a rate with a burstiness, or the timestamps of a trace."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    use_trace_timestamps: bool = False
    trace_speedup: float = 1.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive (inf for all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if not self.trace_speedup > 0:
            raise ValueError(f"trace speedup must be positive, got {self.trace_speedup}")

    @property
    def distribution(self) -> str:
        """The name vllm prints for the inter-arrival distribution."""
        if self.use_trace_timestamps:
            return "trace timestamps"
        return "Poisson process" if self.burstiness == 1.0 else "Gamma distribution"


def rate_offsets(count: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets (s) of `count` requests at `request_rate` with gamma gaps (vllm semantics)."""
    if count == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(count)
    if math.isinf(burstiness):
        gaps = np.full(count, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (count / request_rate) / offsets[-1]
    return offsets


def trace_offsets(arrivals_s: Sequence[float | None], speedup: float = 1.0) -> np.ndarray:
    """Offsets from recorded arrival times (s after the trace's first request), divided by `speedup`."""
    if any(arrival is None for arrival in arrivals_s):
        raise ValueError("trace timestamps requested but some requests carry no arrival time")
    times = np.asarray(arrivals_s, dtype=float)
    if len(times) == 0:
        return times
    return (times - times.min()) / speedup


def schedule(
    spec: ArrivalSpec, count: int, rng: np.random.Generator, arrivals_s: Sequence[float | None] = ()
) -> np.ndarray:
    """The arrival offsets of a run: trace timestamps or a rate-driven schedule."""
    if spec.use_trace_timestamps:
        offsets = trace_offsets(arrivals_s, spec.trace_speedup)
        if len(offsets) != count:
            raise ValueError(f"{len(offsets)} trace timestamps for {count} requests")
        return offsets
    return rate_offsets(count, spec.request_rate, spec.burstiness, rng)
