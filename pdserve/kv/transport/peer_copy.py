"""One-launch copies of many blocks straight from a peer's mapped KV regions into local ones (the
`cuda_ipc` transport): no staging buffer, no second copy.

Both sides' regions are described as runs (gpu_copy.RegionRuns: a block is a few contiguous runs
of equal length, K and V halves in vLLM's GPU layout). A `PeerTable` pairs the source's regions,
at their addresses in this process (ipc_memory.open_handle), with the sink's own; it is built
once per source and its arrays uploaded to the sink's GPU once. A pull uploads its two block-id
lists and runs one Triton launch whose programs compute their own addresses:

    run g of the pull = (region r, block j of the pull, run k of the block)
    source address = src_base[r] + src_ids[j] * src_stride[r] + src_offset[r, k]
    sink address   = dst_base[r] + dst_ids[j] * dst_stride[r] + dst_offset[r, k]

The kernel on the sink's GPU reads the source's memory over NVLink (peer access) and writes its
own. `PeerTable.addresses` is the same arithmetic in numpy, the reference the tests hold the
kernel to, and `copy_on_host` the same copy with memmove for CPU regions (tests, fakes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv.transport.gpu_copy import RegionRuns

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# int32 elements per program (16 KiB) and warps per program: the launch's defaults, swept on
# 2 x H200 (benchmarks/gpu/ipc_transfer.py; benchmarks/results/gpu/2026-11-29-h200-x2-ipc/).
DEFAULT_BLOCK_ELEMS = 4096
DEFAULT_NUM_WARPS = 8


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
    def runs_per_block(self) -> int:
        return self.src_offsets.shape[1]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across every region."""
        return len(self.src_bases) * self.runs_per_block * self.run_bytes

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
        runs = np.arange(len(self.src_bases) * len(src_ids) * self.runs_per_block, dtype=np.int64)
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


def copy(
    table: PeerTable,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    anchor: torch.Tensor,
    *,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """One launch on the current stream moving every run of a pull (int64 id tensors on the
    sink's device). `anchor` is any 16-byte aligned int32 tensor on that device: the kernel
    addresses both sides relative to it."""
    if src_ids.numel() == 0:
        return
    assert table.on_device is not None, "copy needs PeerTable.uploaded"
    runs = len(table.src_bases) * src_ids.numel() * table.runs_per_block
    elems = table.run_bytes // 4
    grid = (runs, triton.cdiv(elems, block_elems))
    if any(t.data_ptr() % 16 for t in (anchor, src_ids, dst_ids)):
        # Triton specializes pointers on 16-byte alignment: another alignment would compile a
        # second kernel on a pull's path (ipc_link pads the ids so that none does).
        raise ValueError("peer_copy.copy needs 16-byte aligned tensors")
    _peer_kernel[grid](
        anchor, anchor.data_ptr(), src_ids, dst_ids, *table.on_device, src_ids.numel(),
        RUNS=table.runs_per_block, RUN_ELEMS=elems, BLOCK=block_elems, num_warps=num_warps,
    )  # fmt: skip


if triton is not None:
    # Per-pull values are not specialized on: a new pull size must never recompile.
    @triton.jit(do_not_specialize=["anchor_addr", "num_blocks"])
    def _peer_kernel(
        anchor, anchor_addr, src_ids, dst_ids, src_bases, src_strides, src_offsets,
        dst_bases, dst_strides, dst_offsets, num_blocks,
        RUNS: tl.constexpr, RUN_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program (run, chunk) moves BLOCK int32 of one run from the source to the sink.

        Addresses are int64 and taken relative to `anchor` (Triton knows a pointer argument is
        16-byte aligned; every address here is too), so each access is a 128-bit vector."""
        run = tl.program_id(0).to(tl.int64)
        per_region = num_blocks.to(tl.int64) * RUNS
        region = run // per_region
        within = run - region * per_region
        block = within // RUNS
        k = within - block * RUNS
        src = tl.load(src_bases + region) + tl.load(src_ids + block) * tl.load(src_strides + region)
        src += tl.load(src_offsets + region * RUNS + k)
        dst = tl.load(dst_bases + region) + tl.load(dst_ids + block) * tl.load(dst_strides + region)
        dst += tl.load(dst_offsets + region * RUNS + k)
        src_elem = tl.multiple_of((src - anchor_addr) // 4, 4)  # exact: both 16-byte aligned
        dst_elem = tl.multiple_of((dst - anchor_addr) // 4, 4)
        lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = lane < RUN_ELEMS
        tl.store(anchor + dst_elem + lane, tl.load(anchor + src_elem + lane, mask=mask), mask=mask)
