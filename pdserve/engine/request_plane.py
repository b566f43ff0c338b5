"""The direct request plane: a frontend's requests to one engine actor, and their outputs back,
over one socket beside Ray.

Why: a request's way in through a Ray actor call and its first output's way back through a Ray
streaming item cost 1.35 ms of every first token on this project's 2-core CI host, where the same
two messages over a unix socket take 0.09 ms (`benchmarks/request_plane.py`). Ray still places,
starts, supervises and stops the engine actors and carries their control calls (stats, KV pins,
drains); only submit, abort and outputs take this path. A frontend that cannot reach it (or
`engine.request_plane: ray`) uses the actor's Ray methods, `submit()` and `outputs()`, which stay.

Lifecycle: `EngineActor.start()` opens a `PlaneServer`: a unix socket in a private directory for
frontends on its node, and TCP on the node's address for the others. `EngineInfo.extra
["request_plane"]` advertises both (`PlaneEndpoint`). A frontend opens one `PlaneLink` per
engine on its first request there (`PlaneLink.connect`). The link authenticates both ends and
subscribes: it takes over the subscriber's output queue, as `outputs()` does. Then it carries
submits and aborts one way and batches of outputs the other. When a link breaks, the frontend
fails every request open on it at once (as for a broken Ray stream), and its next request
connects again. The server aborts whatever the broken link's subscriber left running, since no
one reads it any more. `PlaneServer.close()` ends every link and removes the socket file.

Wire: frames of a 4-byte big-endian length and a body. The handshake is raw bytes, so nothing
is decoded before the peer proves it holds the cluster token (`kv.cluster_token`):

    engine   -> frontend  nonce_e (16 bytes)
    frontend -> engine    version (1) + nonce_f (16) + HMAC(token, "frontend" nonce_e nonce_f
                          subscriber) (32) + subscriber (utf-8)
    engine   -> frontend  HMAC(token, "engine" nonce_e nonce_f subscriber) (32)

Each proof binds the other side's fresh nonce, so a recorded handshake replays nowhere, and the
token itself never crosses the wire. After that, msgpack: frontend -> engine `[SUBMIT, request]`
or `[ABORT, request_id]`; engine -> frontend, one list of outputs (`GenerateDelta`,
`GenerateFailure`) per frame. The values are the engine's own frozen dataclasses, encoded field
by field as msgpack extension types (`encode`, `decode`). The plane is plaintext, like Ray's own
traffic between nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from pdserve.engine.types import (
    EngineInfo, GenerateDelta, GenerateFailure, GenerateRequest, KVPull, Leg, SamplingOptions,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
SUBMIT, ABORT = 0, 1
NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
MAX_FRAME = 256 << 20  # a 256k-token prompt is ~1.3 MB; anything near this is not ours
MAX_HELLO = 1024  # before a peer has proven the token, nothing larger is read (a hello is ~100 B)
HANDSHAKE_TIMEOUT_S = 5.0
_HEADER = struct.Struct("!I")

EngineOutput = GenerateDelta | GenerateFailure


class PlaneError(ConnectionError):
    """The request plane could not be set up or broke: a refused handshake, a wire version
    another side does not speak, a malformed frame."""


# ---------------------------------------------------------------------------------- codec
# Extension codes: 0 a tuple (msgpack has one array type; the dataclasses' tuples must stay
# tuples), 1 a `Leg`, then one per dataclass, its fields in declaration order.
_TUPLE, _LEG = 0, 1
_CLASSES: tuple[type, ...] = (GenerateRequest, SamplingOptions, GenerateDelta, GenerateFailure,
                              KVPull, TokenLogprob)
_CODES = {cls: code for code, cls in enumerate(_CLASSES, start=2)}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _CLASSES}


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, encode(list(obj)))
    if isinstance(obj, Leg):
        return msgpack.ExtType(_LEG, obj.value.encode())
    code = _CODES.get(type(obj))
    if code is None:
        raise TypeError(f"{type(obj).__name__} does not travel on the request plane")
    return msgpack.ExtType(code, encode([getattr(obj, name) for name in _FIELDS[type(obj)]]))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(decode(data))
    if code == _LEG:
        return Leg(data.decode())
    if not 2 <= code < 2 + len(_CLASSES):
        raise PlaneError(f"unknown value type {code} on the request plane")
    return _CLASSES[code - 2](*decode(data))


def encode(value: Any) -> bytes:
    """msgpack of plain values and the engine's request and output dataclasses."""
    return msgpack.packb(value, default=_default, strict_types=True, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


# -------------------------------------------------------------------------------- framing
def _frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    """The next frame's body; raises `asyncio.IncompleteReadError` at the end of the stream."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > limit:
        raise PlaneError(f"request plane frame of {size} bytes refused")
    return await reader.readexactly(size)


def _proof(token: str, role: bytes, nonce_e: bytes, nonce_f: bytes, subscriber: bytes) -> bytes:
    return hmac.new(token.encode(), role + nonce_e + nonce_f + subscriber, hashlib.sha256).digest()


def _socket_root() -> str | None:
    """Where engines' unix sockets go: beside Ray's own, in this Ray session's `sockets/`
    directory, so that an engine killed before it could remove its socket leaves it there and
    not loose in /tmp; the system's temp directory outside Ray, or when that path would be too
    long for a unix socket (108 bytes with the file's own name)."""
    try:
        import ray

        session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001
    except Exception:  # noqa: BLE001 - no Ray node in this process (tests)
        return None
    root = os.path.join(session, "sockets")
    return root if os.path.isdir(root) and len(root) < 60 else None


# ------------------------------------------------------------------------------ endpoints
@dataclass(frozen=True, slots=True)
class PlaneEndpoint:
    """Where an engine's request plane listens: its unix socket (reachable from its node) and
    TCP address (from anywhere in the cluster)."""

    unix_path: str
    host: str
    port: int

    def as_extra(self) -> dict[str, Any]:
        return {"unix_path": self.unix_path, "host": self.host, "port": self.port}

    @classmethod
    def of(cls, info: EngineInfo | None) -> PlaneEndpoint | None:
        """The endpoint an engine advertised, or None (no plane: the frontend uses Ray)."""
        extra = (info.extra if info is not None else {}).get("request_plane")
        return cls(**extra) if extra else None


# --------------------------------------------------------------------------- engine side
class PlaneHost(Protocol):
    """What the server needs from the engine actor it serves."""

    def attach(self, subscriber: str) -> asyncio.Queue[EngineOutput | None]: ...

    def detach(self, subscriber: str, queue: asyncio.Queue[EngineOutput | None]) -> None: ...

    async def submit(self, request: GenerateRequest, subscriber: str = "") -> None: ...

    async def abort(self, request_id: str) -> None: ...


async def output_batches(queue: asyncio.Queue[EngineOutput | None]) -> AsyncIterator[list[EngineOutput]]:
    """Every output put on `queue`, batched: waits for one, then takes all that are queued.
    Ends at a None (the queue was taken over, or the engine stops)."""
    while (item := await queue.get()) is not None:
        batch = [item]
        while not queue.empty() and (item := queue.get_nowait()) is not None:
            batch.append(item)
        yield batch
        if item is None:
            return


class PlaneServer:
    """The engine actor's end: accepts links, runs each one's submits and sends its outputs."""

    def __init__(self, host: PlaneHost, token: str, replica_id: str) -> None:
        if not token:
            raise ValueError("the request plane needs the cluster token")
        self._host = host
        self._token = token
        self._replica_id = replica_id
        self._servers: list[asyncio.AbstractServer] = []
        self._dir: str | None = None
        self._links: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self, tcp_host: str) -> PlaneEndpoint:
        """Listen on a fresh unix socket and on `tcp_host` (an ephemeral port)."""
        self._dir = tempfile.mkdtemp(prefix="pdserve-plane-", dir=_socket_root())  # mode 0700
        path = os.path.join(self._dir, "engine.sock")
        self._servers.append(await asyncio.start_unix_server(self._accept, path))
        tcp = await asyncio.start_server(self._accept, tcp_host or "127.0.0.1", 0)
        self._servers.append(tcp)
        host, port = tcp.sockets[0].getsockname()[:2]
        logger.info("engine %s request plane on %s and %s:%d", self._replica_id, path, host, port)
        return PlaneEndpoint(path, host, port)

    async def close(self) -> None:
        """Stop listening and end every link: each one's connection is closed, so its loop
        ends as for a frontend that went away (cancelled only if that takes over 5 s)."""
        for server in self._servers:
            server.close()
        for writer in list(self._links.values()):
            writer.close()
        if self._links:
            _, late = await asyncio.wait(list(self._links), timeout=HANDSHAKE_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links[task] = writer
        try:
            try:
                subscriber = await asyncio.wait_for(self._handshake(reader, writer),
                                                    HANDSHAKE_TIMEOUT_S)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, PlaneError) as e:
                logger.warning("engine %s refused a request plane link: %s", self._replica_id, e)
                return
            await self._serve(subscriber, reader, writer)
        finally:
            self._links.pop(task, None)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        nonce_e = secrets.token_bytes(NONCE_BYTES)
        writer.write(_frame(nonce_e))
        hello = await _read_frame(reader, MAX_HELLO)
        head = 1 + NONCE_BYTES + PROOF_BYTES
        if len(hello) <= head or hello[0] != WIRE_VERSION:
            raise PlaneError(f"wire version {hello[:1].hex() or 'none'}, this engine speaks "
                             f"{WIRE_VERSION}")
        nonce_f, proof, name = hello[1:1 + NONCE_BYTES], hello[1 + NONCE_BYTES:head], hello[head:]
        if not hmac.compare_digest(proof, _proof(self._token, b"frontend", nonce_e, nonce_f, name)):
            raise PlaneError("the cluster token does not match")
        writer.write(_frame(_proof(self._token, b"engine", nonce_e, nonce_f, name)))
        await writer.drain()
        return name.decode()

    async def _serve(self, subscriber: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        queue = self._host.attach(subscriber)
        sender = asyncio.get_running_loop().create_task(self._send(queue, writer))
        try:
            while True:
                kind, value = decode(await _read_frame(reader))
                if kind == SUBMIT:
                    await self._host.submit(value, subscriber)
                elif kind == ABORT:
                    await self._host.abort(value)
        except (OSError, asyncio.IncompleteReadError, PlaneError):
            pass  # the frontend went away or closed its link
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            self._host.detach(subscriber, queue)

    @staticmethod
    async def _send(queue: asyncio.Queue[EngineOutput | None], writer: asyncio.StreamWriter) -> None:
        try:
            async for batch in output_batches(queue):
                writer.write(_frame(encode(batch)))
                await writer.drain()
        finally:
            writer.close()  # taken over by a newer link, or the engine stops: this one ends


# ------------------------------------------------------------------------- frontend side
class PlaneLink:
    """A frontend's end of one engine's request plane."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, endpoint: PlaneEndpoint, token: str, subscriber: str,
                      timeout_s: float = HANDSHAKE_TIMEOUT_S) -> PlaneLink:
        """Opens the engine's unix socket when it is on this node (its file is here), else its
        TCP address; authenticates both ends. Raises OSError / PlaneError / TimeoutError."""
        if os.path.exists(endpoint.unix_path):
            opening: Awaitable[Any] = asyncio.open_unix_connection(endpoint.unix_path)
        else:
            opening = asyncio.open_connection(endpoint.host, endpoint.port)
        reader, writer = await asyncio.wait_for(opening, timeout_s)
        try:
            await asyncio.wait_for(cls._handshake(reader, writer, token, subscriber), timeout_s)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         token: str, subscriber: str) -> None:
        try:
            nonce_e = await _read_frame(reader, MAX_HELLO)
            nonce_f, name = secrets.token_bytes(NONCE_BYTES), subscriber.encode()
            proof = _proof(token, b"frontend", nonce_e, nonce_f, name)
            writer.write(_frame(bytes([WIRE_VERSION]) + nonce_f + proof + name))
            answer = await _read_frame(reader, MAX_HELLO)
        except asyncio.IncompleteReadError:
            raise PlaneError("the engine closed the request plane during the handshake "
                             "(a different cluster token or wire version)") from None
        if not hmac.compare_digest(answer, _proof(token, b"engine", nonce_e, nonce_f, name)):
            raise PlaneError("the engine could not prove the cluster token")

    async def submit(self, request: GenerateRequest) -> None:
        await self._send([SUBMIT, request])

    async def abort(self, request_id: str) -> None:
        await self._send([ABORT, request_id])

    async def _send(self, message: list[Any]) -> None:
        if self._writer.is_closing():
            raise PlaneError("the request plane link is closed")
        self._writer.write(_frame(encode(message)))
        await self._writer.drain()

    async def batches(self) -> AsyncIterator[list[EngineOutput]]:
        """The engine's output batches until the link ends (returns) or breaks (raises)."""
        try:
            while True:
                yield decode(await _read_frame(self._reader))
        except asyncio.IncompleteReadError:
            return

    def close(self) -> None:
        self._writer.close()
