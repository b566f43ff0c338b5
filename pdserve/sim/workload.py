"""Simulated workloads: arrival times and (prompt, output) lengths as numpy arrays.

Lengths and rate-driven arrivals come from the benchmark harness itself (`pdserve.bench`:
`draw_lengths` over its uniform lengths and named shapes, `rate_offsets` with vllm's
Poisson/gamma semantics, `read_mooncake_trace`), so a simulated run and a measured run of the
same seed see the same requests. What the harness has no use for, and the simulator adds: rate
curves over a day (diurnal, bursty), turned into arrivals by time-rescaling a unit-rate
Poisson (or gamma) process through the curve's cumulative rate.

Prompts are lengths only: the simulator models no prefix cache, so token ids would be unused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.arrivals import rate_offsets
from pdserve.bench.workloads import (
    SHAPES, LengthDistribution, UniformLengths, draw_lengths, read_mooncake_trace,
)


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests sorted by arrival: arrival (s), prompt tokens, output tokens."""

    arrivals: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray
    name: str = "workload"

    def __post_init__(self) -> None:
        if not len(self.arrivals) == len(self.prompts) == len(self.outputs):
            raise ValueError("arrivals, prompts and outputs differ in length")

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def span_s(self) -> float:
        return float(self.arrivals[-1]) if len(self) else 0.0


def lengths_of(dataset: str, count: int, rng: np.random.Generator, input_len: int = 1024,
               output_len: int = 128, range_ratio: float = 0.0, length_scale: float = 1.0,
               max_model_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prompts, outputs) as the harness draws them: "random" or a shape name (chat, code, ...)."""
    if dataset == "random":
        inputs: LengthDistribution = UniformLengths.from_range_ratio(input_len, range_ratio)
        outputs: LengthDistribution = UniformLengths.from_range_ratio(output_len, range_ratio)
    elif dataset in SHAPES:
        shape = SHAPES[dataset]
        inputs = shape.input_lengths.scaled(length_scale)
        outputs = shape.output_lengths.scaled(length_scale)
    else:
        raise ValueError(f"unknown dataset {dataset!r}: random or one of {sorted(SHAPES)}")
    pairs = np.asarray(draw_lengths(inputs, outputs, count, rng, max_model_len), dtype=np.int64)
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return pairs[:, 0], pairs[:, 1]


def at_rate(dataset: str, count: int, request_rate: float, burstiness: float = 1.0,
            seed: int = 0, **lengths) -> Workload:
    """`count` requests at a constant rate (vllm bench's schedule for the same seed)."""
    rng = np.random.default_rng(seed)
    prompts, outputs = lengths_of(dataset, count, rng, **lengths)
    # The harness draws the schedule from a fresh generator of the same seed after the prompts.
    offsets = rate_offsets(count, request_rate, burstiness, np.random.default_rng(seed))
    return Workload(offsets, prompts, outputs, f"{dataset}@{request_rate:g}")


def mooncake(path: str, limit: int | None = None, speedup: float = 1.0) -> Workload:
    """A Mooncake-format trace: its timestamps (sped up) and lengths."""
    records = read_mooncake_trace(path, limit)
    if not records:
        return Workload(np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), path)
    t0 = records[0].timestamp_ms
    arrivals = np.array([(r.timestamp_ms - t0) / 1000 / speedup for r in records])
    order = np.argsort(arrivals, kind="stable")
    prompts = np.array([max(1, r.input_length) for r in records], dtype=np.int64)
    outputs = np.array([max(1, r.output_length) for r in records], dtype=np.int64)
    return Workload(arrivals[order], prompts[order], outputs[order], f"mooncake:{path}")


# --- rate curves ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RateCurve:
    """Request rate (req/s) as a piecewise-linear function of time over [0, duration_s]."""

    times_s: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.times_s) != len(self.rates) or len(self.times_s) < 2:
            raise ValueError("a rate curve needs >= 2 (time, rate) points")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:])) or min(self.rates) < 0:
            raise ValueError("curve times must increase and rates be non-negative")

    @property
    def duration_s(self) -> float:
        return self.times_s[-1] - self.times_s[0]

    def rate(self, t: float | np.ndarray) -> np.ndarray:
        return np.interp(t, self.times_s, self.rates)

    def cumulative(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, expected requests by then): the integral of the curve at its points."""
        t = np.asarray(self.times_s, float)
        r = np.asarray(self.rates, float)
        return t, np.concatenate(([0.0], np.cumsum(np.diff(t) * (r[1:] + r[:-1]) / 2)))

    def scaled(self, factor: float) -> RateCurve:
        return RateCurve(self.times_s, tuple(r * factor for r in self.rates))


def diurnal(peak_rate: float, trough_ratio: float = 0.25, duration_s: float = 86400.0,
            peak_at_s: float = 14 * 3600.0, points: int = 289) -> RateCurve:
    """A day of traffic: a cosine between trough and peak, highest at `peak_at_s`."""
    t = np.linspace(0.0, duration_s, points)
    low = peak_rate * trough_ratio
    r = low + (peak_rate - low) * (1 + np.cos(2 * math.pi * (t - peak_at_s) / 86400.0)) / 2
    return RateCurve(tuple(t.tolist()), tuple(r.tolist()))


def bursty(curve: RateCurve, bursts: int, burst_factor: float = 2.0, burst_s: float = 600.0,
           ramp_s: float = 60.0, seed: int = 0) -> RateCurve:
    """`curve` with `bursts` surges of `burst_factor` x lasting `burst_s` at random times."""
    rng = np.random.default_rng(seed)
    t0, t1 = curve.times_s[0], curve.times_s[-1]
    starts = np.sort(rng.uniform(t0, t1 - burst_s - 2 * ramp_s, size=bursts))
    grid = set(curve.times_s)
    for s in starts:
        grid.update((s, s + ramp_s, s + ramp_s + burst_s, s + 2 * ramp_s + burst_s))
    t = np.array(sorted(grid))
    factor = np.ones_like(t)
    for s in starts:
        factor = np.maximum(factor, np.interp(
            t, [s, s + ramp_s, s + ramp_s + burst_s, s + 2 * ramp_s + burst_s],
            [1.0, burst_factor, burst_factor, 1.0], left=1.0, right=1.0))
    return RateCurve(tuple(t.tolist()), tuple((curve.rate(t) * factor).tolist()))


def curve_arrivals(curve: RateCurve, rng: np.random.Generator, burstiness: float = 1.0
                   ) -> np.ndarray:
    """Arrival times following `curve`: a unit-rate renewal process mapped through the inverse
    cumulative rate (gamma gaps with vllm's burstiness; 1 = non-homogeneous Poisson)."""
    times, cum = curve.cumulative()
    expected = cum[-1]
    if expected <= 0:
        return np.zeros(0)
    count = int(rng.poisson(expected))
    gaps = rng.gamma(burstiness, 1.0 / burstiness, size=count + 1)
    units = np.cumsum(gaps)
    units = units[units < expected]
    # The cumulative rate is piecewise quadratic between the curve's points: invert it on a
    # fine grid of trapezoids (exact for the piecewise-linear rate up to the grid's spacing).
    fine = np.linspace(times[0], times[-1], max(len(times) * 16, 10_000))
    rates = curve.rate(fine)
    seg = np.concatenate(([0.0], np.cumsum(np.diff(fine) * (rates[1:] + rates[:-1]) / 2)))
    return np.interp(units, seg, fine)


def from_curve(curve: RateCurve, dataset: str = "chat", seed: int = 0, burstiness: float = 1.0,
               **lengths) -> Workload:
    rng = np.random.default_rng(seed)
    arrivals = curve_arrivals(curve, rng, burstiness)
    prompts, outputs = lengths_of(dataset, len(arrivals), rng, **lengths)
    return Workload(arrivals, prompts, outputs, f"{dataset}-curve")


def concat(parts: Sequence[Workload], name: str = "workload") -> Workload:
    arrivals = np.concatenate([p.arrivals for p in parts])
    order = np.argsort(arrivals, kind="stable")
    return Workload(arrivals[order], np.concatenate([p.prompts for p in parts])[order],
                    np.concatenate([p.outputs for p in parts])[order], name)
