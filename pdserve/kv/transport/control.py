"""The NCCL path's per-pair control connection: one TCP socket, msgpack frames, kept open.

Lifecycle: the source opens a listener per pair in SetupCommunicator and hands the sink its
port and a random key (over the authenticated gRPC session); the sink connects and proves the
key in its first frame; then, for every pull, the sink sends one `PullHeader` frame and the
source answers with one `PullReply` frame. The socket lives as long as the pair.

Why not a gRPC call per pull: a unary RPC crosses gRPC's server thread pool and HTTP/2 stack,
~1.2-1.6 ms per pull on an idle host and far more inside a busy engine process, where each
thread hand-off waits for the GIL. A blocking socket read is one hand-off.

Frames are a 4-byte big-endian length, then a msgpack map. Nothing is unpickled; every field
is type-checked before use.
"""

from __future__ import annotations

import hmac
import socket
import struct
from dataclasses import dataclass

import msgpack

from pdserve.kv.transport.errors import KVTransportError

# A pull header holds a block list; 1 MiB is ~130k block ids, far above any request.
MAX_FRAME_BYTES = 1 << 20
# Block ids per pull the source accepts: bounds the bytes a malformed header can make it send.
MAX_PULL_BLOCKS = 1 << 20
_LENGTH = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class PullHeader:
    """Sink -> source, once per pull: which pinned blocks to send, in which order."""

    request_id: str
    block_ids: list[int]
    release_after: bool

    def to_wire(self) -> dict:
        return {"request_id": self.request_id, "block_ids": self.block_ids, "release": self.release_after}

    @classmethod
    def from_wire(cls, frame: object) -> PullHeader:
        """Validates a header from the network; raises KVTransportError if malformed."""
        if not isinstance(frame, dict):
            raise KVTransportError("malformed pull header")
        request_id, block_ids, release = frame.get("request_id"), frame.get("block_ids"), frame.get("release")
        if (
            not isinstance(request_id, str)
            or not isinstance(release, bool)
            or not isinstance(block_ids, list)
            or len(block_ids) > MAX_PULL_BLOCKS
            or not all(type(b) is int and b >= 0 for b in block_ids)
        ):
            raise KVTransportError("malformed pull header")
        return cls(request_id, block_ids, release)


def reply_to_wire(error: str | None) -> dict:
    """Source -> sink, once per pull: None if the blocks were sent, else why they were refused."""
    return {"error": error}


def reply_from_wire(frame: object) -> str | None:
    """The refusal message of a reply, or None; raises KVTransportError if malformed."""
    if not isinstance(frame, dict) or not isinstance(frame.get("error"), (str, type(None))):
        raise KVTransportError("malformed pull reply")
    return frame["error"]


def send_frame(sock: socket.socket, message: dict) -> None:
    """Writes one frame; blocks until the kernel took it (small frames: at once)."""
    body = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> object:
    """Reads one frame; raises ConnectionError on EOF, KVTransportError if oversized."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise KVTransportError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return msgpack.unpackb(_recv_exactly(sock, length), raw=False, strict_map_key=True)


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    chunks, remaining = [], nbytes
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError("the KV pair's control connection was closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def listen(host: str) -> socket.socket:
    """A listener for one pair's control connection on a free port; source side."""
    listener = socket.create_server((host, 0), backlog=1)
    return listener


def accept(listener: socket.socket, key: bytes, timeout_s: float) -> socket.socket:
    """Waits for the sink's connection and checks its key; closes the listener. Source pair
    thread, once per pair. Raises KVTransportError (wrong key) or TimeoutError."""
    listener.settimeout(timeout_s)
    try:
        conn, _ = listener.accept()
    finally:
        listener.close()
    try:
        conn.settimeout(timeout_s)
        hello = recv_frame(conn)
        proof = hello.get("key") if isinstance(hello, dict) else None
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, key):
            raise KVTransportError("control connection refused: wrong pair key")
        conn.settimeout(None)  # the pair thread blocks here between pulls
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        conn.close()
        raise
    return conn


def connect(host: str, port: int, key: bytes, timeout_s: float) -> socket.socket:
    """Connects to a pair's listener and proves the key; sink side, once per pair. Later
    reads time out after `timeout_s` (a source that stops answering fails the pull)."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(conn, {"key": key})
    except BaseException:
        conn.close()
        raise
    return conn
