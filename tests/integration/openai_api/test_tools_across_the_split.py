"""Tool calls through the official openai client, colocated and disaggregated alike, on real CPU
vLLM engines with the `hermes` tool-call parser (conftest.py). A named `tool_choice` and
`"required"` force the calls with a grammar (vLLM's structured outputs) that the decode engine
continues after token 1; the parser turns the text into `tool_calls`. `"auto"` leaves the choice
to the model (SmolLM2's template ignores tools, so it answers in text), parsed the same way.
Without a parser configured a request with tools is refused (tests/unit/test_api.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.integration.openai_api.conftest import MODEL, client_of

pytestmark = pytest.mark.integration

# strict: vLLM holds the arguments to the schema (otherwise to any JSON value).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
MESSAGES = [{"role": "system", "content": "You call tools to answer."},
            {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                if call.function and call.function.arguments:
                    arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


def test_a_named_tool_is_called_alike_streamed_and_not(colocated, disaggregated):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120,
                  temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    a = client_of(colocated).chat.completions.create(**kwargs)
    b = client_of(disaggregated).chat.completions.create(**kwargs)
    assert calls(a.choices[0].message) == calls(b.choices[0].message)
    [(name, arguments)] = calls(b.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert b.choices[0].message.tool_calls[0].id
    streamed, _ = streamed_calls(client_of(disaggregated).chat.completions.create(**kwargs,
                                                                                  stream=True))
    assert streamed == calls(a.choices[0].message)


def test_required_tool_choice_calls_a_tool_alike(colocated, disaggregated):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120,
                  temperature=0, tool_choice="required")
    a = client_of(colocated).chat.completions.create(**kwargs)
    b = client_of(disaggregated).chat.completions.create(**kwargs)
    assert calls(a.choices[0].message) == calls(b.choices[0].message)
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    got = calls(b.choices[0].message)
    assert got and all(name in ("get_weather", "get_time") for name, _ in got)
    for name, arguments in got:
        tool = WEATHER if name == "get_weather" else TIME
        jsonschema.validate(arguments, tool["function"]["parameters"])
    if b.choices[0].finish_reason != "length":
        assert b.choices[0].finish_reason == "tool_calls"
    streamed, finish = streamed_calls(client_of(disaggregated).chat.completions.create(
        **kwargs, stream=True))
    assert streamed == got and finish == b.choices[0].finish_reason


def test_auto_tool_choice_answers_alike(colocated, disaggregated):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=16, temperature=0)
    a = client_of(colocated).chat.completions.create(**kwargs)
    b = client_of(disaggregated).chat.completions.create(**kwargs)
    assert (a.choices[0].message.content, calls(a.choices[0].message)) == \
        (b.choices[0].message.content, calls(b.choices[0].message))


def test_a_tool_result_turn_is_accepted(disaggregated):
    messages = [*MESSAGES,
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call-1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature": 21}'}]
    r = client_of(disaggregated).chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0)
    assert r.choices[0].message.content
