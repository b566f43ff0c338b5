"""The HTTP layer over the mock engine: responses, streaming, the bad-input table, metrics."""

import asyncio
import dataclasses
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.api.app import build_app
from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.testing import InProcessBackend, tiny_tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
CONTEXT = 64


def make_backend(engines=1, **timing):
    settings = MockEngineConfig(**{"max_model_len": CONTEXT, "prefill_tokens_per_s": 1e6,
                                   "decode_step_s": 0.0, "decode_step_per_seq_s": 0.0, **timing})
    return InProcessBackend([MockEngine(f"e{i}", "colocated", MODEL, settings)
                             for i in range(engines)])


@pytest.fixture
def client():
    backend = make_backend()
    app = build_app(backend, tiny_tokenizer(), MODEL)
    with TestClient(app) as client:
        # The mock engine's decode loop must run on the loop that serves the app.
        client.portal.call(backend.start)
        yield client
        client.portal.call(backend.shutdown)


def sse_events(text):
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def test_completion(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert len(body["choices"][0]["text"].split()) == 3


def test_token_id_prompt_matches_text_prompt(client):
    tok = tiny_tokenizer()
    ids = tok.encode("hello world")
    a = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4}).json()
    b = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 4}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_chat_uses_the_chat_template(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    # <|im_start|> user say hello <|im_end|> <|im_start|> assistant: the template's tokens count
    assert body["usage"]["prompt_tokens"] == 7


def test_chat_default_max_tokens_is_the_rest_of_the_context(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT


def test_stop_sequence_ends_the_output(client):
    full = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5}).json()
    words = full["choices"][0]["text"].split()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5,
                                             "stop": [words[2]]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"].split() == words[:2]


def test_streaming_completion_and_usage(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                             "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len(text.split()) == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_streaming_chat_starts_with_the_role(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
        "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


BAD_INPUTS = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("missing model", "/v1/completions", {"prompt": "hello"}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("mistyped max_tokens", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("max_tokens < 1", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature < 0", "/v1/completions", {"model": MODEL, "prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "w1 " * CONTEXT}, 400, "messages"),
    ("prompt + max_tokens too long", "/v1/completions", {"model": MODEL, "prompt": "w1 " * 10, "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("n too large", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 65}, 400, "n"),
    ("max_tokens 0 without echo", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0},
     400, "max_tokens"),
    ("best_of", "/v1/completions", {"model": MODEL, "prompt": "a", "best_of": 3}, 400, "best_of"),
    ("beam search", "/v1/completions", {"model": MODEL, "prompt": "a", "use_beam_search": True}, 400,
     "use_beam_search"),
    ("client kv_transfer_params", "/v1/completions",
     {"model": MODEL, "prompt": "a", "kv_transfer_params": {"do_remote_prefill": True}}, 400,
     "kv_transfer_params"),
    ("too many logprobs", "/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21}, 400,
     "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("logit_bias key not a token id", "/v1/completions",
     {"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias token outside the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": "a", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("stop_token_ids outside the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": "a", "stop_token_ids": [999999]}, 400, "stop_token_ids"),
    ("min_tokens over max_tokens", "/v1/completions",
     {"model": MODEL, "prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("prompt_logprobs on a stream", "/v1/completions",
     {"model": MODEL, "prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("two output constraints", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, 400,
     "structured_outputs"),
    ("image content", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages"),
    ("tools without a parser", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     400, "tool_choice"),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("chat unknown model", "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("chat temperature < 0", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(client, name, path, body, status, param):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert ok.status_code == 200


def test_unknown_route_is_an_openai_404(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_models_health_and_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get("/health").status_code == 200
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
    text = client.get("/metrics").text
    assert 'pdserve_time_to_first_token_seconds_count{pool="colocated"} 1.0' in text
    assert 'pdserve_time_per_output_token_seconds_count{pool="colocated"} 1.0' in text
    assert 'pdserve_requests_running{pool="colocated"}' in text
    assert 'pdserve_requests_waiting{pool="colocated"}' in text


async def test_closing_a_stream_aborts_the_engine_request():
    backend = make_backend(decode_step_s=0.01)
    await backend.start()
    app = build_app(backend, tiny_tokenizer(), MODEL)
    from pdserve.serving.metrics import ServingMetrics
    from pdserve.api.protocol import CompletionRequest
    from pdserve.api.serving import OpenAIServing

    serving = OpenAIServing(backend, tiny_tokenizer(), MODEL, ServingMetrics())
    prepared = await serving.prepare_completion(
        CompletionRequest(model=MODEL, prompt="hello", max_tokens=50, stream=True))
    stream = serving.stream(prepared)
    for _ in range(3):
        await anext(stream)
    assert backend.engine_stats()[0].num_running == 1
    await stream.aclose()  # what Starlette does when the client goes away
    stats = backend.engine_stats()[0]
    assert stats.num_running == 0 and stats.num_aborted_total == 1
    del app


async def test_admission_limit_returns_429_with_retry_after():
    backend = make_backend(decode_step_s=0.05)
    await backend.start()
    app = build_app(backend, tiny_tokenizer(), MODEL, max_queued_requests=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        slow = asyncio.create_task(http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 20}))
        await asyncio.sleep(0.1)
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert (await slow).status_code == 200
        again = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert again.status_code == 200


class _RefusingBackend:
    """Delegates to a real backend but refuses (as the scheduler's admission does) on demand."""

    def __init__(self, inner):
        self._inner = inner
        self.refuse = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def info(self):
        return self._inner.info

    @property
    def pools(self):
        return self._inner.pools

    @property
    def serving_pool(self):
        return self._inner.serving_pool

    def generate(self, request):
        if self.refuse is not None:
            raise self.refuse
        return self._inner.generate(request)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_scheduler_refusal_is_a_429_or_503_before_any_byte(stream):
    from pdserve.errors import EngineUnavailableError, OverloadedError

    inner = make_backend()
    await inner.start()
    backend = _RefusingBackend(inner)
    app = build_app(backend, tiny_tokenizer(), MODEL)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        backend.refuse = OverloadedError(7.4, "ttft_slo", 12.0)
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "ttft_slo" in r.json()["error"]["message"]
        backend.refuse = EngineUnavailableError("no engine can take requests in pool 'decode'")
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        backend.refuse = None  # the server keeps serving
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    await inner.shutdown()


class _SilentFirstTokenBackend(_RefusingBackend):
    """The engine's first token renders as no text (as a dummy-weight model's token outside the
    tokenizer's vocabulary does, or a byte the detokenizer holds back)."""

    def generate(self, request):
        async def deltas():
            first = True
            async for delta in self._inner.generate(request):
                if first and delta.token_ids:
                    delta, first = dataclasses.replace(delta, text=""), False
                yield delta
        return deltas()


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_a_token_without_text_still_streams_a_chunk(kind):
    # The client's first chunk marks the first token (TTFT), as with vLLM's server: a token
    # whose text is empty must not wait for the next one.
    inner = make_backend()
    await inner.start()
    app = build_app(_SilentFirstTokenBackend(inner), tiny_tokenizer(), MODEL)
    body = {"model": MODEL, "max_tokens": 3, "stream": True}
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hello"}]
    else:
        path, body["prompt"] = "/v1/completions", "hello"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.post(path, json=body)
    chunks = [json.loads(e)["choices"][0] for e in sse_events(r.text)[:-1]]
    if kind == "chat":
        chunks = chunks[1:]  # the role
        texts = [c["delta"].get("content") for c in chunks]
    else:
        texts = [c["text"] for c in chunks]
    assert len(chunks) == 3 and texts[0] == "" and all(texts[1:])
    assert chunks[-1]["finish_reason"] == "length"
    await inner.shutdown()
