"""One-launch gathers and scatters of many blocks across many CUDA regions (the NCCL path).

A vLLM GPU KV cache is one tensor per layer, so a pull of N blocks touches N x layers block
slices in separate allocations. Copying them with torch ops costs one or more Python calls per
region and batch (~35 us each, measured: ~2 ms of host time per 256 MiB pull on an H200 host),
and inside a busy engine process every one of those calls can wait for the GIL. Here a pull is
planned once on the host into a table of (source address, destination address) pairs, one per
contiguous run of bytes, uploaded with one copy; each batch then moves with one Triton launch.

A region qualifies when its block is a few contiguous runs of equal length that are multiples
of 16 bytes (vLLM's GPU layouts: K and V halves of a block, 2 runs); `RunTable.build` returns
None otherwise and callers fall back to `blocks.gather` / `blocks.scatter`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv.transport import blocks
from pdserve.kv.transport.base import BlockRegion

logger = logging.getLogger(__name__)

try:  # Triton ships with CUDA builds of torch; CPU hosts fall back to torch copies.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Elements are 16-byte words (4 x int32): runs and addresses must be 16-byte aligned, so every
# load and store is one 128-bit access.
_WORD_BYTES = 16
# Words per program: 16 KiB per program keeps enough loads in flight per SM.
_BLOCK_WORDS = 1024


@dataclass(frozen=True, slots=True)
class _RegionRuns:
    base: int  # data_ptr of the region's tensor
    block_stride: int  # bytes between consecutive blocks
    offsets: tuple[int, ...]  # byte offset of each run inside a block
    run_bytes: int


@dataclass(frozen=True, slots=True)
class RunTable:
    """The run layout of a set of regions; built once per endpoint (regions never move)."""

    bases: np.ndarray  # [regions] data_ptr of each region's tensor
    strides: np.ndarray  # [regions] bytes between consecutive blocks
    offsets: np.ndarray  # [regions, runs] byte offset of each run inside a block
    run_bytes: int

    @classmethod
    def build(cls, regions: Sequence[BlockRegion]) -> RunTable | None:
        """The table, or None when Triton is missing or a region does not qualify."""
        if triton is None or not regions or any(r.tensor.device.type != "cuda" for r in regions):
            return None
        table = cls.from_runs([_describe(r) for r in regions])
        if table is None or not _kernel_works(regions[0].tensor.device):
            return None
        return table

    @classmethod
    def from_runs(cls, described: Sequence[_RegionRuns | None]) -> RunTable | None:
        """The table of regions whose runs are all alike in count and length, else None."""
        if not described or any(d is None for d in described):
            return None
        if len({(d.run_bytes, len(d.offsets)) for d in described}) != 1:
            return None
        return cls(
            np.array([d.base for d in described], dtype=np.int64),
            np.array([d.block_stride for d in described], dtype=np.int64),
            np.array([d.offsets for d in described], dtype=np.int64),
            described[0].run_bytes,
        )

    def plan(
        self,
        block_ids: Sequence[int],
        batches: Sequence[Sequence[tuple[blocks.Piece, int]]],
        staging_ptrs: Sequence[int],
        *,
        to_staging: bool,
    ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Run addresses of a whole pull: an int64 array [runs, 2] of (src, dst) and, per batch,
        its [start, end) rows. Batch i uses staging buffer i % 2. Host only, a few numpy calls
        per pull whatever its size (a loop per piece cost ~25 us a region)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        # Wire order (blocks.plan_pieces): region by region, the blocks in the order named, the
        # runs of each block in order; pieces and batches keep that order.
        kv = self.bases[:, None, None] + ids[None, :, None] * self.strides[:, None, None]
        kv = (kv + self.offsets[:, None, :]).reshape(-1)
        runs_per_block = self.offsets.shape[1]
        pieces = [(piece.count * runs_per_block, staging_ptrs[i % 2] + offset)
                  for i, batch in enumerate(batches) for piece, offset in batch]  # fmt: skip
        counts = np.array([c for c, _ in pieces], dtype=np.int64)
        piece_of_run = np.repeat(np.arange(len(pieces)), counts)
        first_run = np.cumsum(counts) - counts
        within = np.arange(len(kv), dtype=np.int64) - first_run[piece_of_run]
        flat = np.array([b for _, b in pieces], dtype=np.int64)[piece_of_run] + within * self.run_bytes
        table = np.stack((kv, flat) if to_staging else (flat, kv), axis=1)
        ends = np.cumsum([sum(p.count for p, _ in batch) * runs_per_block for batch in batches])
        return table, [(int(e - n), int(e)) for e, n in zip(ends, np.diff(ends, prepend=0), strict=True)]


def upload(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """The address table on the device (one host-to-device copy, on the current stream)."""
    return torch.from_numpy(table).to(device)


def copy_runs(addresses: torch.Tensor, span: tuple[int, int], run_bytes: int) -> None:
    """Copies rows [start, end) of an uploaded table, one run per row, in one launch on the
    current stream."""
    start, end = span
    if end <= start:
        return
    words = run_bytes // _WORD_BYTES
    grid = (end - start, triton.cdiv(words, _BLOCK_WORDS))
    _copy_kernel[grid](addresses[start:end], words, BLOCK=_BLOCK_WORDS)


_checked: dict[torch.device, bool] = {}


def _kernel_works(device: torch.device) -> bool:
    """Compiles and runs the kernel once per device on a small copy; False (and a warning)
    if Triton fails there, so the endpoint falls back to torch copies instead of failing pulls."""
    if device not in _checked:
        try:
            source = torch.arange(4096, dtype=torch.int32, device=device)
            target = torch.zeros_like(source)
            table = np.array([[source.data_ptr() + 8192, target.data_ptr()]], dtype=np.int64)
            with torch.cuda.device(device):
                copy_runs(upload(table, device), (0, 1), 8192)
                torch.cuda.synchronize(device)
            _checked[device] = torch.equal(target[:2048], source[2048:])
        except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
            logger.warning("Triton block copies unavailable on %s (%s); using torch copies", device, exc)
            _checked[device] = False
    return _checked[device]


def _describe(region: BlockRegion) -> _RegionRuns | None:
    tensor = region.tensor
    runs = blocks._runs_of(
        tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), region.block_dim
    )
    if runs is None or runs.run_bytes % _WORD_BYTES or tensor.data_ptr() % _WORD_BYTES:
        return None
    if runs.block_stride % _WORD_BYTES or any(o % _WORD_BYTES for o in runs.offsets):
        return None
    return _RegionRuns(tensor.data_ptr(), runs.block_stride, runs.offsets, runs.run_bytes)


if triton is not None:

    @triton.jit
    def _copy_kernel(addresses, words, BLOCK: tl.constexpr):
        """Program (run, chunk) copies BLOCK 16-byte words of one run: addresses[run] = (src, dst)."""
        run = tl.program_id(0).to(tl.int64)
        src = tl.load(addresses + run * 2).to(tl.pointer_type(tl.int32))
        dst = tl.load(addresses + run * 2 + 1).to(tl.pointer_type(tl.int32))
        word = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = word < words
        lanes = tl.arange(0, 4)
        offsets = (word[:, None] * 4 + lanes[None, :]).to(tl.int64)
        mask2 = mask[:, None]
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask2), mask=mask2)
