"""Disaggregated serving on real local Ray with mock engines: 1 prefill + 2 decode.

The mock engine's output is a deterministic function of the prompt, and its decode leg continues
exactly where a colocated engine would, so a correct prefill -> decode hand-off yields the same
text as colocated serving. (The same flow with real vLLM engines and KV transfers lives in the
KV connector's integration tests.)
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal

import httpx
import pytest

from pdserve.testing import save_tiny_model, tiny_tokenizer
from pdserve.testing.server import metric_value, start_server, wait_for_metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "pdserve.log"
    running = start_server(
        ["--engine", "mock", "--model", str(model_dir), "--served-model-name", "tiny",
         "--mode", "disaggregated", "--prefill", "1", "--decode", "2",
         "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5",
         "--set", "engine.mock.decode_step_s=0.01"], log, start_timeout_s=180)
    yield running
    running.stop()


def complete(server, prompt, max_tokens=8, **extra):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def expected_text(prompt_ids, max_tokens):
    """What the mock engine produces for this prompt colocated (see MockEngine._next_token)."""
    base = sum(prompt_ids) + len(prompt_ids)
    return "".join(f" t{(base * 31 + i * 7) % 32000}" for i in range(max_tokens))


def test_sixteen_concurrent_requests_over_1p2d_match_colocated(server):
    tok = tiny_tokenizer()
    prompts = [" ".join(f"w{(i * 7 + j) % 300}" for j in range(1 + i * 3)) for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: complete(server, p, max_tokens=12), prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result["choices"][0]["text"] == expected_text(tok.encode(prompt), 12)
        assert result["usage"]["completion_tokens"] == 12
        assert result["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    def served(text):
        return [metric_value(text, "pdserve_engine_finished_requests", pool="decode", replica=r) or 0
                for r in ("decode-0", "decode-1")]

    text = wait_for_metrics(server.base_url, lambda t: sum(served(t)) >= 16)
    served = served(text)
    assert sum(served) == 16 and min(served) >= 4, served  # both decode engines took a share
    assert metric_value(text, "pdserve_engine_finished_requests", pool="prefill", replica="prefill-0") == 16
    # Every decode leg pulled its prompt's KV (mock: 128 KiB per prompt token).
    pulled = sum(len(tok.encode(p)) * 131072 for p in prompts)
    text = wait_for_metrics(server.base_url, lambda t: (metric_value(
        t, "pdserve_kv_transfer_bytes_total", transport="mock") or 0) >= pulled)
    assert metric_value(text, "pdserve_kv_transfer_bytes_total", transport="mock") == pulled
    assert metric_value(text, "pdserve_kv_transfer_seconds_count", transport="mock") == 16
    # Each leg's engine-side first output, per pool: a prefill and a decode leg per request.
    text = wait_for_metrics(server.base_url, lambda t: all((metric_value(
        t, "pdserve_engine_time_to_first_output_seconds_count", pool=pool) or 0) >= 16
        for pool in ("prefill", "decode")))
    for pool in ("prefill", "decode"):
        assert metric_value(text, "pdserve_engine_time_to_first_output_seconds_sum", pool=pool) > 0


def test_streaming_sends_the_prefill_token_first(server):
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == expected_text(tiny_tokenizer().encode("hello"), 3)
    assert len(texts) == 3


def test_max_tokens_one_is_served_by_prefill_alone(server):
    result = complete(server, "hello world", max_tokens=1)
    assert result["choices"][0]["text"] == expected_text(tiny_tokenizer().encode("hello world"), 1)


def engine_pid(server, replica):
    text = httpx.get(f"{server.base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith("pdserve_engine_info{") and f'replica="{replica}"' in line:
            return int(line.split('pid="')[1].split('"')[0])
    raise AssertionError(f"no pdserve_engine_info for {replica}")


def test_killed_prefill_engine_is_recomputed_on_decode(server):
    os.kill(engine_pid(server, "prefill-0"), signal.SIGKILL)
    tok = tiny_tokenizer()
    # With the only prefill engine gone, the recompute policy serves every request on the
    # decode engines, with the same output.
    for prompt in ("hello w1 w2", "w5 w6", "hello"):
        result = complete(server, prompt, max_tokens=5)
        assert result["choices"][0]["text"] == expected_text(tok.encode(prompt), 5)
