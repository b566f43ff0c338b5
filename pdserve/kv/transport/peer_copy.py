"""One-launch copies of many blocks straight from a peer's mapped KV regions into local ones (the
`cuda_ipc` transport): no staging buffer, no second copy.

Both sides' regions are described as runs (gpu_copy.RegionRuns: a block is a few contiguous runs
of equal length, K and V halves in vLLM's GPU layout). A `PeerTable` pairs the source's regions,
at their addresses in this process (ipc_memory.open_handle), with the sink's own; it is built
once per source and its arrays uploaded to the sink's GPU once. The copy kernel's programs
compute their own addresses:

    run g of the pull = (region r, block j of the pull, run k of the block)
    source address = src_base[r] + src_ids[j] * src_stride[r] + src_offset[r, k]
    sink address   = dst_base[r] + dst_ids[j] * dst_stride[r] + dst_offset[r, k]

The kernel on the sink's GPU reads the source's memory over NVLink (peer access) and writes its
own. It takes a pull's ids as one int64 buffer, `[n, 0, src ids (n), dst ids (n)]`, and runs a
fixed grid (a few programs per SM, each looping over chunks of runs), so every launch of one link
is the same launch whatever the pull's size. That is what makes a pull's host side short: a
`LaunchRing` (one per link) captures, once per slot, a CUDA graph of "copy the slot's pinned ids
to the GPU, run the kernel, record the slot's event", and a pull writes its ids into the next
slot and launches that graph: one CUDA call, no Triton dispatch, no allocation. Where capture is
not possible (or `graphs=False`), the same three steps are launched one by one.

`PeerTable.addresses` is the same arithmetic in numpy, the reference the tests hold the kernel
to, and `copy_on_host` the same copy with memmove for CPU regions (tests, fakes).
"""

from __future__ import annotations

import array
import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv.transport import ipc_memory
from pdserve.kv.transport.gpu_copy import RegionRuns

logger = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# int32 elements per chunk (16 KiB), warps per program and resident programs per SM: the
# defaults, swept on 2 x H200 (benchmarks/gpu/ipc_transfer.py; benchmarks/results/gpu/
# 2026-11-29-h200-x2-ipc2/). 8 programs of 8 warps fill an SM's 2048 threads.
DEFAULT_BLOCK_ELEMS = 4096
DEFAULT_NUM_WARPS = 8
DEFAULT_PROGRAMS_PER_SM = 8
# Slots of a ring: more than the pulls a link has in flight in practice; a pull that finds its
# slot still in use waits for that slot's copy.
RING_SLOTS = 8
# Block ids a slot holds at first (16 KiB of pinned ids with 8-byte ids); a larger pull grows
# every slot to the next power of two (and captures their graphs again), once.
FIRST_CAPACITY = 512
_HEADER = 2  # [n, 0] before the ids: keeps the source ids 16-byte aligned


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """How the copy kernel is launched; CudaIpcSink's keywords, fixed per sink."""

    block_elems: int = DEFAULT_BLOCK_ELEMS  # int32 elements a program moves per step
    num_warps: int = DEFAULT_NUM_WARPS
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM
    graphs: bool = True  # False: each pull launches its three steps one by one (comparison)
    streaming: bool = False  # loads bypass L1 (.cg), stores are marked streaming (.cs)


@dataclass(frozen=True, slots=True)
class PeerTable:
    """Source and sink run layouts of a pair of region lists (same count, same runs per block and
    run length), with the arrays on the sink's device once `uploaded`."""

    src_bases: np.ndarray  # [regions] source region addresses in this process
    src_strides: np.ndarray
    src_offsets: np.ndarray  # [regions, runs]
    dst_bases: np.ndarray
    dst_strides: np.ndarray
    dst_offsets: np.ndarray
    run_bytes: int
    on_device: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def pair(cls, src: Sequence[RegionRuns], dst: Sequence[RegionRuns | None]) -> PeerTable:
        """Raises ValueError unless both sides have the same count of regions and every region
        the same runs per block and run length; host arrays only."""
        if len(src) != len(dst) or not src:
            raise ValueError(f"{len(src)} source regions but {len(dst)} local ones")
        shapes = {(d.run_bytes, len(d.offsets)) for d in (*src, *dst) if d is not None}
        if None in dst or len(shapes) != 1:
            raise ValueError(f"the regions' blocks are not alike runs on both sides: {sorted(shapes)}")

        def arrays(side: Sequence[RegionRuns]) -> tuple[np.ndarray, ...]:
            return (
                np.array([d.base for d in side], dtype=np.int64),
                np.array([d.block_stride for d in side], dtype=np.int64),
                np.array([d.offsets for d in side], dtype=np.int64).reshape(len(side), -1),
            )

        return cls(*arrays(src), *arrays(dst), src[0].run_bytes)  # type: ignore[arg-type]

    @property
    def num_regions(self) -> int:
        return len(self.src_bases)

    @property
    def runs_per_block(self) -> int:
        return self.src_offsets.shape[1]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across every region."""
        return self.num_regions * self.runs_per_block * self.run_bytes

    def uploaded(self, device: torch.device) -> PeerTable:
        """This table with its six arrays on `device` (once; synchronous)."""
        host = (
            self.src_bases,
            self.src_strides,
            self.src_offsets,
            self.dst_bases,
            self.dst_strides,
            self.dst_offsets,
        )
        tensors = tuple(torch.from_numpy(a.reshape(-1).copy()).to(device) for a in host)
        return PeerTable(*host, self.run_bytes, tensors)

    def addresses(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> np.ndarray:
        """int64 [runs, 2]: (source address, sink address) of every run of a pull, in the kernel's
        order. Host reference for tests and for `copy_on_host`."""
        runs = np.arange(self.num_regions * len(src_ids) * self.runs_per_block, dtype=np.int64)
        per_region = len(src_ids) * self.runs_per_block
        region, within = np.divmod(runs, per_region)
        block, run = np.divmod(within, self.runs_per_block)
        src = self.src_bases[region] + np.asarray(src_ids, np.int64)[block] * self.src_strides[region]
        dst = self.dst_bases[region] + np.asarray(dst_ids, np.int64)[block] * self.dst_strides[region]
        return np.stack((src + self.src_offsets[region, run], dst + self.dst_offsets[region, run]), axis=1)


def copy_on_host(table: PeerTable, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """The pull as memmoves between host addresses (CPU regions: tests and fakes); returns bytes."""
    pairs = table.addresses(src_ids, dst_ids)
    for src, dst in pairs.tolist():
        ctypes.memmove(dst, src, table.run_bytes)
    return len(pairs) * table.run_bytes


def write_ids(buffer: memoryview, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """Lays a pull's ids out as the kernel reads them, `[n, 0, src..., dst...]`, at the start of
    `buffer` (int64 items, format "q"); returns how many items that took. array.array turns a
    list of ints into machine words about a third faster than numpy does (on every pull)."""
    n = len(src_ids)
    buffer[0] = n
    buffer[_HEADER : _HEADER + n] = array.array("q", src_ids)
    buffer[_HEADER + n : _HEADER + 2 * n] = array.array("q", dst_ids)
    return _HEADER + 2 * n


def id_buffer(ids: np.ndarray | torch.Tensor) -> memoryview:
    """A CPU int64 array or tensor as `write_ids` writes it (no copy)."""
    array_ = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    return memoryview(array_).cast("B").cast("q")


def launch_kernel(
    table: PeerTable, ids: torch.Tensor, anchor: torch.Tensor, settings: LaunchSettings, programs: int
) -> None:
    """One launch, on the current stream, of the copy over the pull laid out in `ids` (int64 on
    the sink's device, `write_ids`'s layout): `programs` programs whatever the pull's size.
    `anchor` is any 16-byte aligned int32 tensor on that device: the kernel addresses both
    sides relative to it."""
    assert table.on_device is not None, "the kernel needs PeerTable.uploaded"
    elems = table.run_bytes // 4
    block = min(settings.block_elems, triton.next_power_of_2(elems))
    if anchor.data_ptr() % 16 or ids.data_ptr() % 16:
        # Triton specializes pointers on 16-byte alignment: another alignment would compile a
        # second kernel (the ring's buffers and the link's anchor are allocations: aligned).
        raise ValueError("peer_copy needs 16-byte aligned tensors")
    _peer_kernel[(programs,)](
        anchor, anchor.data_ptr(), ids, *table.on_device, table.num_regions,
        RUNS=table.runs_per_block, RUN_ELEMS=elems, BLOCK=block, CHUNKS=triton.cdiv(elems, block),
        STREAMING=settings.streaming, num_warps=settings.num_warps,
    )  # fmt: skip


@dataclass(slots=True)
class _Slot:
    host: torch.Tensor  # pinned int64 ids, write_ids's layout, capacity blocks
    host_ids: memoryview  # the same memory as machine words (writing it costs no torch call)
    ids: torch.Tensor  # their copy on the GPU, which the kernel reads
    done: torch.cuda.Event  # recorded after the slot's latest copy
    graph: torch.cuda.CUDAGraph | None = None  # ids to the GPU, kernel, record `done`
    graph_exec: int = 0
    launched: int = 0  # copies queued through this slot
    finished: int = 0  # the latest of them seen finished (by Launched.wait)


@dataclass(frozen=True, slots=True)
class Launched:
    """One queued copy (LaunchRing.launch's answer)."""

    slot: _Slot
    number: int  # its count among the slot's copies

    def wait(self) -> None:
        """Blocks until the copy has run (a spin on its event; the GIL is released). One thread
        waits for a ring's copies, so the slot's `finished` only grows."""
        self.slot.done.synchronize()  # a later record of the event only waits longer
        if self.slot.finished < self.number:
            self.slot.finished = self.number


class LaunchRing:
    """One link's launches of the copy: RING_SLOTS slots, each with pinned ids, their GPU copy,
    an event and (with `settings.graphs`) a CUDA graph captured once. GPU only; the link calls
    `launch` under its lock (one caller at a time) and `close` after its stream has drained.

    A slot is reused once its previous copy has run (its event), so a pull never overwrites ids
    that the GPU has not read yet. Building the ring compiles the kernel (a launch over zero
    blocks) and captures the graphs: milliseconds, once per link and per growth."""

    def __init__(
        self, table: PeerTable, anchor: torch.Tensor, stream: torch.cuda.Stream, settings: LaunchSettings
    ):
        self.table, self.anchor, self.stream, self.settings = table, anchor, stream, settings
        self.device = anchor.device
        self.programs = programs_for(self.device, settings)
        self.graph_error: str | None = None  # why the ring launches step by step, if it does
        self._calls = ipc_memory.StreamCalls() if settings.graphs else None
        self._stream_handle = stream.cuda_stream
        self._slots: list[_Slot] = []
        self._next = 0
        self.capacity = 0
        self._grow(FIRST_CAPACITY)

    def launch(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> Launched:
        """Queues one pull's copy on the ring's stream. Blocks only when the slot's previous
        copy has not run yet; asks CUDA only when no `wait` has seen it run. Raises
        KVTransportError if CUDA refuses the launch."""
        if len(src_ids) > self.capacity:
            self._grow(len(src_ids))
        slot = self._slots[self._next]
        self._next = (self._next + 1) % RING_SLOTS
        if slot.finished < slot.launched and not slot.done.query():
            slot.done.synchronize()
        used = write_ids(slot.host_ids, src_ids, dst_ids)
        if not slot.graph_exec:
            self._launch_steps(slot, used)
        elif torch.cuda.current_device() == self.device.index:  # the runtime launches there
            self._calls.launch_graph(slot.graph_exec, self._stream_handle)
        else:
            with torch.cuda.device(self.device):
                self._calls.launch_graph(slot.graph_exec, self._stream_handle)
        slot.launched += 1
        return Launched(slot, slot.launched)

    def close(self) -> None:
        """Frees the graphs and buffers; the caller has waited for the stream."""
        self._slots = []

    def _launch_steps(self, slot: _Slot, used: int) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            slot.ids[:used].copy_(slot.host[:used], non_blocking=True)
            launch_kernel(self.table, slot.ids, self.anchor, self.settings, self.programs)
            slot.done.record(self.stream)

    def _grow(self, blocks: int) -> None:
        """Replaces every slot by one that holds `blocks` ids (a power of two, at least
        FIRST_CAPACITY), once the old slots' copies have run."""
        for slot in self._slots:
            slot.done.synchronize()
        capacity = max(FIRST_CAPACITY, 1 << (blocks - 1).bit_length())
        self._slots = [self._slot(capacity) for _ in range(RING_SLOTS)]
        self._next, self.capacity = 0, capacity

    def _slot(self, capacity: int) -> _Slot:
        size = _HEADER + 2 * capacity
        host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            ids = torch.zeros(size, dtype=torch.int64, device=self.device)  # n = 0: copies nothing
            launch_kernel(self.table, ids, self.anchor, self.settings, self.programs)  # compiles
            done = torch.cuda.Event()
            done.record(self.stream)  # creates the CUDA event that the graph records
        slot = _Slot(host, id_buffer(host), ids, done)
        if self._calls is not None and self.graph_error is None:
            try:
                slot.graph = self._capture(slot, size * 8)
                slot.graph_exec = slot.graph.raw_cuda_graph_exec()
            except Exception as exc:  # noqa: BLE001 - any failure: launch step by step instead
                self.graph_error = f"{type(exc).__name__}: {exc}"
                logger.warning("KV copy graphs unavailable, launching step by step: %s", exc)
                slot.graph, slot.graph_exec = None, 0
        return slot

    def _capture(self, slot: _Slot, nbytes: int) -> torch.cuda.CUDAGraph:
        """The slot's graph: its whole pinned buffer to the GPU, the kernel, its event."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # thread_local: other threads of an engine may use CUDA freely meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                to, source = slot.ids.data_ptr(), slot.host.data_ptr()
                self._calls.copy_to_device(to, source, nbytes, self._stream_handle)
                launch_kernel(self.table, slot.ids, self.anchor, self.settings, self.programs)
                self._calls.record_external(slot.done.cuda_event, self._stream_handle)
            finally:
                graph.capture_end()
        self.stream.synchronize()
        return graph


def programs_for(device: torch.device, settings: LaunchSettings) -> int:
    """The launch's fixed grid: `programs_per_sm` on every SM of `device`."""
    return torch.cuda.get_device_properties(device).multi_processor_count * settings.programs_per_sm


if triton is not None:
    # anchor_addr differs per link (a new link must not recompile); the pull's size is read on
    # the GPU, so no launch argument depends on the pull.
    @triton.jit(do_not_specialize=["anchor_addr"])
    def _peer_kernel(
        anchor, anchor_addr, ids, src_bases, src_strides, src_offsets,
        dst_bases, dst_strides, dst_offsets, num_regions,
        RUNS: tl.constexpr, RUN_ELEMS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
        STREAMING: tl.constexpr,
    ):  # fmt: skip
        """Each program moves chunks pid, pid + programs, ... of the pull; chunk c is BLOCK int32
        of run c // CHUNKS. Addresses are int64 and taken relative to `anchor` (Triton knows a
        pointer argument is 16-byte aligned; every address here is too), so each access is a
        128-bit vector."""
        n = tl.load(ids).to(tl.int64)
        per_region = n * RUNS
        total = num_regions * per_region * CHUNKS
        programs = tl.num_programs(0).to(tl.int64)
        for chunk in range(tl.program_id(0).to(tl.int64), total, programs):
            run = chunk // CHUNKS
            part = chunk - run * CHUNKS
            region = run // per_region
            within = run - region * per_region
            block = within // RUNS
            k = within - block * RUNS
            src = tl.load(src_bases + region) + tl.load(ids + 2 + block) * tl.load(src_strides + region)
            src += tl.load(src_offsets + region * RUNS + k)
            dst = tl.load(dst_bases + region) + tl.load(ids + 2 + n + block) * tl.load(dst_strides + region)
            dst += tl.load(dst_offsets + region * RUNS + k)
            src_elem = tl.multiple_of((src - anchor_addr) // 4, 4)  # exact: both 16-byte aligned
            dst_elem = tl.multiple_of((dst - anchor_addr) // 4, 4)
            lane = part * BLOCK + tl.arange(0, BLOCK)
            mask = lane < RUN_ELEMS  # all true (and dropped by the compiler) when BLOCK divides runs
            if STREAMING:
                data = tl.load(anchor + src_elem + lane, mask=mask, cache_modifier=".cg")
                tl.store(anchor + dst_elem + lane, data, mask=mask, cache_modifier=".cs")
            else:
                tl.store(anchor + dst_elem + lane, tl.load(anchor + src_elem + lane, mask=mask), mask=mask)
