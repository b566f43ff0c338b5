"""benchmarks/gpu/proof.py's own helpers for the grid (issue 31): the record's issue-9 keys, the
next rate of a sweep, and `plan`, which checks grid.sh's slices before anything starts."""

import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.bench import grid
from pdserve.bench.arms import ENGINE

pytestmark = pytest.mark.unit

TARGETS = ("8", "10", "15", "20")


_PATH = Path(__file__).parents[3] / "benchmarks" / "gpu" / "proof.py"
_spec = importlib.util.spec_from_file_location("gpu_proof", _PATH)
proof = importlib.util.module_from_spec(_spec)
sys.modules["gpu_proof"] = proof  # its dataclasses look their module up there
_spec.loader.exec_module(proof)


def _record(arm: str, sweeps: dict[str, list[dict]]) -> dict:
    return {"schema": 2, "run_id": "id", "arm": arm, "num_gpus": 1, "engine": ENGINE,
            "sweeps": [{"workload": name, "ttft_ms": grid.WORKLOADS[name].ttft_ms,
                        "tpot_targets_ms": [8.0, 10.0, 15.0, 20.0], "rates": rows,
                        "spec": grid.WORKLOADS[name].as_dict()} for name, rows in sweeps.items()]}


def test_a_one_workload_record_also_carries_issue_9s_top_level_keys():
    record = _record("vllm-1", {"isl2k": [{"rate": 4.0, "attainment": {}}]})
    flat = proof.with_issue9_keys(record)
    assert (flat["isl"], flat["osl"], flat["ttft_ms"]) == (2048, 256, 500.0)
    assert flat["rates"] == record["sweeps"][0]["rates"]
    two = _record("vllm-1", {"isl2k": [], "isl8k": []})
    assert "rates" not in proof.with_issue9_keys(two)


def test_fixed_rates_stop_past_every_targets_knee_and_the_bisection_follows_its_lattice():
    lattice = grid.RateLattice(3.0)
    sweep = {"rates": []}
    assert proof._next_rate(sweep, lattice, [4.0, 8.0, 12.0]) == (4.0, None)
    sweep["rates"].append({"attainment": {t: 0.4 for t in TARGETS}, "index": None})
    assert proof._next_rate(sweep, lattice, [4.0, 8.0, 12.0]) is None
    bisect = {"rates": [{"index": 0, "attainment": {t: 1.0 for t in TARGETS}}]}
    assert proof._next_rate(bisect, lattice, None) == (6.0, 4)


def test_plan_checks_every_slice_before_anything_starts(capsys):
    args = type("Args", (), {"slices": ["isl8k+isl16k:1P1D", "isl2k:colocated-1/vllm-1"], "gpus": ["0", "1"],
                             "start_s": 170.0})
    assert proof.plan(args) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["GROUP\tisl8k isl16k\t1P1D=0,1", "GROUP\tisl2k\tcolocated-1=0 vllm-1=1"]
    assert "isl8k+isl16k:1P1D: ~" in out.err
    args.slices = ["isl8k:1P1D", "isl8k:4P4D"]
    assert proof.plan(args) == 2
    assert "need 8 GPUs" in capsys.readouterr().err


def test_the_prior_is_this_arms_earlier_sweeps_of_the_workload(tmp_path):
    import json

    rows = [{"index": 0, "rate": 3.0, "attainment": {t: 1.0 for t in TARGETS}},
            {"index": 1, "rate": 3.57, "attainment": {t: 0.0 for t in TARGETS}}]
    for name, arm in (("a", "disagg"), ("b", "1P1D"), ("c", "colocated-2"), ("d", "1P1D-ipc")):
        (tmp_path / f"{name}.json").write_text(json.dumps(_record(arm, {"isl8k": rows, "isl16k": []})))
    spec = proof.arm_spec("1P1D")
    # issue 9's name for the same deployment counts; another arm or transport does not.
    assert len(proof.earlier_sweeps([tmp_path], spec, "isl8k")) == 2
    assert proof.earlier_sweeps(None, spec, "isl8k") == []
    lattice = grid.RateLattice(3.0)
    sweeps = [{**s, "lattice": {"unit": 3.0, "steps_per_octave": 4}}
              for s in proof.earlier_sweeps([tmp_path], spec, "isl8k")]
    prior = grid.prior_knees(sweeps, TARGETS, lattice)
    assert prior == {t: 0 for t in TARGETS}
    assert proof._next_rate({"rates": []}, lattice, None, prior) == (3.0, 0)


def test_a_record_says_how_fast_its_hosts_cpu_does_the_frontends_per_token_steps():
    timings = proof.frontend_cpu_ms(tokens=2048, repeats=2)
    assert set(timings) == {"parse_json", "block_hashes", "msgpack_pack"}
    assert all(ms > 0 for ms in timings.values())


def test_rates_given_per_workload_override_those_given_for_every_workload():
    given = [proof._rates_arg("1,2"), proof._rates_arg("isl8k=0.5,1.5")]
    assert proof.rates_for(given, "isl8k") == [0.5, 1.5]
    assert proof.rates_for(given, "isl16k") == [1.0, 2.0]
    assert proof.rates_for([proof._rates_arg("isl8k=0.5")], "isl2k") == []
    assert proof.rates_for(None, "isl2k") == []
    with pytest.raises(Exception, match="unknown workload 'isl9k'"):
        proof._rates_arg("isl9k=1")
    with pytest.raises(Exception, match="numbers separated by commas"):
        proof._rates_arg("isl8k=fast")


def test_the_ttft_split_sets_each_clock_of_a_probe_beside_the_clients():
    path = Path(__file__).parents[3] / "benchmarks" / "gpu" / "ttft_split.py"
    spec = importlib.util.spec_from_file_location("gpu_ttft_split", path)
    ttft_split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttft_split)
    pdserve_row = {"rate": 1.0, "requests": {"ttft_ms": [100.0, 110.0, None]},
                   "kv": {"frontend_ttft_count_colocated": 2, "frontend_ttft_sum_colocated": 0.2,
                          "first_output_count_colocated": 2, "first_output_sum_colocated": 0.19,
                          "vllm_ttft_count_colocated": 2, "vllm_ttft_sum_colocated": 0.18,
                          "prefill_count_colocated": 2, "prefill_sum_colocated": 0.16}}
    part = ttft_split.split(pdserve_row)
    assert part["requests"] == 2 and part["client"] == pytest.approx(105.0)
    assert (part["frontend"], part["actor"], part["vllm"], part["prefill"]) == pytest.approx((100, 95, 90, 80))
    assert part["client_minus_vllm"] == pytest.approx(15.0)
    vllm_row = {"rate": 1.0, "requests": {"ttft_ms": [100.0]},
                "kv": {"vllm_ttft_count": 1, "vllm_ttft_sum": 0.09, "prefill_count": 1, "prefill_sum": 0.08}}
    part = ttft_split.split(vllm_row)
    assert (part["frontend"], part["vllm"], part["client_minus_vllm"]) == (None, pytest.approx(90), pytest.approx(10))
