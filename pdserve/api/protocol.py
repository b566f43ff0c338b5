"""OpenAI request schemas: what /v1/completions and /v1/chat/completions accept.

Field names, defaults and ranges follow the OpenAI API (and vLLM's server where OpenAI is
silent). Features pdserve does not implement are refused with a clear 400 rather than silently
ignored: a client asking for logprobs or n > 1 must not get an answer that looks complete.
Unknown fields are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    @model_validator(mode="before")
    @classmethod
    def _refuse_text_that_is_not_unicode(cls, data: Any) -> Any:
        # JSON may escape a lone UTF-16 surrogate ("\ud800"); no tokenizer nor UTF-8 encoder
        # takes one, so it is refused here, before any of it is echoed or tokenized.
        if _holds_lone_surrogate(data):
            raise ValueError("The request holds text that is not valid Unicode (a lone UTF-16 "
                             "surrogate such as \\ud800); send UTF-8 text.")
        return data

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: bool | int | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS.")

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _null_means_default(cls, value: float | None, info) -> float:
        # The openai client sends JSON null for "not given" in some code paths.
        return 1.0 if value is None else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _holds_lone_surrogate(data: Any) -> bool:
    """Whether any string (value or key) in a parsed JSON tree cannot be encoded as UTF-8.
    Iterative: a deeply nested body must not exhaust the stack."""
    pending = [data]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's default for the legacy completions endpoint.
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            value = value[0]
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("prompt token ids must be non-negative")
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]
