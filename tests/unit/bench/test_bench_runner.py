"""End-to-end runs against the scripted fake OpenAI server (conftest.py), and the files a run saves.

The server sleeps TTFT before the first token and ITL between tokens; assertions allow generous slack
above those delays (a loaded CI machine only ever makes things slower) and check exact counts.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.client import EndpointConfig, OpenAIStreamClient, fetch_first_model
from pdserve.slo import SloTargets
from pdserve.bench.plots import plot_latency_cdfs
from pdserve.bench.report import (
    CSV_COLUMNS,
    default_result_filename,
    format_summary,
    result_json,
    save_csv,
    save_json,
)
from pdserve.bench.runner import BenchmarkError, RunConfig, run_benchmark
from pdserve.bench.workloads import BenchRequest

pytestmark = pytest.mark.unit

SLACK_S = 0.5  # scheduling noise allowed above a scripted delay


def _requests(count: int, output_len: int = 5, prompt: str = "w1 w2 w3") -> list[BenchRequest]:
    return [BenchRequest(prompt=prompt, prompt_len=3, output_len=output_len) for _ in range(count)]


def _config(base_url: str, **overrides) -> RunConfig:
    endpoint = EndpointConfig(
        base_url=base_url, model="fake-model", endpoint=overrides.pop("endpoint", "/v1/completions")
    )
    return RunConfig(endpoint=endpoint, disable_tqdm=True, **overrides)


async def test_recorded_timeline_matches_the_script(fake_server) -> None:
    script = fake_server.state.script
    result = await run_benchmark(_config(fake_server.base_url), _requests(4))
    metrics = result.metrics
    assert (metrics.completed, metrics.failed) == (4, 0)
    assert metrics.output_lens == (5, 5, 5, 5)  # from the usage block
    assert metrics.total_input == 4 * 3  # the server's prompt_tokens: three words
    for outcome in result.outcomes:
        assert script.ttft_s <= outcome.ttft_s < script.ttft_s + SLACK_S
        assert len(outcome.itls_s) == 4  # one gap per token chunk after the first
        assert outcome.e2el_s == pytest.approx(outcome.ttft_s + sum(outcome.itls_s))
    assert script.itl_s * 0.5 <= metrics.itl.median_ms / 1000 < script.itl_s + SLACK_S
    assert script.itl_s * 0.5 <= metrics.tpot.mean_ms / 1000 < script.itl_s + SLACK_S
    assert metrics.duration_s >= script.ttft_s + 4 * script.itl_s * 0.5


async def test_max_concurrency_caps_requests_in_flight(fake_server) -> None:
    result = await run_benchmark(_config(fake_server.base_url, max_concurrency=2), _requests(6, output_len=3))
    assert fake_server.state.peak_in_flight == 2
    assert result.metrics.completed == 6
    assert max(o.queued_s for o in result.outcomes) > fake_server.state.script.ttft_s  # some waited


async def test_warmups_are_sent_but_not_measured(fake_server) -> None:
    result = await run_benchmark(_config(fake_server.base_url, num_warmups=3), _requests(2, output_len=2))
    assert len(fake_server.state.requests) == 3 + 2
    assert len(result.outcomes) == 2 and result.metrics.completed == 2


async def test_arrivals_follow_the_schedule(fake_server) -> None:
    config = _config(fake_server.base_url, arrivals=ArrivalSpec(request_rate=20.0), seed=3)
    result = await run_benchmark(config, _requests(5, output_len=1))
    for outcome, offset in zip(result.outcomes, result.arrival_offsets_s, strict=True):
        sent = outcome.start_s - result.run_start_s
        assert offset - 0.01 <= sent < offset + SLACK_S
    assert result.arrival_offsets_s[-1] == pytest.approx(5 / 20.0)


async def test_the_arrival_seed_keeps_the_schedule_when_the_prompt_seed_changes(fake_server) -> None:
    def config(seed: int, arrival_seed: int | None) -> RunConfig:
        return _config(fake_server.base_url, arrivals=ArrivalSpec(request_rate=50.0), seed=seed,
                       arrival_seed=arrival_seed)

    first = await run_benchmark(config(0, 7), _requests(4, output_len=1))
    repeat = await run_benchmark(config(100, 7), _requests(4, output_len=1))
    other = await run_benchmark(config(100, None), _requests(4, output_len=1))
    assert first.arrival_offsets_s == repeat.arrival_offsets_s
    assert other.arrival_offsets_s != first.arrival_offsets_s  # drawn from seed 100
    assert result_json(repeat)["seed"] == 100 and result_json(repeat)["arrival_seed"] == 7
    assert "arrival_seed" not in result_json(other)


async def test_failures_are_counted_with_their_error(fake_server) -> None:
    requests = _requests(2) + _requests(1, prompt="FAIL please")
    result = await run_benchmark(_config(fake_server.base_url), requests)
    assert (result.metrics.completed, result.metrics.failed) == (2, 1)
    assert "HTTP 500" in result.outcomes[2].error and "scripted failure" in result.outcomes[2].error


async def test_chat_endpoint_skips_the_role_chunk(fake_server) -> None:
    fake_server.state.script.ttft_s = 0.1
    result = await run_benchmark(_config(fake_server.base_url, endpoint="/v1/chat/completions"), _requests(2))
    for outcome in result.outcomes:
        assert outcome.success and outcome.chunk_count == 5
        assert 0.1 <= outcome.ttft_s < 0.1 + SLACK_S
    assert result.config.backend == "openai-chat"


async def test_output_length_without_usage_uses_the_tokenizer_count(fake_server) -> None:
    fake_server.state.script.send_usage = False
    result = await run_benchmark(
        _config(fake_server.base_url), _requests(2, output_len=4), count_tokens=lambda text: len(text.split())
    )
    assert result.metrics.output_lens == (4, 4)  # "t0 t1 t2 t3 "
    assert result.metrics.total_input == 2 * 3  # no usage: the workload's prompt_len


async def test_goodput_and_attainment_against_generous_and_impossible_slos(fake_server) -> None:
    generous = _config(fake_server.base_url, slo=SloTargets(ttft_ms=5000, tpot_ms=5000))
    result = await run_benchmark(generous, _requests(3, output_len=2))
    assert result.metrics.attainment.all == 1.0
    assert result.metrics.request_goodput == pytest.approx(result.metrics.request_throughput)
    impossible = _config(fake_server.base_url, slo=SloTargets(ttft_ms=1))  # the script sleeps 50 ms
    assert (await run_benchmark(impossible, _requests(3, output_len=2))).metrics.attainment.all == 0.0


async def test_all_warmups_failing_stops_the_run(fake_server) -> None:
    with pytest.raises(BenchmarkError, match="warm-up"):
        await run_benchmark(_config(fake_server.base_url, num_warmups=2), _requests(2, prompt="FAIL"))


async def test_unreachable_server_fails_requests_not_the_run() -> None:
    result = await run_benchmark(_config("http://127.0.0.1:9"), _requests(2))
    assert result.metrics.failed == 2 and all("Error" in o.error for o in result.outcomes)


async def test_first_model_comes_from_v1_models(fake_server) -> None:
    assert await fetch_first_model(fake_server.base_url) == "fake-model"
    with pytest.raises(ConnectionError):
        await fetch_first_model("http://127.0.0.1:9")


async def test_client_must_be_entered() -> None:
    client = OpenAIStreamClient(EndpointConfig(base_url="http://127.0.0.1:9", model="m"))
    with pytest.raises(RuntimeError):
        await client.send(_requests(1)[0])


async def test_saved_json_csv_and_plot(fake_server, tmp_path: Path) -> None:
    config = _config(
        fake_server.base_url,
        slo=SloTargets(ttft_ms=5000, tpot_ms=5000),
        percentiles=(90.0, 99.0, 99.9),
        tokenizer_id="/models/tok",
        max_concurrency=2,
    )
    result = await run_benchmark(config, _requests(3, output_len=3))
    payload = result_json(result)
    for key in (
        "date",
        "backend",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "completed",
        "failed",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "ttfts",
        "itls",
        "input_lens",
        "output_lens",
        "mean_ttft_ms",
        "median_tpot_ms",
        "std_itl_ms",
        "p90_e2el_ms",
        "p99_tpot_ms",
        "p99.9_ttft_ms",
    ):
        assert key in payload, key
    assert payload["request_rate"] == "inf" and payload["tokenizer_id"] == "/models/tok"
    assert payload["slo_attainment"] == {"ttft": 1.0, "tpot": 1.0, "all": 1.0}
    assert "generated_texts" not in payload
    assert result_json(result, include_texts=True)["generated_texts"] == ["t0 t1 t2 "] * 3
    path = save_json(payload, tmp_path / default_result_filename(result))
    assert path.name.startswith("openai-infqps-concurrency2-fake-model-")
    assert json.loads(path.read_text())["completed"] == 3
    rows = list(csv.reader(save_csv(result, tmp_path / "run.csv").open()))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 1 + 3
    png = plot_latency_cdfs(result, tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = format_summary(result)
    assert "Serving Benchmark Result" in summary and "P99.9 TTFT (ms):" in summary
    assert "All targets met (%):" in summary
