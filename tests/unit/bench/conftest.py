"""Fixtures for the benchmark harness tests: an offline tokenizer and a scripted fake OpenAI server.

The fake server streams like vLLM's OpenAI server (one SSE chunk per token, a trailing usage chunk,
`data: [DONE]`; chat opens with a role-only delta) and sleeps for scripted delays, so a test knows what
TTFT, ITL and output length the client must record. It binds 127.0.0.1 on port 0 and keeps counts of
requests and of the peak number in flight.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

WORDS = [f"w{i}" for i in range(200)]


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordLevel tokenizer over 200 words, saved as a transformers tokenizer directory.

    Whitespace-separated words round-trip exactly through decode/encode, so prompt lengths are exact.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
    path = tmp_path_factory.mktemp("word-tokenizer")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained on a few sentences: decode/encode does *not* round-trip random ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "prefill and decode run on separate GPUs"] * 20
    core.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    path = tmp_path_factory.mktemp("bpe-tokenizer")
    hf.save_pretrained(path)
    return path


@dataclass
class FakeScript:
    """What the fake server does: delays (s), whether it reports usage, and which prompts fail."""

    ttft_s: float = 0.05
    itl_s: float = 0.02
    send_usage: bool = True
    fail_marker: str = "FAIL"


@dataclass
class FakeServerState:
    script: FakeScript
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


def _prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return len(body["messages"][-1]["content"].split())
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _chunk(body: dict, index: int, count: int, chat: bool) -> dict:
    finish = "length" if index == count - 1 else None
    if chat:
        return {
            "object": "chat.completion.chunk",
            "model": body["model"],
            "choices": [{"index": 0, "delta": {"content": f"t{index} "}, "finish_reason": finish}],
        }
    return {
        "object": "text_completion",
        "model": body["model"],
        "choices": [{"index": 0, "text": f"t{index} ", "finish_reason": finish}],
    }


async def _stream(request: web.Request, state: FakeServerState, chat: bool) -> web.StreamResponse:
    body = await request.json()
    state.requests.append(body)
    prompt_text = json.dumps(body.get("prompt", body.get("messages")))
    if state.script.fail_marker in prompt_text:
        return web.json_response({"error": {"message": "scripted failure", "code": 500}}, status=500)
    count = body.get("max_tokens") or body.get("max_completion_tokens")
    state.in_flight += 1
    state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
    try:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        await asyncio.sleep(state.script.ttft_s)
        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for index in range(count):
            if index:
                await asyncio.sleep(state.script.itl_s)
            await send(_chunk(body, index, count, chat))
        if state.script.send_usage:
            usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": count}
            await send({"choices": [], "usage": usage})
        await send("[DONE]")
        await response.write_eof()
        return response
    finally:
        state.in_flight -= 1


@dataclass
class FakeServer:
    base_url: str
    state: FakeServerState


def _build_app(state: FakeServerState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        return await _stream(request, state, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _stream(request, state, chat=True)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    return app


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """The fake server on its own event loop in a thread.

    A separate loop keeps the server's scripted sleeps independent of the client's loop, and lets sync
    tests (the CLI calls asyncio.run itself) use the same server as async ones.
    """
    state = FakeServerState(script=FakeScript())
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, object] = {}

    async def start() -> None:
        runner = web.AppRunner(_build_app(state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = site._server.sockets[0].getsockname()[1]  # port 0: ask the socket
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop)
    assert started.wait(10), "fake server did not start"
    try:
        yield FakeServer(base_url=f"http://127.0.0.1:{holder['port']}", state=state)
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
