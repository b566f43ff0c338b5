"""Schemathesis against the in-process app's /openapi.json: generated requests, valid and
invalid, to both generation endpoints; then any Unicode text, lone surrogates included (which
schemathesis does not generate), in every text field. No answer is a 5xx, every 4xx carries an
OpenAI-style error body, and the service is healthy afterwards. Bounded (hypothesis' max_examples) so it
runs in about a minute on 2 cores; the figures are printed (`-s`) at the end."""

from __future__ import annotations

import collections

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdserve.api.app import build_app  # noqa: E402
from pdserve.api.guard import AccessPolicy  # noqa: E402
from pdserve.config.schema import MockEngineConfig  # noqa: E402
from pdserve.engine.mock_engine import MockEngine  # noqa: E402
from pdserve.testing import InProcessBackend, tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.slow]

MODEL = "tiny"
KEY = "sk-fuzz"
# Per endpoint; each example is one request. 300 x 2 ran in ~1 min on 2 busy cores.
MAX_EXAMPLES = 300
SENT: collections.Counter[str] = collections.Counter()


def _served_app():
    settings_ = MockEngineConfig(max_model_len=256, prefill_tokens_per_s=1e6, decode_step_s=0.0,
                                 decode_step_per_seq_s=0.0)
    backend = InProcessBackend([MockEngine("e0", "colocated", MODEL, settings_)])
    app = build_app(backend, tiny_tokenizer(), MODEL, default_max_tokens=8,
                    access=AccessPolicy((KEY,)))
    started = False

    async def served(scope, receive, send):
        # The mock engine's loop must run on the loop that serves the app: start it there.
        nonlocal started
        if scope["type"] == "lifespan" and not started:
            started = True
            await backend.start()
        await app(scope, receive, send)

    served.fastapi_app = app
    return served


APP = _served_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP).include(
    path_regex=r"^/v1/(chat/)?completions$")


@schemathesis.check
def openai_error_body(ctx, response, case):
    """A 4xx says what went wrong the way OpenAI clients parse it."""
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_generated_requests_never_get_a_5xx(case):
    from schemathesis.checks import not_a_server_error

    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
    if isinstance(case.body, dict) and "model" in case.body and sum(SENT.values()) % 4:
        # Three cases in four name the served model, so that they get past the model check
        # into tokenization, the context checks and the engine.
        case.body["model"] = MODEL
    response = case.call()
    SENT[f"{case.method} {case.path} {response.status_code}"] += 1
    case.validate_response(response, checks=[not_a_server_error, openai_error_body])


# Any code point, lone UTF-16 surrogates included (json.dumps escapes them as \\udXXX).
ANY_TEXT = st.lists(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)),
                    max_size=30).map("".join)


def _body_with(text: str, where: str) -> tuple[str, dict]:
    completion = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    if where in ("prompt", "model"):
        return "/v1/completions", {**completion, where: text}
    if where == "stop":
        return "/v1/completions", {**completion, "stop": [text]}
    if where == "field name":
        return "/v1/completions", {**completion, text: 1}
    message = {"role": "user", "content": text} if where == "content" else {"role": text}
    return "/v1/chat/completions", {**chat, "messages": [message]}


@given(text=ANY_TEXT, where=st.sampled_from(["prompt", "model", "stop", "field name", "content",
                                             "role"]))
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
def test_any_text_in_any_field_gets_200_or_a_4xx(text, where):
    import json

    from schemathesis.python import asgi

    path, body = _body_with(text, where)
    with asgi.get_client(APP) as client:
        r = client.post(path, data=json.dumps(body), headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    SENT[f"POST {path} (any text) {r.status_code}"] += 1
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_service_is_healthy_after_the_fuzzing():
    from schemathesis.python import asgi

    with asgi.get_client(APP) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": MODEL, "prompt": "hello world", "max_tokens": 3})
        assert r.status_code == 200, r.text
    print(f"\nfuzz: {sum(SENT.values())} requests sent; by endpoint and status:")
    for key, count in sorted(SENT.items()):
        print(f"  {key}: {count}")
