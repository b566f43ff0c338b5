"""Turning OpenAI requests into engine requests, and engine deltas into OpenAI responses.

`OpenAIServing` owns the tokenizer and the checks that need it (context length, token ids in
the vocabulary), and runs a request against the backend either to completion or as an SSE
stream. A request is one engine request per choice: `n` samples of a prompt (and, on
/v1/completions, each prompt of a batch) are independent requests, as vLLM's own frontend
fans `n` out (`seed + i` for sample i), so each one takes the disaggregated path by itself.
Request metrics are observed by the backend's request flow, with the request ledger's timing.
The response bodies and chunks are built in `responses.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from pdserve.api.errors import (
    OpenAIError, bad_request, internal, model_not_found, overloaded, unavailable,
)
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pdserve.api.responses import Choice, Output, PreparedRequest, Rendering, Responses
from pdserve.api.tokenization import render_chat
from pdserve.api.tools import ToolCalling
from pdserve.engine.types import GenerateDelta, GenerateRequest, SamplingOptions
from pdserve.errors import (
    EngineDiedError, EngineRejectedRequestError, EngineRequestError, EngineUnavailableError,
    OverloadedError, RequestDeadlineError,
)
from pdserve.serving.backend import EngineBackend

logger = logging.getLogger(__name__)


class OpenAIServing:
    def __init__(self, backend: EngineBackend, tokenizer: Any, served_name: str,
                 default_max_tokens: int | None = None, tool_call_parser: str | None = None) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self.served_name = served_name
        self._default_max_tokens = default_max_tokens
        self._vocab = len(tokenizer)
        self.tools = ToolCalling(tool_call_parser, tokenizer)

    @property
    def max_model_len(self) -> int:
        return self._backend.info.max_model_len

    async def prepare_completion(self, body: CompletionRequest) -> PreparedRequest:
        self._check_model(body.model)
        _log_ignored(body)
        prompts: list[list[int]] = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompts.append(await asyncio.to_thread(
                    self._tokenizer.encode, prompt, add_special_tokens=body.add_special_tokens))
            else:
                self._check_token_ids(prompt, "prompt")
                prompts.append(list(prompt))
        prompts = [_truncated(ids, body.truncate_prompt_tokens, self.max_model_len) for ids in prompts]
        score_only = body.echo and body.max_tokens == 0
        logprobs = body.logprobs
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo and logprobs is not None:
            prompt_logprobs = logprobs
        rendering = Rendering(
            logprobs=logprobs, echo=body.echo, score_only=score_only,
            prompt_ids=prompts, tokens_as_ids=body.return_tokens_as_token_ids,
            return_token_ids=body.return_token_ids,
            continuous_usage=body.continuous_usage_in_stream(),
        )
        if body.echo:
            rendering.prompt_texts = [
                p if isinstance(p, str) and body.truncate_prompt_tokens is None
                else await asyncio.to_thread(self._tokenizer.decode, ids)
                for p, ids in zip(body.prompts(), prompts, strict=True)]
        return self._prepare("completion", "cmpl", body, prompts,
                             1 if score_only else body.max_tokens, logprobs, prompt_logprobs,
                             body.output_constraint(), rendering)

    async def prepare_chat(self, body: ChatCompletionRequest) -> PreparedRequest:
        self._check_model(body.model)
        _log_ignored(body)
        plan = self.tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        ids = await asyncio.to_thread(self._apply_chat_template, body, plan)
        ids = _truncated(ids, body.truncate_prompt_tokens, self.max_model_len)
        constraint = body.output_constraint()
        if plan is not None and plan.structured_outputs is not None:
            constraint = plan.structured_outputs  # the tool calls asked for, forced
        rendering = Rendering(
            logprobs=body.logprobs_per_token(), prompt_ids=[ids],
            tokens_as_ids=body.return_tokens_as_token_ids,
            return_token_ids=body.return_token_ids, tools=plan,
            continuous_usage=body.continuous_usage_in_stream(),
        )
        return self._prepare("chat", "chatcmpl", body, [ids], body.requested_max_tokens(),
                             body.logprobs_per_token(), body.prompt_logprobs, constraint,
                             rendering)

    def start(self, prepared: PreparedRequest) -> None:
        """Place every choice with the backend before any response byte is sent, so that a
        refusal (429 with Retry-After) or an unavailable pool (503) is a proper HTTP status.
        A refusal of one choice closes the choices already placed."""
        try:
            for choice in prepared.choices:
                choice.deltas = self._backend.generate(choice.request)
                choice.provenance = getattr(choice.deltas, "provenance", None)
        except (OverloadedError, EngineUnavailableError) as e:
            for choice in prepared.choices:
                if choice.deltas is not None:
                    _close_soon(choice.deltas)
                    choice.deltas = None
            if isinstance(e, OverloadedError):
                raise overloaded(max(1, round(e.retry_after_s)), str(e)) from e
            raise unavailable(str(e)) from e

    async def validate(self, prepared: PreparedRequest) -> None:
        """For a streamed request whose input the engine validates (a structured-output
        constraint): wait for each choice's first output, so that a refusal is an HTTP 400
        rather than an error event inside a 200 stream."""
        if not (prepared.stream and prepared.constrained):
            return
        try:
            for choice in prepared.choices:
                choice.deltas = await _peeked(self._run(prepared, choice))
        except BaseException:
            for choice in prepared.choices:
                if choice.deltas is not None:
                    await choice.deltas.aclose()
                    choice.deltas = None
            raise

    async def complete(self, prepared: PreparedRequest) -> dict[str, Any]:
        """Run every choice to the end and build the non-streaming response body."""
        outputs = [Output() for _ in prepared.choices]

        async def run(choice: Choice) -> None:
            async with aclosing(self._run(prepared, choice)) as deltas:
                async for delta in deltas:
                    outputs[choice.index].add(delta)

        tasks = [asyncio.ensure_future(run(c)) for c in prepared.choices]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return Responses(prepared, self.served_name, self._tokenizer).full(outputs)

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[str]:
        """SSE events; errors after the stream began arrive as an error event, then [DONE]."""
        responses = Responses(prepared, self.served_name, self._tokenizer)
        outputs = [Output() for _ in prepared.choices]
        try:
            if prepared.kind == "chat":
                for choice in prepared.choices:
                    yield _sse(responses.chat_role(choice.index))
            async with aclosing(_merged_streams(
                    [self._run(prepared, c) for c in prepared.choices])) as deltas:
                async for index, delta in deltas:
                    out = outputs[index]
                    first = not out.token_ids and not out.text
                    out.add(delta)
                    chunk = responses.delta(index, delta, first, outputs)
                    if chunk is not None:
                        yield _sse(chunk)
            if prepared.include_usage:
                yield _sse(responses.usage(outputs))
        except OpenAIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    async def _run(self, prepared: PreparedRequest,
                   choice: Choice) -> AsyncIterator[GenerateDelta]:
        request = choice.request
        stream = choice.deltas or self._backend.generate(request)
        choice.deltas = None
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    yield delta
        except EngineUnavailableError as e:
            logger.warning("request %s: its engine became unavailable: %s", request.request_id, e)
            raise unavailable("The engine serving this request became unavailable; retry the "
                              f"request (request id {prepared.request_id}).") from e
        except RequestDeadlineError as e:
            logger.warning("request %s: %s", request.request_id, e)
            raise OpenAIError(f"The request ran past the server's deadline for a request "
                              f"(request id {prepared.request_id}).", 504, "timeout") from e
        except EngineDiedError as e:
            logger.error("request %s lost: %s", request.request_id, e)
            raise unavailable("The engines serving this request died and no live engine could "
                              f"continue it; retry the request (request id "
                              f"{prepared.request_id}).") from e
        except EngineRejectedRequestError as e:
            # vLLM's validation message names the field and what is wrong with it.
            raise bad_request(f"The request was refused: {e}") from e
        except EngineRequestError as e:
            # The detail (engine and actor names, Ray's error text) is for the operator's log;
            # the client learns what it can act on and the id to quote.
            logger.error("request %s failed in its engine: %s", request.request_id, e)
            raise internal("The engine serving this request died or failed; retry the request "
                           f"(request id {prepared.request_id}).") from e

    def _prepare(self, kind: str, prefix: str, body: _SamplingFields, prompts: list[list[int]],
                 max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                 constraint: dict[str, Any] | None, rendering: Rendering) -> PreparedRequest:
        budgets = [self._check_length(len(ids), max_tokens) for ids in prompts]
        for name in ("stop_token_ids", "allowed_token_ids"):
            self._check_token_ids(getattr(body, name) or [], name)
        bias = tuple((int(k), max(-100.0, min(100.0, v)))
                     for k, v in (body.logit_bias or {}).items())
        self._check_token_ids([t for t, _ in bias], "logit_bias")
        # A tool-call parser may need the special tokens that delimit calls in the text.
        detokenizing = rendering.tools or body
        if body.min_tokens > min(budgets):
            raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed max_tokens "
                              f"({min(budgets)})", "min_tokens")
        base = SamplingOptions(
            max_tokens=budgets[0], temperature=body.temperature, top_p=body.top_p,
            top_k=max(body.top_k, 0), min_p=body.min_p, seed=body.seed,
            stop=body.stop_sequences(), stop_token_ids=tuple(body.stop_token_ids or ()),
            include_stop_str_in_output=body.include_stop_str_in_output,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
            logit_bias=bias,
            allowed_token_ids=(tuple(body.allowed_token_ids)
                               if body.allowed_token_ids is not None else None),
            bad_words=tuple(body.bad_words or ()), ignore_eos=body.ignore_eos,
            skip_special_tokens=detokenizing.skip_special_tokens,
            spaces_between_special_tokens=detokenizing.spaces_between_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_output=constraint,
        )
        request_id = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        engine_id = f"{prefix}-{uuid.uuid4().hex}"
        choices = []
        for p, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
            for i in range(body.n):
                # vLLM's n: sample i of a seeded request uses seed + i.
                seed = None if body.seed is None else body.seed + i
                sampling = replace(base, max_tokens=budget, seed=seed)
                index = len(choices)
                rid = engine_id if len(prompts) * body.n == 1 else f"{engine_id}-{index}"
                choices.append(Choice(index, GenerateRequest(rid, tuple(ids), sampling), p))
        return PreparedRequest(kind, request_id, choices, body.stream,
                               body.include_usage_in_stream(), rendering)

    def _check_model(self, model: str) -> None:
        if model != self.served_name:
            raise model_not_found(model)

    def _check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if ids and max(ids) >= self._vocab:
            raise bad_request(f"{param}: token ids must be < the vocabulary size {self._vocab}",
                              param)

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

    def _apply_chat_template(self, body: ChatCompletionRequest, plan: Any) -> list[int]:
        kwargs = body.template_kwargs()
        if plan is not None and plan.template_tools is not None:
            kwargs["tools"] = plan.template_tools
        return render_chat(self._tokenizer, body.template_messages(),
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           add_special_tokens=body.add_special_tokens, template_kwargs=kwargs)


def _log_ignored(body: _SamplingFields) -> None:
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s",
                       ignored)


def _truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last `keep` tokens (-1: as many as
    the model's context holds)."""
    if keep is None:
        return ids
    keep = max_model_len if keep < 0 else keep
    return ids[len(ids) - keep:] if 0 < keep < len(ids) else ids


async def _peeked(stream: AsyncIterator[GenerateDelta]) -> AsyncIterator[GenerateDelta]:
    """`stream` with its first item already awaited (its errors raise here, now)."""
    first = await anext(stream, None)

    async def rest() -> AsyncIterator[GenerateDelta]:
        async with aclosing(stream):
            if first is None:
                return
            yield first
            async for delta in stream:
                yield delta

    return rest()


def _close_soon(stream: AsyncIterator[GenerateDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        asyncio.ensure_future(aclose())


async def _merged_streams(streams: list[AsyncIterator[GenerateDelta]],
                          ) -> AsyncIterator[tuple[int, GenerateDelta]]:
    """(choice index, delta) from every stream as they come; one stream's error ends all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, GenerateDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
