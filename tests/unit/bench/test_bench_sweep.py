"""Goodput search policy, sweeps, target parsing and the comparison table (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.client import EndpointConfig, RequestOutcome
from pdserve.bench.metrics import compute_metrics
from pdserve.slo import SloTargets
from pdserve.bench.plots import plot_attainment_vs_rate
from pdserve.bench.runner import BenchmarkResult, RunConfig
from pdserve.bench.sweep import (
    ComparisonRow,
    GoodputSearch,
    NamedTarget,
    SweepPoint,
    best_passing_rate,
    comparison_row_of_run,
    format_comparison,
    max_rate_meeting,
    next_probe_rate,
    search_goodput,
    sweep_rates,
)

pytestmark = pytest.mark.unit


def _drive(search: GoodputSearch, capacity: float) -> list[tuple[float, float]]:
    """Run the pure search policy against a server that meets the SLO exactly up to `capacity`."""
    probes: list[tuple[float, float]] = []
    while (rate := next_probe_rate(search, probes)) is not None:
        probes.append((rate, 0.95 if rate <= capacity else 0.5))
    return probes


@pytest.mark.parametrize("capacity", [0.3, 1.0, 7.3, 100.0])
def test_search_converges_on_the_capacity_from_below(capacity: float) -> None:
    search = GoodputSearch(start_rate=1.0, rel_tolerance=0.05, max_probes=30)
    probes = _drive(search, capacity)
    best = best_passing_rate(search, probes)
    assert best <= capacity
    assert best >= capacity * (1 - 0.05) - 1e-9
    assert len(probes) <= 30


def test_search_stops_at_max_rate_and_at_min_rate() -> None:
    search = GoodputSearch(start_rate=1.0, max_rate=8.0)
    assert [rate for rate, _ in _drive(search, capacity=1e9)] == [1.0, 2.0, 4.0, 8.0]
    hopeless = _drive(GoodputSearch(start_rate=1.0, min_rate=0.1), capacity=0.0)
    assert best_passing_rate(GoodputSearch(), hopeless) == 0.0
    assert min(rate for rate, _ in hopeless) == pytest.approx(0.1)


def test_search_respects_the_probe_budget() -> None:
    assert len(_drive(GoodputSearch(max_probes=3, rel_tolerance=1e-6), capacity=5.5)) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_attainment": 0.0},
        {"target_attainment": 1.5},
        {"growth": 1.0},
        {"start_rate": 10.0, "max_rate": 5.0},
    ],
)
def test_search_settings_are_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GoodputSearch(**kwargs)


def _result_with_attainment(share_good: float, rate: float, count: int = 20) -> BenchmarkResult:
    """A result whose requests meet a 100 ms TTFT target in the given share."""
    good = round(share_good * count)
    outcomes = [
        RequestOutcome(
            success=True,
            prompt_len=4,
            ttft_s=0.05 if i < good else 0.5,
            e2el_s=0.6,
            output_tokens=2,
            itls_s=(0.1,),
        )
        for i in range(count)
    ]
    config = RunConfig(endpoint=EndpointConfig(base_url="http://x", model="m"), slo=SloTargets(ttft_ms=100))
    metrics = compute_metrics(outcomes, count / rate, slo=config.slo)
    return BenchmarkResult(
        config=config.at_rate(rate),
        requests=(),
        outcomes=tuple(outcomes),
        arrival_offsets_s=(),
        duration_s=count / rate,
        metrics=metrics,
        date="d",
        run_start_s=0.0,
    )


async def test_search_goodput_drives_runs_and_normalises_per_gpu() -> None:
    seen: list[float] = []

    async def run_at(rate: float) -> BenchmarkResult:
        seen.append(rate)
        return _result_with_attainment(1.0 if rate <= 6.0 else 0.5, rate)

    found = await search_goodput(run_at, GoodputSearch(start_rate=2.0, rel_tolerance=0.1), num_gpus=2)
    assert seen[:3] == [2.0, 4.0, 8.0]
    assert 6.0 * 0.9 <= found.max_goodput_rate <= 6.0
    assert found.per_gpu == pytest.approx(found.max_goodput_rate / 2)
    assert [p.request_rate for p in found.points] == seen


async def test_sweep_records_attainment_per_rate(tmp_path: Path) -> None:
    async def run_at(rate: float) -> BenchmarkResult:
        return _result_with_attainment(1.0 if rate < 3 else 0.6, rate)

    points = await sweep_rates(run_at, [1.0, 2.0, 4.0])
    assert [(p.request_rate, p.attainment) for p in points] == [(1.0, 1.0), (2.0, 1.0), (4.0, 0.6)]
    assert max_rate_meeting(points, 0.9) == 2.0
    png = plot_attainment_vs_rate({"a": points, "b": points[:2]}, tmp_path / "sweep.png", num_gpus={"a": 2})
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        await sweep_rates(run_at, [float("inf")])


def test_attainment_needs_slo_targets() -> None:
    result = _result_with_attainment(1.0, 1.0)
    no_slo = BenchmarkResult(
        config=result.config,
        requests=(),
        outcomes=result.outcomes,
        arrival_offsets_s=(),
        duration_s=1.0,
        metrics=compute_metrics(result.outcomes, 1.0),
        date="d",
        run_start_s=0.0,
    )
    with pytest.raises(ValueError, match="goodput"):
        SweepPoint.of(1.0, no_slo)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("colocated=http://10.0.0.1:8000", NamedTarget("colocated", "http://10.0.0.1:8000", 1)),
        ("disagg=https://h/api,gpus=4", NamedTarget("disagg", "https://h/api", 4)),
    ],
)
def test_named_target_parsing(spec: str, expected: NamedTarget) -> None:
    assert NamedTarget.parse(spec) == expected


@pytest.mark.parametrize("spec", ["http://h:8000", "x=ftp://h", "x=http://h,gpus=0", "x=http://h,gpus=two"])
def test_named_target_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        NamedTarget.parse(spec)


def test_comparison_table_shows_ratios_to_the_baseline() -> None:
    rows = [
        ComparisonRow("colocated", 2, (("goodput", 2.0), ("p99 TTFT ms", 400.0))),
        ComparisonRow("disaggregated", 2, (("goodput", 3.0), ("p99 TTFT ms", 100.0))),
    ]
    table = format_comparison(rows)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["target", "gpus", "goodput"]
    assert "2.00 (1.00x)" in lines[2] and "3.00 (1.50x)" in lines[3] and "100.00 (0.25x)" in lines[3]
    assert lines[-1] == "(ratios are relative to colocated)"
    assert format_comparison([]) == ""


def test_comparison_row_of_run_is_per_gpu() -> None:
    result = _result_with_attainment(1.0, rate=4.0)
    values = dict(comparison_row_of_run("x", 2, result).values)
    assert values["req/s per GPU"] == pytest.approx(result.metrics.request_throughput / 2)
    assert values["SLO attainment %"] == pytest.approx(100.0)
    assert "p99 TTFT ms" in values
