"""`pdserve serve --engine mock` over HTTPS (a self-signed certificate made here) against
clients that misbehave on the wire: a half-sent request head, a body that never arrives, a
stream reader that stops reading. Each is cut off within its deadline, and the server keeps
serving (the stalled stream's admission slot is freed); an endless head is refused. Also: `pdserve config show` shows no
secret."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.testing.server import free_port, spawn_process
from pdserve.testing.tokenizer import save_tiny_model

pytestmark = pytest.mark.integration

DEADLINE_S = 2.0
# Generous: a busy 2-core CI host runs the server, Ray and this test together.
SLACK_S = 6.0
MAX_CONNECTIONS = 4
KEY = "sk-integration"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class TlsServer:
    def __init__(self, running, cert: Path) -> None:
        self.running = running
        self.port = running.port
        self.log_path = running.log_path
        self.base_url = f"https://127.0.0.1:{running.port}"
        self.tls = ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server")
    cert, key = self_signed_certificate(workdir)
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), "--engine", "mock",
               "--model", str(save_tiny_model(workdir / "tiny-model")),
               "--served-model-name", "tiny", "--mode", "colocated", "--replicas", "1",
               "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--api-key", KEY,
               "--set", "pools.colocated.num_cpus=0.5",
               "--set", "engine.mock.max_model_len=65536", "--set", "engine.mock.decode_step_s=0.001",
               "--set", "api.max_queued_requests=1", "--set", f"api.max_connections={MAX_CONNECTIONS}",
               "--set", f"api.header_timeout_s={DEADLINE_S}",
               "--set", f"api.body_timeout_s={DEADLINE_S}",
               "--set", f"api.write_timeout_s={DEADLINE_S}"]
    running = spawn_process(command, port, workdir / "pdserve.log")
    server = TlsServer(running, cert)
    try:
        wait_healthy(server)
        yield server
    finally:
        running.stop()


def wait_healthy(server: TlsServer, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.running.process.poll() is not None:
            raise RuntimeError(f"server exited:\n{server.running.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", verify=server.tls, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy in {timeout_s} s:\n{server.running.log_tail()}")


def connect(server, rcvbuf: int | None = None) -> ssl.SSLSocket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(DEADLINE_S + SLACK_S)
    return server.tls.wrap_socket(sock, server_hostname="127.0.0.1")


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ssl.SSLEOFError:  # closed without TLS's close_notify: closed all the same
        pass
    return received


def complete(server, **extra):
    return httpx.post(f"{server.base_url}/v1/completions", timeout=30, verify=server.tls,
                      headers={"Authorization": f"Bearer {KEY}"}, json={"model": "tiny", "prompt": "hello world", "max_tokens": 4, **extra})


def test_https_serves_the_api_behind_its_key_and_says_so(server):
    r = complete(server)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert f"pdserve ready: https://127.0.0.1:{server.port}/v1" in server.log_path.read_text()
    no_key = httpx.get(f"{server.base_url}/v1/models", verify=server.tls, timeout=10)
    assert no_key.status_code == 401 and no_key.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(f"{server.base_url}/v1/models", verify=server.tls, timeout=10,
                      headers={"Authorization": "Bearer sk-guessed"})
    assert wrong.status_code == 401
    log = server.log_path.read_text()
    assert KEY not in log and "sk-guessed" not in log  # keys never reach the log
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port gets no answer
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)


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


def test_a_request_head_over_the_limit_gets_431(server):
    filler = b"".join(b"X-Filler-%03d: " % i + b"a" * 86 + b"\r\n" for i in range(670))
    with connect(server) as sock:
        # 67 KB of head, past the 64 KiB default, never finished; sent whole, then read, so the
        # server has read all of it when it closes (unread bytes would turn its FIN into a RST).
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pdserve\r\n" + filler)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"request_header_fields_too_large"' in answer
    assert complete(server).status_code == 200


def test_bytes_that_are_not_http_get_an_openai_style_400(server):
    with connect(server) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "invalid_http_request" and error["message"]


def test_a_body_that_never_arrives_gets_408_within_the_deadline(server):
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\n" + AUTH +
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        answer = read_until_closed(sock)
        waited = time.monotonic() - started
    assert DEADLINE_S - 0.5 <= waited <= DEADLINE_S + SLACK_S, waited
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"request_timeout"' in answer


def test_a_stalled_stream_reader_is_aborted_and_its_slot_freed(server):
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 65000,
                       "stream": True}).encode()
    # A tiny receive window and no reads: the server's send buffer fills within a second.
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\n" + AUTH +
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
        # The stalled stream holds the only admission slot (api.max_queued_requests=1).
        assert complete(server).status_code == 429
        # 65000 tokens take the mock at least 65 s (1 ms a step); the kernel's send buffers
        # (autotuned up to MBs) fill in ~20 s at that rate, then the write deadline runs.
        stalled_at = time.monotonic()
        while (status := complete(server).status_code) == 429 and time.monotonic() - stalled_at < 60:
            time.sleep(0.5)
        assert status == 200, "the stalled stream still holds its admission slot"
        # The server aborted the connection: what is left to read ends in a reset or EOF.
        with pytest.raises((ConnectionResetError, ssl.SSLError, TimeoutError)):
            while sock.recv(1 << 20):
                pass
            raise ConnectionResetError  # EOF: closed (the abort's RST may arrive as EOF)
    assert "the client read nothing" in server.log_path.read_text()


def test_connections_past_the_cap_get_503(server):
    held = []
    try:
        # uvicorn answers 503 once the open connections, the new one included, reach the cap.
        for _ in range(MAX_CONNECTIONS - 1):
            sock = connect(server)
            # A served request, then idle in keep-alive: open, and under no head deadline.
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: pdserve\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        assert complete(server).status_code == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while (status := complete(server).status_code) == 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200


def test_config_show_redacts_every_secret(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("sk-in-file\n")
    shown = subprocess.run(
        [sys.executable, "-m", "pdserve", "config", "show", "--set", "api.api_keys=[sk-one, sk-two]",
         "--set", f"api.api_key_file={key_file}", "--set", "api.metrics_api_key=m-secret",
         "--set", "kv.cluster_token=kv-secret"],
        capture_output=True, text=True, check=True).stdout
    for secret in ("sk-one", "sk-two", "m-secret", "kv-secret"):
        assert secret not in shown
    assert "api_keys:\n  - '***'\n  - '***'" in shown and "cluster_token: '***'" in shown
