"""Serving metrics, computed and named exactly like `vllm bench serve` (vllm/benchmarks/serve.py,
`calculate_metrics`), plus SLO attainment.

Pure functions of recorded outcomes: no clock, no I/O, so the same numbers come out of a live run, a
replayed result file, or a unit test with a hand-made timeline. The vllm rules reproduced here, each one a
choice a reader might otherwise get wrong:

- Only successful requests contribute latencies, tokens and input lengths; failures count in `failed`.
- Input length: the server's `usage.prompt_tokens` when it reports one, else the workload's prompt_len.
- Output length: the server's `usage.completion_tokens`; if missing (or 0), the tokenizer's count of the
  generated text; without a tokenizer, the number of token chunks (vllm uses 1 there, which would make
  TPOT meaningless for servers that omit usage).
- TPOT = (E2EL - TTFT) / (output_len - 1), only for requests with more than one output token. For
  goodput a one-token request counts TPOT as 0 (it trivially meets any TPOT target).
- ITL pools every inter-chunk gap of every request; statistics are over that pooled list.
- Statistics use numpy defaults: population std, linear-interpolated percentiles, and 0 for an empty list.
- Throughputs divide by the benchmark duration (first send to last completion, measured by the runner).
- Goodput: requests/s of completed requests meeting every given SLO (`--goodput ttft:MS tpot:MS e2el:MS`).

Attainment (not in vllm) is the fraction of *all* benchmarked requests meeting each target and all of them;
a failed request meets none, so overload that turns into errors cannot look like success.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.client import RequestOutcome
from pdserve.slo import SLO_NAMES, SloTargets

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile_label(p: float) -> str:
    """vllm's spelling of a percentile in result keys: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency metric in milliseconds; percentiles as (percentile, value) pairs."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        # vllm passes `values or 0`: an empty list summarises as all zeros rather than NaN.
        data = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
        return cls(
            mean_ms=float(np.mean(data)),
            median_ms=float(np.median(data)),
            std_ms=float(np.std(data)),
            percentiles_ms=tuple((float(p), float(np.percentile(data, p))) for p in percentiles),
        )

    def percentile(self, p: float) -> float:
        for q, value in self.percentiles_ms:
            if q == p:
                return value
        raise KeyError(f"percentile {p} was not computed (have {[q for q, _ in self.percentiles_ms]})")


@dataclass(frozen=True, slots=True)
class Attainment:
    """Fractions of all requests meeting each SLO target (`per_slo`) and every target (`all`)."""

    per_slo: tuple[tuple[str, float], ...]
    all: float

    def as_dict(self) -> dict[str, float]:
        return {**dict(self.per_slo), "all": self.all}


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """Everything `calculate_metrics` reports, plus attainment; `output_lens` is per request (0 if failed)."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: tuple[int, ...]
    tpots_s: tuple[float, ...]
    attainment: Attainment | None

    def stats(self, metric: str) -> LatencyStats:
        if metric not in LATENCY_METRICS:
            raise KeyError(f"unknown latency metric {metric!r}; known: {', '.join(LATENCY_METRICS)}")
        return getattr(self, metric)


def input_length(outcome: RequestOutcome) -> int:
    """Prompt tokens of a request: the server's count when reported (vllm 0.32 does the same)."""
    return outcome.prompt_tokens if outcome.prompt_tokens is not None else outcome.prompt_len


def output_length(outcome: RequestOutcome, count_tokens: Callable[[str], int] | None) -> int:
    """Output tokens of a successful request: usage, else tokenizer count, else chunk count."""
    if outcome.output_tokens:
        return outcome.output_tokens
    if count_tokens is not None:
        return count_tokens(outcome.generated_text)
    return outcome.chunk_count


def request_tpot_s(outcome: RequestOutcome, output_len: int) -> float | None:
    """(E2EL - TTFT) / (output_len - 1); None for requests with at most one output token."""
    if output_len <= 1:
        return None
    return (outcome.e2el_s - outcome.ttft_s) / (output_len - 1)


def meets_slo(outcome: RequestOutcome, output_len: int, slo: SloTargets) -> dict[str, bool]:
    """Per target: does this request meet it? Failed requests meet nothing."""
    if not outcome.success:
        return {name: False for name, _ in slo.items()}
    observed_s = {
        "ttft": outcome.ttft_s,
        "tpot": request_tpot_s(outcome, output_len) or 0.0,
        "e2el": outcome.e2el_s,
    }
    # vllm's test is `slo >= value` on seconds: meeting the target exactly counts as good.
    return {name: target_ms / 1000.0 >= observed_s[name] for name, target_ms in slo.items()}


def compute_metrics(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    slo: SloTargets | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> BenchmarkMetrics:
    """All run metrics from per-request outcomes and the run's duration (see the module docstring)."""
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    slo = slo or SloTargets()
    output_lens = [output_length(o, count_tokens) if o.success else 0 for o in outcomes]
    done = [(o, n) for o, n in zip(outcomes, output_lens, strict=True) if o.success]
    tpots = [t for o, n in done if (t := request_tpot_s(o, n)) is not None]
    verdicts = _verdicts(outcomes, output_lens, slo)
    every = np.logical_and.reduce(list(verdicts.values())) if verdicts else None
    good = int(every.sum()) if every is not None else len(done)
    total_input = sum(input_length(o) for o, _ in done)
    total_output = sum(output_lens)
    peak_tokens, peak_concurrency = _peaks([o for o, _ in done])
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outcomes) - len(done),
        total_input=total_input,
        total_output=total_output,
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=LatencyStats.of([o.ttft_s for o, _ in done], percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of([gap for o, _ in done for gap in o.itls_s], percentiles),
        e2el=LatencyStats.of([o.e2el_s for o, _ in done], percentiles),
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
        output_lens=tuple(output_lens),
        tpots_s=tuple(tpots),
        attainment=_attainment(verdicts, every, len(outcomes)) if slo else None,
    )


def _verdicts(outcomes: Sequence[RequestOutcome], output_lens: Sequence[int],
              slo: SloTargets) -> dict[str, np.ndarray]:
    """`meets_slo` for every request at once, as one boolean array per target (same rules:
    failed requests meet nothing, a one-token request's TPOT counts as 0)."""
    if not slo:
        return {}
    ok = np.fromiter((o.success for o in outcomes), bool, len(outcomes))
    columns = {
        "ttft": lambda o, n: o.ttft_s,
        "tpot": lambda o, n: request_tpot_s(o, n) or 0.0,
        "e2el": lambda o, n: o.e2el_s,
    }
    out = {}
    for name, target_ms in slo.items():
        get = columns[name]
        observed = np.fromiter((get(o, n) if o.success else np.inf
                                for o, n in zip(outcomes, output_lens, strict=True)),
                               float, len(outcomes))
        out[name] = ok & (target_ms / 1000.0 >= observed)
    return out


def _attainment(verdicts: dict[str, np.ndarray], every: np.ndarray, count: int) -> Attainment:
    total = max(1, count)
    per_slo = tuple((name, int(v.sum()) / total) for name, v in verdicts.items())
    return Attainment(per_slo=per_slo, all=int(every.sum()) / total)


def _peaks(done: Sequence[RequestOutcome]) -> tuple[float, int]:
    """Peak output tokens and peak concurrent requests over one-second buckets (vllm 0.32).

    Token times are rebuilt from start + TTFT + cumulative ITLs, one token per chunk; a request counts as
    concurrent in every bucket from the one it starts in to the one it ends in, both included.
    """
    if not done:
        return 0.0, 0
    origin = min(o.start_s for o in done)
    buckets = int(np.ceil(max(o.start_s + o.e2el_s for o in done) - origin)) + 1
    tokens = np.zeros(buckets)
    concurrent = np.zeros(buckets)
    for outcome in done:
        token_times = outcome.start_s + outcome.ttft_s + np.cumsum((0.0, *outcome.itls_s))
        indices = (token_times - origin).astype(int)
        np.add.at(tokens, indices[(indices >= 0) & (indices < buckets)], 1)
        first = int(outcome.start_s - origin)
        last = int(outcome.start_s + outcome.e2el_s - origin)
        concurrent[first : last + 1] += 1
    return float(tokens.max()), int(concurrent.max())
