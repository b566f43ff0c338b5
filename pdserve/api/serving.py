"""Turning OpenAI requests into engine requests, and engine deltas into OpenAI responses.

`OpenAIServing` owns the tokenizer and the checks that need it (context length), and runs a
request against the backend either to completion or as an SSE stream. Request metrics are
observed by the backend's request flow, with the request ledger's timing (one timer for the
SLO tracker and Prometheus).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pdserve.api.errors import (
    OpenAIError, bad_request, internal, model_not_found, overloaded, unavailable,
)
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.engine.types import GenerateDelta, GenerateRequest, SamplingOptions
from pdserve.errors import (
    EngineDiedError, EngineRequestError, EngineUnavailableError, OverloadedError,
    RequestDeadlineError,
)
from pdserve.serving.backend import EngineBackend

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PreparedRequest:
    kind: str  # "completion" or "chat"
    engine_request: GenerateRequest
    stream: bool
    include_usage: bool
    # Set by `OpenAIServing.start`: the placed request's deltas (placement happened already).
    deltas: AsyncIterator[GenerateDelta] | None = None


class OpenAIServing:
    def __init__(self, backend: EngineBackend, tokenizer: Any, served_name: str,
                 default_max_tokens: int | None = None) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self.served_name = served_name
        self._default_max_tokens = default_max_tokens

    @property
    def max_model_len(self) -> int:
        return self._backend.info.max_model_len

    async def prepare_completion(self, body: CompletionRequest) -> PreparedRequest:
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            ids = await asyncio.to_thread(self._tokenizer.encode, body.prompt)
        else:
            ids = list(body.prompt)
            vocab = len(self._tokenizer)
            if any(t >= vocab for t in ids):
                raise bad_request(f"prompt token ids must be < the vocabulary size {vocab}",
                                  "prompt")
        return self._prepare("completion", "cmpl", body, ids, body.max_tokens)

    async def prepare_chat(self, body: ChatCompletionRequest) -> PreparedRequest:
        self._check_model(body.model)
        ids = await asyncio.to_thread(self._apply_chat_template, body.template_messages())
        return self._prepare("chat", "chatcmpl", body, ids, body.requested_max_tokens())

    def start(self, prepared: PreparedRequest) -> None:
        """Place the request with the backend before any response byte is sent, so that a
        refusal (429 with Retry-After) or an unavailable pool (503) is a proper HTTP status."""
        try:
            prepared.deltas = self._backend.generate(prepared.engine_request)
        except OverloadedError as e:
            raise overloaded(max(1, round(e.retry_after_s)), str(e)) from e
        except EngineUnavailableError as e:
            raise unavailable(str(e)) from e

    async def complete(self, prepared: PreparedRequest) -> dict[str, Any]:
        """Run to the end and build the non-streaming response body."""
        text, finish, last = [], None, None
        async with aclosing(self._run(prepared)) as deltas:
            async for delta in deltas:
                text.append(delta.text)
                finish, last = delta.finish_reason, delta
        assert last is not None
        return _full_response(prepared, self.served_name, "".join(text), finish, last)

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[str]:
        """SSE events; errors after the stream began arrive as an error event, then [DONE]."""
        chunks = _ChunkBuilder(prepared, self.served_name)
        try:
            if prepared.kind == "chat":
                yield _sse(chunks.chat_role())
            # aclosing: closing this stream (client gone) must close the chain down to the
            # backend now, not whenever the garbage collector gets to it.
            async with aclosing(self._run(prepared)) as deltas:
                async for delta in deltas:
                    # A chunk per token event, even when its text is empty (a token the
                    # detokenizer holds back or cannot render), as vLLM's server does: the
                    # client's first chunk is the first token, whichever engine made it.
                    if delta.token_ids or delta.text or delta.finish_reason:
                        yield _sse(chunks.delta(delta))
                    if delta.finished and prepared.include_usage:
                        yield _sse(chunks.usage(delta))
        except OpenAIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    async def _run(self, prepared: PreparedRequest) -> AsyncIterator[GenerateDelta]:
        request = prepared.engine_request
        stream = prepared.deltas or self._backend.generate(request)
        prepared.deltas = None
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    yield delta
        except EngineUnavailableError as e:
            logger.warning("request %s: its engine became unavailable: %s", request.request_id, e)
            raise unavailable("The engine serving this request became unavailable; retry the "
                              f"request (request id {request.request_id}).") from e
        except RequestDeadlineError as e:
            logger.warning("request %s: %s", request.request_id, e)
            raise OpenAIError(f"The request ran past the server's deadline for a request "
                              f"(request id {request.request_id}).", 504, "timeout") from e
        except EngineDiedError as e:
            logger.error("request %s lost: %s", request.request_id, e)
            raise unavailable("The engines serving this request died and no live engine could "
                              f"continue it; retry the request (request id "
                              f"{request.request_id}).") from e
        except EngineRequestError as e:
            # The detail (engine and actor names, Ray's error text) is for the operator's log;
            # the client learns what it can act on and the id to quote.
            logger.error("request %s failed in its engine: %s", request.request_id, e)
            raise internal("The engine serving this request died or failed; retry the request "
                           f"(request id {request.request_id}).") from e

    def _prepare(self, kind: str, prefix: str, body: Any, ids: list[int],
                 max_tokens: int | None) -> PreparedRequest:
        max_tokens = self._check_length(len(ids), max_tokens)
        sampling = SamplingOptions(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            seed=body.seed, stop=body.stop_sequences(), presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos,
        )
        request = GenerateRequest(f"{prefix}-{uuid.uuid4().hex}", tuple(ids), sampling)
        return PreparedRequest(kind, request, body.stream, body.include_usage_in_stream())

    def _check_model(self, model: str) -> None:
        if model != self.served_name:
            raise model_not_found(model)

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        if prompt_len == 0:
            raise bad_request("The prompt is empty after tokenization.", "prompt")
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input.",
                "messages", "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self._default_max_tokens or limit, limit - prompt_len)
        if prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in "
                "the completion). Please reduce the length of the input or of max_tokens.",
                "max_tokens", "context_length_exceeded")
        return max_tokens

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors for message orders the template refuses
            raise bad_request(f"the model's chat template rejected the messages: {e}",
                              "messages") from e
        # The template already wrote the special tokens; do not add another BOS.
        return self._tokenizer.encode(text, add_special_tokens=False)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(delta: GenerateDelta) -> dict[str, int]:
    return {"prompt_tokens": delta.num_prompt_tokens,
            "completion_tokens": delta.num_output_tokens,
            "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens}


def _full_response(prepared: PreparedRequest, model: str, text: str, finish: str | None,
                   last: GenerateDelta) -> dict[str, Any]:
    base = {"id": prepared.engine_request.request_id, "created": int(time.time()),
            "model": model, "usage": _usage(last)}
    if prepared.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {**base, "object": "text_completion", "choices": [choice]}


class _ChunkBuilder:
    def __init__(self, prepared: PreparedRequest, model: str) -> None:
        self._chat = prepared.kind == "chat"
        self._base: Callable[[], dict[str, Any]] = lambda: {
            "id": prepared.engine_request.request_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": int(time.time()), "model": model,
        }

    def chat_role(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._base(), "choices": [choice]}

    def delta(self, delta: GenerateDelta) -> dict[str, Any]:
        if self._chat:
            content = delta.text if delta.text or delta.token_ids else None
            choice = {"index": 0, "delta": {} if content is None else {"content": content},
                      "logprobs": None, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": None,
                      "finish_reason": delta.finish_reason}
        return {**self._base(), "choices": [choice]}

    def usage(self, delta: GenerateDelta) -> dict[str, Any]:
        return {**self._base(), "choices": [], "usage": _usage(delta)}
