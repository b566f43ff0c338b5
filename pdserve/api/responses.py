"""OpenAI response bodies and stream chunks, from a prepared request and its choices' deltas.

Shapes follow vLLM's server: logprobs as vLLM renders them (the chosen token, its logprob
clamped at -9999, the alternatives in vLLM's order: completions show `logprobs` + 1 of them,
chat the first `top_logprobs`), `echo` prepends the prompt and, with logprobs, its logprobs (the
first position has none), `stop_reason` names the stop string or token that ended a choice, a
tool-call parser's plan turns chat text into `tool_calls`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.types import GenerateDelta, GenerateRequest, PositionLogprobs


# OpenAI's floor for a logprob that is -inf (JSON has no infinity).
_LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Choice:
    """One choice of a response: its engine request and, once placed, its deltas."""

    index: int
    request: GenerateRequest
    prompt_index: int = 0
    deltas: AsyncIterator[GenerateDelta] | None = None
    # Where its tokens came from (`pdserve.serving.provenance.Provenance`), once placed.
    provenance: Any = None


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

    @property
    def constrained(self) -> bool:
        """Whether its output follows a structured-output constraint, which the engine
        validates: a streamed response then waits for its first output before answering, so
        that a refused constraint is a 400, not a stream error."""
        return self.choices[0].request.sampling.structured_output is not None

    def headers(self) -> dict[str, str]:
        """The first choice's provenance headers (pdserve.serving.provenance): for a streamed
        response, sent before it runs, the placement; after a whole response, everything."""
        provenance = self.choices[0].provenance
        return {} if provenance is None else provenance.headers()


@dataclass(slots=True)
class Output:
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


class Responses:
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

    def _usage(self, outputs: list[Output]) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self._r.prompt_ids)
        completion = 0 if self._r.score_only else sum(o.output_tokens for o in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # --- whole responses

    def full(self, outputs: list[Output]) -> dict[str, Any]:
        choices = [self._full_choice(c, o) for c, o in zip(self._p.choices, outputs, strict=True)]
        body = {**self._base(), "choices": choices, "usage": self._usage(outputs)}
        if self._chat and outputs[0].prompt_logprobs is not None:
            # vLLM's extension: on chat, the prompt's logprobs are the response's.
            body["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs)
        return body

    def _full_choice(self, choice: Choice, out: Output) -> dict[str, Any]:
        text = "".join(out.text)
        finish = out.finish_reason
        extra: dict[str, Any] = {"stop_reason": out.stop_reason}
        if not self._chat and out.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
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
        text, ids, positions = self._echoed(choice, text, out.token_ids, out.logprobs,
                                            out.prompt_logprobs, first=True)
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
              outputs: list[Output]) -> dict[str, Any] | None:
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
            text, ids, positions = self._echoed(choice, delta.text, delta.token_ids,
                                                delta.logprobs or (), delta.prompt_logprobs,
                                                first)
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

    def _echoed(self, choice: Choice, text: str, ids: Sequence[int],
                positions: Sequence[PositionLogprobs],
                prompt_logprobs: Sequence[PositionLogprobs | None] | None,
                first: bool) -> tuple[str, list[int], list[PositionLogprobs | None]]:
        """A completion's text, token ids and logprobs as the client gets them: with `echo`, the
        prompt's come first (on a stream, in its first chunk); scoring the prompt alone
        (max_tokens 0), the generated token is not shown."""
        if not (self._r.echo and first):
            return ("", [], []) if self._r.score_only else (text, list(ids), list(positions))
        prompt_ids = self._r.prompt_ids[choice.prompt_index]
        prompt_text = self._r.prompt_texts[choice.prompt_index]
        prompt_positions = list(prompt_logprobs or [None] * len(prompt_ids))
        if self._r.score_only:
            return prompt_text, list(prompt_ids), prompt_positions
        return prompt_text + text, [*prompt_ids, *ids], [*prompt_positions, *positions]

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

    def usage(self, outputs: list[Output]) -> dict[str, Any]:
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


def prompt_logprobs_json(positions: Sequence[PositionLogprobs | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt position None (the first) or {token id:
    {"logprob", "rank", "decoded_token"}}, -inf as -9999."""
    return [None if p is None else
            {str(c.token_id): {"logprob": max(c.logprob, _LOGPROB_FLOOR), "rank": c.rank,
                               "decoded_token": c.text} for c in p}
            for p in positions]


def _chosen(position: PositionLogprobs | None, token_id: int):
    if position is None:
        return None
    return next((c for c in position if c.token_id == token_id), None)
