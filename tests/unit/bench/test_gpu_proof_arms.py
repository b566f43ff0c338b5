"""pdserve.bench.arms and arm_summary (benchmarks/gpu/proof.py): arm names, the commands that serve
them, their counters, and the goodput table over a folder of arm records."""

import argparse
import json

import pytest

from pdserve.bench import arm_summary, arms

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("name", "kind", "prefill", "decode", "gpus"),
    [("2P2D", "disagg", 2, 2, 4), ("1P3D", "disagg", 1, 3, 4), ("colocated-4", "colocated", 0, 0, 4),
     ("vllm-4", "vllm", 0, 0, 4), ("disagg", "disagg", 1, 1, 2), ("colocated", "colocated", 0, 0, 2),
     ("3P1D-grpc", "disagg", 3, 1, 4)],
)
def test_arm_names_parse_to_engine_counts(name, kind, prefill, decode, gpus):
    spec = arms.arm_spec(name)
    assert (spec.kind, spec.prefill, spec.decode, spec.num_gpus) == (kind, prefill, decode, gpus)


@pytest.mark.parametrize("name", ["0P2D", "2P0D", "colocated-0", "2P2", "tp2", "", "2P2D-rdma",
                                  "colocated-2-grpc", "adaptive", "vllm-2-ipc"])
def test_bad_arm_names_are_refused_with_the_forms_allowed(name):
    with pytest.raises(argparse.ArgumentTypeError, match=r"xPyD-ipc; then -adaptive\[-Tms\]\), "
                       if name not in ("0P2D", "2P0D", "colocated-0") else "at least one"):
        arms.arm_spec(name)


def _record(arm: str, gpus: int, rows: list[tuple[float, float, float, float]]) -> dict:
    """rows: (rate, attainment at 8, 10, 20 ms)."""
    bench = {"request_throughput": 1.0, "median_ttft_ms": 100, "p90_ttft_ms": 200,
             "median_tpot_ms": 9, "p90_tpot_ms": 10, "failed": 0}
    return {"arm": arm, "label": arms.arm_spec(arm).label, "num_gpus": gpus, "start_s": 90.0,
            "commands": [], "host": {}, "skipped_rates": [], "rates": [
                {"rate": r, "attainment": {"8": a8, "10": a10, "20": a20}, "bench": bench}
                for r, a8, a10, a20 in rows]}


def test_goodput_is_per_gpu_and_each_disaggregated_arm_is_compared_with_each_baseline(tmp_path, capsys):
    records = [
        _record("2P2D", 4, [(20, 0.0, 0.95, 1.0), (28, 0.0, 0.5, 0.92), (36, 0.0, 0.1, 0.6)]),
        _record("colocated-4", 4, [(16, 0.0, 0.97, 1.0), (24, 0.0, 0.2, 0.95), (32, 0.0, 0.0, 0.4)]),
        _record("vllm-4", 4, [(16, 0.0, 0.5, 1.0), (24, 0.0, 0.0, 0.7)]),
    ]
    for record in records:
        (tmp_path / f"{record['arm']}.json").write_text(json.dumps(record))
    (tmp_path / "transfer.json").write_text(json.dumps({"rows": []}))  # not an arm: ignored
    assert arm_summary.summarize(tmp_path, plots=False) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["goodput_per_gpu"]) == ["2P2D", "colocated-4", "vllm-4"]
    assert summary["goodput_per_gpu"]["2P2D"] == {"8": 0, "10": 5.0, "20": 7.0}
    assert summary["goodput_per_gpu"]["colocated-4"]["20"] == 6.0
    table = summary["table_markdown"]
    assert "2P2D / colocated-4" in table and "2P2D / vllm-4" in table
    assert "| <= 10 ms | 5 | 4 | 0 | 1.25x | inf |" in table
    # colocated-4 still passed 20 ms at its highest rate, 24 (6 per GPU): only a lower bound.
    assert summary["lower_bound"]["colocated-4"] == {"8": False, "10": False, "20": False}
    assert "| <= 20 ms | 7 | 6 | 4 | 1.17x | 1.75x |" in table


def test_a_goodput_not_pushed_to_failure_is_a_lower_bound_and_so_is_its_ratio(tmp_path, capsys):
    records = [
        _record("disagg", 2, [(8, 1.0, 1.0, 1.0), (12, 0.95, 1.0, 1.0)]),  # never failed
        _record("colocated", 2, [(10, 1.0, 1.0, 1.0), (12, 0.5, 1.0, 1.0), (16, 0.1, 0.5, 0.95)]),
    ]
    for record in records:
        (tmp_path / f"{record['arm']}.json").write_text(json.dumps(record))
    assert arm_summary.summarize(tmp_path, plots=False) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lower_bound"]["disagg"] == {"8": True, "10": True, "20": True}
    table = summary["table_markdown"]
    assert "| <= 8 ms | >= 6 | 5 | >= 1.20x |" in table
    assert "| <= 10 ms | >= 6 | 6 | >= 1.00x |" in table
    assert "| <= 20 ms | >= 6 | >= 8 | ? (0.75x at the rates measured) |" in table


def test_merge_joins_one_arms_rates_from_several_starts(tmp_path):
    first = _record("colocated", 2, [(4, 1, 1, 1), (8, 1, 1, 1)])
    second = {**_record("colocated", 2, [(10, 1, 1, 1), (12, 0.5, 1, 1)]), "start_s": 75.0}
    paths = []
    for i, record in enumerate((second, first)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(record))
    out = tmp_path / "colocated.json"
    assert arm_summary.merge(paths, out) == 0
    merged = json.loads(out.read_text())
    assert [row["rate"] for row in merged["rates"]] == [4, 8, 10, 12]
    assert [run["rates"] for run in merged["runs"]] == [[10, 12], [4, 8]]
    assert merged["start_s"] == 75.0
    (tmp_path / "other.json").write_text(json.dumps(_record("vllm", 2, [(4, 1, 1, 1)])))
    with pytest.raises(SystemExit, match="different arms"):
        arm_summary.merge([paths[0], tmp_path / "other.json"], out)
    # A rate measured twice keeps the first row given; the other is kept aside as a repeat.
    again = tmp_path / "again.json"
    again.write_text(json.dumps(_record("colocated", 2, [(12, 0.7, 1, 1), (14, 0.2, 1, 1)])))
    assert arm_summary.merge([paths[0], again], out) == 0
    merged = json.loads(out.read_text())
    assert [(row["rate"], row["attainment"]["8"]) for row in merged["rates"]] == [(10, 1), (12, 0.5), (14, 0.2)]
    assert [(row["rate"], row["attainment"]["8"]) for row in merged["repeats"]] == [(12, 0.7)]


def test_a_cuda_ipc_arm_and_an_adaptive_arm_are_served_as_their_names_say():
    ipc = arms.arm_spec("1P1D-ipc")
    assert (ipc.transport, ipc.label, ipc.canonical) == ("cuda_ipc", "pdserve 1P1D (CUDA IPC)", "1P1D-ipc")
    assert arms.arm_spec("1P1D-cuda_ipc").canonical == "1P1D-ipc"
    command, env = arms.serve_command(ipc, "model", False, ["0", "1"], 8000)
    assert command[command.index("--transport") + 1] == "cuda_ipc" and env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    adaptive = arms.arm_spec("1P1D-adaptive-20ms")
    assert (adaptive.kind, adaptive.num_gpus, adaptive.adaptive, adaptive.route_tpot_ms) == (
        "disagg", 2, True, 20.0)
    assert adaptive.canonical == "1P1D-adaptive-20ms"
    assert arms.arm_spec("1P1D-adaptive").route_tpot_ms == arms.ADAPTIVE_TPOT_MS
    command, _ = arms.serve_command(adaptive, "model", False, ["0", "1"], 8000, slo_ms=(2000, 20))
    assert command[command.index("--adaptive"):][:5] == ["--adaptive", "--ttft-ms", "2000", "--tpot-ms", "20"]
    with pytest.raises(argparse.ArgumentTypeError):
        arms.arm_spec("adaptive-2")  # no such mode: adaptive is a disaggregated deployment's flag
    assert [arms.arm_spec(n).canonical for n in ("disagg", "colocated", "vllm", "1P1D-nccl")] == [
        "1P1D", "colocated-2", "vllm-2", "1P1D"]


def test_an_adaptive_split_serves_with_adaptive_on_and_routes_against_the_slo_given():
    spec = arms.arm_spec("1P1D-ipc-adaptive")
    assert (spec.kind, spec.transport, spec.adaptive, spec.canonical) == ("disagg", "cuda_ipc", True,
                                                                        "1P1D-ipc-adaptive")
    assert spec.label == "pdserve 1P1D (CUDA IPC, adaptive)"
    command, _ = arms.serve_command(spec, "model", False, ["0", "1"], 8000, slo_ms=(2000.0, 10.0))
    assert command[command.index("--adaptive"):] == ["--adaptive", "--ttft-ms", "2000", "--tpot-ms", "10"]
    plain, _ = arms.serve_command(arms.arm_spec("1P1D"), "model", False, ["0", "1"], 8000, slo_ms=(2000.0, 10.0))
    assert "--adaptive" not in plain and "--ttft-ms" not in plain


def test_every_arm_serves_with_one_context_long_enough_for_every_workload():
    pdserve = arms.pdserve_args("model", mock=False)
    assert pdserve[pdserve.index("--max-model-len") + 1] == str(arms.ENGINE["max_model_len"])
    vllm = arms.vllm_command("model", 8000)
    assert vllm[vllm.index("--max-model-len") + 1] == str(arms.ENGINE["max_model_len"])
    mock = arms.pdserve_args("model", mock=True)
    assert f"engine.mock.max_model_len={arms.ENGINE['max_model_len']}" in mock


def test_the_tuners_serve_args_leave_it_the_knobs_it_sets_per_candidate():
    for mock in (False, True):
        full, tuned = arms.pdserve_args("model", mock), arms.pdserve_args("model", mock, knobs=False)
        assert "--max-num-seqs" in full and "--max-num-seqs" not in tuned
        assert not any(arg.startswith("engine.max_num_batched_tokens") for arg in tuned)
        assert [arg for arg in full if arg not in tuned] == (
            ["--max-num-seqs", str(arms.ENGINE["max_num_seqs"])] if mock else
            ["--max-num-seqs", str(arms.ENGINE["max_num_seqs"]),
             f"engine.max_num_batched_tokens={arms.ENGINE['max_num_batched_tokens']}"])


def test_a_one_token_output_meets_any_tpot_and_a_request_is_scored_on_its_workloads_ttft():
    result = {"ttfts": [0.3, 1.5, 0.2, None], "latencies": [0.3, 4.05, 2.75, None],
              "output_lens": [1, 256, 256, 0], "errors": ["", "", "", "boom"], "input_lens": [8192] * 4}
    requests = arms.per_request(result)
    assert requests["ok"] == [True, True, True, False]
    assert requests["tpot_ms"][:3] == [0.0, pytest.approx(10.0), pytest.approx(10.0)]
    assert requests["input_lens"] == [8192] * 4
    assert arms.attainment(requests, 10.0) == 0.5  # TTFT <= 500 ms: the 1.5 s one misses
    assert arms.attainment(requests, 10.0, ttft_ms=2000.0) == 0.75


def test_a_grpc_arm_serves_with_the_grpc_transport_and_says_so():
    nccl, grpc = arms.arm_spec("3P1D"), arms.arm_spec("3P1D-grpc")
    assert (nccl.transport, grpc.transport) == ("nccl", "grpc")
    assert nccl.label == "pdserve 3P1D (NCCL)" and grpc.label == "pdserve 3P1D (gRPC)"


def test_an_arm_is_served_with_its_transport_and_the_step_trace_when_asked(tmp_path):
    grpc, env = arms.serve_command(arms.arm_spec("3P1D-grpc"), "model", False, ["0", "1", "2", "3"], 8000,
                                   step_trace_root=tmp_path)
    nccl, _ = arms.serve_command(arms.arm_spec("1P1D"), "model", False, ["0", "1"], 8000)
    assert grpc[grpc.index("--transport") + 1] == "grpc" and nccl[nccl.index("--transport") + 1] == "nccl"
    assert f"engine.step_trace_dir={tmp_path}/3P1D-grpc-steps" in grpc
    assert not any(arg.startswith("engine.step_trace_dir") for arg in nccl)
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_an_arms_counters_carry_each_pools_engine_first_output():
    from prometheus_client import generate_latest

    from pdserve.serving.metrics import ServingMetrics
    from pdserve.engine.types import EngineStats

    metrics = ServingMetrics()
    metrics.update_engines([EngineStats("prefill-0", "prefill", first_output_seconds=(0.06, 0.11, 0.12)),
                            EngineStats("decode-0", "decode", first_output_seconds=(0.004,))],
                           ["prefill", "decode"])
    metrics.ttft.labels("prefill").observe(0.1)
    metrics.ttft.labels("prefill").observe(0.3)
    text = generate_latest(metrics.registry).decode()
    counters = arms.engine_counters(text)
    assert counters["first_output_count_prefill"] == 3 and counters["first_output_le0.075_prefill"] == 1
    assert counters["first_output_le0.15_prefill"] == 3 and counters["first_output_count_decode"] == 1
    assert "first_output_count_colocated" not in counters
    assert counters["frontend_ttft_count_prefill"] == 2 and counters["frontend_ttft_sum_prefill"] == pytest.approx(0.4)
    line = arms.counters_line(counters)
    assert "prefill engine first output 97 ms mean, 33% <= 75 ms" in line and "decode engine" in line
    assert "prefill frontend TTFT 200.0 ms mean" in line


def test_a_vllm_arms_counters_carry_vllms_own_ttft_summed_over_its_engines():
    text = "\n".join([
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.3',
        'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 1.0',
        'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.1',
    ])
    text += '\nvllm:request_queue_time_seconds_count{engine="0",model_name="m"} 2.0'
    text += '\nvllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.01'
    counters = arms.vllm_counters(text)
    assert counters["vllm_ttft_count"] == 4.0 and counters["vllm_ttft_sum"] == pytest.approx(0.4)
    assert counters["queue_count"] == 2.0 and counters["prefill_count"] is None
    assert "vLLM's own TTFT 100.0, queue 5.0 ms mean" in arms.counters_line(counters)
    assert set(arms.vllm_counters("").values()) == {None}


def test_a_variant_of_a_pdserve_arm_serves_with_its_settings_after_the_arms_own():
    command, _ = arms.serve_command(arms.arm_spec("colocated-1"), "/m", False, ["0"], 8000,
                                    settings=["engine.extra_engine_args={logits_processors: null}"])
    assert command[-2:] == ["--set", "engine.extra_engine_args={logits_processors: null}"]
