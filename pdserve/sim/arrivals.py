"""Arrivals step by step, for the fluid simulator: from a `Workload`, or drawn as they are needed.

A day at 10k requests/s is 864M requests: as a `Workload` (three numpy arrays) that is ~20 GB,
more than the machine has. `CurveArrivals` draws the same process block by block instead (a
non-homogeneous Poisson process following a `RateCurve`, lengths from the harness's shapes), so
memory stays at one block. `WorkloadArrivals` serves an existing workload the same way, which is
how the fluid and the per-request simulators are compared on identical requests.

Both answer `take(t0, t1)`: the arrivals in [t0, t1) as (times, prompts, outputs), in time order.
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.bench.workloads import SHAPES, UniformLengths
from pdserve.sim.workload import RateCurve, Workload

_EMPTY = (np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64))


class WorkloadArrivals:
    """The requests of a materialised workload, sliced by time."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._next = 0
        self.total = len(workload)

    @property
    def first_s(self) -> float:
        return float(self.workload.arrivals[0]) if self.total else 0.0

    @property
    def done(self) -> bool:
        return self._next >= self.total

    def take(self, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        wl = self.workload
        end = int(np.searchsorted(wl.arrivals, t1, side="left"))
        start, self._next = self._next, max(end, self._next)
        if end <= start:
            return _EMPTY
        return wl.arrivals[start:end], wl.prompts[start:end], wl.outputs[start:end]


class CurveArrivals:
    """Poisson arrivals following `curve`, with lengths of a harness dataset, drawn per block.

    Each block of `block_s` gets a Poisson count of its expected requests, placed as sorted
    uniforms through the inverse of the block's cumulative rate (the curve is piecewise linear),
    then lengths as the harness draws them (inputs, then outputs; `max_model_len` cuts inputs).
    Same seed, same requests.
    """

    def __init__(self, curve: RateCurve, dataset: str = "chat", seed: int = 0,
                 block_s: float = 10.0, input_len: int = 1024, output_len: int = 128,
                 range_ratio: float = 0.0, length_scale: float = 1.0,
                 max_model_len: int | None = None) -> None:
        if dataset == "random":
            self._inputs = UniformLengths.from_range_ratio(input_len, range_ratio)
            self._outputs = UniformLengths.from_range_ratio(output_len, range_ratio)
        elif dataset in SHAPES:
            self._inputs = SHAPES[dataset].input_lengths.scaled(length_scale)
            self._outputs = SHAPES[dataset].output_lengths.scaled(length_scale)
        else:
            raise ValueError(f"unknown dataset {dataset!r}: random or one of {sorted(SHAPES)}")
        self.curve = curve
        self.block_s = block_s
        self.max_model_len = max_model_len
        self.total = None  # not known in advance
        self.drawn = 0
        self._rng = np.random.default_rng(seed)
        self._end = curve.times_s[-1]
        self._block_end = curve.times_s[0]
        self._buf = _EMPTY
        self._pos = 0

    @property
    def first_s(self) -> float:
        return self.curve.times_s[0]

    @property
    def done(self) -> bool:
        return self._block_end >= self._end and self._pos >= len(self._buf[0])

    def take(self, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = []
        while True:
            times = self._buf[0]
            end = int(np.searchsorted(times, t1, side="left"))
            if end > self._pos:
                parts.append(tuple(a[self._pos:end] for a in self._buf))
                self._pos = end
            if end < len(times) or self._block_end >= self._end:
                break
            self._draw_block()
        if not parts:
            return _EMPTY
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate(cols) for cols in zip(*parts))

    def _draw_block(self) -> None:
        a = self._block_end
        b = min(a + self.block_s, self._end)
        self._block_end = b
        grid = np.linspace(a, b, 33)
        rates = self.curve.rate(grid)
        cum = np.concatenate(([0.0], np.cumsum(np.diff(grid) * (rates[1:] + rates[:-1]) / 2)))
        count = int(self._rng.poisson(cum[-1])) if cum[-1] > 0 else 0
        # `count` sorted uniforms on [0, cum[-1]) as normalised sums of exponential gaps: the
        # same law as sorting uniform draws, in O(n) instead of O(n log n).
        gaps = np.cumsum(self._rng.standard_exponential(count + 1))
        times = np.interp(gaps[:-1] * (cum[-1] / gaps[-1]), cum, grid)
        inputs = self._inputs.sample(self._rng, count)
        outputs = self._outputs.sample(self._rng, count)
        if self.max_model_len is not None:
            outputs = np.minimum(outputs, self.max_model_len - 1)
            inputs = np.maximum(1, np.minimum(inputs, self.max_model_len - outputs))
        self._buf = (times, inputs.astype(np.int64), np.maximum(outputs, 1).astype(np.int64))
        self._pos = 0
        self.drawn += count


def flat(rate: float, duration_s: float) -> RateCurve:
    """A constant rate over [0, duration_s]."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError("a flat curve needs a finite positive rate")
    return RateCurve((0.0, duration_s), (rate, rate))
