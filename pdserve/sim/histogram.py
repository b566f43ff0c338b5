"""Latency distributions as counts in log-spaced bins, for runs too large for per-request lists.

The fluid simulator (fluid.py) finishes hundreds of millions of requests; keeping one float per
request per metric would take gigabytes. `LatencyHistogram` keeps counts in bins 1/400 of a
decade wide (adjacent edges differ by 0.58%), plus the exact count, sum and sum of squares, so
mean and std are exact and a percentile is off by at most half a bin (0.29%). `OutcomeTally`
adds the harness's run totals and SLO verdicts (counted per request when each finishes) and
summarises under the same keys, with the same rules, as `pdserve.bench.metrics` /
`results.LatencyRecorder`: failed requests meet no SLO, a one-token request meets any TPOT
target, attainment is over all requests, goodput over the run's duration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.metrics import LatencyStats, percentile_label
from pdserve.slo import SloTargets

_LOW_S = 1e-6  # shortest latency binned (1 us); anything shorter lands in the first bin
_DECADES = 10  # up to 1e4 s
_PER_DECADE = 400  # 0.58% bins: percentiles within 0.3%, well under any tolerance we quote
# Bin index = log10(v / _LOW_S) x _PER_DECADE, computed through log2 (half the cost of log10).
_PER_LOG2 = _PER_DECADE * math.log10(2.0)
_LOG2_LOW = math.log2(_LOW_S)


class LatencyHistogram:
    """Counts of latencies (seconds) in log bins; exact count, mean and std."""

    __slots__ = ("counts", "n", "total", "total_sq")

    def __init__(self) -> None:
        self.counts = np.zeros(_DECADES * _PER_DECADE + 1, np.int64)
        self.n = 0
        self.total = 0.0
        self.total_sq = 0.0

    def add(self, values_s: np.ndarray) -> None:
        if not len(values_s):
            return
        v = np.asarray(values_s, float)
        scaled = np.log2(np.maximum(v, _LOW_S))
        scaled -= _LOG2_LOW
        scaled *= _PER_LOG2
        index = scaled.astype(np.int64)  # >= 0: truncation is floor
        np.minimum(index, len(self.counts) - 1, out=index)
        self.counts += np.bincount(index, minlength=len(self.counts))
        self.n += len(v)
        self.total += float(v.sum())
        # Not np.dot: a BLAS call wakes the BLAS thread pool, which on a shared machine cost
        # milliseconds per call (25x the rest of `add`), not the microseconds of the sum itself.
        self.total_sq += float(np.einsum("i,i->", v, v))

    def quantile(self, q: float) -> float:
        """The q-th percentile (numpy's linear rank (n-1) q/100), interpolated inside its bin."""
        if self.n == 0:
            return 0.0
        rank = (self.n - 1) * q / 100.0
        cum = np.cumsum(self.counts)
        b = int(np.searchsorted(cum, rank, side="right"))
        below = cum[b - 1] if b else 0
        inside = (rank - below + 0.5) / self.counts[b]  # position within the bin, 0..1
        return _LOW_S * 10 ** ((b + min(max(inside, 0.0), 1.0)) / _PER_DECADE)

    def stats(self, percentiles: Sequence[float]) -> LatencyStats:
        """As `LatencyStats.of` (milliseconds; all zeros when empty, as vllm reports)."""
        if self.n == 0:
            return LatencyStats.of([], percentiles)
        mean = self.total / self.n
        std = math.sqrt(max(self.total_sq / self.n - mean * mean, 0.0))
        return LatencyStats(mean * 1e3, self.quantile(50) * 1e3, std * 1e3,
                            tuple((float(p), self.quantile(p) * 1e3) for p in percentiles))


class OutcomeTally:
    """Finished and failed requests of a run, as counts; summarised under the harness's keys."""

    def __init__(self, slo: SloTargets | None = None) -> None:
        self.slo = slo or SloTargets()
        self.ttft = LatencyHistogram()
        self.tpot = LatencyHistogram()
        self.e2el = LatencyHistogram()
        self.completed = 0
        self.failed = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.met = {name: 0 for name, _ in self.slo.items()}
        self.met_all = 0

    def add_done(self, ttft_s: np.ndarray, tpot_s: np.ndarray, e2el_s: np.ndarray,
                 prompts: np.ndarray, outputs: np.ndarray) -> None:
        """Finished requests; `tpot_s` is NaN for one-token requests (no TPOT, meets any target)."""
        n = len(ttft_s)
        if not n:
            return
        self.completed += n
        self.input_tokens += int(prompts.sum())
        self.output_tokens += int(outputs.sum())
        self.ttft.add(ttft_s)
        self.e2el.add(e2el_s)
        has_tpot = ~np.isnan(tpot_s)
        self.tpot.add(tpot_s if has_tpot.all() else tpot_s[has_tpot])
        if not self.slo:
            return
        observed = {"ttft": ttft_s, "tpot": np.where(has_tpot, tpot_s, 0.0), "e2el": e2el_s}
        every = np.ones(n, bool)
        for name, target_ms in self.slo.items():
            ok = observed[name] <= target_ms / 1000.0  # vllm: `slo >= value` counts as good
            self.met[name] += int(ok.sum())
            every &= ok
        self.met_all += int(every.sum())

    def add_failed(self, count: int) -> None:
        self.failed += count

    def summary(self, duration_s: float, percentiles: Sequence[float]) -> dict[str, Any]:
        """The keys `results.LatencyRecorder.summary` writes (no ITLs, no per-request lists)."""
        duration_s = max(duration_s, 1e-9)
        out: dict[str, Any] = {
            "duration": duration_s, "completed": self.completed, "failed": self.failed,
            "total_input_tokens": self.input_tokens, "total_output_tokens": self.output_tokens,
            "request_throughput": self.completed / duration_s,
            "output_throughput": self.output_tokens / duration_s,
        }
        for metric in ("ttft", "tpot", "e2el"):
            stats = getattr(self, metric).stats(tuple(percentiles))
            out[f"mean_{metric}_ms"] = stats.mean_ms
            out[f"median_{metric}_ms"] = stats.median_ms
            out[f"std_{metric}_ms"] = stats.std_ms
            for p, v in stats.percentiles_ms:
                out[f"p{percentile_label(p)}_{metric}_ms"] = v
        if self.slo:
            total = max(self.completed + self.failed, 1)
            out["request_goodput"] = self.met_all / duration_s
            out["goodput_slos"] = self.slo.as_dict()
            out["slo_attainment"] = {**{k: v / total for k, v in self.met.items()},
                                     "all": self.met_all / total}
        return out
