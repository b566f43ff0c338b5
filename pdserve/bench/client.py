"""Async streaming client for OpenAI-compatible /v1/completions and /v1/chat/completions.

Lifecycle: `OpenAIStreamClient` opens one aiohttp session on `__aenter__` (its connection pool is reused
by every request, as vllm bench does, so connection setup does not pollute TTFT) and closes it on
`__aexit__`. `send` posts one streaming request and never raises for server or network trouble: it returns
a `RequestOutcome` with `success=False` and the error, because a benchmark counts failures, it does not
stop on them.

Timing follows vllm/benchmarks/lib/endpoint_request_func.py: the clock starts just before the POST; TTFT
is the arrival of the first SSE chunk that carries a token; every later token chunk adds one inter-token
latency (a chunk may hold several tokens, so ITL is per chunk, exactly like vllm); E2EL ends at the last
token chunk. Output tokens come from the final `usage` block (`stream_options.include_usage`); the metrics
fall back to counting when a server sends none.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.server_info import list_models
from pdserve.bench.workloads import BenchRequest

# vllm bench's session timeout: long enough for the slowest request of an overloaded run.
_DEFAULT_TIMEOUT_S = 6 * 60 * 60
# Error bodies can be whole HTML pages; keep enough to recognise the failure.
_MAX_ERROR_CHARS = 500
KEEPALIVE_S = 3.0  # idle pooled connections close after this, under servers' usual 5 s


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """Where and how to send requests; `extra_body` is merged into every request body."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = _DEFAULT_TIMEOUT_S

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What one request did, in seconds on the client's monotonic clock.

    `start_s` is when the POST was sent and `queued_s` how long the request waited on the concurrency
    cap before that. `output_tokens`/`prompt_tokens` are the server's usage numbers (None when it sent
    none); `chunk_count` is the number of token-bearing chunks, the last-resort output count.
    """

    success: bool
    prompt_len: int
    start_s: float = 0.0
    ttft_s: float = 0.0
    itls_s: tuple[float, ...] = ()
    e2el_s: float = 0.0
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    chunk_count: int = 0
    generated_text: str = ""
    error: str = ""
    queued_s: float = 0.0


class SSEDecoder:
    """Incremental server-sent-events decoder: feed raw bytes, get the `data` of each complete event.

    Network reads split events anywhere (mid-line, mid-UTF-8 character), so bytes are buffered until a
    line ends, and an event is emitted at the blank line that terminates it. Multi-line data is joined
    with newlines; comments and other fields (`event:`, `id:`) are ignored, as OpenAI streams use none.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            raw, self._buffer = self._buffer[:newline], self._buffer[newline + 1 :]
            event = self._on_line(raw.rstrip(b"\r").decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)

    def flush(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        events = self.feed(b"\n") if self._buffer else []
        if self._data_lines:
            events.append("\n".join(self._data_lines))
            self._data_lines = []
        return events

    def _on_line(self, line: str) -> str | None:
        if not line:
            if not self._data_lines:
                return None
            event, self._data_lines = "\n".join(self._data_lines), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data_lines.append(value[1:] if value.startswith(" ") else value)
        return None


class StreamRecorder:
    """Turns the timed `data` payloads of one stream into a `RequestOutcome` (no I/O, testable alone)."""

    def __init__(self, prompt_len: int, start_s: float, is_chat: bool) -> None:
        self._prompt_len = prompt_len
        self._start_s = start_s
        self._is_chat = is_chat
        self._token_times: list[float] = []
        self._text: list[str] = []
        self._usage: dict[str, Any] = {}
        self._error = ""

    def on_event(self, data: str, now_s: float) -> None:
        if data.strip() == "[DONE]":
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            self._error = f"unparseable stream chunk: {data[:_MAX_ERROR_CHARS]!r}"
            return
        if not isinstance(payload, dict):
            return
        if "error" in payload:
            self._error = f"stream error: {json.dumps(payload['error'])[:_MAX_ERROR_CHARS]}"
            return
        if usage := payload.get("usage"):
            self._usage = usage
        if choices := payload.get("choices"):
            text = _chunk_text(choices[0], self._is_chat)
            if text is not None:
                self._token_times.append(now_s)
                self._text.append(text)

    def finish(self, queued_s: float = 0.0) -> RequestOutcome:
        if self._error or not self._token_times:
            return self.fail(self._error or "stream ended without any token", queued_s)
        times = self._token_times
        return RequestOutcome(
            success=True,
            prompt_len=self._prompt_len,
            start_s=self._start_s,
            ttft_s=times[0] - self._start_s,
            itls_s=tuple(later - earlier for earlier, later in itertools.pairwise(times)),
            e2el_s=times[-1] - self._start_s,
            output_tokens=_optional_int(self._usage.get("completion_tokens")),
            prompt_tokens=_optional_int(self._usage.get("prompt_tokens")),
            chunk_count=len(times),
            generated_text="".join(self._text),
            queued_s=queued_s,
        )

    def fail(self, error: str, queued_s: float = 0.0) -> RequestOutcome:
        return RequestOutcome(
            success=False,
            prompt_len=self._prompt_len,
            start_s=self._start_s,
            generated_text="".join(self._text),
            error=error,
            queued_s=queued_s,
        )


def _chunk_text(choice: dict[str, Any], is_chat: bool) -> str | None:
    """The text a choice carries, or None when the chunk carries no token.

    Completions: every chunk with a choice is a token event, even with empty text (a special token), as
    in vllm. Chat: vLLM opens with a role-only delta (`content: ""`) and may end with a bare
    finish_reason; neither is a token, so only non-empty content or reasoning counts.
    """
    if not is_chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or None


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def request_body(endpoint: EndpointConfig, request: BenchRequest) -> dict[str, Any]:
    """The JSON body vllm bench sends for this request (streaming, usage included)."""
    body: dict[str, Any] = {"model": endpoint.model, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if endpoint.is_chat:
        if not isinstance(request.prompt, str):
            raise ValueError("chat endpoints take text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.output_len
    else:
        body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
        body["max_tokens"] = request.output_len
    if endpoint.temperature is not None:
        body["temperature"] = endpoint.temperature
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    body.update(endpoint.extra_body)
    return body


class OpenAIStreamClient:
    """Sends streaming requests to one endpoint over a shared connection pool (see module docstring)."""

    def __init__(
        self,
        endpoint: EndpointConfig,
        max_connections: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.endpoint = endpoint
        self._max_connections = max_connections or 0  # aiohttp: 0 means unlimited
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIStreamClient:
        # Idle connections are dropped before the server's keep-alive can close them (uvicorn,
        # and so vLLM's server, closes after 5 s): reusing one the server is closing fails the
        # request with "Server disconnected" (seen on a GPU profile, 2026-11-27).
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, limit_per_host=self._max_connections,
            keepalive_timeout=KEEPALIVE_S,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.endpoint.timeout_s),
            headers=self._headers(),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.endpoint.api_key:
            headers["Authorization"] = f"Bearer {self.endpoint.api_key}"
        return headers

    async def send(self, request: BenchRequest, queued_s: float = 0.0) -> RequestOutcome:
        """Stream one request to completion and record its timeline."""
        if self._session is None:
            raise RuntimeError("use the client as `async with OpenAIStreamClient(...)`")
        body = request_body(self.endpoint, request)
        recorder = StreamRecorder(request.prompt_len, self._clock(), self.endpoint.is_chat)
        try:
            async with self._session.post(self.endpoint.url, json=body) as response:
                if response.status != 200:
                    text = (await response.text())[:_MAX_ERROR_CHARS]
                    return recorder.fail(f"HTTP {response.status}: {text}", queued_s)
                decoder = SSEDecoder()
                async for chunk in response.content.iter_any():
                    for data in decoder.feed(chunk):
                        recorder.on_event(data, self._clock())
                for data in decoder.flush():
                    recorder.on_event(data, self._clock())
        except (aiohttp.ClientError, TimeoutError) as exc:
            return recorder.fail(f"{type(exc).__name__}: {exc}", queued_s)
        return recorder.finish(queued_s)


async def fetch_first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists on /v1/models (vllm bench's default for --model)."""
    models = await list_models(base_url, api_key, timeout_s)
    url = base_url.rstrip("/") + "/v1/models"
    if not models:
        raise ConnectionError(f"{url} lists no models")
    return str(models[0]["id"])


def iter_events(raw: bytes, chunk_size: int = 7) -> Iterator[str]:
    """Decode a whole SSE body fed in small pieces (tests and offline replays of captured streams)."""
    decoder = SSEDecoder()
    for offset in range(0, len(raw), chunk_size):
        yield from decoder.feed(raw[offset : offset + chunk_size])
    yield from decoder.flush()
