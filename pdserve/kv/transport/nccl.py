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
the pin, answers with one reply frame and sends. Both ends cut the pull into the same batches
(blocks.plan_pieces/pack_batches), so no per-batch metadata crosses the wire. A refused pull
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
breaks the pair on that end; the next pull sets up a fresh pair.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgpack
import torch
import torch.distributed as dist

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.transport import blocks, control, gpu_copy
from pdserve.kv.transport.base import BlockRegion, KVLayoutSpec, KVTransfer, KVTransportError
from pdserve.kv.transport.grpc import HANDSHAKE_TIMEOUT_S, GrpcSink, GrpcSource, SourceSession

logger = logging.getLogger(__name__)

# Staging: a ring of 4 buffers of 64 MiB per pair and side (the same 256 MiB as the first
# design's 2 x 128 MiB). Measured NCCL send/recv between two H100s over NVLink: 20 GB/s at 1 MiB
# messages, 282 GB/s at 16 MiB, 348 GB/s at 128 MiB, 372 GB/s at 1 GiB; one Llama-8B block of one
# layer is 64 KiB, so sending slices one by one would crawl. Swept on 4 x H100 in one run
# (benchmarks/transfer_sweep.py; benchmarks/results/gpu/2026-11-26-x4/): a 256 MiB pull took
# 1.61 ms with 2 x 128 MiB, 1.60 with 4 x 32, 1.46 with 4 x 64 (best), 2.74-3.00 with 16 MiB
# batches (the host falls behind the wire); NCCL channel and chunk-size settings did not help.
DEFAULT_STAGING_BYTES = 64 << 20
DEFAULT_STAGING_BUFFERS = 4
# What a source that predates the setting uses (its settings lack "staging_buffers").
LEGACY_STAGING_BUFFERS = 2
# Rendezvous and per-pull timeout of a pair. A receive waits this long for a dead peer
# before failing the pull; keep it well above the longest pull (~1 s for 256 MiB on gloo).
DEFAULT_PAIR_TIMEOUT_S = 30.0
# How often the watchdog looks for pulls past their deadline; a timeout fires this much late.
WATCHDOG_PERIOD_S = 0.5
# The pair settings the source sends in SetupCommunicator.params (msgpack), with their types.
_SETTINGS_KEYS: dict[str, type | tuple[type, ...]] = {
    "timeout_s": (int, float),
    "staging_bytes": int,
    "control_port": int,
    "control_key": bytes,
}
# Later settings, absent from older sources' params: (type, value when absent). Older sinks
# ignore them; the batch plan depends on staging_bytes only, so either side may differ in ring
# depth without losing step (send i still meets receive i).
_OPTIONAL_SETTINGS: dict[str, tuple[type, object]] = {
    "staging_buffers": (int, LEGACY_STAGING_BUFFERS),
    "nccl_min_channels": (int, 0),  # 0: NCCL's own choice
}
# Staging ring depth and NCCL channels a source may ask for.
MAX_STAGING_BUFFERS = 16
MAX_NCCL_CHANNELS = 64
# Pull phases kept when tracing (benchmarks); old ones fall off.
_TRACE_LEN = 4096


def backend_for(regions: Sequence[BlockRegion]) -> tuple[str, torch.device]:
    """("nccl", cuda device) or ("gloo", cpu) from where the regions live; all must share it."""
    devices = {r.tensor.device for r in regions}
    if len(devices) != 1:
        raise ValueError(f"all KV regions must live on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    return ("nccl" if device.type == "cuda" else "gloo"), device


def make_pair_group(
    store: dist.Store, rank: int, backend: str, host: str, timeout_s: float, min_channels: int = 0
) -> dist.ProcessGroup:
    """A 2-rank group over `store`; blocks until the peer joins (gloo) or the first op (NCCL).
    `min_channels` > 0 asks NCCL for at least that many channels (CTAs) on this pair's
    communicators only (ncclConfig_t.minCTAs; no environment, no GPU setting changes).

    Called once per pair on each end, on a pair or pull thread.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    options = dist.ProcessGroupNCCL.Options()
    # Past our own watchdog's deadline, so a stuck pull is aborted by it, not by torch's.
    options._timeout = timeout + datetime.timedelta(seconds=30)
    if min_channels:
        try:
            # NCCL refuses a minimum without a maximum ("Invalid config min/max channels
            # attribute value 32/-2147483648", seen on H100): give both.
            options.config.min_ctas = min_channels
            options.config.max_ctas = MAX_NCCL_CHANNELS
        except AttributeError:  # torch built against an NCCL without ncclConfig_t CTAs
            logger.warning("this torch cannot set NCCL channels per communicator; using defaults")
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def local_ip_towards(host: str) -> str:
    """The local address that routes to `host` (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


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


@dataclass(slots=True)
class _Pair:
    """One end of a pair: its communicator, control connection, staging ring and stream."""

    pair_id: str
    backend: str
    device: torch.device
    timeout_s: float
    staging_bytes: int
    store: dist.Store
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    min_channels: int = 0  # NCCL channels asked for (0: NCCL's choice)
    group: dist.ProcessGroup | None = None
    control: socket.socket | None = None
    staging: tuple[torch.Tensor, ...] = ()
    stream: torch.cuda.Stream | None = None
    deadline: float | None = None  # of the pull in flight; the watchdog aborts past it
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The views of this end's regions that the pair's pulls move (head slices when the peers'
    # TP sizes differ: heads.peer_regions), and their run table.
    regions: tuple[BlockRegion, ...] = ()
    runs: gpu_copy.RunTable | None = None

    def join(self, rank: int, host: str) -> None:
        """Builds the group, staging and stream; pair thread (source) or pull thread (sink), once."""
        self.group = make_pair_group(
            dist.PrefixStore(self.pair_id, self.store),
            rank,
            self.backend,
            host,
            self.timeout_s,
            self.min_channels,
        )
        # Allocated on the device's current stream; used only on the pair's own stream.
        self.staging = tuple(
            torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.staging_buffers)
        )
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)

    def live_group(self) -> dist.ProcessGroup:
        """The group, or KVTransportError once the pair was aborted."""
        group = self.group
        if group is None:
            raise KVTransportError(f"KV pair {self.pair_id} was closed or timed out")
        return group

    def finish_stream(self) -> None:
        """Waits, GIL released, until everything queued on the pair's stream has run (CUDA); a
        no-op on gloo, whose ops already waited. Raises if the pair was aborted meanwhile."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            event.synchronize()
        self.live_group()

    def abort(self) -> None:
        """Tears the group and control connection down so pending and later ops fail; any
        thread (close, watchdog, the pair's own threads); only the first call matters."""
        group, self.group = self.group, None
        conn, self.control = self.control, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if group is not None:
            try:
                group.abort()
            except Exception:
                logger.debug("abort of KV pair %s failed", self.pair_id, exc_info=True)


class _Watchdog:
    """One thread per endpoint that aborts pairs whose pull outlived its deadline.

    NCCL operations never time out on the host side by themselves (the pull thread waits on a
    CUDA event), so a dead or stuck peer is caught here. Lifecycle: start in the endpoint's
    constructor, `stop` in its close.
    """

    def __init__(self, pairs: dict, lock: threading.Lock, period_s: float = WATCHDOG_PERIOD_S):
        self._pairs, self._lock, self._period_s = pairs, lock, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-nccl-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            now = time.monotonic()
            with self._lock:
                entries = list(self._pairs.values())
            for entry in entries:
                pair = entry[0] if isinstance(entry, tuple) else entry
                if pair.deadline is not None and now > pair.deadline:
                    logger.warning("KV pair %s: pull exceeded %.0f s, aborting", pair.pair_id, pair.timeout_s)
                    pair.abort()


class NcclSource(GrpcSource):
    """A GrpcSource that also sends blocks over per-pair torch.distributed groups.

    Takes GrpcSource's arguments plus `staging_bytes` (per buffer: the batch size of one
    send), `staging_buffers` (ring depth), `nccl_min_channels` (0: NCCL's choice) and
    `pair_timeout_s`; the sink of each pair adopts the first three. Each pair has its own
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
        **grpc_options,
    ):
        if not 2 <= staging_buffers <= MAX_STAGING_BUFFERS or not 0 <= nccl_min_channels <= MAX_NCCL_CHANNELS:
            raise ValueError(
                f"staging_buffers must be 2..{MAX_STAGING_BUFFERS} and nccl_min_channels "
                f"0..{MAX_NCCL_CHANNELS}, got {staging_buffers} and {nccl_min_channels}"
            )
        self.backend, self.device = backend_for(regions)
        self._region_nbytes = [r.info().block_nbytes for r in regions]
        self.staging_bytes = max(staging_bytes, *self._region_nbytes)
        self.staging_buffers = staging_buffers
        self.nccl_min_channels = nccl_min_channels
        self.pair_timeout_s = pair_timeout_s
        self._runs = gpu_copy.RunTable.build(regions)  # one-launch gathers on CUDA, else None
        self._pairs: dict[str, tuple[_Pair, socket.socket]] = {}
        self._pairs_lock = threading.Lock()
        self._closing = False
        super().__init__(layout, regions, **grpc_options)
        self._watchdog = _Watchdog(self._pairs, self._pairs_lock)

    def serve_setup_communicator(
        self, pair_id: str, backend: str, regions: Sequence[BlockRegion]
    ) -> tuple[str, bytes]:
        """Server thread, once per pair: hosts the pair's store and control listener and starts
        the pair thread. Returns at once with the store's address and the pair settings."""
        if backend != self.backend:
            raise KVTransportError(
                f"backend mismatch: source uses {self.backend}, sink asked for {backend!r}"
            )
        timeout = datetime.timedelta(seconds=self.pair_timeout_s)
        store = dist.TCPStore(self.host, 0, 2, True, timeout, wait_for_workers=False)
        pair = _Pair(
            pair_id,
            self.backend,
            self.device,
            self.pair_timeout_s,
            self.staging_bytes,
            store,
            staging_buffers=self.staging_buffers,
            min_channels=self.nccl_min_channels,
            regions=tuple(regions),
            runs=self._runs if regions is self.regions else gpu_copy.RunTable.build(regions),
        )
        listener = control.listen(self.host)
        key = secrets.token_bytes(32)
        with self._pairs_lock:
            if pair_id in self._pairs or self._closing:
                listener.close()
                raise ValueError(f"pair {pair_id!r} already exists or the source is closing")
            self._pairs[pair_id] = (pair, listener)
        threading.Thread(
            target=self._serve_pair, args=(pair, listener, key), name=f"kv-pair-{pair_id}", daemon=True
        ).start()
        settings = {
            "timeout_s": self.pair_timeout_s,
            "staging_bytes": self.staging_bytes,
            "staging_buffers": self.staging_buffers,
            "nccl_min_channels": self.nccl_min_channels,
            "control_port": listener.getsockname()[1],
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

    def _serve_pair(self, pair: _Pair, listener: socket.socket, key: bytes) -> None:
        try:
            pair.join(rank=0, host=self.host)
            pair.control = control.accept(listener, key, pair.timeout_s)
            while True:
                conn = pair.control
                if conn is None:
                    break
                header = control.PullHeader.from_wire(control.recv_frame(conn))
                self._serve_pull(pair, conn, header)
        except Exception as exc:  # noqa: BLE001 - a broken pair is dropped; its sink fails its pull
            closed = self._closing or isinstance(exc, ConnectionError)
            level = logging.DEBUG if closed else logging.WARNING
            logger.log(level, "KV pair %s ended: %s", pair.pair_id, exc)
        finally:
            with self._pairs_lock:
                self._pairs.pop(pair.pair_id, None)
            listener.close()
            pair.abort()

    def _serve_pull(self, pair: _Pair, conn: socket.socket, header: control.PullHeader) -> None:
        """Pair thread, once per pull: answers, then sends the blocks (stale bytes if refused)."""
        try:
            self.open_read(header.request_id, header.block_ids)
        except (LookupError, ValueError) as exc:
            control.send_frame(conn, control.reply_to_wire(str(exc)))
            self._send(pair, header.block_ids, gather=False)
            return
        sent = False
        try:
            control.send_frame(conn, control.reply_to_wire(None))
            self._send(pair, header.block_ids, gather=True)
            sent = True
        finally:
            self.close_read(header.request_id, release=sent and header.release_after)

    def _send(self, pair: _Pair, block_ids: list[int], *, gather: bool) -> None:
        """Gathers and sends the pull's batches round the staging ring; returns once the last
        send is done (so the blocks may be freed and staging reused)."""
        pair.deadline = time.monotonic() + pair.timeout_s
        ring = len(pair.staging)
        pending: list = [None] * ring
        with _on_stream(pair):
            batches, copy = _batch_copier(
                pair.runs,
                pair.regions,
                [r.info().block_nbytes for r in pair.regions],
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
        pair.finish_stream()
        pair.deadline = None


@dataclass(slots=True)
class PullTrace:
    """Where one NCCL pull's time went (seconds from start_pull), kept when tracing."""

    request_id: str
    nbytes: int
    thread_start: float = 0.0  # the pull thread picked it up
    header_sent: float = 0.0  # the control frame left
    queued: float = 0.0  # every receive and scatter is queued
    data_done: float = 0.0  # the GPU finished the last scatter (host saw it)
    reply_read: float = 0.0  # the source's answer was read; the pull ends right after
    gpu_s: float | None = None  # CUDA events: first receive queued to last scatter done


class NcclSink(GrpcSink):
    """A GrpcSink whose pulls move over per-pair groups; takes GrpcSink's arguments, plus
    `trace` (keep a PullTrace per pull in `traces`, for benchmarks).

    The first pull from a source sets the pair up (one SetupCommunicator round trip plus the
    rendezvous); later pulls cost one control frame each way plus the transfer.
    """

    def __init__(
        self, layout: KVLayoutSpec, regions: Sequence[BlockRegion], *, trace: bool = False, **grpc_options
    ):
        self.backend, self.device = backend_for(regions)
        self._pairs: dict[str, _Pair] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self.traces: deque[PullTrace] | None = deque(maxlen=_TRACE_LEN) if trace else None
        self._runs = gpu_copy.RunTable.build(regions)  # one-launch scatters on CUDA, else None
        super().__init__(layout, regions, **grpc_options)
        self._watchdog = _Watchdog(self._pairs, self._lock)

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
        self, pair: _Pair, transfer: KVTransfer, dst: list[int], trace: PullTrace | None
    ) -> None:
        """Posts a receive per staging buffer, then per batch: scatter it, and post the receive
        that reuses its buffer. On CUDA all of it is queued before the one wait."""
        region_nbytes = [r.info().block_nbytes for r in pair.regions]
        ring = len(pair.staging)
        pending: dict[int, object] = {}
        timing = self._gpu_timing(pair, trace)
        pair.deadline = time.monotonic() + pair.timeout_s

        def post(i: int) -> None:
            staging = pair.staging[i % ring][: blocks.batch_nbytes(batches[i])]
            pending[i] = pair.live_group().recv([staging], 0, _tag(i))

        with _on_stream(pair):
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
        trace = PullTrace(transfer.request_id, nbytes, thread_start=transfer.elapsed_s)
        self.traces.append(trace)
        return trace

    @staticmethod
    def _stamp(trace: PullTrace | None, transfer: KVTransfer, phase: str) -> None:
        if trace is not None:
            setattr(trace, phase, transfer.elapsed_s)

    @staticmethod
    def _gpu_timing(pair: _Pair, trace: PullTrace | None) -> tuple[torch.cuda.Event, ...] | None:
        if trace is None or pair.stream is None:
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

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
            pair_id,
            self.backend,
            self.device,
            settings["timeout_s"],
            settings["staging_bytes"],
            store,
            staging_buffers=settings["staging_buffers"],
            min_channels=settings["nccl_min_channels"],
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

    def _drop_pair(self, address: str, pair: _Pair) -> None:
        with self._lock:
            if self._pairs.get(address) is pair:
                del self._pairs[address]
        pair.abort()


def _decode_settings(params: bytes) -> dict[str, float | int | bytes]:
    """Pair settings from the network: msgpack of plain values only, checked before use."""
    settings = msgpack.unpackb(params, raw=False, strict_map_key=True)
    if not isinstance(settings, dict):
        raise KVTransportError("malformed pair settings from the KV source")
    for key, (kind, absent) in _OPTIONAL_SETTINGS.items():
        settings.setdefault(key, absent)
    kinds = {**_SETTINGS_KEYS, **{key: kind for key, (kind, _) in _OPTIONAL_SETTINGS.items()}}
    for key, kind in kinds.items():
        if not isinstance(settings.get(key), kind) or isinstance(settings.get(key), bool):
            raise KVTransportError(f"malformed pair setting {key!r} from the KV source")
    if (
        not 0 < settings["staging_bytes"] <= 1 << 32
        or not 2 <= settings["staging_buffers"] <= MAX_STAGING_BUFFERS
        or not 0 <= settings["nccl_min_channels"] <= MAX_NCCL_CHANNELS
        or not 0 < settings["timeout_s"] <= 3600
        or not 0 < settings["control_port"] < 65536
        or len(settings["control_key"]) != 32
    ):
        raise KVTransportError("pair settings from the KV source out of range")
    return settings


def _tag(batch: int) -> int:
    """The message tag of batch i: alternating 0/1 whatever the ring depth, as before rings
    (gloo matches a tag's messages in order; NCCL ignores tags)."""
    return batch % 2


def _batch_copier(
    runs: gpu_copy.RunTable | None,
    regions: Sequence[BlockRegion],
    region_nbytes: Sequence[int],
    pair: _Pair,
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


@contextlib.contextmanager
def _on_stream(pair: _Pair) -> Iterator[None]:
    """Runs a CUDA pair's block copies and ops on its own stream; no-op on CPU."""
    if pair.stream is None:
        yield
        return
    torch.cuda.set_device(pair.device)
    with torch.cuda.stream(pair.stream):
        yield
