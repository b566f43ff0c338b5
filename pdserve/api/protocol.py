"""OpenAI request schemas: what /v1/completions and /v1/chat/completions accept.

Field names, defaults and ranges follow the OpenAI API, and vLLM's server for its extensions
(`top_k`, `min_p`, `repetition_penalty`, `structured_outputs`, `prompt_logprobs`, ...), so a
client written for `vllm serve` works unchanged. Three kinds of field:

- supported: honoured the same way in colocated and disaggregated mode (README's endpoint
  table lists them);
- known but not honoured here (beam search, multimodal input, a client's own KV transfer
  parameters, ...): a request that sets one gets 400 naming it, never an answer that silently
  ignores what it asked for (`_UNSUPPORTED`);
- unknown: accepted and ignored, as OpenAI-compatible servers do, but named in the server's
  log for each request that sends one (`ignored_fields`), as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM's default `max_logprobs`: the most alternatives per position an engine returns.
MAX_LOGPROBS = 20
# The most choices one request may ask for (n, or prompts x n on /v1/completions).
MAX_CHOICES = 64
_INT64 = 2**63


class FieldError(ValueError):
    """A check across fields that names the field the client should change (the HTTP layer
    reports it as the error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    # Unknown fields are kept (not honoured) so that the server can name them in its log.
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """The request's unknown fields, which it ignores."""
        return sorted(self.model_extra or ())


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(_Request):
    name: str = "response"
    description: str | None = None
    # `schema` is the OpenAI name; pydantic reserves it on models, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("When response_format type is 'json_schema', the 'json_schema' "
                             "field must be provided.")
        return self


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extension: exactly one constraint and its options."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of 'json', 'regex', "
                             "'choice', 'grammar' or 'json_object'")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")
        return self

    def params(self) -> dict[str, Any]:
        """As vLLM's `StructuredOutputsParams` keyword arguments."""
        out: dict[str, Any] = {}
        for key in ("regex", "choice", "grammar", "json_object", "whitespace_pattern"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.json_ is not None:
            out["json"] = self.json_
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        if self.disable_additional_properties:
            out["disable_additional_properties"] = True
        return out


# Fields vLLM's server knows that pdserve does not honour: set to anything but their default
# (the value on the right), the request gets 400 saying so.
_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "watermarking": None,
    "logprob_token_ids": None, "prompt_embeds": None, "kv_transfer_params": None,
    "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None,
    "thinking_token_budget": None, "mm_processor_kwargs": None, "media_io_kwargs": None,
    "mm_payload": None, "return_mm_kwargs": None, "cache_salt": None, "priority": 0,
    "chat_template": None, "documents": None, "functions": None, "function_call": None,
    "audio": None, "modalities": None, "prediction": None, "routed_experts_prompt_start": 0,
    "suffix": None, "stream_interval": None, "return_token_offsets": None,
    "return_prompt_text": None,
}
_WHY = {
    "use_beam_search": "beam search is not supported",
    "kv_transfer_params": "pdserve moves the KV cache itself; clients may not direct it",
    "ec_transfer_params": "pdserve does not take encoder-cache transfers from clients",
    "chat_template": "a request's own chat template is not accepted; the model's is used",
    "functions": "the legacy 'functions' field is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
}


class _SamplingFields(_Request):
    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, default in _UNSUPPORTED.items():
                if name in data and data[name] not in (None, default):
                    why = _WHY.get(name, "pdserve does not support it")
                    raise FieldError(name, f"'{name}' is not supported: {why}.")
        return data

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM: keep the k most likely tokens; 0 or -1: all")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS.")
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Before vLLM 0.11, its structured output fields; still sent by older clients.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    request_id: str | None = Field(None, max_length=256)
    user: str | None = None

    @field_validator("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "n",
                     mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        # The openai client sends JSON null for "not given" in some code paths.
        if value is None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _some_allowed(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("allowed_token_ids must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs are not available when stream is "
                             "true")
        constraints = [name for name in ("response_format", "structured_outputs", "guided_json",
                                         "guided_regex", "guided_choice", "guided_grammar")
                       if getattr(self, name) is not None
                       and not (name == "response_format" and self.response_format.type == "text")]
        if len(constraints) > 1:
            raise FieldError(constraints[1], "only one output constraint may be given, got "
                             f"{constraints}")
        return self

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def output_constraint(self) -> dict[str, Any] | None:
        """The structured-output constraint asked for, as vLLM's `StructuredOutputsParams`
        keyword arguments; None for free text."""
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return {"json_object": True}
        if rf is not None and rf.type == "json_schema":
            return {"json": rf.json_schema.json_schema}
        legacy = {"json": self.guided_json, "regex": self.guided_regex,
                  "choice": self.guided_choice, "grammar": self.guided_grammar}
        for key, value in legacy.items():
            if value is not None:
                out = {key: value}
                if self.guided_whitespace_pattern:
                    out["whitespace_pattern"] = self.guided_whitespace_pattern
                return out
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's default for the legacy completions endpoint; 0 only with echo (score the prompt).
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list) -> str | list:
        batch = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) \
            else [value]
        if len(batch) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request")
        for prompt in batch:
            if len(prompt) == 0:
                raise ValueError("prompt must not be empty")
            # The field's type made a list of token ids a list[int]; min() is one C loop.
            if isinstance(prompt, list) and min(prompt) < 0:
                raise ValueError("prompt token ids must be non-negative integers")
        return value

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens must be at least 1 (0 only with echo, "
                             "to score the prompt)")
        if self.best_of not in (None, 1, self.n):
            raise FieldError("best_of", "best_of is not supported; use n for several samples")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise FieldError("n", f"prompts x n must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (one for a plain request)."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return list(value)
        return [value]


class TextPart(_Request):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; this "
                             "model takes text only")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            # As vLLM hands them to templates: arguments parsed back into objects where they
            # are JSON (most templates render them with tojson).
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _call_for_template(call: ToolCall) -> dict[str, Any]:
    import json

    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "when using top_logprobs, logprobs must be set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "Cannot set both continue_final_message "
                             "and add_generation_prompt to true.")
        if self.echo:
            raise FieldError("echo", "'echo' is not supported on chat completions")
        if self.tools is not None and self.output_constraint() is not None \
                and self.tool_choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "You can only either use constraints for structured "
                             "outputs or tools, not both.")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template, as vLLM passes them."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    def logprobs_per_token(self) -> int | None:
        """vLLM's `SamplingParams.logprobs` for this request: alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None
