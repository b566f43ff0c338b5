"""SSE decoding, stream timelines and request bodies of the streaming client (no network)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.client import EndpointConfig, SSEDecoder, StreamRecorder, iter_events, request_body
from pdserve.bench.workloads import BenchRequest

pytestmark = pytest.mark.unit


def _completion(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def _chat(delta: dict) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": delta}]})


def test_decoder_reassembles_events_split_anywhere() -> None:
    body = (
        ": keep-alive comment\n\n"
        'data: {"a": "é"}\r\n\r\n'
        "event: message\ndata: line one\ndata: line two\n\n"
        "data: [DONE]\n\n"
    ).encode()
    for size in (1, 2, 3, 7, len(body)):  # 1-byte pieces also split the 2-byte UTF-8 "é"
        assert list(iter_events(body, chunk_size=size)) == ['{"a": "é"}', "line one\nline two", "[DONE]"]


def test_decoder_flushes_an_unterminated_last_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"x": 1}\n\ndata: tail') == ['{"x": 1}']
    assert decoder.flush() == ["tail"]
    assert decoder.flush() == []


def test_decoder_accepts_data_without_space_after_colon() -> None:
    assert list(iter_events(b"data:{}\n\n")) == ["{}"]


def test_completion_stream_timeline() -> None:
    recorder = StreamRecorder(prompt_len=7, start_s=10.0, is_chat=False)
    for now, text in ((10.25, "a"), (10.30, "b"), (10.40, "")):  # empty text: a special token, still a token
        recorder.on_event(_completion(text), now)
    recorder.on_event(
        json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}}), 10.5
    )
    recorder.on_event("[DONE]", 10.6)
    outcome = recorder.finish(queued_s=0.2)
    assert outcome.success and outcome.error == ""
    assert outcome.ttft_s == pytest.approx(0.25)
    assert outcome.itls_s == pytest.approx((0.05, 0.10))
    assert outcome.e2el_s == pytest.approx(0.40)  # ends at the last token, not at the usage chunk
    assert (outcome.output_tokens, outcome.prompt_tokens, outcome.chunk_count) == (3, 8, 3)
    assert outcome.generated_text == "ab"
    assert (outcome.prompt_len, outcome.start_s, outcome.queued_s) == (7, 10.0, 0.2)


def test_chat_role_only_and_finish_chunks_are_not_tokens() -> None:
    recorder = StreamRecorder(prompt_len=1, start_s=0.0, is_chat=True)
    recorder.on_event(_chat({"role": "assistant", "content": ""}), 0.1)
    recorder.on_event(_chat({"content": "Hel"}), 0.3)
    recorder.on_event(_chat({"reasoning_content": "hmm"}), 0.4)
    recorder.on_event(_chat({"content": "lo"}), 0.6)
    recorder.on_event(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 0.7)
    outcome = recorder.finish()
    assert outcome.ttft_s == pytest.approx(0.3)
    assert outcome.itls_s == pytest.approx((0.1, 0.2))
    assert outcome.e2el_s == pytest.approx(0.6)
    assert outcome.output_tokens is None and outcome.chunk_count == 3


def test_error_in_stream_fails_the_request() -> None:
    recorder = StreamRecorder(prompt_len=1, start_s=0.0, is_chat=False)
    recorder.on_event(_completion("a"), 0.1)
    recorder.on_event(json.dumps({"error": {"message": "engine died", "code": 500}}), 0.2)
    outcome = recorder.finish()
    assert not outcome.success and "engine died" in outcome.error


@pytest.mark.parametrize("events", [[], ["[DONE]"], ['{"choices": [], "usage": {"completion_tokens": 0}}']])
def test_stream_without_tokens_fails(events: list[str]) -> None:
    recorder = StreamRecorder(prompt_len=1, start_s=0.0, is_chat=False)
    for data in events:
        recorder.on_event(data, 1.0)
    outcome = recorder.finish()
    assert not outcome.success and "without any token" in outcome.error


def test_garbage_chunk_fails_the_request() -> None:
    recorder = StreamRecorder(prompt_len=1, start_s=0.0, is_chat=False)
    recorder.on_event(_completion("a"), 0.1)
    recorder.on_event("{not json", 0.2)
    assert "unparseable" in recorder.finish().error


def test_completion_body_matches_vllm_bench() -> None:
    endpoint = EndpointConfig(
        base_url="http://h:8000/", model="m", ignore_eos=True, temperature=0.0, extra_body={"top_k": 1}
    )
    body = request_body(endpoint, BenchRequest(prompt=(1, 2, 3), prompt_len=3, output_len=16))
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [1, 2, 3],
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "top_k": 1,
    }
    assert endpoint.url == "http://h:8000/v1/completions" and not endpoint.is_chat


def test_chat_body_uses_messages_and_max_completion_tokens() -> None:
    endpoint = EndpointConfig(base_url="http://h:8000", model="m", endpoint="/v1/chat/completions")
    body = request_body(endpoint, BenchRequest(prompt="hi there", prompt_len=2, output_len=4))
    assert body["messages"] == [{"role": "user", "content": "hi there"}]
    assert body["max_completion_tokens"] == 4 and "ignore_eos" not in body and "temperature" not in body
    assert endpoint.is_chat
    with pytest.raises(ValueError):
        request_body(endpoint, BenchRequest(prompt=(1, 2), prompt_len=2, output_len=4))
