"""pdserve.bench.grid and grid_summary (issue 31's grid, benchmarks/gpu/grid.sh): the workloads,
the rate bisection, the slices a device call runs, and the cells, spreads, best pdserve arm, TTFT
overhead and merge over runs of several sessions."""

import json
from pathlib import Path

import pytest

from pdserve.bench import arm_summary, grid, grid_summary
from pdserve.bench.arms import ENGINE

pytestmark = pytest.mark.unit

TARGETS = ("8", "10", "15", "20")


# --- workloads ---------------------------------------------------------------------------------


def test_every_workload_fits_the_engines_context_with_its_ttft_target():
    assert {name: w.ttft_ms for name, w in grid.WORKLOADS.items()} == {
        "isl2k": 500.0, "isl8k": 2000.0, "isl16k": 2000.0, "mooncake": 2000.0}
    for workload in grid.WORKLOADS.values():
        assert workload.input_len + workload.output_len <= ENGINE["max_model_len"]
    assert ENGINE["max_model_len"] >= 16384 + 256
    flags = grid.WORKLOADS["isl16k"].bench_flags()
    assert flags[flags.index("--random-input-len") + 1] == "16384"
    mooncake = grid.WORKLOADS["mooncake"].bench_flags()
    assert mooncake == ["--dataset-name", "summarization", "--max-model-len", str(ENGINE["max_model_len"])]


def test_a_probes_seed_depends_on_workload_and_rate_only_and_2k_keeps_issue_9s():
    isl2k, isl8k = grid.WORKLOADS["isl2k"], grid.WORKLOADS["isl8k"]
    assert isl2k.seed(8) == 8000 and isl2k.seed(12) == 12000  # the arrivals of every earlier run
    assert isl8k.seed(8) != isl2k.seed(8) and isl8k.seed(2.38) != isl8k.seed(2.83)
    assert isl8k.num_prompts(1.0) == isl8k.min_prompts and isl8k.num_prompts(10.0) == 120


def test_the_lattice_gives_every_arm_of_a_gpu_count_the_same_rates():
    lattice = grid.RateLattice(grid.WORKLOADS["isl8k"].rate_unit * 2)
    assert [lattice.rate(k) for k in range(-4, 5)] == [1.5, 1.78, 2.12, 2.52, 3.0, 3.57, 4.24, 5.05, 6.0]
    assert (lattice.low, lattice.high) == (-12, 12)
    assert grid.RateLattice(3.0, steps_per_octave=8).rate(4) == 4.24


# --- the bisection -----------------------------------------------------------------------------


def _arm(knees: dict[str, float]):
    """A synthetic arm whose attainment at TPOT target t is 1 below rate knees[t], 0 from it."""
    return lambda rate: {t: 1.0 if rate < knees[t] else 0.0 for t in TARGETS}


def _bisect(arm, lattice: grid.RateLattice, prior: dict[str, int] | None = None) -> dict[int, dict[str, float]]:
    probes: dict[int, dict[str, float]] = {}
    while (index := grid.next_index(probes, TARGETS, lattice, prior)) is not None:
        assert index not in probes, "a rate is never probed twice"
        probes[index] = arm(lattice.rate(index))
    return probes


def test_the_bisection_brackets_every_targets_knee_to_one_lattice_step():
    lattice = grid.RateLattice(3.0)
    knees = {"8": 2.0, "10": 4.0, "15": 7.0, "20": 7.5}
    probes = _bisect(_arm(knees), lattice)
    for target, knee in knees.items():
        found = grid.bracket({lattice.rate(i): a[target] >= 0.9 for i, a in probes.items()})
        assert found.passed < knee <= found.failed
        assert found.failed / found.passed == pytest.approx(2 ** 0.25, rel=0.02)
    # Ten probes for four knees spread over 2-7.5 req/s; the same lattice as a fixed grid over the
    # span they needed (1.5-12 req/s) takes 13, and 2 req/s steps (2-12) place the 2 req/s knee
    # no better than "below 2".
    assert len(probes) == 10


def test_the_tightest_target_is_served_first():
    lattice = grid.RateLattice(3.0)
    arm = _arm({"8": 2.0, "10": 4.0, "15": 7.0, "20": 7.5})
    probes: dict[int, dict[str, float]] = {}
    for _ in range(4):
        index = grid.next_index(probes, TARGETS, lattice)
        probes[index] = arm(lattice.rate(index))
    # After four probes (3 -> 1.5 -> 2.12 -> 1.78) 8 ms is bracketed; 10 ms got nothing of its own.
    assert [lattice.rate(i) for i in probes] == [3.0, 1.5, 2.12, 1.78]


def test_a_knee_beyond_the_lattice_ends_the_search_with_what_it_has():
    lattice = grid.RateLattice(1.0, low_octaves=1, high_octaves=1)
    always = _bisect(lambda rate: {t: 1.0 for t in TARGETS}, lattice)
    never = _bisect(lambda rate: {t: 0.0 for t in TARGETS}, lattice)
    assert sorted(lattice.rate(i) for i in always) == [1.0, 2.0]
    assert sorted(lattice.rate(i) for i in never) == [0.5, 1.0]


def _sweep(lattice: grid.RateLattice, probes: dict[int, dict[str, float]]) -> dict:
    """A record's sweep of the probes, as proof.py writes it."""
    return {"lattice": {"unit": lattice.unit, "steps_per_octave": lattice.steps_per_octave},
            "rates": [{"index": i, "rate": lattice.rate(i), "attainment": a} for i, a in probes.items()]}


def test_an_earlier_runs_knees_bracket_an_unmoved_knee_in_two_probes_and_a_moved_one_still():
    lattice = grid.RateLattice(3.0)
    knees = {"8": 2.0, "10": 4.0, "15": 7.0, "20": 7.5}
    first = _bisect(_arm(knees), lattice)
    prior = grid.prior_knees([_sweep(lattice, first)], TARGETS, lattice)
    assert [lattice.rate(prior[t]) for t in TARGETS] == [1.78, 3.57, 6.0, 7.14]
    again = _bisect(_arm(knees), lattice, prior)
    assert len(again) == 7 < len(first) == 10  # 15 and 20 ms: knees a step apart share a probe
    assert len(_bisect(_arm({t: 2.0 for t in TARGETS}), lattice, {t: prior["8"] for t in TARGETS})) == 2
    # Knees that moved (here up by half an octave and more) are still bracketed to one step.
    moved = {"8": 2.9, "10": 6.0, "15": 11.0, "20": 11.5}
    probes = _bisect(_arm(moved), lattice, prior)
    for target, knee in moved.items():
        found = grid.bracket({lattice.rate(i): a[target] >= 0.9 for i, a in probes.items()})
        assert found.passed < knee <= found.failed
        assert found.failed / found.passed == pytest.approx(2 ** 0.25, rel=0.02)


def test_prior_knees_take_the_median_over_runs_on_the_same_lattice_only():
    lattice = grid.RateLattice(3.0)
    runs = [_bisect(_arm({t: knee for t in TARGETS}), lattice) for knee in (2.0, 2.5, 4.0)]
    sweeps = [_sweep(lattice, probes) for probes in runs]
    assert grid.prior_knees(sweeps, TARGETS, lattice) == {t: -2 for t in TARGETS}  # 2.12 req/s
    finer = grid.RateLattice(3.0, steps_per_octave=8)
    assert grid.prior_knees(sweeps, TARGETS, finer) == {}
    unbracketed = _sweep(lattice, {0: {t: 1.0 for t in TARGETS}})
    assert grid.prior_knees([unbracketed], TARGETS, lattice) == {}


def test_a_pass_above_a_failure_is_noise_the_bracket_ignores():
    assert grid.bracket({1: True, 2: False, 3: True}) == grid.Bracket(1, 2)
    assert grid.bracket({1: False, 2: True}) == grid.Bracket(None, 1)
    assert grid.bracket({1: True, 2: True}) == grid.Bracket(2, None)


# --- slices ------------------------------------------------------------------------------------


def test_a_slice_names_workloads_and_arms_one_after_another_or_side_by_side():
    groups = grid.parse_slice("isl8k+isl16k:1P1D,colocated-1/vllm-1")
    assert groups == [grid.SliceGroup(("isl8k", "isl16k"), ("1P1D",)),
                      grid.SliceGroup(("isl8k", "isl16k"), ("colocated-1", "vllm-1"))]
    assert grid.assign_gpus(("colocated-1", "vllm-1"), ["0", "1"]) == [["0"], ["1"]]
    with pytest.raises(ValueError, match="need 4 GPUs"):
        grid.assign_gpus(("1P1D", "colocated-2"), ["0", "1"])
    for bad, message in (("isl9k:1P1D", "unknown workload"), ("isl2k", "expected WORKLOAD"),
                         ("isl2k:3PD", "xPyD-ipc"), ("isl2k:", "expected")):
        with pytest.raises(ValueError, match=message):
            grid.parse_slice(bad)


def test_a_slice_of_two_long_workloads_on_one_arm_fits_one_device_call():
    # 8k and 16k against one start of an arm: the start, the warm-up and ~6 probes of each, inside
    # grid.sh's default budget (570 s) less its reserve (50 s).
    assert grid.estimate_arm_s(("isl8k", "isl16k"), 2, start_s=170) < 570 - 50


# --- cells, spread, best arm, overhead, merge ----------------------------------------------------


def _row(rate: float, attained: dict[str, float], ttfts=None, ok=None, seed=None) -> dict:
    ttfts = ttfts or []
    bench = {"median_ttft_ms": 1, "p90_ttft_ms": 2, "median_tpot_ms": 3, "p90_tpot_ms": 4, "failed": 0}
    return {"rate": rate, "num_prompts": len(ttfts) or 10,
            "seed": seed if seed is not None else round(rate * 1000),
            "attainment": {t: attained.get(t, attained.get("*", 1.0)) for t in TARGETS}, "bench": bench,
            "requests": {"ttft_ms": ttfts, "tpot_ms": [5.0] * len(ttfts), "ok": ok or [True] * len(ttfts)}}


def _record(arm: str, gpus: int, run_id: str, sweeps: dict[str, list[dict]]) -> dict:
    return {"schema": 2, "run_id": run_id, "arm": arm, "num_gpus": gpus, "engine": ENGINE, "mock": False,
            "sweeps": [{"workload": name, "ttft_ms": grid.WORKLOADS[name].ttft_ms,
                        "tpot_targets_ms": [8.0, 10.0, 15.0, 20.0], "rates": rows}
                       for name, rows in sweeps.items()]}


def _write(folder: Path, record: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{record['arm']}.json").write_text(json.dumps(record))


def test_a_cell_has_each_arms_goodput_per_gpu_with_its_spread_and_the_best_pdserve_arm(tmp_path):
    one, two = tmp_path / "session-1", tmp_path / "session-2"
    # 1P1D: 8 ms passes to 3 req/s (2 GPUs: 1.5 per GPU) in run 1, to 4.24 in run 2.
    _write(one, _record("1P1D", 2, "r1-1P1D", {"isl8k": [_row(3, {"*": 1}), _row(3.57, {"8": 0.5})]}))
    _write(two, _record("1P1D", 2, "r2-1P1D", {"isl8k": [_row(4.24, {"*": 1}), _row(5.05, {"8": 0.8})]}))
    colocated = [_row(1.5, {"*": 1}), _row(3, {"8": 0.2, "10": 0.95})]
    _write(one, _record("colocated-2", 2, "r1-col", {"isl8k": colocated}))
    _write(two, _record("vllm-2", 2, "r2-vllm", {"isl8k": [_row(1.5, {"*": 1}), _row(3, {"8": 0.1})]}))
    merged = tmp_path / "merged"
    assert grid_summary.merge_runs([one, two], merged) == 0
    assert arm_summary.summarize(merged, plots=False) == 0
    summary = json.loads((merged / "summary.json").read_text())
    cells = {(c["workload"], c["ttft_ms"], c["tpot_ms"]): c for c in summary["cells"]}
    assert set(cells) == {("isl8k", 2000.0, t) for t in (8.0, 10.0, 15.0, 20.0)}
    tight = cells[("isl8k", 2000.0, 8.0)]["goodput_per_gpu"]
    assert {k: tight["1P1D"][k] for k in ("value", "min", "max", "runs")} == {
        "value": (1.5 + 2.12) / 2, "min": 1.5, "max": 2.12, "runs": 2}
    assert tight["1P1D"]["brackets"] == [[1.5, 1.785], [2.12, 2.525]]
    assert tight["colocated-2"]["value"] == 0.75 and tight["vllm-2"]["value"] == 0.75
    assert tight["pdserve_best"]["arm"] == "1P1D" and tight["pdserve_best"]["runs"] == 2
    assert cells[("isl8k", 2000.0, 8.0)]["pdserve_best_vs"]["vllm-2"] == pytest.approx(1.81 / 0.75)
    # Where colocated-2 never failed, its goodput is a lower bound, and so is the best arm's.
    loose = cells[("isl8k", 2000.0, 20.0)]["goodput_per_gpu"]
    assert loose["colocated-2"]["lower_bound"] and loose["pdserve_best"]["arm"] == "1P1D"
    assert loose["pdserve_best"]["lower_bound"]
    # ... and its ratios to arms that never failed either are unknown.
    assert cells[("isl8k", 2000.0, 20.0)]["pdserve_best_vs_bound"] == {"colocated-2": "unknown", "vllm-2": "unknown"}
    assert "pdserve_best_vs_bound" not in cells[("isl8k", 2000.0, 8.0)]
    assert "| <= 8 ms | 1.81 [1.5-2.12] x2 | 0.75 | 0.75 | 1P1D 1.81 [1.5-2.12] x2 | 2.41x | 2.41x |" \
        in summary["cells_markdown"]
    assert "| 1P1D >= 2.15 [1.78-2.52] x2 | ? 1.44x | ? 1.44x |" in summary["cells_markdown"]
    # Merging the same sessions again adds nothing: each run counts once.
    assert grid_summary.merge_runs([one, two], merged) == 0
    assert len(grid_summary.load_runs(merged)) == 4
    assert arm_summary.summarize(merged, plots=True) == 0
    assert (merged / "attainment.png").stat().st_size > 1000


def test_the_best_arms_ratio_says_which_side_a_lower_bound_leaves_open():
    entry = lambda value, lower: {"value": value, "min": value, "max": value, "runs": 1, "lower_bound": lower}  # noqa: E731
    measured = grid_summary.pdserve_best({"1P1D": entry(2.12, False), "colocated-2": entry(1.5, False)})
    assert measured["arm"] == "1P1D" and not measured["lower_bound"]
    open_colocated = grid_summary.pdserve_best({"1P1D": entry(2.12, False), "colocated-2": entry(1.5, True)})
    assert open_colocated["arm"] == "1P1D" and open_colocated["lower_bound"]  # colocated may lie higher
    assert grid_summary._bound(measured, entry(1.5, True)) == "at_most"
    assert grid_summary._bound(open_colocated, entry(1.5, False)) == "at_least"
    assert grid_summary._bound(open_colocated, entry(1.5, True)) == "unknown"
    assert grid_summary._bound(measured, entry(1.5, False)) is None


def test_the_ttft_overhead_is_taken_request_by_request_per_rate_then_over_rates():
    def run(arm, rows):
        return grid_summary.runs_of(_record(arm, 2, f"id-{arm}", {"isl2k": rows}), "x")[0]

    ours = run("colocated-2", [_row(8, {}, ttfts=[60, 70, 80, 500]), _row(12, {}, ttfts=[50, 50, 50]),
                               _row(16, {}, ttfts=[90, 90])])
    theirs = run("vllm-2", [
        _row(8, {}, ttfts=[55, 64, 74, 100], ok=[True, True, True, False]),  # its 4th failed: left out
        _row(12, {}, ttfts=[40, 40, 40]),
        _row(16, {}, ttfts=[80, 80], seed=1)])  # other requests than pdserve's at 16: no pairs
    overheads = grid_summary.ttft_overheads([ours, theirs])
    assert len(overheads) == 1 and overheads[0]["pdserve"] == "colocated-2"
    per_rate = [(r["rate"], r["ms_p50"], r["requests"]) for r in overheads[0]["per_rate"]]
    assert per_rate == [(8, 6, 3), (12, 10, 3)]
    assert overheads[0]["ms_p50"] == 8 and grid_summary.overhead_p50(overheads) == 8


def test_issue_9s_records_read_as_2k_runs_and_keep_their_table(tmp_path):
    bench = {"request_throughput": 1, "median_ttft_ms": 1, "p90_ttft_ms": 1, "median_tpot_ms": 1,
             "p90_tpot_ms": 1, "failed": 0}
    legacy = {"arm": "disagg", "label": "pdserve 1P1D (NCCL)", "num_gpus": 2, "start_s": 90.0,
              "commands": ["x"], "host": {}, "skipped_rates": [], "isl": 2048, "osl": 256, "ttft_ms": 500.0,
              "tpot_targets_ms": [8.0, 10.0, 20.0],
              "rates": [{"rate": r, "attainment": {"8": a, "10": 1.0, "20": 1.0}, "bench": bench}
                        for r, a in ((8, 1.0), (12, 0.5))]}
    (tmp_path / "disagg.json").write_text(json.dumps(legacy))
    (tmp_path / "disagg-part1.json").write_text(json.dumps(legacy))  # a part merged into disagg.json
    assert arm_summary.summarize(tmp_path, plots=False) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["goodput_per_gpu"]["disagg"] == {"8": 4.0, "10": 6.0, "20": 6.0}
    assert [(c["tpot_ms"], c["goodput_per_gpu"]["1P1D"]["value"]) for c in summary["cells"]] == [
        (8.0, 4.0), (10.0, 6.0), (20.0, 6.0)]
    merged = tmp_path / "merged"
    grid_summary.merge_runs([tmp_path], merged)
    (record,) = [json.loads(p.read_text()) for p in merged.glob("*.json")]
    assert record["schema"] == 2 and record["sweeps"][0]["workload"] == "isl2k"
