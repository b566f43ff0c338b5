"""OpenAI tool calling (`tools`, `tool_choice`) for /v1/chat/completions, as vLLM serves it.

pdserve answers tool requests the way `vllm serve --enable-auto-tool-choice --tool-call-parser
NAME` does, by running vLLM's own parsers (`vllm.parser.ParserManager`, which wraps the
`vllm.tool_parsers` registry) and copying the decisions vLLM 0.32's chat server makes around them
(`vllm/entrypoints/openai/chat_completion/serving.py`, `vllm/renderers/online_renderer.py`).

Lifecycle:

1. Startup: `ToolCalling(api.tool_call_parser, tokenizer)` resolves the parser once; an unknown
   name, or a parser that cannot work with the model's tokenizer, is a `ValueError` then.
2. Per request, before templating: `plan(tools, tool_choice, parallel_tool_calls)` validates the
   combination (a 400 `OpenAIError` with vLLM's message) and returns a `ToolPlan`, or None when
   the request has no tools. The plan says what the chat template gets as `tools=`, which
   structured-output constraint the engine must apply, and how to detokenize.
3. After generation: `plan.complete(text, token_ids, finish_reason)` turns the whole output into
   content and tool calls; or, streaming, `plan.streamer()` gives a `ToolStream` fed each engine
   delta (`finished=True` with the last), that returns the chat deltas to send; its `finish`
   says whether to report "tool_calls" as the finish reason.

vLLM is imported lazily (constructor and methods), so `import pdserve.api.tools` does not need
it. vLLM's parsers are stateful: every `complete` call and every `streamer` gets a fresh one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.errors import OpenAIError, bad_request

# The pdserve setting that plays the part of `--enable-auto-tool-choice --tool-call-parser`.
SETTING = "api.tool_call_parser"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A finished generation as the chat message reports it."""

    content: str | None
    # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments": JSON text}}.
    tool_calls: list[dict[str, Any]]
    # "tool_calls" where vLLM reports it instead of the engine's reason; None: the engine's.
    finish_reason_override: str | None


class ToolCalling:
    """Tool calling for one served model: its tool parser (if any) and tokenizer."""

    def __init__(self, parser_name: str | None, tokenizer: Any) -> None:
        """`parser_name`: a vLLM tool parser name (`api.tool_call_parser`); None: no parser,
        so only requests without tools, or with tool_choice "none", are served (as vLLM)."""
        self.parser_name = parser_name
        self._tokenizer = tokenizer
        self._parser_cls = _load_parser(parser_name, tokenizer) if parser_name else None

    def plan(self, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
             parallel_tool_calls: bool | None = True) -> ToolPlan | None:
        """How to serve a request's `tools` / `tool_choice` (as the client sent them, JSON).

        None when there is nothing to do (no tools, tool_choice absent or "none"). Raises a 400
        `OpenAIError` for what vLLM refuses: an empty tools list, tool_choice without tools, a
        named tool not among the tools, an invalid tool_choice, and any tool_choice but "none"
        without a parser. tool_choice None means absent: "auto" when tools are given (OpenAI's
        default, and vLLM's).
        """
        if tools is None and tool_choice in (None, "none"):
            return None
        request = _vllm_request(tools, tool_choice, parallel_tool_calls)
        self._check_parser_for(request.tool_choice)
        # vllm serve renders the tools for every tool_choice, "none" included (its
        # --exclude-tools-when-tool-choice-none is off by default). Dumped before
        # adjust_request, which may pop "$defs" out of the tools' parameters.
        template_tools = [tool.model_dump() for tool in request.tools]
        parser_cls = self._parser_cls
        if parser_cls is not None and (parser_cls.always_adjust_request
                                       or request.tool_choice != "none"):
            # online_renderer.preprocess_chat: the parser sets the structured-output
            # constraint of "required" / named choices and its detokenization needs.
            request = parser_cls(self._tokenizer, request.tools).adjust_request(request)
        return ToolPlan(
            template_tools=template_tools,
            structured_outputs=_structured_outputs_kwargs(request.structured_outputs),
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            _parsing=_Parsing(parser_cls, self._tokenizer, request),
        )

    def _check_parser_for(self, tool_choice: Any) -> None:
        # online_renderer.render_chat: without a tool parser only "none" is served.
        if self._parser_cls is not None or tool_choice in (None, "none"):
            return
        if tool_choice == "auto":
            raise bad_request(
                f'"auto" tool choice requires a tool-call parser: this server has none. Its '
                f"operator enables it with the setting {SETTING} (a vLLM tool parser name, as "
                "vllm serve --enable-auto-tool-choice --tool-call-parser NAME).", "tool_choice")
        desc = (f'"{tool_choice}"' if isinstance(tool_choice, str)
                else f'function "{tool_choice.function.name}"')
        raise bad_request(f"tool_choice={desc} requires a tool-call parser: this server has "
                          f"none (the setting {SETTING}).", "tool_choice")


@dataclass(frozen=True, slots=True)
class _Parsing:
    """What parsing an output needs: vLLM's parser class and its (adjusted) request."""

    parser_cls: Any  # type[vllm.parser.Parser] | None
    tokenizer: Any
    request: Any  # vllm ChatCompletionRequest: tools, tool_choice, parallel_tool_calls

    def new_parser(self) -> Any:
        return None if self.parser_cls is None else self.parser_cls(self.tokenizer,
                                                                    self.request.tools)

    @property
    def named(self) -> bool:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
        )
        return type(self.request.tool_choice) is ChatCompletionNamedToolChoiceParam

    @property
    def required(self) -> bool:
        return self.request.tool_choice == "required"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tool calling: what to render and constrain, and how to read the output."""

    # apply_chat_template(tools=...): the tools' definitions, OpenAI shape.
    template_tools: list[dict[str, Any]] | None
    # Keyword arguments of vLLM's StructuredOutputsParams the engine must generate under:
    # {"json": schema} ("required", or a named tool, for parsers that read plain JSON) or
    # {"structural_tag": JSON text} (parsers with a model format, e.g. hermes and llama3_json,
    # under vLLM's default VLLM_ENFORCE_STRICT_TOOL_CALLING); None: unconstrained. vLLM drops
    # the request's response_format when it sets one.
    structured_outputs: dict[str, Any] | None
    # Detokenize with these (some parsers need their special tokens in the text: hermes, ...).
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    _parsing: _Parsing = field(repr=False)

    @property
    def structured_json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, when the constraint is one."""
        schema = (self.structured_outputs or {}).get("json")
        return schema if isinstance(schema, dict) else None

    def complete(self, text: str, token_ids: Sequence[int], finish_reason: str | None,
                 prompt_token_ids: Sequence[int] | None = None) -> ToolResult:
        """The whole output -> the message's content and tool calls, and whether to report
        "tool_calls" as the finish reason (chat_completion_full_generator). `finish_reason`:
        the engine's ("stop", "length", ...); `prompt_token_ids`: vLLM hands them to the parser
        (only parsers with prompt-dependent state read them)."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        parsing = self._parsing
        request = parsing.request
        parser = parsing.new_parser()
        if parser is None:
            content, calls = text, []
        else:
            if prompt_token_ids is not None:
                parser.set_prompt_token_ids(prompt_token_ids)
            _, content, calls = parser.parse(text, request, enable_auto_tools=True,
                                             model_output_token_ids=list(token_ids))
        tool_calls = [ToolCall(id=call.id or make_tool_call_id(), function=call)
                      for call in calls or []]
        auto_tools_called = False
        if parsing.named or parsing.required:
            content = content or ""
        elif parser is None or request.tool_choice == "none":
            tool_calls = []
        else:  # "auto"
            auto_tools_called = bool(tool_calls)
        if request.parallel_tool_calls is False:
            tool_calls = tool_calls[:1]
        # In OpenAI's API a call made under "auto" or "required" ends with "tool_calls", one
        # forced by name with "stop".
        called = auto_tools_called or (parsing.required and finish_reason == "stop")
        return ToolResult(content, [call.model_dump() for call in tool_calls],
                          "tool_calls" if called else None)

    def streamer(self, prompt_token_ids: Sequence[int] = ()) -> ToolStream:
        """A stream's parser state; one per stream."""
        return ToolStream(self._parsing, prompt_token_ids)


class ToolStream:
    """Engine deltas -> chat deltas, as vLLM's chat_completion_stream_generator makes them."""

    def __init__(self, parsing: _Parsing, prompt_token_ids: Sequence[int] = ()) -> None:
        self._parsing = parsing
        self._parser = parsing.new_parser()
        # Without a reasoning parser vLLM only checks that it was given prompt ids (any) to
        # enter its tool-call phase.
        self._prompt_token_ids = list(prompt_token_ids)
        self._tools_streamed = False

    def feed(self, delta_text: str, delta_token_ids: Sequence[int], *,
             finished: bool = False) -> dict[str, Any] | None:
        """One engine delta -> the chat delta to send (`{"content": ...}` and/or
        `{"tool_calls": [{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}]}`), or
        None: send no chunk (the parser holds the text back).

        `finished=True` goes with the engine's last delta (the one that carries its finish
        reason): vLLM then appends arguments parsed but not yet streamed, and always sends a
        chunk (`{}` when there is nothing else), which carries the finish reason (`finish`).
        """
        if self._parser is None:
            message: Any = _delta_message(content=delta_text)
        else:
            message = self._parser.parse_delta(
                delta_text, list(delta_token_ids), self._parsing.request,
                self._prompt_token_ids, finished=finished)
            if message is not None and message.tool_calls:
                self._tools_streamed = True
        if message is None:
            if not finished:
                return None
            message = _delta_message()
        if self._parsing.request.parallel_tool_calls is False and message.tool_calls:
            message.tool_calls = [call for call in message.tool_calls if call.index == 0]
        return message.model_dump(exclude_unset=True)

    def finish(self, engine_finish_reason: str | None) -> str | None:
        """At the end: "tool_calls" to report instead of the engine's finish reason when calls
        were streamed under "auto" or "required" and the engine stopped by itself; None: the
        engine's."""
        if (self._tools_streamed and not self._parsing.named
                and engine_finish_reason == "stop"):
            return "tool_calls"
        return None


def _load_parser(name: str, tokenizer: Any) -> Any:
    from vllm.parser import ParserManager
    from vllm.tool_parsers import ToolParserManager

    names = ToolParserManager.list_registered()
    if name not in names:
        raise ValueError(f"{SETTING}: no vLLM tool parser is named {name!r}; the installed vLLM "
                         f"has: {', '.join(names)}")
    try:
        # What vllm serve --enable-auto-tool-choice --tool-call-parser NAME builds; it also
        # checks the parser against the tokenizer (tokens its format needs).
        return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True,
                                        tokenizer=tokenizer)
    except Exception as e:
        reason = e.__cause__ or e
        raise ValueError(f"{SETTING}={name!r} cannot be used with this model's tokenizer: "
                         f"{reason}") from e


def _vllm_request(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                  parallel_tool_calls: bool | None) -> Any:
    """vLLM's ChatCompletionRequest for the tool fields: its validators are vLLM's checks, and
    its parsers read the request."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    data: dict[str, Any] = {"messages": [{"role": "user", "content": ""}], "tools": tools,
                            "parallel_tool_calls": parallel_tool_calls}
    if tool_choice is not None:  # absent: vLLM makes it "auto" when there are tools
        data["tool_choice"] = tool_choice
    try:
        return ChatCompletionRequest.model_validate(data)
    except VLLMValidationError as e:  # vLLM's check_tool_usage: its message, as vllm serve
        raise bad_request(e.args[0], e.parameter) from e
    except ValidationError as e:
        raise _validation_error(e) from e
    except (KeyError, TypeError) as e:  # vLLM's validator reads tool["function"]["name"]
        raise bad_request("Each tool must be {\"type\": \"function\", \"function\": {\"name\": "
                          f"...}}: {e!r}", "tools") from e


def _validation_error(error: Any) -> OpenAIError:
    from vllm.exceptions import VLLMValidationError

    errors = error.errors()
    for item in errors:
        cause = item.get("ctx", {}).get("error")
        if isinstance(cause, VLLMValidationError):
            return bad_request(cause.args[0], cause.parameter)
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    return bad_request(f"{where}: {first.get('msg')}", where.split(".")[0] or None)


def _structured_outputs_kwargs(params: Any) -> dict[str, Any] | None:
    if params is None:
        return None
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
            if f.init and getattr(params, f.name) != f.default}


def _delta_message(**fields: Any) -> Any:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage

    return DeltaMessage(**fields)
