"""Smoke run of the benchmark harness against the real service: `pdserve serve` on the CPU vLLM engine
with the embedded model, measured by `pdserve bench serve` through its command line.

One service (one engine, ~60 s to start, ~4 GB) is shared by the module.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from pdserve.testing.server import start_server

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
NUM_PROMPTS = 4
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def server(embedded_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "pdserve.log"
    running = start_server(["--model", "embedded", "--mode", "colocated"], log)
    yield running
    running.stop()


def bench(server, tokenizer_dir, out_dir, *extra: str) -> dict:
    command = [
        sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", server.base_url,
        "--tokenizer", str(tokenizer_dir), "--dataset-name", "random", "--random-input-len", "48",
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
        "--goodput", "ttft:600000", "tpot:600000", "--save-result", "--result-dir", str(out_dir),
        "--result-filename", "smoke.json", "--disable-tqdm", *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out_dir / "smoke.json").read_text())


def test_bench_serve_measures_every_request_of_the_real_service(server, embedded_checkpoint, tmp_path):
    result = bench(server, embedded_checkpoint, tmp_path, "--request-rate", "inf", "--num-warmups", "1")
    assert result["model_id"] == MODEL  # asked the server (no --model given)
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    # ignore_eos (the random dataset's default): exactly the requested output length, every request.
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == OUTPUT_LEN * NUM_PROMPTS
    assert all(length > 0 for length in result["input_lens"])
    assert len(result["ttfts"]) == NUM_PROMPTS and all(t > 0 for t in result["ttfts"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"mean_{metric}_ms"] > 0 and result[f"p99_{metric}_ms"] > 0
    assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
    assert result["slo_attainment"]["all"] == 1.0 and result["request_goodput"] > 0

    with (tmp_path / "smoke.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == NUM_PROMPTS
    assert all(row["success"] == "1" and int(row["output_len"]) == OUTPUT_LEN for row in rows)
    assert all(float(row["ttft_ms"]) > 0 and float(row["tpot_ms"]) > 0 for row in rows)
    assert (tmp_path / "smoke.cdf.png").stat().st_size > 0


def test_bench_serve_chat_endpoint_under_a_concurrency_cap(server, embedded_checkpoint, tmp_path):
    result = bench(server, embedded_checkpoint, tmp_path, "--endpoint", "/v1/chat/completions",
                   "--request-rate", "4", "--max-concurrency", "2", "--model", MODEL)
    assert result["backend"] == "openai-chat"
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    # The cap holds: at no moment were more than 2 requests in flight (from the per-request CSV;
    # the JSON's max_concurrent_requests counts vLLM's way, per one-second bucket, and may exceed it).
    with (tmp_path / "smoke.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert max_in_flight(rows) <= 2


def max_in_flight(rows: list[dict]) -> int:
    """Most requests in flight at once, from each row's start and end-to-end latency."""
    events = []
    for row in rows:
        start = float(row["start_s"])
        events += [(start, 1), (start + float(row["e2el_ms"]) / 1000.0, -1)]
    in_flight = peak = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at a tie
        in_flight += change
        peak = max(peak, in_flight)
    return peak
