"""NCCL transport: blocks move over one torch.distributed group per (source, sink) worker pair.

The gRPC transport handles handshake and session as for gRPC pulls. Then, once per pair:
- SetupCommunicator: the source hosts a TCPStore for the pair's rendezvous and a listener for
  its control connection (`control`), starts the pair's thread, and returns both addresses plus
  the pair settings and a random key. The pair thread joins a 2-rank group as rank 0 and accepts
  the control connection; the sink joins as rank 1 and connects, proving the key. Groups are
  built directly (ProcessGroupNCCL on CUDA, ProcessGroupGloo on CPU, chosen from the tensors'
  device), never through init_process_group: a worker may hold many pairs.

Per pull, the sink sends one header frame (request, source blocks, release) over the control
connection and at once posts its receives; the source's pair thread wakes on the frame, checks
the pin, queues its sends, then answers with one reply frame (the sink reads it after the
data). Both ends cut the pull into the same batches (blocks.plan_pieces/pack_batches), so no
per-batch metadata crosses the wire. A refused pull
(not pinned, lease expired) still sends the planned bytes, stale, so both ends stay in step;
the sink reads the refusal after the data and fails the pull (the connector recomputes or
fails the request, whose destination blocks it reports as failed).

Staging is a ring of `staging_buffers` buffers of `staging_bytes` per side (pair settings, the
source's choice). Batch i is gathered into buffer i % K and sent as one message, so gathering
batches i+1 .. i+K-1 overlaps sending batch i (and receiving them overlaps scattering i), and
the pipeline's fill and drain is one small batch. On CUDA the copies are gpu_copy's launches
over tables uploaded once per endpoint: a pull uploads only its block ids. Every gather, send,
receive and scatter of a pull is queued without waiting on the host (the pair's stream orders
them), then the pull thread waits once on a CUDA event: the pull costs two thread wake-ups per
side, not one per operation, which matters inside a busy engine process where every wake-up
waits for the GIL. A watchdog aborts a pair whose pull outlives the pair timeout, which ends
the pending NCCL operations and fails the pull.

Pulls on one pair run one at a time in the same order on both ends. A failed send or receive
breaks the pair on that end; the next pull sets up a fresh pair. A source holds at most
`max_pairs` live pairs, `max_pairs_per_session` per sink session (sessions.PairBudget), so its
staging is bounded; a sink drops an idle pair whose source closed it (nccl_pair.Watchdog).

Sends and receives go through direct NCCL calls (nccl_direct) when both ends can make them,
else through a torch ProcessGroupNCCL (nccl_pair: `pair_api`); gloo on CPU.
"""

from __future__ import annotations

import datetime
import functools
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import torch
import torch.distributed as dist

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.transport import blocks, control, gpu_copy
from pdserve.kv.transport.base import KVTransfer
from pdserve.kv.transport.defaults import (
    DEFAULT_NCCL_API, DEFAULT_NCCL_MAX_PAIRS, DEFAULT_NCCL_MAX_PAIRS_PER_SESSION,
)
from pdserve.kv.transport.errors import KVTransportError
from pdserve.kv.transport.grpc import HANDSHAKE_TIMEOUT_S, GrpcSink, GrpcSource, SourceSession
from pdserve.kv.transport.nccl_pair import (
    DEFAULT_PAIR_TIMEOUT_S, DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, MAX_NCCL_CHANNELS,
    MAX_STAGING_BUFFERS, Pair, Watchdog, backend_for, decode_settings, local_ip_towards, offered_backend,
    on_stream, pair_api, resolve_api,
)
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec
from pdserve.kv.transport.sessions import PairBudget, Session

logger = logging.getLogger(__name__)

# Pull phases kept when tracing (benchmarks); old ones fall off.
_TRACE_LEN = 4096


def plan(
    region_nbytes: Sequence[int], num_blocks: int, staging_bytes: int
) -> list[list[tuple[blocks.Piece, int]]]:
    """The batches of a pull; both ends call it with the same arguments. Cached (pulls of one
    size repeat): treat the result as read-only."""
    return _pull_plan(tuple(region_nbytes), num_blocks, staging_bytes, None)[0]


@functools.lru_cache(maxsize=512)
def _pull_plan(
    region_nbytes: tuple[int, ...], num_blocks: int, staging_bytes: int, run_shape: tuple[int, int] | None
) -> tuple[list[list[tuple[blocks.Piece, int]]], list[tuple[int, int]] | None]:
    """The batches of a pull and, given (runs per block, run bytes) of a gpu_copy.RunTable,
    each batch's span of runs. Pure, so cached across pulls."""
    capacity = max(staging_bytes, *region_nbytes)
    batches = blocks.pack_batches(blocks.plan_pieces(region_nbytes, num_blocks, capacity), capacity)
    if run_shape is None:
        return batches, None
    return batches, gpu_copy.batch_spans(*run_shape, num_blocks, batches)


class NcclSource(GrpcSource):
    """A GrpcSource that also sends blocks over per-pair torch.distributed groups.

    Takes GrpcSource's arguments plus `staging_bytes` (per buffer: the batch size of one
    send), `staging_buffers` (ring depth), `nccl_min_channels` (0: NCCL's choice),
    `pair_timeout_s`, `nccl_api` ("auto", "direct" or "torch": nccl_pair.resolve_api),
    `max_pairs` and `max_pairs_per_session` (live pairs, so staging is bounded: PairBudget) and
    `trace` (keep a SourceTrace per pull in `traces`, for benchmarks); the sink of each pair
    adopts the first three and the API chosen for the pair. Each pair has its own
    thread: it joins the group, accepts the control connection, then serves the pair's pulls in
    order until the sink goes away or the source closes.
    """

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_buffers: int = DEFAULT_STAGING_BUFFERS,
        nccl_min_channels: int = 0,
        pair_timeout_s: float = DEFAULT_PAIR_TIMEOUT_S,
        nccl_api: str = DEFAULT_NCCL_API,
        max_pairs: int = DEFAULT_NCCL_MAX_PAIRS,
        max_pairs_per_session: int = DEFAULT_NCCL_MAX_PAIRS_PER_SESSION,
        trace: bool = False,
        **grpc_options,
    ):
        if not 2 <= staging_buffers <= MAX_STAGING_BUFFERS or not 0 <= nccl_min_channels <= MAX_NCCL_CHANNELS:
            raise ValueError(
                f"staging_buffers must be 2..{MAX_STAGING_BUFFERS} and nccl_min_channels "
                f"0..{MAX_NCCL_CHANNELS}, got {staging_buffers} and {nccl_min_channels}"
            )
        self.backend, self.device = backend_for(regions)
        self.nccl_api = resolve_api(nccl_api, self.backend, nccl_min_channels)
        self._region_nbytes = [r.info().block_nbytes for r in regions]
        self.staging_bytes = max(staging_bytes, *self._region_nbytes)
        self.staging_buffers = staging_buffers
        self.nccl_min_channels = nccl_min_channels
        self.pair_timeout_s = pair_timeout_s
        self._runs = gpu_copy.RunTable.build(regions)  # one-launch gathers on CUDA, else None
        self._pairs: dict[str, tuple[Pair, socket.socket]] = {}
        self._pairs_lock = threading.Lock()
        self._budget = PairBudget(max_pairs, max_pairs_per_session)
        self._closing = False
        self.traces: deque[SourceTrace] | None = deque(maxlen=_TRACE_LEN) if trace else None
        super().__init__(layout, regions, **grpc_options)
        self._watchdog = Watchdog(self._pairs, self._pairs_lock)

    def serve_setup_communicator(self, pair_id: str, backend: str, session: Session) -> tuple[str, bytes]:
        """Server thread, once per pair: hosts the pair's store and control listener and starts
        the pair thread, whose pulls read as `session`. Returns at once with the store's
        address and the pair settings; raises PairLimitError past the pair limits."""
        self._budget.reserve(session, pair_id)
        try:
            return self._start_pair(pair_id, backend, session)
        except BaseException:
            self._budget.release(session, pair_id)
            raise

    def _start_pair(self, pair_id: str, backend: str, session: Session) -> tuple[str, bytes]:
        regions = self.regions_for(session.layout)
        api = pair_api(backend, self.backend, self.nccl_api)
        timeout = datetime.timedelta(seconds=self.pair_timeout_s)
        store = dist.TCPStore(self.host, 0, 2, True, timeout, wait_for_workers=False)
        pair = Pair(
            pair_id,
            self.backend,
            self.device,
            self.pair_timeout_s,
            self.staging_bytes,
            store,
            staging_buffers=self.staging_buffers,
            min_channels=self.nccl_min_channels,
            api=api,
            regions=tuple(regions),
            runs=self._runs if regions is self.regions else gpu_copy.RunTable.build(regions),
        )
        listener = control.listen(self.host)
        control_port = listener.getsockname()[1]  # before the pair thread may close it
        key = secrets.token_bytes(32)
        with self._pairs_lock:
            if self._closing:
                listener.close()
                raise ValueError("the KV source is closing")
            self._pairs[pair_id] = (pair, listener)
        threading.Thread(
            target=self._serve_pair,
            args=(pair, listener, key, session),
            name=f"kv-pair-{pair_id}",
            daemon=True,
        ).start()
        settings = {
            "timeout_s": self.pair_timeout_s,
            "staging_bytes": self.staging_bytes,
            "staging_buffers": self.staging_buffers,
            "nccl_min_channels": self.nccl_min_channels,
            "nccl_api": api,
            "control_port": control_port,
            "control_key": key,
        }
        return f"{self.host}:{store.port}", msgpack.packb(settings, use_bin_type=True)

    def close(self) -> None:
        """Stops the gRPC server, then every pair (its thread sees the abort), then the pins."""
        with self._pairs_lock:
            self._closing = True
            pairs, self._pairs = list(self._pairs.values()), {}
        self._watchdog.stop()
        try:
            super().close()
        finally:
            for pair, listener in pairs:
                listener.close()
                pair.abort()

    def completed_traces(self, count: int | None = None, timeout_s: float = 10.0) -> list[SourceTrace]:
        """The last `count` kept traces (all if None) once this side has finished each pull they
        record. A sink's pull can end a moment before the pair thread stamps its own end, so a
        benchmark reading traces right after its pulls waits here. Raises TimeoutError."""
        if self.traces is None:
            raise RuntimeError("this NcclSource keeps no traces (trace=False)")
        deadline = time.monotonic() + timeout_s
        while True:
            traces = list(self.traces)[-count:] if count else list(self.traces)
            if all(t.done for t in traces):
                return traces
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not t.done for t in traces)} pulls still sending")
            time.sleep(0.001)

    def _serve_pair(self, pair: Pair, listener: socket.socket, key: bytes, session: Session) -> None:
        try:
            pair.join(rank=0, host=self.host)
            pair.control = control.accept(listener, key, pair.timeout_s)
            while True:
                conn = pair.control
                if conn is None:
                    break
                header = control.PullHeader.from_wire(control.recv_frame(conn))
                trace = None
                if self.traces is not None:
                    trace = SourceTrace(header.request_id, header_read=time.monotonic())
                    self.traces.append(trace)
                self._serve_pull(pair, conn, header, session.session_id, trace)
        except Exception as exc:  # noqa: BLE001 - a broken pair is dropped; its sink fails its pull
            closed = self._closing or isinstance(exc, ConnectionError)
            level = logging.DEBUG if closed else logging.WARNING
            logger.log(level, "KV pair %s ended: %s", pair.pair_id, exc)
        finally:
            with self._pairs_lock:
                self._pairs.pop(pair.pair_id, None)
            listener.close()
            pair.abort()
            self._budget.release(session, pair.pair_id)

    def _serve_pull(
        self,
        pair: Pair,
        conn: socket.socket,
        header: control.PullHeader,
        reader: str,
        trace: SourceTrace | None = None,
    ) -> None:
        """Pair thread, once per pull: queues the sends of the blocks (stale bytes if refused),
        answers, then waits for the sends. The sink reads the answer after the data, so
        answering first would only delay the first send."""
        try:
            self.open_read(header.request_id, header.block_ids, reader)
        except (LookupError, ValueError) as exc:
            self._send(pair, header.block_ids, gather=False, reply=control.reply_to_wire(str(exc)))
            if trace is not None:
                trace.refused, trace.done = True, time.monotonic()
            return
        sent = False
        try:
            self._send(pair, header.block_ids, gather=True, reply=control.reply_to_wire(None), trace=trace)
            sent = True
        finally:
            self.close_read(header.request_id, release=sent and header.release_after)

    def _send(
        self,
        pair: Pair,
        block_ids: list[int],
        *,
        gather: bool,
        reply: bytes,
        trace: SourceTrace | None = None,
    ) -> None:
        """Gathers and sends the pull's batches round the staging ring, sends `reply` on the
        control connection once all are queued, and returns once the last send is done (so the
        blocks may be freed and staging reused)."""
        pair.deadline = time.monotonic() + pair.timeout_s
        ring = len(pair.staging)
        pending: list = [None] * ring
        with on_stream(pair):
            batches, copy = _batch_copier(
                pair.runs,
                pair.regions,
                pair.region_nbytes,
                pair,
                block_ids,
                to_staging=True,
            )
            for i, batch in enumerate(batches):
                slot = i % ring
                if pending[slot] is not None:
                    pending[slot].wait()  # that buffer's last send is done (CUDA: the stream waits)
                staging = pair.staging[slot]
                if gather:
                    copy(i, staging)
                # Looked up per batch: close() may abort the pair between two sends.
                group = pair.live_group()
                pending[slot] = group.send([staging[: blocks.batch_nbytes(batch)]], 1, _tag(i))
            for work in pending:
                if work is not None:
                    work.wait()
        if trace is not None:
            trace.queued = time.monotonic()
        conn = pair.control
        if conn is None:
            raise KVTransportError(f"KV pair {pair.pair_id}: control connection closed")
        if trace is not None:
            trace.replied = time.monotonic()  # stamped first: the sink may read it at once
        control.send_frame(conn, reply)
        pair.finish_stream()
        pair.deadline = None
        if trace is not None:
            trace.done = time.monotonic()


@dataclass(slots=True)
class SourceTrace:
    """When the source's pair thread did each part of one pull (time.monotonic(), the same
    clock for every process of a host, so a benchmark lines it up with the sink's PullTrace)."""

    request_id: str
    header_read: float  # the sink's header frame was read (the pair thread woke)
    queued: float = 0.0  # every gather and send is queued
    replied: float = 0.0  # the answer frame was sent (after the sends were queued)
    done: float = 0.0  # the GPU finished the last send (host saw it); 0 while still sending
    refused: bool = False  # the blocks were not readable: stale bytes went out instead


@dataclass(slots=True)
class PullTrace:
    """Where one NCCL pull's time went (seconds from start_pull), kept when tracing."""

    request_id: str
    nbytes: int
    started_at: float = 0.0  # time.monotonic() at start_pull: lines a SourceTrace up with this one
    thread_start: float = 0.0  # the pull thread picked it up
    header_sent: float = 0.0  # the control frame left
    queued: float = 0.0  # every receive and scatter is queued
    data_done: float = 0.0  # the GPU finished the last scatter (host saw it)
    reply_read: float = 0.0  # the source's answer was read; the pull ends right after
    gpu_s: float | None = None  # CUDA events: first receive queued to last scatter done


class NcclSink(GrpcSink):
    """A GrpcSink whose pulls move over per-pair groups; takes GrpcSink's arguments, plus
    `nccl_api` (what this end can offer: nccl_pair.resolve_api; the source picks) and `trace`
    (keep a PullTrace per pull in `traces`, for benchmarks).

    The first pull from a source sets the pair up (one SetupCommunicator round trip plus the
    rendezvous); later pulls cost one control frame each way plus the transfer.
    """

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        nccl_api: str = DEFAULT_NCCL_API,
        trace: bool = False,
        **grpc_options,
    ):
        self.backend, self.device = backend_for(regions)
        self.nccl_api = resolve_api(nccl_api, self.backend)
        self._pairs: dict[str, Pair] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self.traces: deque[PullTrace] | None = deque(maxlen=_TRACE_LEN) if trace else None
        self._runs = gpu_copy.RunTable.build(regions)  # one-launch scatters on CUDA, else None
        super().__init__(layout, regions, **grpc_options)
        self._watchdog = Watchdog(self._pairs, self._lock, drop_closed=True)

    def close(self) -> None:
        """Closes like GrpcSink, then aborts every pair."""
        self._watchdog.stop()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.abort()
        super().close()

    def _pull(
        self, session: SourceSession, transfer: KVTransfer, src: list[int], dst: list[int], release: bool
    ) -> None:
        """Pull thread: header out, receives queued, one wait, then the source's reply."""
        address = session.info.address
        trace = self._start_trace(transfer, len(dst))
        pair = self._pair(session)
        with pair.lock:
            try:
                conn = pair.control
                if conn is None:
                    raise KVTransportError("control connection closed")
                control.send_frame(conn, control.PullHeader(transfer.request_id, src, release).to_wire())
                self._stamp(trace, transfer, "header_sent")
                self._receive_batches(pair, transfer, dst, trace)
                refusal = control.reply_from_wire(control.recv_frame(conn))
                self._stamp(trace, transfer, "reply_read")
            except Exception as exc:
                self._drop_pair(address, pair)  # its message order is unknown now
                raise KVTransportError(f"{self.backend} receive from {address} failed: {exc}") from exc
        if refusal is not None:  # the pair is still in step: only this request failed
            raise KVTransportError(f"refused by {address}: {refusal}")

    def _receive_batches(
        self, pair: Pair, transfer: KVTransfer, dst: list[int], trace: PullTrace | None
    ) -> None:
        """Posts a receive per staging buffer, then per batch: scatter it, and post the receive
        that reuses its buffer. On CUDA all of it is queued before the one wait."""
        region_nbytes = pair.region_nbytes
        ring = len(pair.staging)
        pending: dict[int, object] = {}
        timing = self._gpu_timing(pair, trace)
        pair.deadline = time.monotonic() + pair.timeout_s

        def post(i: int) -> None:
            staging = pair.staging[i % ring][: blocks.batch_nbytes(batches[i])]
            pending[i] = pair.live_group().recv([staging], 0, _tag(i))

        with on_stream(pair):
            if timing:
                timing[0].record()
            batches, copy = _batch_copier(
                pair.runs, pair.regions, region_nbytes, pair, dst, to_staging=False
            )
            for i in range(min(ring, len(batches))):
                post(i)
            for i, batch in enumerate(batches):
                pending.pop(i).wait()  # CUDA: the stream waits; gloo: the data is here
                copy(i, pair.staging[i % ring])
                if pair.stream is None:
                    transfer.add_bytes(sum(piece.nbytes for piece, _ in batch))
                if i + ring < len(batches):
                    post(i + ring)  # into the buffer just scattered: queued after that scatter
            if timing:
                timing[1].record()
        self._stamp(trace, transfer, "queued")
        pair.finish_stream()
        pair.deadline = None
        if pair.stream is not None:
            transfer.add_bytes(len(dst) * sum(region_nbytes))
        self._stamp(trace, transfer, "data_done")
        if timing and trace is not None:
            trace.gpu_s = timing[0].elapsed_time(timing[1]) / 1e3

    def _start_trace(self, transfer: KVTransfer, num_blocks: int) -> PullTrace | None:
        if self.traces is None:
            return None
        nbytes = num_blocks * sum(r.block_nbytes for r in self.region_infos)
        trace = PullTrace(
            transfer.request_id,
            nbytes,
            started_at=time.monotonic() - transfer.elapsed_s,
            thread_start=transfer.elapsed_s,
        )
        self.traces.append(trace)
        return trace

    @staticmethod
    def _stamp(trace: PullTrace | None, transfer: KVTransfer, phase: str) -> None:
        if trace is not None:
            setattr(trace, phase, transfer.elapsed_s)

    @staticmethod
    def _gpu_timing(pair: Pair, trace: PullTrace | None) -> tuple[torch.cuda.Event, ...] | None:
        if trace is None or pair.stream is None:
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _pair(self, session: SourceSession) -> Pair:
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

    def _setup_pair(self, session: SourceSession) -> Pair:
        pair_id = f"{self.engine_id}-{secrets.token_hex(8)}"
        offer = offered_backend(self.backend, self.nccl_api)
        request = pb.SetupCommunicatorRequest(pair_id=pair_id, backend=offer)
        response = session.stub.SetupCommunicator(
            request, timeout=HANDSHAKE_TIMEOUT_S, metadata=session.metadata
        )
        settings = decode_settings(response.params)
        if settings["nccl_api"] == "direct" and self.nccl_api != "direct":
            raise KVTransportError("the KV source chose a direct NCCL pair this sink did not offer")
        host, _, port = response.store_address.rpartition(":")
        timeout = datetime.timedelta(seconds=settings["timeout_s"])
        store = dist.TCPStore(host, int(port), 2, False, timeout)
        pair = Pair(
            pair_id,
            self.backend,
            self.device,
            settings["timeout_s"],
            settings["staging_bytes"],
            store,
            staging_buffers=settings["staging_buffers"],
            min_channels=settings["nccl_min_channels"],
            api=settings["nccl_api"],
            regions=session.regions,
            runs=self._runs if session.regions is self.regions else gpu_copy.RunTable.build(session.regions),
        )
        try:
            pair.join(rank=1, host=local_ip_towards(host))
            pair.control = control.connect(
                host, settings["control_port"], settings["control_key"], settings["timeout_s"]
            )
        except BaseException:
            pair.abort()
            raise
        return pair

    def _drop_pair(self, address: str, pair: Pair) -> None:
        with self._lock:
            if self._pairs.get(address) is pair:
                del self._pairs[address]
        pair.abort()


def _tag(batch: int) -> int:
    """The message tag of batch i: alternating 0/1 whatever the ring depth, as before rings
    (gloo matches a tag's messages in order; NCCL ignores tags)."""
    return batch % 2


def _batch_copier(
    runs: gpu_copy.RunTable | None,
    regions: Sequence[BlockRegion],
    region_nbytes: Sequence[int],
    pair: Pair,
    block_ids: list[int],
    *,
    to_staging: bool,
) -> tuple[list[list[tuple[blocks.Piece, int]]], Callable[[int, torch.Tensor], None]]:
    """(batches, copy) of a pull: its plan, and copy(i, staging) that moves batch i between the
    regions and a staging buffer, on the current stream. With a run table, one small block-id
    upload per pull and one launch per batch; otherwise one torch copy (CUDA) or memmove loop
    (CPU) per piece. Per-pair regions plug in here: pass that pair's table and regions."""
    run_shape = None if runs is None else (runs.runs_per_block, runs.run_bytes)
    batches, spans = _pull_plan(tuple(region_nbytes), len(block_ids), pair.staging_bytes, run_shape)
    if runs is not None:
        ids = gpu_copy.upload_block_ids(block_ids, pair.device)  # lives as long as `copy`

        def launch(i: int, staging: torch.Tensor) -> None:
            words = staging[: spans[i][1] * runs.run_bytes].view(torch.int32)
            gpu_copy.copy_batch(runs, ids, spans[i], words, to_staging=to_staging)

        return batches, launch
    index = blocks.block_index(block_ids, pair.device)
    move = blocks.gather if to_staging else blocks.scatter

    def copy(i: int, staging: torch.Tensor) -> None:
        for piece, offset in batches[i]:
            move(regions[piece.region], index, piece, staging[offset:])

    return batches, copy

