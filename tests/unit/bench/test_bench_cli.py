"""The `bench` command line: flag errors, registration on a parent CLI, and whole runs on the fake server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench import cli

pytestmark = pytest.mark.unit


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--request-rate", "-1"], "--request-rate: must be > 0"),
        (["serve", "--random-range-ratio", "1.5"], "--random-range-ratio: must be in [0, 1)"),
        (["serve", "--num-prompts", "0"], "--num-prompts: must be >= 1"),
        (["serve", "--max-concurrency", "x"], "--max-concurrency: 'x' is not an integer"),
        (["serve", "--goodput", "latency:10"], "--goodput: invalid SLO 'latency:10'"),
        (["serve", "--percentile-metrics", "ttft,bogus"], "unknown metric"),
        (["serve", "--metric-percentiles", "50,101"], "percentiles must be in (0, 100]"),
        (["serve", "--dataset-name", "sharegpt"], "invalid choice: 'sharegpt'"),
        (["serve", "--dataset-name", "mooncake"], "needs --dataset-path"),
        (["serve", "--dataset-path", "t.jsonl"], "only used with --dataset-name mooncake"),
        (["serve", "--endpoint", "/v1/chat/completions", "--prompt-format", "token-ids"], "needs --endpoint"),
        (["serve", "--extra-body", "[1]"], "must be a JSON object"),
        (["sweep", "--goodput", "ttft:100"], "sweep needs --request-rates"),
        (["sweep", "--request-rates", "1", "2"], "SLO attainment needs targets"),
        (["sweep", "--request-rates", "1", "--search-goodput", "--goodput", "ttft:1"], "not both"),
        (["compare", "--target", "a=http://h"], "at least two --target"),
        (["compare", "--target", "a=http://h", "--target", "a=http://g"], "unique"),
        (["compare", "--target", "a=http://h", "--target", "nourl"], "--target: invalid target"),
        (["bogus"], "invalid choice"),
    ],
)
def test_bad_flags_are_argparse_errors(argv: list[str], message: str, capsys) -> None:
    assert message in _error_of(argv, capsys)


def test_add_parser_registers_bench_on_a_parent_cli() -> None:
    parent = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(parent.add_subparsers(dest="command"))
    args = parent.parse_args(["bench", "serve", "--num-prompts", "3", "--request-rate", "2.5"])
    assert (args.command, args.bench_command, args.num_prompts, args.request_rate) == (
        "bench",
        "serve",
        3,
        2.5,
    )
    assert args.func is cli.run_command and args.handler is cli.run_command
    assert args.metric_percentiles == (90.0, 99.0) and args.percentile_metrics == (
        "ttft",
        "tpot",
        "itl",
        "e2el",
    )


def _common(fake_server, tokenizer_dir: Path, tmp_path: Path) -> list[str]:
    return [
        "--model",
        "fake-model",
        "--tokenizer",
        str(tokenizer_dir),
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--no-plots",
    ]


def test_serve_runs_and_saves_vllm_style_results(fake_server, word_tokenizer_dir, tmp_path, capsys) -> None:
    argv = [
        "serve",
        "--base-url",
        fake_server.base_url,
        *_common(fake_server, word_tokenizer_dir, tmp_path),
        "--goodput",
        "ttft:5000",
        "tpot:5000",
        "--max-concurrency",
        "2",
        "--num-warmups",
        "1",
        "--seed",
        "5",
        "--arrival-seed",
        "9",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Request goodput (req/s):" in out
    (json_path,) = tmp_path.glob("*.json")
    payload = json.loads(json_path.read_text())
    assert payload["completed"] == 4 and payload["tokenizer_id"] == str(word_tokenizer_dir)
    assert payload["max_concurrency"] == 2 and payload["num_prompts"] == 4
    assert (payload["seed"], payload["arrival_seed"]) == (5, 9)
    assert payload["input_lens"] == [8, 8, 8, 8]  # the server counts the 8 words of each text prompt
    assert json_path.with_suffix(".csv").exists()
    body = fake_server.state.requests[-1]
    assert body["ignore_eos"] is True and isinstance(body["prompt"], str)


def test_serve_fetches_the_model_and_sends_token_ids(fake_server, word_tokenizer_dir, capsys) -> None:
    argv = [
        "serve",
        "--base-url",
        fake_server.base_url,
        "--tokenizer",
        str(word_tokenizer_dir),
        "--num-prompts",
        "2",
        "--random-input-len",
        "5",
        "--random-output-len",
        "2",
        "--prompt-format",
        "token-ids",
        "--no-ignore-eos",
        "--disable-tqdm",
    ]
    assert cli.main(argv) == 0
    assert "using the server's first model: fake-model" in capsys.readouterr().out
    body = fake_server.state.requests[-1]
    assert body["model"] == "fake-model" and len(body["prompt"]) == 5 and "ignore_eos" not in body


def test_sweep_writes_a_summary_per_rate(fake_server, word_tokenizer_dir, tmp_path, capsys) -> None:
    argv = [
        "sweep",
        "--base-url",
        fake_server.base_url,
        *_common(fake_server, word_tokenizer_dir, tmp_path),
        "--goodput",
        "ttft:5000",
        "--request-rates",
        "200",
        "100",
        "--num-gpus",
        "2",
    ]
    assert cli.main(argv) == 0
    assert (
        "Max rate with >= 90% SLO attainment: 200.000 req/s (100.000 req/s per GPU" in capsys.readouterr().out
    )
    (summary_path,) = tmp_path.glob("sweep-*.json")
    system = json.loads(summary_path.read_text())["systems"]["openai"]
    assert [p["request_rate"] for p in system["points"]] == [100.0, 200.0] and system["num_gpus"] == 2
    assert len(list(tmp_path.glob("openai-*qps-*.json"))) == 2  # one result per probed rate
    # Each probe sent prompts of its own (seeds 0 and 1): none could hit the server's prefix
    # cache from the probe before.
    prompts = [body["prompt"] for body in fake_server.state.requests]
    assert len(prompts) == 8 and len(set(prompts)) == 8
    seeds = sorted(json.loads(p.read_text())["seed"] for p in tmp_path.glob("openai-*qps-*.json"))
    assert seeds == [0, 1]


def test_compare_prints_the_side_by_side_table(fake_server, word_tokenizer_dir, tmp_path, capsys) -> None:
    argv = [
        "compare",
        "--target",
        f"colocated={fake_server.base_url},gpus=2",
        "--target",
        f"disagg={fake_server.base_url},gpus=2",
        *_common(fake_server, word_tokenizer_dir, tmp_path),
        "--goodput",
        "ttft:5000",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(ratios are relative to colocated)" in out
    assert any(line.startswith("disagg") and "x)" in line for line in out.splitlines())
    assert {p.name.split("-")[0] for p in tmp_path.glob("*.json")} == {"colocated", "disagg"}


def test_unreachable_tokenizer_is_a_clean_error(fake_server, tmp_path, capsys) -> None:
    argv = [
        "serve",
        "--base-url",
        fake_server.base_url,
        "--model",
        "m",
        "--tokenizer",
        str(tmp_path / "none"),
    ]
    assert cli.main(argv) == 1
    assert "cannot load tokenizer" in capsys.readouterr().err


def test_mooncake_replay_follows_trace_timestamps(fake_server, word_tokenizer_dir, tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 20, "output_length": 2, "hash_ids": [7]} for i in range(3)]
    trace.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    out = tmp_path / "out"
    argv = [
        "serve",
        "--base-url",
        fake_server.base_url,
        "--model",
        "fake-model",
        "--tokenizer",
        str(word_tokenizer_dir),
        "--dataset-name",
        "mooncake",
        "--dataset-path",
        str(trace),
        "--trace-speedup",
        "2",
        "--prompt-format",
        "token-ids",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        "trace.json",
        "--no-plots",
    ]
    assert cli.main(argv) == 0
    payload = json.loads((out / "trace.json").read_text())
    assert payload["arrivals"] == "trace timestamps" and payload["completed"] == 3
    sent = payload["start_times"]
    assert all(o - 0.01 <= t < o + 0.5 for t, o in zip(sent, (0.0, 0.05, 0.1), strict=True))
    prompts = [body["prompt"] for body in fake_server.state.requests]
    assert prompts[0] == prompts[1] == prompts[2] and len(prompts[0]) == 20  # one shared hash id


def test_chat_shape_through_the_chat_endpoint(fake_server, word_tokenizer_dir, tmp_path, capsys) -> None:
    argv = [
        "serve",
        "--base-url",
        fake_server.base_url,
        "--model",
        "fake-model",
        "--tokenizer",
        str(word_tokenizer_dir),
        "--dataset-name",
        "chat",
        "--length-scale",
        "0.01",
        "--num-prompts",
        "3",
        "--endpoint",
        "/v1/chat/completions",
        "--disable-tqdm",
    ]
    assert cli.main(argv) == 0
    assert "Successful requests:                     3" in capsys.readouterr().out
    assert all("messages" in body for body in fake_server.state.requests)
