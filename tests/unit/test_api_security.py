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
    client = serve(access=AccessPolicy(KEYS))
    r = client.post("/v1/completions", content=b"{not json", headers=bearer("nope"))
    assert_openai_error(r, 401, "invalid_api_key")


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
    with pytest.raises(ConfigError, match="api_keys"):
        load_config(None, {"api.api_keys": ["two words"]})


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
