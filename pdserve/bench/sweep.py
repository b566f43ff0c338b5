"""Load sweeps, goodput search and endpoint comparison: the numbers disaggregation is judged by.

- `sweep_rates` runs one workload at each request rate and records SLO attainment (DistServe's plot:
  attainment vs rate, one line per system).
- `search_goodput` finds the highest rate at which at least `target_attainment` (default 90%) of requests
  meet every SLO target. The decision of which rate to probe next is the pure function
  `next_probe_rate` over the probes so far (ladder up by a growth factor until a rate fails, then bisect
  between the best passing and the lowest failing rate), so it is tested without any server and an
  offline replay of recorded probes makes the same decisions. Dividing by `num_gpus` gives goodput per
  GPU, the fair unit when a disaggregated deployment and a colocated one use different GPU counts.
- `format_comparison` prints named endpoints side by side with each value's ratio to the first
  (baseline) endpoint.

Each probe is a full benchmark run of `num_prompts` requests: attainment is measured over a whole run,
never extrapolated from a partial one.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pdserve.bench.metrics import LatencyStats, percentile_label
from pdserve.bench.runner import BenchmarkResult

RunAtRate = Callable[[float], Awaitable[BenchmarkResult]]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One probed rate: the offered rate, attainment of all SLOs, and the full run behind it."""

    request_rate: float
    attainment: float
    result: BenchmarkResult

    @classmethod
    def of(cls, request_rate: float, result: BenchmarkResult) -> SweepPoint:
        attainment = result.metrics.attainment
        if attainment is None:
            raise ValueError("SLO attainment needs SLO targets (--goodput ttft:MS tpot:MS)")
        return cls(request_rate, attainment.all, result)


async def sweep_rates(run_at: RunAtRate, rates: Sequence[float]) -> list[SweepPoint]:
    """Run the workload at each rate in order (lowest first is kindest to a server that may fall over)."""
    points = []
    for rate in rates:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"sweep rates must be positive and finite, got {rate}")
        points.append(SweepPoint.of(rate, await run_at(rate)))
    return points


def max_rate_meeting(points: Sequence[SweepPoint], target_attainment: float) -> float:
    """The highest swept rate whose attainment reaches the target; 0.0 when none does."""
    return max((p.request_rate for p in points if p.attainment >= target_attainment), default=0.0)


@dataclass(frozen=True, slots=True)
class GoodputSearch:
    """Search settings. Stops when the passing/failing bracket is within `rel_tolerance` of the failing
    rate, after `max_probes` runs, at `max_rate`, or when even `min_rate` fails."""

    target_attainment: float = 0.9
    start_rate: float = 1.0
    growth: float = 2.0
    max_rate: float = 1024.0
    min_rate: float = 0.01
    rel_tolerance: float = 0.05
    max_probes: int = 12

    def __post_init__(self) -> None:
        if not 0.0 < self.target_attainment <= 1.0:
            raise ValueError(f"target attainment must be in (0, 1], got {self.target_attainment}")
        if not 0.0 < self.min_rate <= self.start_rate <= self.max_rate < math.inf:
            raise ValueError("need 0 < min_rate <= start_rate <= max_rate < inf")
        if self.growth <= 1.0 or self.rel_tolerance <= 0.0 or self.max_probes < 1:
            raise ValueError("need growth > 1, rel_tolerance > 0 and max_probes >= 1")


def next_probe_rate(search: GoodputSearch, probes: Sequence[tuple[float, float]]) -> float | None:
    """The next rate to try given (rate, attainment) probes so far, or None when the search is done."""
    if not probes:
        return search.start_rate
    if len(probes) >= search.max_probes:
        return None
    passing = [rate for rate, share in probes if share >= search.target_attainment]
    best = max(passing, default=0.0)
    failing_above = [rate for rate, share in probes if share < search.target_attainment and rate > best]
    if not failing_above:
        if best >= search.max_rate:
            return None
        return min(best * search.growth, search.max_rate)
    lowest_failing = min(failing_above)
    if best == 0.0 and lowest_failing <= search.min_rate:
        return None
    if lowest_failing - best <= search.rel_tolerance * lowest_failing:
        return None
    if best == 0.0:
        return max(lowest_failing / search.growth, search.min_rate)
    return (best + lowest_failing) / 2.0


def best_passing_rate(search: GoodputSearch, probes: Sequence[tuple[float, float]]) -> float:
    """The highest probed rate meeting the target attainment (the max goodput); 0.0 if none did."""
    return max((rate for rate, share in probes if share >= search.target_attainment), default=0.0)


@dataclass(frozen=True, slots=True)
class GoodputResult:
    """Outcome of a goodput search: the best passing rate and every probe, in probe order."""

    max_goodput_rate: float
    points: tuple[SweepPoint, ...]
    num_gpus: int = 1

    @property
    def per_gpu(self) -> float:
        return self.max_goodput_rate / self.num_gpus


async def search_goodput(run_at: RunAtRate, search: GoodputSearch, num_gpus: int = 1) -> GoodputResult:
    """Probe rates chosen by `next_probe_rate` until it says stop."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    points: list[SweepPoint] = []
    while (rate := next_probe_rate(search, [(p.request_rate, p.attainment) for p in points])) is not None:
        points.append(SweepPoint.of(rate, await run_at(rate)))
    best = best_passing_rate(search, [(p.request_rate, p.attainment) for p in points])
    return GoodputResult(max_goodput_rate=best, points=tuple(points), num_gpus=num_gpus)


@dataclass(frozen=True, slots=True)
class NamedTarget:
    """An endpoint to compare: a name for tables, its base URL, and the GPUs it runs on."""

    name: str
    base_url: str
    num_gpus: int = 1

    @classmethod
    def parse(cls, spec: str) -> NamedTarget:
        """Parse "NAME=URL" or "NAME=URL,gpus=N" (e.g. "disagg=http://10.0.0.2:8000,gpus=2")."""
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"invalid target {spec!r}: use NAME=URL or NAME=URL,gpus=N")
        url, _, gpus = rest.rpartition(",gpus=") if ",gpus=" in rest else (rest, "", "1")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"invalid target {spec!r}: the URL must start with http:// or https://")
        try:
            num_gpus = int(gpus)
        except ValueError:
            raise ValueError(f"invalid target {spec!r}: gpus must be an integer") from None
        if num_gpus < 1:
            raise ValueError(f"invalid target {spec!r}: gpus must be >= 1")
        return cls(name=name, base_url=url, num_gpus=num_gpus)


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One endpoint's headline numbers, as (column name, value) pairs in display order."""

    name: str
    num_gpus: int
    values: tuple[tuple[str, float], ...]


def format_comparison(rows: Sequence[ComparisonRow]) -> str:
    """A text table of the rows, each value followed by its ratio to the first row's value."""
    if not rows:
        return ""
    columns = [name for name, _ in rows[0].values]
    baseline = dict(rows[0].values)
    header = ["target", "gpus", *columns]
    body = [
        [row.name, str(row.num_gpus), *(_cell(dict(row.values)[c], baseline[c]) for c in columns)]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append(f"(ratios are relative to {rows[0].name})")
    return "\n".join(lines)


def _cell(value: float, baseline: float) -> str:
    ratio = f"{value / baseline:.2f}x" if baseline else "n/a"
    return f"{value:.2f} ({ratio})"


def comparison_row_of_run(name: str, num_gpus: int, result: BenchmarkResult) -> ComparisonRow:
    """Headline numbers of one run at a fixed rate: throughputs per GPU, tail latencies, attainment."""
    metrics = result.metrics
    values = [
        ("req/s per GPU", metrics.request_throughput / num_gpus),
        ("goodput req/s per GPU", metrics.request_goodput / num_gpus),
        ("out tok/s per GPU", metrics.output_throughput / num_gpus),
        _tail("TTFT", metrics.ttft),
        _tail("TPOT", metrics.tpot),
    ]
    if metrics.attainment is not None:
        values.append(("SLO attainment %", metrics.attainment.all * 100.0))
    return ComparisonRow(name=name, num_gpus=num_gpus, values=tuple(values))


def _tail(short_name: str, stats: LatencyStats) -> tuple[str, float]:
    """The highest computed percentile of a metric (p99 by default), or the median if none was asked."""
    if not stats.percentiles_ms:
        return f"median {short_name} ms", stats.median_ms
    p, value = max(stats.percentiles_ms)
    return f"p{percentile_label(p)} {short_name} ms", value


def comparison_row_of_goodput(name: str, goodput: GoodputResult) -> ComparisonRow:
    """Headline numbers of a goodput search: max goodput rate, total and per GPU."""
    values = (("max goodput req/s", goodput.max_goodput_rate), ("per GPU", goodput.per_gpu))
    return ComparisonRow(name=name, num_gpus=goodput.num_gpus, values=values)
