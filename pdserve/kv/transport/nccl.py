"""NCCL transport: blocks move over one torch.distributed group per (source, sink) worker pair.

The gRPC transport is the side channel: handshake and session as for gRPC pulls, then
- SetupCommunicator (once per pair, on the first pull): the source hosts a TCPStore for the pair
  and starts joining a 2-rank group as rank 0 on the pair's own thread; the sink joins as rank 1.
  Groups are constructed directly (ProcessGroupNCCL on CUDA, ProcessGroupGloo on CPU, chosen from
  the tensors' device), never through init_process_group: a worker may hold many pairs.
- PullBlocksNccl (once per pull): the source checks the pin and queues the send; the sink then
  receives. Both ends cut the pull into the same batches (blocks.plan_pieces/pack_batches), so no
  per-batch metadata crosses the wire.

Each batch is gathered into a staging buffer, sent as one message, and scattered on the other
side: many small per-layer block slices would each be a separate, slow message (see
DEFAULT_STAGING_BYTES). Pulls on one pair run one at a time in the same order on both ends. A
failed send or receive breaks the pair on that end; the next pull sets up a fresh pair.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import msgpack
import torch
import torch.distributed as dist

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.transport import blocks
from pdserve.kv.transport.base import BlockRegion, KVLayoutSpec, KVTransfer, KVTransportError
from pdserve.kv.transport.grpc import HANDSHAKE_TIMEOUT_S, GrpcSink, GrpcSource, SourceSession

logger = logging.getLogger(__name__)

# 64 MiB staging per pair and side. Measured NCCL send/recv between two H100s over NVLink:
# 20 GB/s at 1 MiB messages, 282 GB/s at 16 MiB, 372 GB/s at 1 GiB. One Llama-8B block of one
# layer is 64 KiB, so sending slices one by one would crawl; 64 MiB batches get near peak while
# costing little memory (a 2048-token prompt, 256 MiB, is 4 batches).
DEFAULT_STAGING_BYTES = 64 << 20
# Rendezvous and per-operation timeout of a pair. A receive waits this long for a dead peer
# before failing the pull; keep it well above the longest pull (~1 s for 256 MiB on gloo).
DEFAULT_PAIR_TIMEOUT_S = 30.0
# PullBlocksNccl refusals about the request itself; any other failure also drops the pair.
_REQUEST_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
# The pair settings the source sends in SetupCommunicator.params (msgpack), with their types.
_SETTINGS_KEYS: dict[str, type | tuple[type, ...]] = {"timeout_s": (int, float), "staging_bytes": int}


def backend_for(regions: Sequence[BlockRegion]) -> tuple[str, torch.device]:
    """("nccl", cuda device) or ("gloo", cpu) from where the regions live; all must share it."""
    devices = {r.tensor.device for r in regions}
    if len(devices) != 1:
        raise ValueError(f"all KV regions must live on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    return ("nccl" if device.type == "cuda" else "gloo"), device


def make_pair_group(
    store: dist.Store, rank: int, backend: str, host: str, timeout_s: float
) -> dist.ProcessGroup:
    """A 2-rank group over `store`; blocks until the peer joins (gloo) or the first op (NCCL).

    Called once per pair on each end, on a pair or pull thread.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def local_ip_towards(host: str) -> str:
    """The local address that routes to `host` (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def plan(
    region_nbytes: Sequence[int], num_blocks: int, staging_bytes: int
) -> list[list[tuple[blocks.Piece, int]]]:
    """The batches of a pull; both ends call it with the same arguments."""
    capacity = max(staging_bytes, *region_nbytes)
    return blocks.pack_batches(blocks.plan_pieces(region_nbytes, num_blocks, capacity), capacity)


def wait_stream(stream: torch.cuda.Stream | None, deadline: float) -> None:
    """Blocks until a CUDA stream's work is done or `deadline` passes (raises TimeoutError).

    NCCL ops never block the host, so a dead peer shows up only here; gloo ops already waited.
    """
    if stream is None:
        return
    event = stream.record_event()
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL transfer did not complete before the pair timeout")
        time.sleep(0.0002)


@dataclass(slots=True)
class _Pair:
    """One end of a pair's communicator, its staging buffer and (CUDA) stream."""

    pair_id: str
    backend: str
    device: torch.device
    timeout_s: float
    staging_bytes: int
    store: dist.Store
    group: dist.ProcessGroup | None = None
    staging: torch.Tensor | None = None
    stream: torch.cuda.Stream | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def join(self, rank: int, host: str) -> None:
        """Builds the group and staging; pair thread (source) or pull thread (sink), once."""
        self.group = make_pair_group(
            dist.PrefixStore(self.pair_id, self.store), rank, self.backend, host, self.timeout_s
        )
        self.staging = torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)

    def live_group(self) -> dist.ProcessGroup:
        """The group, or KVTransportError once the pair was aborted."""
        group = self.group
        if group is None:
            raise KVTransportError(f"KV pair {self.pair_id} was closed")
        return group

    def abort(self) -> None:
        """Tears the group down so later ops fail fast; any thread, at most once matters."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.abort()
            except Exception:
                logger.debug("abort of KV pair %s failed", self.pair_id, exc_info=True)


@dataclass(frozen=True, slots=True)
class _SendJob:
    request_id: str
    block_ids: list[int]
    release_after: bool


class NcclSource(GrpcSource):
    """A GrpcSource that also sends blocks over per-pair torch.distributed groups.

    Takes GrpcSource's arguments plus `staging_bytes` and `pair_timeout_s`. Each pair has its
    own thread that joins the group, then runs the pair's sends in order.
    """

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        pair_timeout_s: float = DEFAULT_PAIR_TIMEOUT_S,
        **grpc_options,
    ):
        self.backend, self.device = backend_for(regions)
        self._region_nbytes = [r.info().block_nbytes for r in regions]
        self.staging_bytes = max(staging_bytes, *self._region_nbytes)
        self.pair_timeout_s = pair_timeout_s
        self._pairs: dict[str, tuple[_Pair, queue.Queue[_SendJob | None]]] = {}
        self._pairs_lock = threading.Lock()
        self._closing = False
        super().__init__(layout, regions, **grpc_options)

    def serve_setup_communicator(self, pair_id: str, backend: str) -> tuple[str, bytes]:
        """Server thread, once per pair: hosts the pair's store and starts joining as rank 0.

        Returns at once (the group forms when the sink joins) with the store's address and the
        pair settings both ends must share.
        """
        if backend != self.backend:
            raise KVTransportError(
                f"backend mismatch: source uses {self.backend}, sink asked for {backend!r}"
            )
        timeout = datetime.timedelta(seconds=self.pair_timeout_s)
        store = dist.TCPStore(self.host, 0, 2, True, timeout, wait_for_workers=False)
        pair = _Pair(pair_id, self.backend, self.device, self.pair_timeout_s, self.staging_bytes, store)
        jobs: queue.Queue[_SendJob | None] = queue.Queue()
        with self._pairs_lock:
            if pair_id in self._pairs:
                raise ValueError(f"pair {pair_id!r} already exists")
            self._pairs[pair_id] = (pair, jobs)
        threading.Thread(
            target=self._serve_pair, args=(pair, jobs), name=f"kv-pair-{pair_id}", daemon=True
        ).start()
        settings = {"timeout_s": self.pair_timeout_s, "staging_bytes": self.staging_bytes}
        return f"{self.host}:{store.port}", msgpack.packb(settings)

    def serve_pull_nccl(
        self, pair_id: str, request_id: str, block_ids: list[int], release_after: bool
    ) -> int:
        """Server thread, once per pull: checks the pin and queues the send. Returns the bytes
        that will be sent; raises KVTransportError (unknown pair) or LookupError/ValueError
        (unknown request or block)."""
        with self._pairs_lock:
            entry = self._pairs.get(pair_id)
        if entry is None:  # not the request's fault: the sink must set up a new pair
            raise KVTransportError(f"unknown or broken KV pair {pair_id!r}")
        self.open_read(request_id, block_ids)
        entry[1].put(_SendJob(request_id, block_ids, release_after))
        return len(block_ids) * sum(self._region_nbytes)

    def close(self) -> None:
        """Stops the gRPC server, then every pair thread, then drops the pins."""
        with self._pairs_lock:
            self._closing = True
            pairs, self._pairs = list(self._pairs.values()), {}
        try:
            super().close()
        finally:
            for pair, jobs in pairs:
                jobs.put(None)
                pair.abort()

    def _serve_pair(self, pair: _Pair, jobs: queue.Queue[_SendJob | None]) -> None:
        try:
            pair.join(rank=0, host=self.host)
            while (job := jobs.get()) is not None:
                self._run_send(pair, job)
        except Exception as exc:  # noqa: BLE001 - a broken pair is dropped; its sink fails its pull
            level = logging.DEBUG if self._closing else logging.WARNING
            logger.log(level, "KV pair %s broke: %s", pair.pair_id, exc)
        finally:
            with self._pairs_lock:
                self._pairs.pop(pair.pair_id, None)
            self._fail_queued(jobs)
            pair.abort()

    def _run_send(self, pair: _Pair, job: _SendJob) -> None:
        sent = False
        try:
            self._send(pair, job.block_ids)
            sent = True
        finally:
            self.close_read(job.request_id, release=sent and job.release_after)

    def _send(self, pair: _Pair, block_ids: list[int]) -> None:
        staging = pair.staging
        deadline = time.monotonic() + pair.timeout_s
        with _on_stream(pair):
            index = blocks.block_index(block_ids, pair.device)  # on the stream that uses it
            for batch in plan(self._region_nbytes, len(block_ids), pair.staging_bytes):
                for piece, offset in batch:
                    blocks.gather(self.regions[piece.region], index, piece, staging[offset:])
                # Looked up per batch: close() may abort the pair between two sends.
                pair.live_group().send([staging[: blocks.batch_nbytes(batch)]], 1, 0).wait()
        # The blocks may be freed once every gather has read them: wait for the stream.
        wait_stream(pair.stream, deadline)

    def _fail_queued(self, jobs: queue.Queue[_SendJob | None]) -> None:
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self.close_read(job.request_id, release=False)


class NcclSink(GrpcSink):
    """A GrpcSink whose pulls move over per-pair groups; takes GrpcSink's arguments.

    The first pull from a source sets the pair up (one SetupCommunicator round trip plus the
    group's rendezvous); later pulls cost one PullBlocksNccl round trip plus the transfer.
    """

    def __init__(self, layout: KVLayoutSpec, regions: Sequence[BlockRegion], **grpc_options):
        self.backend, self.device = backend_for(regions)
        self._pairs: dict[str, _Pair] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        super().__init__(layout, regions, **grpc_options)

    def close(self) -> None:
        """Closes like GrpcSink, then aborts every pair."""
        super().close()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.abort()

    def _pull(
        self, session: SourceSession, transfer: KVTransfer, src: list[int], dst: list[int], release: bool
    ) -> None:
        """Pull thread: one PullBlocksNccl round trip, then the batches over the pair."""
        address = session.info.address
        pair = self._pair(session)
        with pair.lock:
            request = pb.PullBlocksNcclRequest(
                pair_id=pair.pair_id, request_id=transfer.request_id, block_ids=src, release_after=release
            )
            try:
                session.stub.PullBlocksNccl(request, timeout=HANDSHAKE_TIMEOUT_S, metadata=session.metadata)
            except grpc.RpcError as exc:
                if exc.code() not in _REQUEST_ERRORS:  # the pair (or the source) is gone
                    self._drop_pair(address, pair)
                raise
            try:
                self._receive_batches(pair, transfer, dst)
            except Exception as exc:
                self._drop_pair(address, pair)  # its message order is unknown now
                raise KVTransportError(f"{self.backend} receive from {address} failed: {exc}") from exc

    def _receive_batches(self, pair: _Pair, transfer: KVTransfer, dst: list[int]) -> None:
        group, staging = pair.live_group(), pair.staging
        deadline = time.monotonic() + pair.timeout_s
        region_nbytes = [r.block_nbytes for r in self.region_infos]
        with _on_stream(pair):
            index = blocks.block_index(dst, pair.device)
            for batch in plan(region_nbytes, len(dst), pair.staging_bytes):
                group.recv([staging[: blocks.batch_nbytes(batch)]], 0, 0).wait()
                for piece, offset in batch:
                    blocks.scatter(self.regions[piece.region], index, piece, staging[offset:])
                    transfer.add_bytes(piece.nbytes)
        wait_stream(pair.stream, deadline)

    def _pair(self, session: SourceSession) -> _Pair:
        address = session.info.address
        with self._lock:
            if address in self._pairs:
                return self._pairs[address]
            lock = self._pair_locks.setdefault(address, threading.Lock())
        with lock:
            with self._lock:
                if address in self._pairs:
                    return self._pairs[address]
            pair = self._setup_pair(session)
            with self._lock:
                self._pairs[address] = pair
            return pair

    def _setup_pair(self, session: SourceSession) -> _Pair:
        pair_id = f"{self.engine_id}-{secrets.token_hex(8)}"
        request = pb.SetupCommunicatorRequest(pair_id=pair_id, backend=self.backend)
        response = session.stub.SetupCommunicator(
            request, timeout=HANDSHAKE_TIMEOUT_S, metadata=session.metadata
        )
        settings = _decode_settings(response.params)
        host, _, port = response.store_address.rpartition(":")
        timeout = datetime.timedelta(seconds=settings["timeout_s"])
        store = dist.TCPStore(host, int(port), 2, False, timeout)
        pair = _Pair(
            pair_id, self.backend, self.device, settings["timeout_s"], settings["staging_bytes"], store
        )
        pair.join(rank=1, host=local_ip_towards(host))
        return pair

    def _drop_pair(self, address: str, pair: _Pair) -> None:
        with self._lock:
            if self._pairs.get(address) is pair:
                del self._pairs[address]
        pair.abort()


def _decode_settings(params: bytes) -> dict[str, float | int]:
    """Pair settings from the network: msgpack of plain numbers only, checked before use."""
    settings = msgpack.unpackb(params, raw=False, strict_map_key=True)
    if not isinstance(settings, dict):
        raise KVTransportError("malformed pair settings from the KV source")
    for key, kind in _SETTINGS_KEYS.items():
        if not isinstance(settings.get(key), kind) or isinstance(settings.get(key), bool):
            raise KVTransportError(f"malformed pair setting {key!r} from the KV source")
    if not 0 < settings["staging_bytes"] <= 1 << 32 or not 0 < settings["timeout_s"] <= 3600:
        raise KVTransportError("pair settings from the KV source out of range")
    return settings


@contextlib.contextmanager
def _on_stream(pair: _Pair) -> Iterator[None]:
    """Runs a CUDA pair's block copies and ops on its own stream; no-op on CPU."""
    if pair.stream is None:
        yield
        return
    torch.cuda.set_device(pair.device)
    with torch.cuda.stream(pair.stream):
        yield
