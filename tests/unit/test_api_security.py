"""The HTTP API against hostile or unauthenticated clients, in process: API keys, secrets kept
out of what the server shows."""

import pytest
from fastapi.testclient import TestClient

from pdserve.api.app import build_app
from pdserve.api.guard import AccessPolicy
from pdserve.config import load_api_keys, load_config
from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.errors import ConfigError
from pdserve.testing import InProcessBackend, tiny_tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
KEYS = ("sk-first-key", "sk-second-key")
METRICS_KEY = "metrics-secret"
COMPLETION = {"model": MODEL, "prompt": "hello world", "max_tokens": 2}


def make_client(engine=None, **app_options):
    settings = MockEngineConfig(max_model_len=64, prefill_tokens_per_s=1e6, decode_step_s=0.0,
                                decode_step_per_seq_s=0.0)
    backend = InProcessBackend([engine or MockEngine("e0", "colocated", MODEL, settings)])
    return backend, TestClient(build_app(backend, tiny_tokenizer(), MODEL, **app_options),
                               raise_server_exceptions=False)


@pytest.fixture
def serve():
    started = []

    def start(engine=None, **app_options):
        backend, client = make_client(engine, **app_options)
        client.__enter__()
        client.portal.call(backend.start)
        started.append((backend, client))
        return client

    yield start
    for backend, client in started:
        client.portal.call(backend.shutdown)
        client.__exit__(None, None, None)


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(response, status, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), {"Authorization": "Basic abc"},
                                     {"Authorization": f"Bearer {KEYS[0]}x"}])
def test_a_missing_or_wrong_key_gets_401(serve, headers):
    client = serve(access=AccessPolicy(KEYS))
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models")):
        r = client.request(method, path, json=COMPLETION, headers=headers)
        error = assert_openai_error(r, 401, "invalid_api_key" if "Bearer" in str(headers) else None)
        assert error["type"] == "invalid_request_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert "sk-" not in r.text  # neither the configured keys nor the one sent


def test_a_wrong_key_is_refused_before_the_body_is_read(serve):
    from pdserve.testing.server import metric_value

    client = serve(access=AccessPolicy(KEYS))
    r = client.post("/v1/completions", content=b"{not json", headers=bearer("nope"))
    assert_openai_error(r, 401, "invalid_api_key")
    # Refusals are counted, so an operator sees a client guessing keys.
    assert metric_value(client.get("/metrics").text, "pdserve_requests_rejected_total",
                        status="401") == 1


@pytest.mark.parametrize("key", KEYS)
def test_any_configured_key_is_accepted(serve, key):
    client = serve(access=AccessPolicy(KEYS))
    r = client.post("/v1/completions", json=COMPLETION, headers=bearer(key))
    assert r.status_code == 200, r.text
    assert client.get("/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 200


def test_without_keys_the_api_is_open(serve):
    client = serve()
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_health_stays_open_and_metrics_is_open_without_its_key(serve):
    client = serve(access=AccessPolicy(KEYS))
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_metrics_behind_its_own_key(serve):
    client = serve(access=AccessPolicy(KEYS, METRICS_KEY))
    assert_openai_error(client.get("/metrics"), 401)
    assert_openai_error(client.get("/metrics", headers=bearer(KEYS[0])), 401, "invalid_api_key")
    r = client.get("/metrics", headers=bearer(METRICS_KEY))
    assert r.status_code == 200 and "pdserve_" in r.text
    assert client.get("/health").status_code == 200


def test_api_keys_come_from_the_config_and_the_key_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-from-file\n\n  sk-other  \n")
    config = load_config(None, {"api.api_keys": ["sk-inline"], "api.api_key_file": str(key_file)})
    assert load_api_keys(config.api) == ("sk-inline", "sk-from-file", "sk-other")
    key_file.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_api_keys(config.api)
    for bad in ("two words", "", "clé", "tab\there"):
        with pytest.raises(ConfigError, match="api_keys"):
            load_config(None, {"api.api_keys": [bad]})


def test_engines_get_the_config_without_api_keys():
    config = load_config(None, {"api.api_keys": ["sk-a"], "api.metrics_api_key": "m",
                                "kv.cluster_token": "kv-token", "api.port": 9000})
    engine_config = config.without_api_secrets()
    assert engine_config.api.api_keys == () and engine_config.api.metrics_api_key is None
    assert engine_config.kv.cluster_token == "kv-token" and engine_config.api.port == 9000


def test_the_cli_takes_repeated_api_keys():
    from pdserve.cli import build_parser, serve_overrides

    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2"])
    assert serve_overrides(args)["api.api_keys"] == ["k1", "k2"]


def test_config_show_redacts_every_secret(capsys):
    from pdserve.cli import main

    assert main(["config", "show", "--set", "api.api_keys=[sk-a, sk-b]",
                 "--set", "api.metrics_api_key=m-secret", "--set", "kv.cluster_token=kv-secret"]) == 0
    shown = capsys.readouterr().out
    for secret in ("sk-a", "sk-b", "m-secret", "kv-secret"):
        assert secret not in shown
    assert shown.count("***") == 4


# --- hostile input ---------------------------------------------------------------------------

LIMIT = 4096


def test_a_body_over_the_limit_gets_413_before_it_is_parsed(serve):
    from pdserve.api.guard import RequestLimits

    client = serve(limits=RequestLimits(max_body_bytes=LIMIT))
    big = {**COMPLETION, "prompt": "hello " * LIMIT}
    r = client.post("/v1/completions", json=big)
    error = assert_openai_error(r, 413, "request_too_large")
    assert str(LIMIT) in error["message"]
    assert r.headers["connection"] == "close"
    # Chunked, without a Content-Length: refused once the bytes read pass the limit.
    chunks = (b"x" * 1024 for _ in range(2 * LIMIT // 1024))
    assert_openai_error(client.post("/v1/completions", content=chunks), 413, "request_too_large")
    # A body within the limit is served as before.
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**COMPLETION, "prompt": "\ud800"}),
    ("/v1/completions", {**COMPLETION, "model": "tiny\udfff"}),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", "\ud83d"]}),
    ("/v1/completions", {**COMPLETION, "extra\ud800key": 1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}),
])
def test_text_that_is_not_unicode_gets_400(serve, path, body):
    import json

    client = serve()
    # json.dumps escapes the lone surrogate as \\ud800, as a client's JSON encoder would.
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400)
    assert "not valid Unicode" in error["message"]
    assert client.get("/health").status_code == 200


def test_invalid_utf8_bytes_get_400(serve):
    client = serve()
    r = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\xff\xfe"}',
                    headers={"content-type": "application/json"})
    assert "not valid Unicode" in assert_openai_error(r, 400)["message"]


def test_a_body_that_is_not_json_says_where_it_breaks(serve):
    client = serve()
    r = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                    headers={"content-type": "application/json"})
    message = assert_openai_error(r, 400)["message"]
    assert message.startswith("The request body is not valid JSON") and "line 1 column 28" in message


INTERNALS = ("ActorDiedError", "5f3a9c0e1d", "pid=4242", "10.1.2.3", "Traceback", "RuntimeError")


class _FailingEngine(MockEngine):
    def __init__(self, error):
        super().__init__("e0", "colocated", MODEL, MockEngineConfig(max_model_len=64))
        self._error = error

    async def generate(self, request):
        raise self._error
        yield


@pytest.mark.parametrize("error", [
    "engine",  # an engine failure as the Ray backend reports it
    "unexpected",  # a bug: an exception nobody turned into an OpenAI error
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_body_carries_no_internals(serve, caplog, error, stream):
    from pdserve.errors import EngineRequestError

    detail = ("engine colocated-0 died: ActorDiedError(actor_id=5f3a9c0e1d, pid=4242, "
              "ip=10.1.2.3)\nTraceback (most recent call last): ...")
    raised = EngineRequestError(detail) if error == "engine" else RuntimeError(detail)
    client = serve(_FailingEngine(raised))
    with caplog.at_level("ERROR"):
        r = client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    if stream and error == "engine":
        assert r.status_code == 200  # the stream had begun: the error is its last event
        body = r.text
        assert '"code":"internal_error"' in body
    elif stream:
        body = r.text  # the stream breaks off; nothing of the error reaches the client
    else:
        body = assert_openai_error(r, 500, "internal_error")["message"]
        assert "id " in body  # the id the operator finds the detail under in the log
    for internal in INTERNALS:
        assert internal not in body, body
    assert "5f3a9c0e1d" in caplog.text  # the detail is in the server log
    assert client.get("/health").status_code == 200


# --- slow clients ----------------------------------------------------------------------------

async def test_a_body_that_stops_arriving_gets_408():
    import asyncio

    from pdserve.api.guard import HttpGuard, RequestLimits

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app must not see a request whose body never arrived")

    messages = [{"type": "http.request", "body": b'{"model": ', "more_body": True}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client sends nothing more

    sent = []

    async def send(message):
        sent.append(message)

    guard = HttpGuard(app, AccessPolicy(), RequestLimits(body_timeout_s=0.05))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "client": ("127.0.0.1", 5000)}
    await asyncio.wait_for(guard(scope, receive, send), 5)
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    assert b'"request_timeout"' in sent[1]["body"]


def test_tls_needs_both_the_certificate_and_its_key():
    from pdserve.cli import build_parser, serve_overrides

    with pytest.raises(ConfigError, match="ssl_keyfile go together"):
        load_config(None, {"api.ssl_certfile": "cert.pem"})
    args = build_parser().parse_args(["serve", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"])
    config = load_config(None, serve_overrides(args))
    assert (str(config.api.ssl_certfile), str(config.api.ssl_keyfile)) == ("c.pem", "k.pem")
