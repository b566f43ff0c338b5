"""Turning OpenAI requests into engine requests, and engine deltas into OpenAI responses.

`OpenAIServing` owns the tokenizer and the checks that need it (context length, token ids in
the vocabulary), and runs a request against the backend either to completion or as an SSE
stream. A request is one engine request per choice: `n` samples of a prompt (and, on
/v1/completions, each prompt of a batch) are independent requests, as vLLM's own frontend
fans `n` out (`seed + i` for sample i), so each one takes the disaggregated path by itself.
Request metrics are observed by the backend's request flow, with the request ledger's timing.

Response shapes follow vLLM's server: logprobs as `_completion_logprobs` / `_chat_logprobs`
render them (the chosen token, its logprob clamped at -9999, the alternatives in vLLM's order),
`echo` prepends the prompt and, with logprobs, its logprobs (the first position has none),
`stop_reason` names the stop string or token that ended a choice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.api.errors import (
    OpenAIError, bad_request, internal, model_not_found, overloaded, unavailable,
)
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pdserve.api.tokenization import render_chat
from pdserve.engine.types import GenerateDelta, GenerateRequest, PositionLogprobs, SamplingOptions
from pdserve.errors import (
    EngineDiedError, EngineRejectedRequestError, EngineRequestError, EngineUnavailableError,
    OverloadedError, RequestDeadlineError,
)
from pdserve.serving.backend import EngineBackend

logger = logging.getLogger(__name__)

# OpenAI's floor for a logprob that is -inf (JSON has no infinity).
_LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Choice:
    """One choice of a response: its engine request and, once placed, its deltas."""

    index: int
    request: GenerateRequest
    prompt_index: int = 0
    deltas: AsyncIterator[GenerateDelta] | None = None


@dataclass(slots=True)
class Rendering:
    """What the response needs beyond the deltas."""

    logprobs: int | None = None  # alternatives per token to show; None: no logprobs
    echo: bool = False
    score_only: bool = False  # echo with max_tokens 0: the prompt alone
    prompt_texts: list[str] = field(default_factory=list)  # per prompt (echo)
    prompt_ids: list[list[int]] = field(default_factory=list)  # per prompt
    tokens_as_ids: bool = False
    return_token_ids: bool = False
    continuous_usage: bool = False
    tools: Any = None  # a pdserve.api.tools.ToolPlan, or None


@dataclass(slots=True)
class PreparedRequest:
    kind: str  # "completion" or "chat"
    request_id: str
    choices: list[Choice]
    stream: bool
    include_usage: bool
    rendering: Rendering = field(default_factory=Rendering)
    # The engine validates a structured-output constraint: a streamed response waits for its
    # first output before answering, so that a refused constraint is a 400, not a stream error.
    validate_first: bool = False
    # Where the first choice was placed: {'prefill': replica (a remote prefill only),
    # 'decode': replica} (response headers).
    engines: dict[str, str] = field(default_factory=dict)

    @property
    def engine_request(self) -> GenerateRequest:
        return self.choices[0].request


@dataclass(slots=True)
class _Output:
    """One choice's output so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: Sequence[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_tokens: int = 0

    def add(self, delta: GenerateDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.output_tokens = delta.num_output_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class OpenAIServing:
    def __init__(self, backend: EngineBackend, tokenizer: Any, served_name: str,
                 default_max_tokens: int | None = None, tool_call_parser: str | None = None) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self.served_name = served_name
        self._default_max_tokens = default_max_tokens
        self._vocab = len(tokenizer)
        from pdserve.api.tools import ToolCalling

        self._tools = ToolCalling(tool_call_parser, tokenizer)

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
        prompts = [_truncated(ids, body.truncate_prompt_tokens) for ids in prompts]
        score_only = body.echo and body.max_tokens == 0
        logprobs = body.logprobs
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo and logprobs is not None:
            prompt_logprobs = logprobs
        rendering = Rendering(
            logprobs=logprobs, echo=body.echo, score_only=score_only,
            prompt_ids=prompts, tokens_as_ids=body.return_tokens_as_token_ids,
            return_token_ids=body.return_token_ids,
            continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
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
        plan = self._tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        ids = await asyncio.to_thread(self._apply_chat_template, body, plan)
        ids = _truncated(ids, body.truncate_prompt_tokens)
        constraint = body.output_constraint()
        if plan is not None and plan.structured_outputs is not None:
            constraint = plan.structured_outputs  # the tool calls asked for, forced
        rendering = Rendering(
            logprobs=body.logprobs_per_token(), prompt_ids=[ids],
            tokens_as_ids=body.return_tokens_as_token_ids,
            return_token_ids=body.return_token_ids, tools=plan,
            continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
        )
        prepared = self._prepare("chat", "chatcmpl", body, [ids], body.requested_max_tokens(),
                                 body.logprobs_per_token(), body.prompt_logprobs, constraint,
                                 rendering)
        if plan is not None:
            # A tool-call parser may need the special tokens that delimit calls in the text.
            for choice in prepared.choices:
                choice.request = replace(choice.request, sampling=replace(
                    choice.request.sampling, skip_special_tokens=plan.skip_special_tokens,
                    spaces_between_special_tokens=plan.spaces_between_special_tokens))
        return prepared

    def start(self, prepared: PreparedRequest) -> None:
        """Place every choice with the backend before any response byte is sent, so that a
        refusal (429 with Retry-After) or an unavailable pool (503) is a proper HTTP status.
        A refusal of one choice closes the choices already placed."""
        try:
            for choice in prepared.choices:
                choice.deltas = self._backend.generate(choice.request)
            prepared.engines = getattr(prepared.choices[0].deltas, "engines", None) or {}
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
        if not (prepared.stream and prepared.validate_first):
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
        outputs = [_Output() for _ in prepared.choices]

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
        return _Responses(prepared, self.served_name, self._tokenizer).full(outputs)

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[str]:
        """SSE events; errors after the stream began arrive as an error event, then [DONE]."""
        responses = _Responses(prepared, self.served_name, self._tokenizer)
        outputs = [_Output() for _ in prepared.choices]
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
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
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
                               body.include_usage_in_stream(), rendering,
                               validate_first=constraint is not None)

    def _check_model(self, model: str) -> None:
        if model != self.served_name:
            raise model_not_found(model)

    def _check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if any(t >= self._vocab for t in ids):
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


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: up to the model's
    length, which the length check enforces anyway)."""
    if keep is None or keep < 0 or len(ids) <= keep:
        return ids
    return ids[len(ids) - keep:] if keep else ids


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


class _Responses:
    """Builds response bodies and stream chunks for one prepared request."""

    def __init__(self, prepared: PreparedRequest, model: str, tokenizer: Any) -> None:
        self._p = prepared
        self._r = prepared.rendering
        self._model = model
        self._tokenizer = tokenizer
        self._chat = prepared.kind == "chat"
        self._tool_streams: dict[int, Any] = {}

    def _base(self) -> dict[str, Any]:
        return {"id": self._p.request_id,
                "object": ("chat.completion" if self._chat else "text_completion"),
                "created": int(time.time()), "model": self._model}

    def _usage(self, outputs: list[_Output]) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self._r.prompt_ids)
        completion = 0 if self._r.score_only else sum(o.output_tokens for o in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # --- whole responses

    def full(self, outputs: list[_Output]) -> dict[str, Any]:
        choices = [self._full_choice(c, o) for c, o in zip(self._p.choices, outputs, strict=True)]
        return {**self._base(), "choices": choices, "usage": self._usage(outputs)}

    def _full_choice(self, choice: Choice, out: _Output) -> dict[str, Any]:
        text = "".join(out.text)
        finish = out.finish_reason
        extra: dict[str, Any] = {"stop_reason": out.stop_reason}
        if self._r.return_token_ids:
            extra["token_ids"] = out.token_ids
            extra["prompt_token_ids"] = self._r.prompt_ids[choice.prompt_index]
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            plan = self._r.tools
            if plan is not None:
                result = plan.complete(text, out.token_ids, finish,
                                       self._r.prompt_ids[choice.prompt_index])
                message = {"role": "assistant", "content": result.content,
                           "tool_calls": result.tool_calls}
                finish = result.finish_reason_override or finish
            logprobs = (self._chat_logprobs(out.token_ids, out.logprobs)
                        if self._r.logprobs is not None else None)
            return {"index": choice.index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish, **extra}
        ids, positions = out.token_ids, list(out.logprobs)
        if self._r.echo:
            prompt_ids = self._r.prompt_ids[choice.prompt_index]
            prompt_positions = list(out.prompt_logprobs or [None] * len(prompt_ids))
            prompt_text = self._r.prompt_texts[choice.prompt_index]
            if self._r.score_only:
                ids, positions, text = prompt_ids, prompt_positions, prompt_text
            else:
                ids, positions = [*prompt_ids, *ids], [*prompt_positions, *positions]
                text = prompt_text + text
        logprobs = (self._completion_logprobs(ids, positions)
                    if self._r.logprobs is not None else None)
        if self._r.score_only:
            finish = "length"
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish, **extra}

    # --- stream chunks

    def chat_role(self, index: int) -> dict[str, Any]:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return {**self._base(), "object": "chat.completion.chunk", "choices": [choice]}

    def delta(self, index: int, delta: GenerateDelta, first: bool,
              outputs: list[_Output]) -> dict[str, Any] | None:
        """The chunk for one choice's delta, or None when there is nothing to send."""
        # A chunk per token event, even when its text is empty (a token the detokenizer holds
        # back or cannot render), as vLLM's server does: the client's first chunk is the first
        # token, whichever engine made it.
        if not (delta.token_ids or delta.text or delta.finish_reason):
            return None
        choice = self._p.choices[index]
        finish = delta.finish_reason
        extra: dict[str, Any] = {}
        if delta.finished:
            extra["stop_reason"] = delta.stop_reason
        if self._r.return_token_ids:
            extra["token_ids"] = list(delta.token_ids)
        if self._chat:
            logprobs = (self._chat_logprobs(delta.token_ids, delta.logprobs or ())
                        if self._r.logprobs is not None else None)
            message, finish = self._chat_delta(index, delta)
            if message is None and not delta.finished:
                return None
            body = {"index": index, "delta": message or {}, "logprobs": logprobs,
                    "finish_reason": finish, **extra}
            chunk = {**self._base(), "object": "chat.completion.chunk", "choices": [body]}
        else:
            text, ids = delta.text, list(delta.token_ids)
            positions = list(delta.logprobs or ())
            if self._r.echo and first:
                prompt_ids = self._r.prompt_ids[choice.prompt_index]
                prompt_text = self._r.prompt_texts[choice.prompt_index]
                prompt_positions = list(delta.prompt_logprobs or [None] * len(prompt_ids))
                if self._r.score_only:
                    text, ids, positions = prompt_text, prompt_ids, prompt_positions
                else:
                    text, ids = prompt_text + text, [*prompt_ids, *ids]
                    positions = [*prompt_positions, *positions]
            elif self._r.score_only:
                text, ids, positions = "", [], []
            if self._r.score_only and delta.finished:
                finish = "length"
            logprobs = (self._completion_logprobs(ids, positions)
                        if self._r.logprobs is not None else None)
            body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                    **extra}
            chunk = {**self._base(), "choices": [body]}
        if self._r.continuous_usage and self._p.include_usage:
            chunk["usage"] = self._usage(outputs)
        return chunk

    def _chat_delta(self, index: int, delta: GenerateDelta) -> tuple[dict | None, str | None]:
        finish = delta.finish_reason
        plan = self._r.tools
        if plan is None:
            content = delta.text if delta.text or delta.token_ids else None
            return (None if content is None else {"content": content}), finish
        stream = self._tool_streams.get(index)
        if stream is None:
            prompt = self._r.prompt_ids[self._p.choices[index].prompt_index]
            stream = self._tool_streams[index] = plan.streamer(prompt)
        message = stream.feed(delta.text, list(delta.token_ids), finished=delta.finished)
        if delta.finished:
            finish = stream.finish(delta.finish_reason) or finish
        return message, finish

    def usage(self, outputs: list[_Output]) -> dict[str, Any]:
        chunk = {**self._base(), "choices": [], "usage": self._usage(outputs)}
        if self._chat:
            chunk["object"] = "chat.completion.chunk"
        return chunk

    # --- logprobs

    def _token(self, token_id: int, text: str | None) -> str:
        if self._r.tokens_as_ids:
            return f"token_id:{token_id}"
        if text:
            return text
        return self._tokenizer.decode([token_id])

    def _completion_logprobs(self, ids: Sequence[int],
                             positions: Sequence[PositionLogprobs | None]) -> dict[str, Any]:
        """As vLLM's completions: per token its text, logprob and the top `logprobs` + 1
        entries of its position (the chosen token first); text offsets into the text."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for token_id, position in zip(ids, positions, strict=True):
            chosen = _chosen(position, token_id)
            token = self._token(token_id, chosen.text if chosen else None)
            tokens.append(token)
            if chosen is None:
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(max(chosen.logprob, _LOGPROB_FLOOR))
                top.append({self._token(c.token_id, c.text): max(c.logprob, _LOGPROB_FLOOR)
                            for c in position[:self._r.logprobs + 1]})
            offsets.append(offset)
            offset += len(token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top}

    def _chat_logprobs(self, ids: Sequence[int],
                       positions: Sequence[PositionLogprobs]) -> dict[str, Any]:
        """As vLLM's chat: per token its text, logprob, UTF-8 bytes and the first
        `top_logprobs` entries of its position."""
        content = []
        for token_id, position in zip(ids, positions, strict=True):
            chosen = _chosen(position, token_id)
            token = self._token(token_id, chosen.text if chosen else None)
            top = [{"token": (t := self._token(c.token_id, c.text)),
                    "logprob": max(c.logprob, _LOGPROB_FLOOR),
                    "bytes": list(t.encode("utf-8", errors="replace"))}
                   for c in position[:self._r.logprobs]]
            content.append({"token": token,
                            "logprob": max(chosen.logprob, _LOGPROB_FLOOR) if chosen else
                            _LOGPROB_FLOOR,
                            "bytes": list(token.encode("utf-8", errors="replace")),
                            "top_logprobs": top})
        return {"content": content}


def _chosen(position: PositionLogprobs | None, token_id: int):
    if position is None:
        return None
    return next((c for c in position if c.token_id == token_id), None)

