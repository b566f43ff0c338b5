"""Disaggregated serving for real: `pdserve serve --mode disaggregated` with 1 prefill + 2 decode
CPU vLLM engines on local Ray, KV blocks pulled by pdserve's connector, through the `openai`
client. Parametrized over the transports (gRPC; NCCL's code path over gloo on CPU).

Reference outputs come from vLLM's own offline engine (same settings), as in test_serve_vllm.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.testing.server import metric_value, start_server, wait_for_metrics

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 128  # the CPU backend's KV block size
# One token, just under / exactly / just over one block, and several blocks.
PROMPT_LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(embedded_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_checkpoint)
    text = (
        "The history of the city begins with a small fishing village on the river, where "
        "traders from the north and the south met every spring to exchange salt and furs. "
    ) * 40
    ids = tok.encode(text)
    return [ids[:n] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(embedded_checkpoint, prompts, tmp_path_factory):
    work = tmp_path_factory.mktemp("reference")
    (work / "in.json").write_text(json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS}))
    script = Path(__file__).with_name("vllm_reference.py")
    subprocess.run(
        [
            sys.executable,
            str(script),
            str(embedded_checkpoint),
            str(work / "in.json"),
            str(work / "out.json"),
        ],
        check=True,
        timeout=600,
    )
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module", params=["grpc", pytest.param("nccl", marks=pytest.mark.slow)])
def server(request, reference, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"server-{request.param}") / "pdserve.log"
    running = start_server(
        [
            "--model",
            "embedded",
            "--mode",
            "disaggregated",
            "--prefill",
            "1",
            "--decode",
            "2",
            "--transport",
            request.param,
            "--set",
            "pools.prefill.num_cpus=0.5",
            "--set",
            "pools.decode.num_cpus=0.5",
            # Three engines share 2 cores and 24 GiB: keep each KV cache small.
            "--kv-cache-memory-bytes",
            str(512 * 1024**2),
        ],
        log,
        start_timeout_s=900,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_output_equals_colocated_vllm(client, prompts, reference):
    for prompt, expected in zip(prompts, reference, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == expected["text"], f"prompt of {len(prompt)} tokens"
        assert r.usage.completion_tokens == len(expected["token_ids"])
        assert r.usage.prompt_tokens == len(prompt)


def test_kv_was_pulled_not_recomputed(server, client, prompts):
    def pulled(text):
        return metric_value(text, "pdserve_kv_transfer_bytes_total", transport=server_transport(text)) or 0

    before = pulled(httpx.get(f"{server.base_url}/metrics").text)
    client.completions.create(model=MODEL, prompt=prompts[-1], max_tokens=4, temperature=0)
    text = wait_for_metrics(server.base_url, lambda t: pulled(t) > before)
    assert pulled(text) > before
    assert (
        metric_value(text, "pdserve_kv_transfer_failures_total", transport=server_transport(text)) or 0
    ) == 0


def server_transport(metrics_text: str) -> str:
    for line in metrics_text.splitlines():
        if line.startswith("pdserve_kv_transfer_bytes_total{"):
            return line.split('transport="')[1].split('"')[0]
    return "none"


def test_sixteen_concurrent_requests_over_1p2d(client, prompts, reference):
    jobs = [(prompts[i % len(prompts)], reference[i % len(prompts)]) for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(
                lambda job: client.completions.create(
                    model=MODEL, prompt=job[0], max_tokens=MAX_TOKENS, temperature=0
                ),
                jobs,
            )
        )
    for (prompt, expected), r in zip(jobs, results, strict=True):
        assert r.choices[0].text == expected["text"], f"prompt of {len(prompt)} tokens"


def test_abort_mid_stream_returns_kv_usage_on_both_sides(server, client, prompts):
    engines = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]

    def usages(text):
        return [metric_value(text, "pdserve_kv_cache_usage_ratio", pool=p, replica=r) for p, r in engines]

    idle = wait_for_metrics(server.base_url, lambda t: all(u == 0 for u in usages(t)))
    assert all(u == 0 for u in usages(idle)), usages(idle)
    stream = client.completions.create(
        model=MODEL, prompt=prompts[-1], max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _chunk in zip(range(4), stream):
        pass
    # The stream is still generating (1000 tokens): its KV shows at the next stats poll.
    busy = wait_for_metrics(server.base_url, lambda t: any(u and u > 0 for u in usages(t)))
    assert any(u and u > 0 for u in usages(busy)), usages(busy)
    stream.close()
    after = wait_for_metrics(server.base_url, lambda t: all(u == 0 for u in usages(t)), timeout_s=60)
    assert all(u == 0 for u in usages(after)), usages(after)


def test_killed_prefill_engine_recomputes_on_decode(server, client, prompts, reference):
    text = httpx.get(f"{server.base_url}/metrics").text
    pid = next(
        int(line.split('pid="')[1].split('"')[0])
        for line in text.splitlines()
        if line.startswith("pdserve_engine_info{") and 'replica="prefill-0"' in line
    )
    os.kill(pid, signal.SIGKILL)
    # The default failure policy (recompute) serves the request on a decode engine, same output.
    r = client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference[2]["text"]
