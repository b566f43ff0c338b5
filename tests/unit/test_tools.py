"""Tool calling (pdserve/api/tools.py) with vLLM's real parsers and the embedded model's tokenizer.

What a client of /v1/chat/completions sees: which tools / tool_choice requests are refused and
how, what the engine is told to generate under, and the tool calls read out of an output, whole
or streamed token by token (the same calls either way).
"""

from __future__ import annotations

import json

import pytest

from pdserve.api.errors import OpenAIError
from pdserve.api.tools import SETTING, ToolCalling
from pdserve.config.schema import ApiConfig

pytestmark = pytest.mark.unit

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
# As vLLM dumps them for the template: a field the client left out is there as None.
TEMPLATE_TOOLS = [TOOLS[0], {"type": "function", "function": {
    "name": "get_time", "description": None, "parameters": TIME_PARAMS}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REQUIRED_CALLS = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                  '{"name": "get_time", "parameters": {"tz": "UTC"}}]')


@pytest.fixture(scope="module")
def smollm2(embedded_checkpoint):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("vllm")
    return transformers.AutoTokenizer.from_pretrained(embedded_checkpoint)


@pytest.fixture(scope="module")
def llama3_vocab(embedded_checkpoint):
    """SmolLM2's tokenizer plus Llama 3's <|python_tag|> token, which vLLM's llama3_json parser
    requires of the vocabulary (SmolLM2 lacks it: see the refusal test)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_checkpoint)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    return tokenizer


@pytest.fixture(scope="module")
def llama3_json(llama3_vocab):
    return ToolCalling("llama3_json", llama3_vocab)


@pytest.fixture(scope="module")
def pythonic(smollm2):
    # A parser whose forced ("required" / named) calls are plain JSON under a JSON schema.
    return ToolCalling("pythonic", smollm2)


def _refusal(tools_calling, tools, tool_choice, parallel=True) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        tools_calling.plan(tools, tool_choice, parallel)
    assert caught.value.status == 400
    return caught.value


# --- startup


def test_the_setting_defaults_to_no_parser():
    assert ApiConfig().tool_call_parser is None
    assert ApiConfig(tool_call_parser="hermes").tool_call_parser == "hermes"


def test_an_unknown_parser_name_is_refused_at_startup_with_the_valid_names(smollm2):
    with pytest.raises(ValueError) as caught:
        ToolCalling("llama3-json", smollm2)
    assert SETTING in str(caught.value)
    assert "llama3_json" in str(caught.value) and "hermes" in str(caught.value)


def test_a_parser_the_vocabulary_cannot_serve_is_refused_at_startup(smollm2):
    # As vllm serve refuses it: SmolLM2 has no <|python_tag|> token.
    with pytest.raises(ValueError, match=r"<\|python_tag\|>"):
        ToolCalling("llama3_json", smollm2)


# --- plan(): what is refused


def test_a_request_without_tools_needs_no_plan(smollm2):
    tools_calling = ToolCalling(None, smollm2)
    assert tools_calling.plan(None, None) is None
    assert tools_calling.plan(None, "none") is None


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_without_a_parser_is_a_400_that_names_the_setting(smollm2, tool_choice):
    error = _refusal(ToolCalling(None, smollm2), TOOLS, tool_choice)
    assert '"auto" tool choice requires' in error.message
    assert SETTING in error.message
    assert error.param == "tool_choice"


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_calls_without_a_parser_are_refused_too(smollm2, tool_choice):
    # vLLM 0.32 reads forced calls through the tool parser as well.
    error = _refusal(ToolCalling(None, smollm2), TOOLS, tool_choice)
    assert SETTING in error.message


def test_tool_choice_none_is_served_without_a_parser(smollm2):
    plan = ToolCalling(None, smollm2).plan(TOOLS, "none")
    assert plan.template_tools == TEMPLATE_TOOLS  # vllm serve renders them even for "none"
    assert plan.structured_outputs is None
    result = plan.complete(LLAMA_CALL, [], "stop")
    assert (result.content, result.tool_calls, result.finish_reason_override) == \
        (LLAMA_CALL, [], None)


@pytest.mark.parametrize(("tools", "tool_choice", "message", "param"), [
    (None, "auto", "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    (None, NAMED, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    ([], None, "`tools` must not be an empty array. Either provide at least one tool or omit "
     "the field entirely.", "tools"),
    (TOOLS, {"type": "function", "function": {"name": "get_stock"}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`",
     "tool_choice"),
    (TOOLS, "sometimes", 'Invalid value for `tool_choice`: sometimes! Only named tools, "none", '
     '"auto" or "required" are supported.', "tool_choice"),
])
def test_invalid_tool_requests_get_vllms_messages(llama3_json, tools, tool_choice, message,
                                                  param):
    error = _refusal(llama3_json, tools, tool_choice)
    assert (error.message, error.param) == (message, param)


def test_a_tool_without_a_function_is_a_400(llama3_json):
    error = _refusal(llama3_json, [{"type": "function"}], NAMED)
    assert error.param == "tools"


# --- plan(): what the template and the engine get


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", NAMED, "none"])
def test_the_template_gets_the_tool_definitions(llama3_json, tool_choice):
    plan = llama3_json.plan(TOOLS, tool_choice)
    assert plan.template_tools == TEMPLATE_TOOLS


def test_auto_is_not_constrained(llama3_json, pythonic):
    assert llama3_json.plan(TOOLS, "auto").structured_outputs is None
    assert pythonic.plan(TOOLS, None).structured_json_schema is None


def test_a_named_tool_is_forced_with_its_parameters_as_the_schema(pythonic):
    plan = pythonic.plan(TOOLS, NAMED)
    assert plan.structured_outputs == {"json": WEATHER_PARAMS}
    assert plan.structured_json_schema == WEATHER_PARAMS


@pytest.mark.parametrize("parallel", [True, None, False])
def test_required_is_forced_with_an_array_of_calls_schema(pythonic, parallel):
    schema = pythonic.plan(TOOLS, "required", parallel).structured_json_schema
    expected = {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
             "required": ["name", "parameters"]}
            for name, params in (("get_weather", WEATHER_PARAMS), ("get_time", TIME_PARAMS))]},
    }
    if parallel is False:  # only an explicit false limits the calls
        expected["maxItems"] = 1
    assert schema == expected


def test_a_model_format_parser_forces_calls_with_a_structural_tag(llama3_json):
    # vLLM's default (VLLM_ENFORCE_STRICT_TOOL_CALLING): llama3_json's own call format.
    plan = llama3_json.plan(TOOLS, NAMED)
    assert plan.structured_json_schema is None
    tag = json.loads(plan.structured_outputs["structural_tag"])
    assert tag["format"]["begin"] == '{"name": "get_weather", "parameters": '


def test_hermes_keeps_special_tokens_in_the_text(smollm2):
    hermes = ToolCalling("hermes", smollm2)
    assert hermes.plan(TOOLS, "auto").skip_special_tokens is False
    assert hermes.plan(TOOLS, "none").skip_special_tokens is True


# --- complete()


def _call(result, index=0) -> tuple[str, str]:
    call = result.tool_calls[index]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return call["function"]["name"], call["function"]["arguments"]


def test_auto_reads_a_call_and_reports_tool_calls(llama3_json, llama3_vocab):
    result = llama3_json.plan(TOOLS, None).complete(LLAMA_CALL, llama3_vocab.encode(LLAMA_CALL),
                                                    "stop")
    assert len(result.tool_calls) == 1
    assert _call(result) == ("get_weather", '{"city": "Paris"}')
    assert result.content is None
    assert result.finish_reason_override == "tool_calls"


def test_auto_leaves_plain_text_as_content(llama3_json, llama3_vocab):
    text = "The weather in Paris is sunny."
    result = llama3_json.plan(TOOLS, "auto").complete(text, llama3_vocab.encode(text), "stop")
    assert (result.content, result.tool_calls, result.finish_reason_override) == (text, [], None)


def test_hermes_reads_its_tagged_call(smollm2):
    result = ToolCalling("hermes", smollm2).plan(TOOLS, "auto").complete(
        HERMES_CALL, smollm2.encode(HERMES_CALL), "stop")
    assert _call(result) == ("get_weather", '{"city": "Paris"}')


def test_a_named_tool_turns_the_forced_json_into_its_call(pythonic, smollm2):
    forced = '{"city": "Paris"}'
    result = pythonic.plan(TOOLS, NAMED).complete(forced, smollm2.encode(forced), "stop")
    assert _call(result) == ("get_weather", forced)
    # OpenAI: a call forced by name finishes with "stop"; vLLM sends content "".
    assert (result.content, result.finish_reason_override) == ("", None)


def test_a_named_tool_with_a_model_format_parser(llama3_json, llama3_vocab):
    result = llama3_json.plan(TOOLS, NAMED).complete(LLAMA_CALL, llama3_vocab.encode(LLAMA_CALL),
                                                     "stop")
    assert _call(result) == ("get_weather", '{"city": "Paris"}')
    assert result.finish_reason_override is None


def test_required_reads_every_call_of_the_array(pythonic, smollm2):
    ids = smollm2.encode(REQUIRED_CALLS)
    result = pythonic.plan(TOOLS, "required").complete(REQUIRED_CALLS, ids, "stop")
    assert [_call(result, i) for i in range(2)] == [("get_weather", '{"city": "Paris"}'),
                                                    ("get_time", '{"tz": "UTC"}')]
    assert result.finish_reason_override == "tool_calls"
    # Cut short by max_tokens: the engine's "length" stands.
    assert pythonic.plan(TOOLS, "required").complete(REQUIRED_CALLS, ids, "length") \
        .finish_reason_override is None


def test_parallel_tool_calls_false_keeps_the_first_call(pythonic, smollm2):
    result = pythonic.plan(TOOLS, "required", False).complete(
        REQUIRED_CALLS, smollm2.encode(REQUIRED_CALLS), "stop")
    assert [_call(result, 0)] == [("get_weather", '{"city": "Paris"}')]
    assert len(result.tool_calls) == 1


# --- streaming


def _stream(plan, text, tokenizer) -> tuple[list[dict], str | None]:
    """Feed `text` one token at a time, as the engine's deltas arrive."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = plan.streamer(prompt_token_ids=[1, 2, 3])
    deltas, sent = [], ""
    for i, token_id in enumerate(ids):
        piece = tokenizer.decode(ids[:i + 1])[len(sent):]
        sent += piece
        delta = stream.feed(piece, [token_id], finished=i == len(ids) - 1)
        if delta is not None:
            deltas.append(delta)
    assert sent == text
    return deltas, stream.finish("stop")


def _assembled(deltas) -> tuple[str, list[tuple[str, str]], list[str]]:
    content, calls, ids = "", {}, []
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            name, args = calls.get(call["index"], ("", ""))
            function = call.get("function") or {}
            calls[call["index"]] = (name + (function.get("name") or ""),
                                    args + (function.get("arguments") or ""))
            if call.get("id"):
                ids.append(call["id"])
    return content, [calls[i] for i in sorted(calls)], ids


@pytest.mark.parametrize(("parser", "tokenizer", "tool_choice", "text"), [
    ("llama3_json", "llama3_vocab", "auto", LLAMA_CALL),
    ("llama3_json", "llama3_vocab", NAMED, LLAMA_CALL),
    ("llama3_json", "llama3_vocab", "required", LLAMA_CALL),
    ("hermes", "smollm2", "auto", HERMES_CALL),
    ("pythonic", "smollm2", NAMED, '{"city": "Paris"}'),
    ("pythonic", "smollm2", "required", REQUIRED_CALLS),
    ("llama3_json", "llama3_vocab", "auto", "No tool is needed: it is sunny."),
])
def test_a_stream_sends_the_calls_of_the_whole_output(request, parser, tokenizer, tool_choice,
                                                      text):
    tokenizer = request.getfixturevalue(tokenizer)
    plan = ToolCalling(parser, tokenizer).plan(TOOLS, tool_choice)
    whole = plan.complete(text, tokenizer.encode(text), "stop")
    deltas, finish = _stream(plan, text, tokenizer)
    content, calls, ids = _assembled(deltas)
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in whole.tool_calls]
    assert len(ids) == len(calls) and all(i.startswith("chatcmpl-tool-") for i in ids)
    assert finish == whole.finish_reason_override
    assert content == (whole.content or "")


def test_a_stream_under_none_is_content_only(llama3_json, llama3_vocab):
    plan = llama3_json.plan(TOOLS, "none")
    deltas, finish = _stream(plan, LLAMA_CALL, llama3_vocab)
    assert _assembled(deltas) == (LLAMA_CALL, [], [])
    assert finish is None


def test_the_last_delta_always_makes_a_chunk(llama3_json, llama3_vocab):
    # The chunk that carries the finish reason, even when the parser holds everything back.
    stream = llama3_json.plan(TOOLS, "auto").streamer()
    assert stream.feed('{"name', llama3_vocab.encode('{"name'), finished=False) is None
    assert stream.feed("", [], finished=True) is not None
