"""Every OpenAI field pdserve supports gives the same answer colocated and disaggregated, on real
CPU vLLM engines: the same request goes to both services of this package (conftest.py) and the
responses are compared. A prompt longer than 8 tokens takes the remote path (prefill engine,
KV pulled by the decode engine: token 1 sampled on one engine, the rest on the other), which
each test checks (`x-pdserve-path`), so it cannot pass by a silent fallback to one engine. A
shorter one may be prefilled on the decode engine (the local-prefill path, the same `FULL` leg
a recompute runs) when the router predicts that no slower than the prefill engine, which it
usually does while the engines are idle; either way its answer must agree.

Greedy requests (temperature 0) must agree token for token and their logprobs within 1e-4; a
seeded sampled request replays token 1 on the decode engine and must agree too.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.integration.openai_api.conftest import MODEL, client_of

pytestmark = pytest.mark.integration

LONG = ("The history of the city begins with a small fishing village on the river, where traders "
        "from the north and the south met every spring to")
SHORT = "The capital of France is"  # 5 tokens: prefilled on the decode engine
TOLERANCE = 1e-4


def post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r


def both(colocated, disaggregated, path: str, body: dict, remote: bool | None = None):
    """The two services' response bodies; `remote=True` checks that the prefill engine served
    the disaggregated one and its decode engine pulled the KV."""
    a = post(colocated, path, body)
    b = post(disaggregated, path, body)
    if remote:
        assert (b.headers["x-pdserve-path"], b.headers["x-pdserve-kv"]) in \
            (("remote", "pulled"), ("remote", "not_needed")), dict(b.headers)
    return a.json(), b.json()


def assert_close_completion_logprobs(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["text_offset"] == b["text_offset"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert abs(x - y) <= TOLERANCE, (x, y)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys()
            assert all(abs(x[k] - y[k]) <= TOLERANCE for k in x)


def assert_close_chat_logprobs(a: dict, b: dict) -> None:
    assert [t["token"] for t in a["content"]] == [t["token"] for t in b["content"]]
    for x, y in zip(a["content"], b["content"], strict=True):
        assert abs(x["logprob"] - y["logprob"]) <= TOLERANCE
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        for p, q in zip(x["top_logprobs"], y["top_logprobs"], strict=True):
            assert abs(p["logprob"] - q["logprob"]) <= TOLERANCE


@pytest.mark.parametrize("prompt, remote", [(LONG, True), (SHORT, None)], ids=["long", "short"])
def test_completion_logprobs_agree(colocated, disaggregated, prompt, remote):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    a, b = both(colocated, disaggregated, "/v1/completions", body, remote)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert len(a["choices"][0]["logprobs"]["tokens"]) == 8
    assert_close_completion_logprobs(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"])


def test_chat_logprobs_agree_streamed_and_not(colocated, disaggregated):
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                  top_logprobs=2)
    a = client_of(colocated).chat.completions.create(**kwargs)
    b = client_of(disaggregated).chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert_close_chat_logprobs(a.choices[0].logprobs.model_dump(), b.choices[0].logprobs.model_dump())
    streamed = client_of(disaggregated).chat.completions.create(**kwargs, stream=True)
    content = [t for chunk in streamed for c in chunk.choices if c.logprobs
               for t in c.logprobs.model_dump()["content"]]
    assert_close_chat_logprobs(a.choices[0].logprobs.model_dump(), {"content": content})


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_alike(colocated, disaggregated, max_tokens):
    # What lm-evaluation-harness sends for loglikelihood: echo, logprobs, max_tokens 0 or 1.
    body = {"prompt": LONG, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 1}
    a, b = both(colocated, disaggregated, "/v1/completions", body, remote=True)
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["text"].startswith(LONG)
    assert la["token_logprobs"][0] is None
    assert len(la["tokens"]) == a["usage"]["prompt_tokens"] + max_tokens
    assert_close_completion_logprobs(la, lb)


def test_prompt_logprobs_extension_agrees(colocated, disaggregated):
    body = {"prompt": LONG, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2}
    a, b = both(colocated, disaggregated, "/v1/completions", body, remote=True)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    pa, pb = a["choices"][0]["prompt_logprobs"], b["choices"][0]["prompt_logprobs"]
    assert len(pa) == a["usage"]["prompt_tokens"] and pa[0] is None and pb[0] is None
    for x, y in zip(pa[1:], pb[1:], strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[k]["logprob"] - y[k]["logprob"]) <= TOLERANCE for k in x)


@pytest.mark.parametrize("prompt, remote", [(LONG, True), (SHORT, None)], ids=["long", "short"])
def test_seeded_n_samples_agree_and_repeat(colocated, disaggregated, prompt, remote):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 1234, "n": 3}
    a, b = both(colocated, disaggregated, "/v1/completions", body, remote)
    texts = [c["text"] for c in a["choices"]]
    assert [c["text"] for c in b["choices"]] == texts
    assert len(set(texts)) > 1  # seed + i per sample: different samples
    _, again = both(colocated, disaggregated, "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == texts
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "population": {"type": "integer", "maximum": 10**9}},
          "required": ["city", "population"], "additionalProperties": False}


def test_json_schema_response_format_is_valid_and_agrees(colocated, disaggregated):
    kwargs = dict(model=MODEL, max_tokens=60, temperature=0,
                  messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "city", "schema": SCHEMA, "strict": True}})
    a = client_of(colocated).chat.completions.create(**kwargs)
    b = client_of(disaggregated).chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert b.choices[0].finish_reason == "stop", b.choices[0].message.content
    jsonschema.validate(json.loads(b.choices[0].message.content), SCHEMA)
    streamed = client_of(disaggregated).chat.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == a.choices[0].message.content


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"structured_outputs": {"regex": "[A-Z][a-z]+, [A-Z][a-z]+"}},
    {"guided_regex": "(red|green|blue)( and (red|green|blue))*"},
], ids=["json_object", "choice", "regex", "guided_regex"])
def test_structured_outputs_agree(colocated, disaggregated, constraint):
    body = {"prompt": LONG, "max_tokens": 12, "temperature": 0, **constraint}
    a, b = both(colocated, disaggregated, "/v1/completions", body, remote=True)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    if "json_object" in json.dumps(constraint) and a["choices"][0]["finish_reason"] == "stop":
        json.loads(a["choices"][0]["text"])


def test_a_grammar_the_engine_refuses_is_a_400(disaggregated):
    for stream in (False, True):
        r = httpx.post(f"{disaggregated.base_url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": LONG, "max_tokens": 4, "stream": stream,
            "structured_outputs": {"grammar": "this is not a grammar ::= ("}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    # The service still serves.
    post(disaggregated, "/v1/completions", {"prompt": SHORT, "max_tokens": 2})


EXTENSIONS = [
    {"top_k": 5, "temperature": 0.8, "seed": 7},
    {"min_p": 0.2, "temperature": 0.8, "seed": 7},
    {"top_p": 0.5, "temperature": 0.8, "seed": 11},
    {"repetition_penalty": 1.3, "temperature": 0},
    {"repetition_penalty": 1.3, "presence_penalty": 1.0, "frequency_penalty": 0.5, "temperature": 0},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0, "temperature": 0},
    {"min_tokens": 6, "temperature": 0, "stop": ["."]},
    {"logit_bias": {"3735": -100, "6560": 5.0}, "temperature": 0},
    {"bad_words": [" trade", " the north"], "temperature": 0},
    {"allowed_token_ids": list(range(200, 4000)), "temperature": 0},
    # LONG's greedy text begins " trade." (token 1 " trade", token 2 "."): "de." begins in token 1
    # and ends in token 2, across the prefill/decode join.
    {"stop": ["de."], "include_stop_str_in_output": True, "temperature": 0},
    {"stop": ["de.", " The"], "temperature": 0},
    {"stop_token_ids": [30], "temperature": 0},  # "."
    {"skip_special_tokens": False, "spaces_between_special_tokens": False, "temperature": 0},
]


@pytest.mark.parametrize("extension", EXTENSIONS, ids=[",".join(e) for e in EXTENSIONS])
@pytest.mark.parametrize("prompt, remote", [(LONG, True), (SHORT, None)], ids=["long", "short"])
def test_sampling_extensions_agree(colocated, disaggregated, extension, prompt, remote):
    body = {"prompt": prompt, "max_tokens": 10, "logprobs": 1, **extension}
    a, b = both(colocated, disaggregated, "/v1/completions", body, remote)
    ca, cb = a["choices"][0], b["choices"][0]
    assert (cb["text"], cb["finish_reason"], cb["stop_reason"]) == \
        (ca["text"], ca["finish_reason"], ca["stop_reason"])
    assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]


def test_the_extensions_do_something(colocated):
    """Each extension above changes the greedy output or its end against the same request
    without it, so the agreement is not that of two services ignoring it."""
    def run(extra: dict) -> dict:
        return post(colocated, "/v1/completions", {"prompt": LONG, "max_tokens": 10,
                                                    "temperature": 0, **extra}).json()["choices"][0]

    for extension, without in (
            ({"repetition_penalty": 1.3}, {}),
            ({"logit_bias": {"3735": -100, "6560": 5.0}}, {}),
            ({"bad_words": [" trade", " the north"]}, {}),
            ({"stop_token_ids": [30]}, {}),
            ({"stop": ["de."], "include_stop_str_in_output": True}, {"stop": ["de."]}),
            ({"stop": ["."], "min_tokens": 6}, {"stop": ["."]})):
        got, base = run({**without, **extension}), run(without)
        assert (got["text"], got["finish_reason"]) != (base["text"], base["finish_reason"]), \
            extension
