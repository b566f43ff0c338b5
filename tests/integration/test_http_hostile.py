"""`pdserve serve --engine mock` against clients that misbehave on the wire: a half-sent request
head, a body that never arrives, a stream reader that stops reading. Each is cut off within its
deadline, and the server keeps serving (the stalled stream's admission slot is freed)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from pdserve.testing.server import start_mock_server

pytestmark = pytest.mark.integration

DEADLINE_S = 2.0
# Generous: a busy 2-core CI host runs the server, Ray and this test together.
SLACK_S = 6.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_mock_server(
        ["--served-model-name", "tiny", "--mode", "colocated", "--replicas", "1",
         "--set", "pools.colocated.num_cpus=0.5",
         "--set", "engine.mock.max_model_len=65536", "--set", "engine.mock.decode_step_s=0.001",
         "--set", "api.max_queued_requests=1",
         "--set", f"api.header_timeout_s={DEADLINE_S}", "--set", f"api.body_timeout_s={DEADLINE_S}",
         "--set", f"api.write_timeout_s={DEADLINE_S}"],
        tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


def connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(DEADLINE_S + SLACK_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def complete(server, **extra):
    return httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "hello world", "max_tokens": 4, **extra})


def test_a_half_sent_request_head_is_cut_off_within_the_deadline(server):
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: appl")
        answer = read_until_closed(sock)
        waited = time.monotonic() - started
    assert DEADLINE_S - 0.5 <= waited <= DEADLINE_S + SLACK_S, waited
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert complete(server).status_code == 200


def test_a_body_that_never_arrives_gets_408_within_the_deadline(server):
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        answer = read_until_closed(sock)
        waited = time.monotonic() - started
    assert DEADLINE_S - 0.5 <= waited <= DEADLINE_S + SLACK_S, waited
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"request_timeout"' in answer


def test_a_stalled_stream_reader_is_aborted_and_its_slot_freed(server):
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 60000,
                       "stream": True}).encode()
    # A tiny receive window and no reads: the server's send buffer fills within a second.
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
        # The stalled stream holds the only admission slot (api.max_queued_requests=1).
        assert complete(server).status_code == 429
        deadline = time.monotonic() + 60  # 60000 tokens would take the mock at least 60 s
        while (status := complete(server).status_code) == 429 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status == 200, "the stalled stream still holds its admission slot"
        freed_after = 60 - (deadline - time.monotonic())
        assert freed_after < 30, freed_after
        # The server aborted the connection: what is left to read ends in a reset or EOF.
        with pytest.raises((ConnectionResetError, TimeoutError)):
            while sock.recv(1 << 20):
                pass
            raise ConnectionResetError  # EOF: closed (the abort's RST may arrive as EOF)
    assert "the client read nothing" in server.log_path.read_text()
