"""gRPC transport: the portable KV data path, and the control side channel of the NCCL path.

Source (prefill worker): a `grpc.server` on its own thread pool serves Handshake, PullBlocks and
Release; it never runs on the caller's thread. Lifecycle: constructed -> serving -> `close()`.
Sink (decode worker): `start_pull` queues the pull on a small thread pool and returns a handle;
each pull handshakes once per source address (cached session), then reads one server stream of
large chunks and writes each chunk straight into its destination blocks.

Security: a sink first asks for a Challenge (a fresh nonce bound to its connection), then both
sides prove the shared cluster token over both nonces and engine ids at Handshake (HMAC,
constant-time compare; handshake.py), so a recorded handshake replayed is refused. The sink gets
a session id that later calls must carry, valid only from the connection that handshook
(sessions.py); a session may Release only requests it pulled (or that nobody pulled yet:
leases.py). Before authentication a caller gets small messages only (MAX_HANDSHAKE_BYTES; the
server reads at most MAX_REQUEST_BYTES from anyone), and the server serves or queues at most
`max_concurrent_rpcs` calls. Only protobuf crosses the wire; block bytes are copied into
tensors, never unpickled. The channel is plaintext unless both ends are given `tls` (tls.py:
server certificate, and optionally client certificates checked against a CA).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.proto import kv_transfer_pb2_grpc as pb_grpc
from pdserve.kv.transport import blocks, wire
from pdserve.kv.transport.base import BlockSink, BlockSource, KVTransfer, ReleaseCallback
from pdserve.kv.transport.defaults import DEFAULT_LEASE_S, DEFAULT_PULL_TIMEOUT_S
from pdserve.kv.transport.errors import KVTransportError, PairLimitError, WireVersionError
from pdserve.kv.transport.handshake import PeerInfo
from pdserve.kv.transport.regions import MAX_BLOCK_NBYTES, BlockRegion, KVLayoutSpec
from pdserve.kv.transport.sessions import Session, SessionTable
from pdserve.kv.transport.tls import TlsFiles

logger = logging.getLogger(__name__)

# 4 MiB chunks: large enough that per-message overhead (~tens of µs) is <5% of a chunk's time at
# gRPC's ~1 GB/s on loopback, small enough to keep a few chunks in flight without big buffers.
DEFAULT_CHUNK_BYTES = 4 << 20
# gRPC's default 4 MiB message cap would reject a chunk holding one large block; a chunk is at
# most max(requested chunk, one block), and a block is at most MAX_BLOCK_NBYTES.
MAX_MESSAGE_BYTES = MAX_BLOCK_NBYTES + (1 << 20)
# HTTP/2 flow-control window per stream. The default starts small and grows by BDP probing;
# with 64 MiB the server keeps many chunks in flight. Measured on loopback (2 busy cores, 16 MiB
# pulls of 512 KiB chunks): ~85 ms per pull with the default, ~40 ms with this.
STREAM_WINDOW_BYTES = 64 << 20
# The largest message a source accepts: what an authenticated pull's request needs (a
# PullBlocksRequest of 1 MiB holds ~200k block ids, far above any request's). A source receives
# only small requests and sends the large chunks, so nobody can make it buffer 257 MiB.
MAX_REQUEST_BYTES = 1 << 20
# The largest Challenge or Handshake request a source reads, checked before use: a hello is a
# few hundred bytes. Unauthenticated callers get no more.
MAX_HANDSHAKE_BYTES = 16 << 10
# Calls a source serves or queues at once; more are refused (RESOURCE_EXHAUSTED) instead of
# queueing without bound. 64: eight decode peers of four pull threads each, twice over.
DEFAULT_MAX_CONCURRENT_RPCS = 64
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
]
_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
]
# Server threads = concurrent streams served; a prefill worker rarely has more decode peers.
DEFAULT_SERVER_THREADS = 8
# Concurrent pulls per sink; more only splits the same link bandwidth.
DEFAULT_PULL_THREADS = 4
# Handshake is one small round trip; longer than this means the source is unreachable.
HANDSHAKE_TIMEOUT_S = 5.0


class GrpcSource(BlockSource):
    """Serves pinned blocks over gRPC; starts serving in the constructor."""

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        cluster_token: str,
        on_release: ReleaseCallback | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        server_threads: int = DEFAULT_SERVER_THREADS,
        max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
        tls: TlsFiles | None = None,
    ):
        """Binds `host:port` (port 0 picks a free one) and starts serving, over TLS when `tls`
        is given; `advertise_host` is the host sinks dial (default: `host`, or this machine's
        IP for a wildcard bind)."""
        super().__init__(
            layout,
            regions,
            engine_id=engine_id,
            cluster_token=cluster_token,
            on_release=on_release,
            lease_s=lease_s,
        )
        self.sessions = SessionTable()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=server_threads, thread_name_prefix="kv-grpc-server"),
            options=_SERVER_OPTIONS,
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self), self._server)
        try:
            if tls is None:
                bound = self._server.add_insecure_port(f"{host}:{port}")
            else:
                bound = self._server.add_secure_port(f"{host}:{port}", tls.server_credentials())
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise KVTransportError(f"could not bind the KV gRPC server to {host}:{port}")
        self.host = advertise_host or _reachable_host(host)
        self.port = bound
        self._server.start()

    @property
    def address(self) -> str:
        """host:port that sinks dial."""
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stops the server at once (streams in flight are cancelled) and drops all pins."""
        try:
            self._server.stop(grace=None).wait(timeout=5.0)
        finally:
            self._pins.close()

    def serve_setup_communicator(self, pair_id: str, backend: str, session: Session) -> tuple[str, bytes]:
        """NCCL side channel (server thread): only NcclSource serves it."""
        raise NotImplementedError("this KV source serves gRPC pulls only")

    def chunks(
        self, block_ids: list[int], max_chunk_bytes: int, regions: Sequence[BlockRegion]
    ) -> Iterator[pb.BlockChunk]:
        """Server thread, once per PullBlocks: the pull's blocks of `regions` (this source's
        views for the peer) as chunks, gathered lazily (one chunk in memory at a time). Blocks
        on the gather copies."""
        chunk_bytes = min(max(max_chunk_bytes, 1), MAX_MESSAGE_BYTES - (1 << 20))
        sizes = [r.info().block_nbytes for r in regions]
        indexes: dict[torch.device, torch.Tensor] = {}
        for piece in blocks.plan_pieces(sizes, len(block_ids), chunk_bytes):
            region = regions[piece.region]
            device = region.tensor.device
            if device not in indexes:
                indexes[device] = blocks.block_index(block_ids, device)
            payload = blocks.gather_bytes(region, indexes[device], piece)
            yield pb.BlockChunk(
                region=piece.region, block_offset=piece.first, block_count=piece.count, data=payload
            )


def _reachable_host(bind_host: str) -> str:
    """The host to advertise for a bind address: a wildcard bind advertises this machine's IP."""
    if bind_host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostbyname(socket.gethostname())
    return bind_host


class _Servicer(pb_grpc.KVTransferServicer):
    """Adapts gRPC calls to a GrpcSource; runs on the server's thread pool."""

    def __init__(self, source: GrpcSource):
        self._source = source

    def Challenge(self, request: pb.ChallengeRequest, context: grpc.ServicerContext) -> pb.ChallengeResponse:
        """Once per handshake: a nonce for this connection's Handshake; refuses another version."""
        self._check_size(request, context)
        try:
            challenge = self._source.issue_challenge(
                request.wire_version, request.engine_id, context.peer()
            )
        except KVTransportError as exc:
            self._refuse(context, exc)
        return wire.challenge_to_response(challenge)

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeResponse:
        """Once per sink and source: checks the sink's hello; refusals carry the reason."""
        self._check_size(request, context)
        hello = wire.hello_from_message(request)
        try:
            nonces = (request.server_nonce, request.client_nonce)
            reply = self._source.accept_hello(hello, *nonces, context.peer())
        except KVTransportError as exc:
            self._refuse(context, exc)
        session = self._source.sessions.open(context.peer(), hello.engine_id, hello.layout)
        regions = [r.info() for r in self._source.regions_for(hello.layout)]
        return wire.hello_to_response(reply, session.session_id, regions)

    def PullBlocks(
        self, request: pb.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.BlockChunk]:
        """Once per gRPC pull: streams the chunks; holds a server thread for the whole stream."""
        session = self._require_session(context)
        regions = self._source.regions_for(session.layout)
        block_ids = list(request.block_ids)
        try:
            self._source.open_read(request.request_id, block_ids, session.session_id)
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        completed = False
        try:
            yield from self._source.chunks(block_ids, request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, regions)
            completed = True
        finally:
            self._source.close_read(request.request_id, release=completed and request.release_after)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        """When a sink gives up on a request, or one of several sink ranks reading it is done:
        unpins it once every such rank released (fires on_release with REMOTE). Refused
        (PERMISSION_DENIED) for a request that other sessions pulled and this one did not."""
        session = self._require_session(context)
        try:
            released = self._source.release_by_peer(request.request_id, session.layout, session.session_id)
        except PermissionError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.ReleaseResponse(released=released)

    def SetupCommunicator(
        self, request: pb.SetupCommunicatorRequest, context: grpc.ServicerContext
    ) -> pb.SetupCommunicatorResponse:
        """Once per NCCL pair: delegates to the source (UNIMPLEMENTED on a plain GrpcSource)."""
        session = self._require_session(context)
        store_address, params = self._call(
            context, self._source.serve_setup_communicator, request.pair_id, request.backend, session
        )
        return pb.SetupCommunicatorResponse(store_address=store_address, params=params)

    def _require_session(self, context: grpc.ServicerContext) -> Session:
        """The caller's session; aborts the call when it has none on this connection."""
        session_id = dict(context.invocation_metadata()).get(wire.SESSION_KEY)
        session = self._source.sessions.get(session_id, context.peer())
        if session is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "no valid session on this connection: handshake first"
            )
        return session

    @staticmethod
    def _check_size(
        request: pb.ChallengeRequest | pb.HandshakeRequest, context: grpc.ServicerContext
    ) -> None:
        """Aborts an unauthenticated call whose request is larger than any honest one."""
        if request.ByteSize() > MAX_HANDSHAKE_BYTES:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"handshake message of {request.ByteSize()} bytes exceeds {MAX_HANDSHAKE_BYTES}",
            )

    @staticmethod
    def _refuse(context: grpc.ServicerContext, error: KVTransportError) -> None:
        """Aborts a handshake call with the refusal's status and trailing metadata."""
        code, trailing = wire.refusal_status(error)
        context.set_trailing_metadata(trailing)
        context.abort(code, str(error))

    @staticmethod
    def _call(context: grpc.ServicerContext, method, *args):
        try:
            return method(*args)
        except NotImplementedError as exc:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        except PairLimitError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except LookupError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except (ValueError, KVTransportError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


@dataclass(frozen=True, slots=True)
class SourceSession:
    """A handshaken source: what the sink knows of it, how to call it, and the views of the
    sink's regions that its pulls fill (head slices when TP sizes differ)."""

    info: PeerInfo
    stub: pb_grpc.KVTransferStub
    metadata: tuple[tuple[str, str], ...]
    regions: tuple[BlockRegion, ...]


class GrpcSink(BlockSink):
    """Pulls blocks from GrpcSources on a small thread pool; `start_pull` never blocks."""

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        cluster_token: str,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
        pull_threads: int = DEFAULT_PULL_THREADS,
        tls: TlsFiles | None = None,
    ):
        super().__init__(layout, regions, engine_id=engine_id, cluster_token=cluster_token)
        self.max_chunk_bytes = max_chunk_bytes
        self.pull_timeout_s = pull_timeout_s
        self._tls = tls
        self._executor = futures.ThreadPoolExecutor(max_workers=pull_threads, thread_name_prefix="kv-pull")
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._sessions: dict[str, SourceSession] = {}
        self._handshake_locks: dict[str, threading.Lock] = {}
        self._inflight: set[KVTransfer] = set()
        self._streams: set[grpc.Future] = set()
        self._closed = False

    def handshake(self, remote_address: str) -> PeerInfo:
        """Handshakes with the source (once; cached) and returns what it is. Raises
        KVTransportError naming what was refused. Blocks for one round trip, at most 5 s."""
        return self.session(remote_address).info

    def session(self, address: str) -> SourceSession:
        """The cached session with a source, handshaking first if needed; pull threads and
        `handshake` call it. Concurrent callers for one address share one handshake."""
        with self._lock:
            if address in self._sessions:
                return self._sessions[address]
            lock = self._handshake_locks.setdefault(address, threading.Lock())
        with lock:
            with self._lock:
                if address in self._sessions:
                    return self._sessions[address]
            session = self._handshake(address)
            with self._lock:
                self._sessions[address] = session
            return session

    def forget(self, address: str) -> None:
        """Drops a cached session so the next pull handshakes again (source restarted)."""
        with self._lock:
            self._sessions.pop(address, None)

    def release_remote(self, remote_address: str, request_id: str) -> None:
        """Queues a Release to the source and returns at once; failures are only logged."""
        with self._lock:
            if not self._closed:
                self._executor.submit(self._release_quietly, remote_address, request_id)

    def close(self) -> None:
        """Cancels streams, fails queued pulls, closes channels. Waits up to a few seconds for
        pulls in flight to notice."""
        with self._lock:
            self._closed = True
            streams, inflight = list(self._streams), list(self._inflight)
        for stream in streams:
            stream.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._abort_inflight(inflight)
        for channel in self._channels.values():
            channel.close()

    def _abort_inflight(self, inflight: list[KVTransfer]) -> None:
        for transfer in inflight:
            transfer.wait(timeout=2.0)
            transfer.finish("the KV sink was closed before the pull finished")

    def _submit(
        self, transfer: KVTransfer, src_block_ids: list[int], dst_block_ids: list[int], release: bool
    ) -> None:
        with self._lock:
            if self._closed:
                raise KVTransportError("the KV sink is closed")
            self._inflight.add(transfer)
            self._executor.submit(self._run, transfer, src_block_ids, dst_block_ids, release)

    def _run(self, transfer: KVTransfer, src: list[int], dst: list[int], release: bool) -> None:
        address = transfer.remote_address
        try:
            for attempt in range(2):
                session = self.session(address)
                transfer.set_transferring()
                try:
                    self._pull(session, transfer, src, dst, release)
                    break
                except grpc.RpcError as exc:
                    # A session is bound to its connection: after a reconnect (or a source
                    # restart) it is refused. Handshake again and retry once, if nothing moved.
                    if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                        raise
                    self.forget(address)
                    if attempt or transfer.bytes_moved:
                        raise
        except grpc.RpcError as exc:
            transfer.finish(str(wire.error_from_rpc(exc, address)))
        except Exception as exc:  # noqa: BLE001 - the contract: failures are state, not exceptions
            transfer.finish(str(exc) or type(exc).__name__)
        else:
            transfer.finish()
        finally:
            with self._lock:
                self._inflight.discard(transfer)

    def _pull(
        self, session: SourceSession, transfer: KVTransfer, src: list[int], dst: list[int], release: bool
    ) -> None:
        """Moves the blocks over one PullBlocks stream; NcclSink overrides it."""
        request = pb.PullBlocksRequest(
            request_id=transfer.request_id,
            block_ids=src,
            max_chunk_bytes=self.max_chunk_bytes,
            release_after=release,
        )
        stream = session.stub.PullBlocks(request, timeout=self.pull_timeout_s, metadata=session.metadata)
        with self._lock:
            self._streams.add(stream)
        try:
            self._receive(stream, transfer, dst, session.regions)
        finally:
            with self._lock:
                self._streams.discard(stream)
        expected = len(dst) * sum(r.info().block_nbytes for r in session.regions)
        if transfer.bytes_moved != expected:
            raise KVTransportError(f"stream ended after {transfer.bytes_moved} of {expected} bytes")

    def _receive(
        self,
        stream: Iterator[pb.BlockChunk],
        transfer: KVTransfer,
        dst: list[int],
        regions: Sequence[BlockRegion],
    ) -> None:
        indexes: dict[torch.device, torch.Tensor] = {}
        for chunk in stream:
            piece = self._piece_of(chunk, len(dst), regions)
            region = regions[piece.region]
            device = region.tensor.device
            if device not in indexes:
                indexes[device] = blocks.block_index(dst, device)
            blocks.scatter_bytes(region, indexes[device], piece, chunk.data)
            transfer.add_bytes(piece.nbytes)
        for device in indexes:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    @staticmethod
    def _piece_of(chunk: pb.BlockChunk, num_blocks: int, regions: Sequence[BlockRegion]) -> blocks.Piece:
        """Validates a chunk from the network before any byte of it is written."""
        if chunk.region >= len(regions):
            raise KVTransportError(f"malformed chunk: region {chunk.region} of {len(regions)}")
        end = chunk.block_offset + chunk.block_count
        if chunk.block_count == 0 or end > num_blocks:
            raise KVTransportError(f"malformed chunk: blocks {chunk.block_offset}..{end} of {num_blocks}")
        nbytes = chunk.block_count * regions[chunk.region].info().block_nbytes
        if len(chunk.data) != nbytes:
            raise KVTransportError(f"malformed chunk: {len(chunk.data)} bytes, expected {nbytes}")
        return blocks.Piece(chunk.region, chunk.block_offset, chunk.block_count, nbytes)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = self._open_channel(address)
            return self._channels[address]

    def _open_channel(self, address: str) -> grpc.Channel:
        if self._tls is None:
            return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        options = _CHANNEL_OPTIONS + self._tls.channel_options()
        return grpc.secure_channel(address, self._tls.channel_credentials(), options=options)

    def _handshake(self, address: str) -> SourceSession:
        """Challenge, then Handshake, on the channel later calls use (the session is bound to
        its connection). Raises KVTransportError naming what was refused."""
        stub = pb_grpc.KVTransferStub(self._channel(address))
        asked = pb.ChallengeRequest(wire_version=self.wire_version, engine_id=self.engine_id)
        try:
            challenge = wire.challenge_from_response(stub.Challenge(asked, timeout=HANDSHAKE_TIMEOUT_S))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise WireVersionError(
                    f"wire version mismatch: this side speaks {self.wire_version}, the source at "
                    f"{address} an older one (it has no Challenge call)"
                ) from None
            raise wire.error_from_rpc(exc, address) from None
        request, transcript = self._hello(challenge)
        try:
            response = stub.Handshake(wire.hello_to_request(request, transcript), timeout=HANDSHAKE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, address) from None
        hello = wire.hello_from_message(response)
        info = self._verify_source(address, hello, wire.regions_from_response(response), transcript)
        metadata = ((wire.SESSION_KEY, response.session_id),)
        return SourceSession(info, stub, metadata, self.regions_for(hello.layout))

    def _release_quietly(self, address: str, request_id: str) -> None:
        try:
            session = self.session(address)
            session.stub.Release(
                pb.ReleaseRequest(request_id=request_id),
                timeout=HANDSHAKE_TIMEOUT_S,
                metadata=session.metadata,
            )
        except Exception as exc:  # noqa: BLE001 - best effort; the source's lease frees the blocks
            logger.warning("Release of %s at %s failed: %s", request_id, address, exc)
