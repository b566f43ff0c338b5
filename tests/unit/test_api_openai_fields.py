"""The OpenAI fields added over the mock engine: the response shapes of n, batched prompts,
logprobs, echo and prompt logprobs, streamed and not, and the log line for unknown fields.
Equality with vLLM across the prefill/decode split is tested on real engines
(tests/integration/openai_api)."""

import json
import logging

import pytest

from pdserve.testing import tiny_tokenizer

from tests.unit.test_api import MODEL, client, sse_events  # noqa: F401 - client: the fixture

pytestmark = pytest.mark.unit

CHAT = [{"role": "user", "content": "hello world"}]


def post(client, path, **body):
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_choices_and_a_batch_of_prompts_in_vllm_order(client):
    body = post(client, "/v1/completions", prompt=["hello world", "hello"], n=2, max_tokens=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    # The mock engine is deterministic: the samples of a prompt agree, the prompts differ.
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    # Each prompt counted once, every sample's tokens counted.
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}


def test_completion_logprobs_have_vllm_shape(client):
    body = post(client, "/v1/completions", prompt="hello world", max_tokens=3, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob  # the chosen token first, then 2 alternatives
        assert len(top) == 3
    assert lp["text_offset"] == [0, len(lp["tokens"][0]), len(lp["tokens"][0] + lp["tokens"][1])]


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    ids = tiny_tokenizer().encode("hello world")
    body = post(client, "/v1/completions", prompt="hello world", max_tokens=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == "hello world"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0


def test_echo_with_generation_prepends_the_prompt(client):
    plain = post(client, "/v1/completions", prompt="hello world", max_tokens=2)
    echoed = post(client, "/v1/completions", prompt="hello world", max_tokens=2, echo=True,
                  logprobs=0)
    assert echoed["choices"][0]["text"] == "hello world" + plain["choices"][0]["text"]
    lp = echoed["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 + 2 and lp["token_logprobs"][0] is None


def test_chat_logprobs_and_top_logprobs(client):
    body = post(client, "/v1/chat/completions", messages=CHAT, max_tokens=3, logprobs=True,
                top_logprobs=2)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
    for c in content:
        assert len(c["top_logprobs"]) == 2
        assert c["bytes"] == list(c["token"].encode())


def test_prompt_logprobs_extension(client):
    ids = tiny_tokenizer().encode("hello world")
    body = post(client, "/v1/completions", prompt="hello world", max_tokens=1, prompt_logprobs=1)
    choice = body["choices"][0]
    assert choice["stop_reason"] is None and choice["finish_reason"] == "length"
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for token_id, position in zip(ids[1:], prompt[1:]):
        assert str(token_id) in position and len(position) == 2  # the token and 1 other
        assert set(position[str(token_id)]) == {"logprob", "rank", "decoded_token"}
    chat = post(client, "/v1/chat/completions", messages=CHAT, max_tokens=1, prompt_logprobs=0)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_streamed_n_chat_sends_each_choice_and_one_usage(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "n": 2, "stream": True,
        "logprobs": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 6
    by_index = {0: [], 1: []}
    for c in chunks:
        for choice in c["choices"]:
            by_index[choice["index"]].append(choice)
    for index, choices in by_index.items():
        assert choices[0]["delta"]["role"] == "assistant"
        assert choices[-1]["finish_reason"] == "length"
        tokens = [lp for ch in choices[1:] if ch["logprobs"] for lp in ch["logprobs"]["content"]]
        assert len(tokens) == 3


def test_streamed_echo_starts_with_the_prompt(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 2,
                                             "echo": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith("hello world")


def test_unknown_fields_are_named_in_the_log(client, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.api.serving"):
        post(client, "/v1/completions", prompt="hello", max_tokens=1, frobnicate=1, store=True)
    assert "['frobnicate', 'store']" in caplog.text


def test_sampling_extensions_are_accepted(client):
    # The mock engine ignores them: this checks only that they are accepted and validated; what
    # they do on real engines, colocated and disaggregated, is tests/integration/openai_api's.
    body = post(client, "/v1/completions", prompt="hello", max_tokens=2, top_k=5, min_p=0.1,
                repetition_penalty=1.2, min_tokens=1, logit_bias={"3": 5}, stop_token_ids=[2],
                include_stop_str_in_output=True, skip_special_tokens=False,
                spaces_between_special_tokens=False, truncate_prompt_tokens=1, seed=3,
                return_token_ids=True)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 2 and len(choice["prompt_token_ids"]) == 1
