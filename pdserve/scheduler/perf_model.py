"""Performance model of one engine kind: how long prefill, a decode step and a KV pull take.

The router predicts TTFT and TPOT with it; the autoscaler turns load into utilisation with it;
the simulator runs engines on it. It is three straight lines:

- prefill time = `prefill_overhead_s + tokens / prefill_tokens_per_s` (an engine prefills one
  batch at a time, so queued prompt tokens add up);
- decode step time = `decode_step_s + decode_step_per_seq_s * batch` (every running request gets
  one token per step; a step is memory bound and grows with the batch);
- KV pull time = `transfer_overhead_s + tokens * kv_bytes_per_token / transfer_bytes_per_s`.

`PerfModel.from_calibration` seeds it from a measured profile (the JSON in ../shared/calibration
or one that `pdserve` records); `OnlineFit` refits each line from what the frontend observes, so
a deployment without a profile converges on its own numbers within a few dozen requests.
Everything here is plain values: no clocks, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class PerfModel:
    prefill_tokens_per_s: float
    decode_step_s: float
    decode_step_per_seq_s: float = 0.0
    prefill_overhead_s: float = 0.0
    kv_bytes_per_token: int = 131072
    transfer_bytes_per_s: float = 50e9
    transfer_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.transfer_bytes_per_s <= 0:
            raise ValueError("rates must be positive")
        if min(self.decode_step_s, self.decode_step_per_seq_s, self.prefill_overhead_s,
               self.transfer_overhead_s) < 0:
            raise ValueError("times must be non-negative")

    def prefill_s(self, tokens: float) -> float:
        """Time to prefill `tokens` prompt tokens (0 tokens cost nothing)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + tokens / self.prefill_tokens_per_s

    def decode_step_time(self, batch: float) -> float:
        """One decode step with `batch` running requests (>= 1)."""
        return self.decode_step_s + self.decode_step_per_seq_s * max(batch, 1.0)

    def transfer_s(self, tokens: float) -> float:
        """Time to pull the KV of `tokens` prompt tokens from a prefill engine."""
        if tokens <= 0:
            return 0.0
        return self.transfer_overhead_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def max_batch_for_tpot(self, tpot_s: float) -> int:
        """The largest batch whose decode step stays within `tpot_s` (0 if none does)."""
        if self.decode_step_time(1) > tpot_s:
            return 0
        if self.decode_step_per_seq_s == 0:
            return 1 << 30
        return int((tpot_s - self.decode_step_s) / self.decode_step_per_seq_s)

    @classmethod
    def from_calibration(cls, data: Mapping[str, Any]) -> PerfModel:
        """Fit the model to a calibration profile.

        Keys used: `prefill_tokens_per_s` (a number or a mapping of runs; the median is taken),
        `ttft_single_ms` (prompt length -> single-request TTFT, gives the fixed prefill cost),
        `tpot_ms_by_batch` (batch -> TPOT; a Theil-Sen line, see `fit_line_robust`),
        `kv_bytes_per_token`, and an
        optional `transfer` section {bytes_per_s, overhead_s} (else the NVLink NCCL numbers of
        `links_h100_pair` at 128 MiB, else 50 GB/s). A `step_fit` section (the step model fitted
        to an engine's own step trace, pdserve.engine.step_trace) replaces the decode line and,
        where it has one, the prefill rate: it times the engine's steps rather than the gaps a
        client sees. Where it also timed the profile's lone prefills (`lone_prefill_s`), the
        fixed prefill cost is its step cost plus the response path: the lone TTFTs less the
        engine's own time for them.
        """
        step_fit = data.get("step_fit") or {}
        rate = step_fit.get("prefill_tokens_per_s") or _median_rate(data["prefill_tokens_per_s"])
        overhead = 0.0
        singles = data.get("ttft_single_ms") or {}
        lone = {k: v for k, v in (step_fit.get("lone_prefill_s") or {}).items() if k in singles}
        if lone:
            # The engine timed the same lone prefills: what the client saw beyond that is the
            # response path, added to the fitted step (a step's fixed cost plus tokens / rate).
            # Unlike the affine fit below it is not skewed where prefill time is not affine in
            # the prompt (CPU engines: first-shape costs, short prompts).
            gaps = [singles[k] / 1000 - s for k, s in lone.items()]
            overhead = step_fit["decode_step_s"] + max(0.0, sum(gaps) / len(gaps))
        elif singles:
            # A single request's TTFT = overhead + tokens / rate; average over the measured sizes.
            gaps = [ms / 1000 - int(tokens) / rate for tokens, ms in singles.items()]
            overhead = max(0.0, sum(gaps) / len(gaps))
        points = [(float(b), ms / 1000) for b, ms in (data.get("tpot_ms_by_batch") or {}).items()]
        if not points:
            raise ValueError("calibration has no tpot_ms_by_batch")
        if step_fit:
            intercept, slope = step_fit["decode_step_s"], step_fit["decode_step_per_seq_s"]
        else:
            intercept, slope = fit_line_robust(points)
        transfer = data.get("transfer") or {}
        link = (data.get("links_h100_pair") or {}).get("nccl_sendrecv_GBps") or {}
        bandwidth = transfer.get("bytes_per_s") or (link.get("128MiB", 0) * 1e9) or 50e9
        return cls(
            prefill_tokens_per_s=rate, prefill_overhead_s=overhead,
            decode_step_s=max(intercept, 0.0), decode_step_per_seq_s=max(slope, 0.0),
            kv_bytes_per_token=int(data.get("kv_bytes_per_token", 131072)),
            transfer_bytes_per_s=float(bandwidth),
            transfer_overhead_s=float(transfer.get("overhead_s", 0.0)),
        )

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        return cls.from_calibration(json.loads(Path(path).read_text()))


def _median_rate(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    rates = sorted(float(v) for v in value.values())
    if not rates:
        raise ValueError("calibration has no prefill rate")
    mid = len(rates) // 2
    return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x; a single x gives a flat line."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def fit_line_robust(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Theil-Sen (intercept, slope): the median of the pairwise slopes, then the median
    intercept; least squares below three points. Profiles time decode gaps at the frontend, where
    one noisy batch size is common: on an H100 profile (batch 1, 8, 32, 64, 128 -> 6.3, 12.7,
    9.6, 11.7, 23.7 ms) least squares put the line at 7.5 + 0.114 ms/seq, lifted by the batch-8
    outlier, and the simulator then missed TPOT by 15-20%; the medians give 6.4 + 0.098."""
    if len(points) < 3:
        return fit_line(points)
    slopes = sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
                    for x2, y2 in points[i + 1:] if x2 != x1)
    if not slopes:
        return fit_line(points)
    slope = _median(slopes)
    return _median(sorted(y - slope * x for x, y in points)), slope


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass(slots=True)
class LineFit:
    """Exponentially weighted least squares of y = a + b x.

    Old observations fade with `decay` per new one (0.98: the last ~50 dominate). A prior of
    `prior_weight` pseudo-observation on the seed line keeps early estimates sane and lets the
    fit fall back to the seed where data never varies in x.
    """

    intercept: float
    slope: float
    decay: float = 0.98
    prior_weight: float = 1.0
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    count: int = 0

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or y < 0:
            return
        d = self.decay
        self._w = self._w * d + 1
        self._sx = self._sx * d + x
        self._sy = self._sy * d + y
        self._sxx = self._sxx * d + x * x
        self._sxy = self._sxy * d + x * y
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(intercept, slope) blending the observations with the seed line."""
        if self.count == 0:
            return self.intercept, self.slope
        # Prior: pseudo-points of the seed line at the observed mean x, spread like the data.
        p = self.prior_weight
        mx = self._sx / self._w
        var = max(self._sxx / self._w - mx * mx, 0.0)
        spread = math.sqrt(var) or max(abs(mx), 1.0)
        w = self._w + p
        sx = self._sx + p * mx
        sy = self._sy + p * (self.intercept + self.slope * mx)
        sxx = self._sxx + p * (mx * mx + spread * spread)
        sxy = self._sxy + p * (mx * (self.intercept + self.slope * mx) + self.slope * spread * spread)
        det = w * sxx - sx * sx
        if det <= 1e-12 * max(w * sxx, 1e-30):
            return sy / w - self.slope * sx / w, self.slope
        slope = (w * sxy - sx * sy) / det
        return (sy - slope * sx) / w, slope


@dataclass(slots=True)
class OnlineFit:
    """Refits a `PerfModel` from observations the frontend makes; the seed is the prior.

    - `observe_prefill(tokens, seconds)`: a prefill leg that found `tokens` prompt tokens ahead
      of it and its own (queued + own, uncached) took `seconds` to its first token;
    - `observe_decode(batch, seconds_per_token)`: an inter-token gap seen at that batch size;
    - `observe_transfer(tokens, seconds)`: a decode leg's time to its first token: the KV pull,
      plus any wait for the decode engine's KV blocks and step. It delays token 2, so it enters
      the predicted TPOT (spread over the request's tokens), never the predicted TTFT.
    """

    seed: PerfModel
    prefill: LineFit | None = None
    decode: LineFit | None = None
    transfer: LineFit | None = None

    def __post_init__(self) -> None:
        s = self.seed
        self.prefill = LineFit(s.prefill_overhead_s, 1 / s.prefill_tokens_per_s)
        self.decode = LineFit(s.decode_step_s, s.decode_step_per_seq_s)
        self.transfer = LineFit(
            s.transfer_overhead_s, s.kv_bytes_per_token / s.transfer_bytes_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.prefill.observe(tokens, seconds)

    def observe_decode(self, batch: int, seconds_per_token: float) -> None:
        if batch > 0:
            self.decode.observe(batch, seconds_per_token)

    def observe_transfer(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.transfer.observe(tokens, seconds)

    def model(self) -> PerfModel:
        """The current estimate; each line is clamped to physical values (no negative times)."""
        s = self.seed
        p0, p1 = self.prefill.line()
        d0, d1 = self.decode.line()
        t0, t1 = self.transfer.line()
        per_token = p1 if p1 > 0 else 1 / s.prefill_tokens_per_s
        per_token_kv = t1 if t1 > 0 else s.kv_bytes_per_token / s.transfer_bytes_per_s
        return replace(
            s, prefill_tokens_per_s=1 / per_token, prefill_overhead_s=max(p0, 0.0),
            decode_step_s=max(d0, 1e-6), decode_step_per_seq_s=max(d1, 0.0),
            transfer_bytes_per_s=s.kv_bytes_per_token / per_token_kv,
            transfer_overhead_s=max(t0, 0.0),
        )
