"""pdserve.sim.validation.score: which cells count, the tolerance, and the repeat spread that
comes from measured values only."""

import json
import sys

import pytest

from pdserve.sim.validation import score as scorer

pytestmark = pytest.mark.unit


def validation(rate_rows):
    """{rate: {metric: (measured, sim)}} -> a validation (benchmarks/research/sim_validate.py's)."""
    rows = []
    for rate, metrics in rate_rows.items():
        rows.append({"run": f"r{rate}", "arm": "colocated", "rate": rate, "metrics": {
            k: {"measured": m, "sim": s, "error_pct": (s - m) / m * 100 if m else None}
            for k, (m, s) in metrics.items()}})
    return {"rows": rows}


def run_a():
    return validation({
        0.5: {"median_ttft_ms": (100, 110), "p90_ttft_ms": (200, 240), "median_tpot_ms": (50, 50),
              "p90_tpot_ms": (80, 70), "request_goodput": (0.4, 0.5), "output_throughput": (15, 15)},
        2.0: {"median_ttft_ms": (1000, 1140), "p90_ttft_ms": (3000, 2000), "median_tpot_ms": (90, 91),
              "p90_tpot_ms": (120, 118), "request_goodput": (0.0, 0.1), "output_throughput": (40, 42)},
    })


def run_b():  # the same cells measured again
    return validation({
        0.5: {"median_ttft_ms": (105, 110), "p90_ttft_ms": (210, 240), "median_tpot_ms": (52, 50),
              "p90_tpot_ms": (82, 70), "request_goodput": (0.45, 0.5), "output_throughput": (15.2, 15)},
        2.0: {"median_ttft_ms": (1100, 1150), "p90_ttft_ms": (4500, 2000), "median_tpot_ms": (92, 91),
              "p90_tpot_ms": (121, 118), "request_goodput": (0.0, 0.1), "output_throughput": (41, 42)},
    })


def test_cells_within_the_tolerance_goodput_apart_and_only_where_measured():
    s = scorer.score(run_a(), {}, 15.0)
    # 5 cells a rate; 0.5: TTFT p90 +20% misses; 2.0: TTFT p90 -33% misses (p50 +14% is in).
    assert (s.within, s.total) == (8, 10)
    # goodput: 0.5 is +25%; 2.0 measured none, so it is not a cell.
    assert (s.goodput_within, s.goodput_total) == (0, 1)
    assert s.misses == ["colocated @0.5 TTFT p90 +20%", "colocated @0.5 goodput +25%",
                        "colocated @2 TTFT p90 -33%"]
    assert scorer.score(run_a(), {}, 25.0).within == 9


def test_the_repeat_spread_comes_from_measured_values_and_marks_cells_that_do_not_repeat():
    spread = scorer.spreads([run_a(), run_b()])
    assert spread[("colocated", 2.0, "p90_ttft_ms", False)] == pytest.approx(50.0)
    assert spread[("colocated", 0.5, "p90_ttft_ms", False)] == pytest.approx(5.0)
    assert ("colocated", 2.0, "request_goodput", False) not in spread  # zero: no ratio
    # The same measurement scored twice (another step model) is not a repeat.
    assert scorer.spreads([run_a(), run_a()]) == {}
    s = scorer.score(run_a(), spread, 15.0)
    # TTFT p90 @2 moved 50% between repeats: out of the repeatable count; @0.5 (5%) stays in.
    assert (s.repeatable_within, s.repeatable_total) == (8, 9)
    assert "colocated @2 TTFT p90 -33%, repeats 50% apart" in s.misses
    assert "colocated @0.5 TTFT p90 +20%, repeats 5% apart" in s.misses
    # The simulator's values play no part: the same spread with any prediction.
    other = validation({0.5: {"p90_ttft_ms": (200, 1)}, 2.0: {"p90_ttft_ms": (3000, 1)}})
    assert scorer.spreads([other, run_b()]) == {
        k: v for k, v in spread.items() if k[2] == "p90_ttft_ms"}


def test_the_command_line_writes_the_table(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run_a()))
    b.write_text(json.dumps(run_b()))
    monkeypatch.setattr(sys, "argv", ["x", str(a), "--spread-from", str(b), "--out", str(tmp_path / "t.md")])
    assert scorer.main() == 0
    text = (tmp_path / "t.md").read_text()
    assert "| 8/10 | 0/1 | 8/9 |" in text and text.strip() == capsys.readouterr().out.strip()


def test_against_the_mean_of_repeats_that_replayed_the_same_arrivals(tmp_path, capsys, monkeypatch):
    # One prediction (a deterministic simulator, the same workload) for two repeats measured
    # 100 and 140: 20% over the first, 14% under the second, on their mean.
    a = validation({0.5: {"p90_ttft_ms": (100, 120), "request_goodput": (0.4, 0.6)}})
    b = validation({0.5: {"p90_ttft_ms": (140, 120), "request_goodput": (0.5, 0.6)}})
    mean = scorer.means([a, b])
    assert mean[("colocated", 0.5, "p90_ttft_ms", False)] == pytest.approx(120.0)
    s = scorer.score(a, scorer.spreads([a, b]), 15.0, mean)
    assert (s.within, s.total) == (0, 1)
    assert (s.mean_within, s.mean_total) == (1, 1)
    # goodput apart: 0.6 against the mean of 0.4 and 0.5 is 33% over
    assert (s.mean_goodput_within, s.mean_goodput_total) == (0, 1)
    assert scorer.means([a, a]) == {}  # one measurement scored twice is no repeat
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    monkeypatch.setattr(sys, "argv", ["x", str(pa), "--spread-from", str(pb), "--against-mean"])
    assert scorer.main() == 0
    assert "| 0/1 | 0/1 | 0/0 | 1/1 | 0/1 |" in capsys.readouterr().out  # it moved 40%: not repeatable
    monkeypatch.setattr(sys, "argv", ["x", str(pa), "--against-mean"])
    with pytest.raises(SystemExit):
        scorer.main()
