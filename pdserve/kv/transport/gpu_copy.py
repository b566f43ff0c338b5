"""One-launch gathers and scatters of many blocks across many CUDA regions (the NCCL path).

A vLLM GPU KV cache is one tensor per layer, so a pull of N blocks touches N x layers block
slices in separate allocations. Copying them with torch ops costs one or more Python calls per
region and batch (~35 us each, measured: ~2 ms of host time per 256 MiB pull on an H200 host),
and inside a busy engine process every one of those calls can wait for the GIL.

Lifecycle: an endpoint builds one `RunTable` from its regions (they never move): each region's
base address, block stride and run offsets, uploaded to the device once. Per pull, only the
block ids travel to the device (`upload_block_ids`: one small pinned, non-blocking copy); per
batch, `copy_batch` is one Triton launch whose programs compute their own addresses:

    run g of the pull, in wire order = (region r, block j of the pull, run k of the block)
    region address  = base[r] + block_ids[j] * stride[r] + offset[r, k]
    staging address = staging + (g - batch's first run) * run_bytes

Wire order is blocks.plan_pieces': region by region, the blocks in the order named, each
block's runs in order. A batch of blocks.pack_batches is then one contiguous range of runs at
contiguous staging offsets, provided a block's bytes are a multiple of blocks.ALIGN_BYTES (no
padding between pieces); `RunTable.from_runs` requires that. `RunTable.addresses` is the same
arithmetic in numpy, the reference the tests hold the kernel and the plan to.

A region qualifies when its block is a few contiguous runs of equal length that are multiples
of 16 bytes (vLLM's GPU layouts: K and V halves of a block, 2 runs); `RunTable.build` returns
None otherwise, or when Triton is missing or fails on the device, and callers fall back to
`blocks.gather` / `blocks.scatter`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv.transport import blocks
from pdserve.kv.transport.regions import BlockRegion

logger = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU hosts fall back to torch copies.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Runs, addresses and strides must be 16-byte aligned, so every load and store of the kernel
# can be one 128-bit access (4 int32 lanes).
_WORD_BYTES = 16
# int32 elements per program: 16 KiB per program keeps enough loads in flight per SM (a 32 KiB
# run of a Llama-8B block is two programs).
_BLOCK_ELEMS = 4096


@dataclass(frozen=True, slots=True)
class RegionRuns:
    """One region's blocks as equal contiguous runs (`describe`); also what a cuda_ipc source
    sends of its regions (peer_copy)."""

    base: int  # data_ptr of the region's tensor
    block_stride: int  # bytes between consecutive blocks
    offsets: tuple[int, ...]  # byte offset of each run inside a block
    run_bytes: int


@dataclass(frozen=True, slots=True)
class RunTable:
    """The run layout of a set of regions; built once per endpoint (regions never move).

    The host arrays describe it; `on_device` holds the same (bases, strides, offsets) as int64
    tensors on the regions' device, uploaded once by `build`."""

    bases: np.ndarray  # [regions] data_ptr of each region's tensor
    strides: np.ndarray  # [regions] bytes between consecutive blocks
    offsets: np.ndarray  # [regions, runs] byte offset of each run inside a block
    run_bytes: int
    on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, regions: Sequence[BlockRegion]) -> RunTable | None:
        """The table with its device copy, or None when Triton is missing or unusable on the
        device, or a region does not qualify. Called once per endpoint (or set of regions)."""
        if triton is None or not regions or any(r.tensor.device.type != "cuda" for r in regions):
            return None
        table = cls.from_runs([describe(r) for r in regions])
        device = regions[0].tensor.device
        if table is None or not _kernel_works(device):
            return None
        return table.uploaded(device)

    @classmethod
    def from_runs(cls, described: Sequence[RegionRuns | None]) -> RunTable | None:
        """The table of regions whose runs are all alike in count and length and whose blocks
        leave no padding between pieces in staging, else None. Host arrays only."""
        if not described or any(d is None for d in described):
            return None
        if len({(d.run_bytes, len(d.offsets)) for d in described}) != 1:
            return None
        if (described[0].run_bytes * len(described[0].offsets)) % blocks.ALIGN_BYTES:
            return None
        return cls(
            np.array([d.base for d in described], dtype=np.int64),
            np.array([d.block_stride for d in described], dtype=np.int64),
            np.array([d.offsets for d in described], dtype=np.int64).reshape(len(described), -1),
            described[0].run_bytes,
        )

    def uploaded(self, device: torch.device) -> RunTable:
        """This table with its arrays copied to `device` (once; synchronous)."""
        tensors = tuple(torch.from_numpy(a.reshape(-1).copy()).to(device) for a in self.host_arrays)
        return RunTable(*self.host_arrays, self.run_bytes, tensors)

    @property
    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.bases, self.strides, self.offsets

    @property
    def runs_per_block(self) -> int:
        return self.offsets.shape[1]

    def spans(
        self, num_blocks: int, batches: Sequence[Sequence[tuple[blocks.Piece, int]]]
    ) -> list[tuple[int, int]]:
        """`batch_spans` for this table's runs."""
        return batch_spans(self.runs_per_block, self.run_bytes, num_blocks, batches)

    def addresses(self, block_ids: Sequence[int], span: tuple[int, int], staging: int) -> np.ndarray:
        """int64 [runs, 2]: (region address, staging address) of each run of one batch, the
        arithmetic `copy_batch` does on the device. Host reference for tests and debugging."""
        first, count = span
        runs = np.arange(first, first + count, dtype=np.int64)
        per_region = len(block_ids) * self.runs_per_block
        region, within = np.divmod(runs, per_region)
        block = np.asarray(block_ids, dtype=np.int64)[within // self.runs_per_block]
        kv = self.bases[region] + block * self.strides[region]
        kv += self.offsets[region, within % self.runs_per_block]
        return np.stack((kv, staging + (runs - first) * self.run_bytes), axis=1)


def batch_spans(
    runs_per_block: int,
    run_bytes: int,
    num_blocks: int,
    batches: Sequence[Sequence[tuple[blocks.Piece, int]]],
) -> list[tuple[int, int]]:
    """(first run, run count) of each batch of a pull of `num_blocks` blocks. Pure; raises
    ValueError if a batch's pieces are not one contiguous range of runs in staging."""
    spans = []
    for batch in batches:
        piece, _ = batch[0]
        first = (piece.region * num_blocks + piece.first) * runs_per_block
        count = 0
        for piece, offset in batch:
            start = (piece.region * num_blocks + piece.first) * runs_per_block
            if start != first + count or offset != count * run_bytes:
                raise ValueError(f"batch not contiguous in runs at {piece}")
            count += piece.count * runs_per_block
        spans.append((first, count))
    return spans


def upload_block_ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """A pull's block ids on `device`, through pinned memory, without blocking the host (on
    the current stream). Keep the result alive until the pull's copies have run."""
    host = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)


def copy_batch(
    table: RunTable,
    block_ids: torch.Tensor,
    span: tuple[int, int],
    staging: torch.Tensor,
    *,
    to_staging: bool,
) -> None:
    """Moves one batch (`span` of `RunTable.spans`) between the regions and `staging` (a 16-byte
    aligned int32 view of a staging buffer), in one launch on the current stream."""
    first, count = span
    if count <= 0:
        return
    assert table.on_device is not None, "copy_batch needs RunTable.build (or .uploaded)"
    bases, strides, offsets = table.on_device
    elems = table.run_bytes // 4
    grid = (count, triton.cdiv(elems, _BLOCK_ELEMS))
    _runs_kernel[grid](
        staging, staging.data_ptr(), block_ids, bases, strides, offsets, first, block_ids.numel(),
        RUNS=table.runs_per_block, RUN_ELEMS=elems, BLOCK=_BLOCK_ELEMS, TO_STAGING=to_staging,
    )  # fmt: skip


_checked: dict[torch.device, bool] = {}


def _kernel_works(device: torch.device) -> bool:
    """Compiles and runs the kernel once per device on a small gather and scatter; False (and a
    warning) if Triton fails there, so the endpoint falls back to torch copies instead of
    failing pulls."""
    if device not in _checked:
        try:
            _checked[device] = kernel_round_trip(device)
        except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
            logger.warning("Triton block copies unavailable on %s (%s); using torch copies", device, exc)
            _checked[device] = False
    return _checked[device]


def kernel_round_trip(device: torch.device) -> bool:
    """Gathers blocks [3, 0] of a 2-region, 2-run layout into staging and scatters them back
    into blocks [1, 2]; True if both match torch's answer. Also run by the tests."""
    shape = (2, 4, 1024)  # [K/V, blocks, 1024 int32]: two 4 KiB runs per block
    regions = [torch.arange(8192, dtype=torch.int32, device=device).view(shape) + (r << 20) for r in range(2)]
    table = RunTable.from_runs([describe(BlockRegion(t, 1)) for t in regions]).uploaded(device)
    staging = torch.zeros(4 * 2 * 1024, dtype=torch.int32, device=device)
    ids = torch.tensor([3, 0], dtype=torch.int64, device=device)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        copy_batch(table, ids, (0, 8), staging, to_staging=True)
        expected = torch.cat([t[:, b].reshape(-1) for t in regions for b in (3, 0)])
        copy_batch(table, ids.new_tensor([1, 2]), (0, 8), staging, to_staging=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    scattered = all(torch.equal(t[:, 1], t[:, 3]) and torch.equal(t[:, 2], t[:, 0]) for t in regions)
    return torch.equal(staging, expected) and scattered


def describe(region: BlockRegion) -> RegionRuns | None:
    """The region's runs, or None unless every run, stride and address is 16-byte aligned."""
    tensor = region.tensor
    runs = blocks._runs_of(
        tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), region.block_dim
    )
    if runs is None or runs.run_bytes % _WORD_BYTES or tensor.data_ptr() % _WORD_BYTES:
        return None
    if runs.block_stride % _WORD_BYTES or any(o % _WORD_BYTES for o in runs.offsets):
        return None
    return RegionRuns(tensor.data_ptr(), runs.block_stride, runs.offsets, runs.run_bytes)


if triton is not None:

    # Per-pull values are not specialized on: a new pull size or batch must never recompile.
    @triton.jit(do_not_specialize=["staging_addr", "first_run", "num_blocks"])
    def _runs_kernel(
        staging, staging_addr, block_ids, bases, strides, offsets, first_run, num_blocks,
        RUNS: tl.constexpr, RUN_ELEMS: tl.constexpr, BLOCK: tl.constexpr, TO_STAGING: tl.constexpr,
    ):  # fmt: skip
        """Program (row, chunk) moves BLOCK int32 of run `first_run + row` of the pull.

        Every address is int64. The region side is addressed relative to `staging` (a pointer
        argument, which Triton knows is 16-byte aligned), so with the multiple-of-4 hints
        each access is a 128-bit vector."""
        row = tl.program_id(0).to(tl.int64)
        run = first_run.to(tl.int64) + row
        per_region = num_blocks.to(tl.int64) * RUNS
        region = run // per_region
        within = run - region * per_region
        block = tl.load(block_ids + within // RUNS)
        kv = tl.load(bases + region) + block * tl.load(strides + region)
        kv += tl.load(offsets + region * RUNS + within % RUNS)
        kv_elem = tl.multiple_of((kv - staging_addr) // 4, 4)  # exact: both 16-byte aligned
        staged_elem = tl.multiple_of(row * RUN_ELEMS, 4)
        lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = lane < RUN_ELEMS
        if TO_STAGING:
            src, dst = staging + kv_elem + lane, staging + staged_elem + lane
        else:
            src, dst = staging + staged_elem + lane, staging + kv_elem + lane
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
