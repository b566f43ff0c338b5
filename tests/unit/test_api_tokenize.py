"""POST /tokenize and /detokenize (vLLM's shapes) over the mock engine: round trips, the chat form
as the chat endpoint renders it, the 400s and 404s, and the API key."""

import json

import pytest
from fastapi.testclient import TestClient

from pdserve.api.app import build_app
from pdserve.api.guard import AccessPolicy
from pdserve.api.protocol import ChatCompletionRequest
from pdserve.api.serving import OpenAIServing
from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.testing import InProcessBackend, tiny_tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny"
CONTEXT = 4096
KEY = "sk-tokenize"


@pytest.fixture
def serve():
    """Start an app over one mock engine: `serve(tokenizer, **app_options) -> (client, backend)`."""
    started = []

    def start(tokenizer=None, **app_options):
        settings = MockEngineConfig(max_model_len=CONTEXT, prefill_tokens_per_s=1e6,
                                    decode_step_s=0.0, decode_step_per_seq_s=0.0)
        backend = InProcessBackend([MockEngine("e0", "colocated", MODEL, settings)])
        app = build_app(backend, tokenizer or tiny_tokenizer(), MODEL, **app_options)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        client.portal.call(backend.start)
        started.append((backend, client))
        return client, backend

    yield start
    for backend, client in started:
        client.portal.call(backend.shutdown)
        client.__exit__(None, None, None)


@pytest.fixture
def client(serve):
    return serve()[0]


@pytest.fixture(scope="module")
def smollm_tokenizer(embedded_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_checkpoint)


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in error["message"] and "pdserve/" not in error["message"]
    return error


def test_tokenize_then_detokenize_round_trips(client):
    tok = tiny_tokenizer()
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "say hello world",
                                       "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": 3, "max_model_len": CONTEXT, "tokens": tok.encode("say hello world"),
                    "token_strs": ["say", "hello", "world"]}
    back = client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": "say hello world"}


def test_model_may_be_left_out_and_token_strs_default_to_null(client):
    body = client.post("/tokenize", json={"prompt": "hello"}).json()
    assert body["count"] == 1 and body["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "hello"}


def test_count_matches_what_completions_counts_as_prompt_tokens(client):
    count = client.post("/tokenize", json={"prompt": "w1 w2 w3 w4 w5"}).json()["count"]
    usage = client.post("/v1/completions", json={"model": MODEL, "prompt": "w1 w2 w3 w4 w5",
                                                 "max_tokens": 1}).json()["usage"]
    assert count == usage["prompt_tokens"] == 5


def test_add_special_tokens_adds_the_bos(smollm_tokenizer, serve):
    client, _ = serve(smollm_tokenizer)
    plain = client.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert plain == smollm_tokenizer.encode("Hello there", add_special_tokens=True)
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    without = client.post("/tokenize", json=chat).json()["tokens"]
    with_special = client.post("/tokenize", json={**chat, "add_special_tokens": True}).json()["tokens"]
    expected = smollm_tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True,
                                                    tokenize=False)
    assert with_special == smollm_tokenizer.encode(expected, add_special_tokens=True)
    assert without == smollm_tokenizer.encode(expected, add_special_tokens=False)


def test_chat_form_tokenizes_as_the_chat_endpoint(smollm_tokenizer, serve):
    client, backend = serve(smollm_tokenizer)
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "What is "},
                                             {"type": "text", "text": "2 + 2?"}]}]
    body = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    serving = OpenAIServing(backend, smollm_tokenizer, MODEL)
    prepared = client.portal.call(serving.prepare_chat,
                                  ChatCompletionRequest(model=MODEL, messages=messages))
    assert body["tokens"] == list(prepared.choices[0].request.prompt_token_ids)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT
    usage = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                      "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_continue_final_message_leaves_the_last_message_open(smollm_tokenizer, serve):
    client, _ = serve(smollm_tokenizer)
    messages = [{"role": "user", "content": "Count to three."},
                {"role": "assistant", "content": "One, two,"}]
    r = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                       "continue_final_message": True})
    assert r.status_code == 200, r.text
    prompt = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert prompt.endswith("One, two,")
    both = client.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert_openai_error(both, 400)


def test_wrong_model_is_the_404_of_the_other_endpoints(client):
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [5]})):
        r = client.post(path, json={**body, "model": "gpt-4"})
        error = assert_openai_error(r, 404, "model")
        assert error["code"] == "model_not_found"
        completion = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hello"})
        assert r.json() == completion.json()


@pytest.mark.parametrize("tokens, param", [
    ([0, 10**6], "tokens"),      # past the vocabulary
    ([526], "tokens"),           # the tiny vocabulary is 0..525
    ([-1], "tokens"),
    ([2**70], "tokens"),         # no C long holds it
    (["5"], "tokens.0"),
    ([5.0], "tokens.0"),
    ([True], "tokens.0"),
    ([], "tokens"),
    ("hello", "tokens"),
])
def test_detokenize_refuses_what_is_not_a_token_id(client, tokens, param):
    assert_openai_error(client.post("/detokenize", json={"tokens": tokens}), 400, param)


@pytest.mark.parametrize("body", [
    {},                                                             # neither form
    {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},  # both
    {"messages": []},
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"prompt": 7},
    {"prompt": "hello \ud800"},                                     # a lone surrogate
    {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
])
def test_tokenize_refuses_bad_bodies_with_400(client, body):
    # json.dumps writes the lone surrogate as the escape "\ud800", as a client's JSON would.
    r = client.post("/tokenize", content=json.dumps(body),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_chat_the_template_refuses_is_a_400(serve):
    refusing = tiny_tokenizer()
    refusing.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    client, _ = serve(refusing)
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    error = assert_openai_error(r, 400, "messages")
    assert "Conversation roles must alternate" in error["message"]


def test_api_keys_guard_the_tokenizer_routes(serve):
    client, _ = serve(access=AccessPolicy(api_keys=(KEY,)))
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [5]})):
        refused = client.post(path, json=body)
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
        wrong = client.post(path, json=body, headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        ok = client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
    assert client.get("/health").status_code == 200  # still open, as before


def test_tools_reach_the_template_as_on_the_chat_endpoint(serve):
    # A template that writes the tools out: /tokenize must render them as the chat endpoint
    # does (vLLM's dump of each tool, unset fields included), not as the client spelled them.
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    client, _ = serve(tokenizer)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hello world"}]
    body = client.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    plain = client.post("/tokenize", json={"messages": messages}).json()
    usage = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "tools": tools, "tool_choice": "none",
        "max_tokens": 1}).json()["usage"]
    assert body["count"] == usage["prompt_tokens"] > plain["count"]
    bad = client.post("/tokenize", json={"messages": messages, "tools": [{"type": "function"}]})
    assert bad.status_code == 400, bad.text
