"""One-launch gathers and scatters (gpu_copy) move the same bytes as the per-piece torch copies.

The address arithmetic is checked twice against blocks.gather / blocks.scatter (the wire form):
on the host (RunTable.addresses with memmove on CPU tensors), and in the Triton kernel itself.
On a CUDA machine the kernel runs on the GPU; elsewhere the same kernel runs in Triton's CPU
interpreter in a child process (TRITON_INTERPRET must be set before Triton is imported).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from pdserve.kv.transport import blocks, gpu_copy
from pdserve.kv.transport.nccl import _pull_plan
from pdserve.kv.transport.regions import BlockRegion

pytestmark = pytest.mark.unit
needs_triton = pytest.mark.skipif(gpu_copy.triton is None, reason="needs Triton")

# (blocks per pull, staging bytes): batches that split a region, that join whole regions, and
# that hold a single block; a block here is 2 KiB (two 1 KiB runs).
CASES = [(5, 6 << 10), (2, 12 << 10), (7, 10 << 10), (1, 2 << 10), (20, 64 << 10)]
RING = 3


def vllm_gpu_regions(device: str, seed: int, num_blocks: int = 20) -> list[BlockRegion]:
    """3 layers shaped [K/V, blocks, block tokens, heads, head dim] in bf16: 2 runs of 1 KiB."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, 4, 2, 64)
    tensors = [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(3)]
    return [BlockRegion(t.to(device), 1) for t in tensors]


def host_move(table, ids, span, staging, *, to_staging: bool) -> None:
    """The reference: RunTable.addresses, then one memmove per run (CPU tensors only)."""
    for kv, staged in table.addresses(ids.tolist(), span, staging.data_ptr()):
        src, dst = (kv, staged) if to_staging else (staged, kv)
        ctypes.memmove(int(dst), int(src), table.run_bytes)


def kernel_move(table, ids, span, staging, *, to_staging: bool) -> None:
    words = staging[: span[1] * table.run_bytes].view(torch.int32)
    gpu_copy.copy_batch(table, ids, span, words, to_staging=to_staging)


def ring_round_trip(device: str, mover: str) -> None:
    """Gathers random blocks through a ring of staging buffers batch by batch, as the NCCL
    path plans them, checks each batch against blocks.gather, scatters it into other blocks
    of other regions and checks those blocks."""
    move = host_move if mover == "host" else kernel_move
    for num_blocks, staging_bytes in CASES:
        src = vllm_gpu_regions(device, seed=num_blocks)
        dst = [BlockRegion(torch.zeros_like(r.tensor), 1) for r in src]
        generator = torch.Generator().manual_seed(staging_bytes)
        src_ids = torch.randperm(20, generator=generator)[:num_blocks].tolist()
        dst_ids = torch.randperm(20, generator=generator)[:num_blocks].tolist()
        gather_table = gpu_copy.RunTable.from_runs([gpu_copy.describe(r) for r in src])
        scatter_table = gpu_copy.RunTable.from_runs([gpu_copy.describe(r) for r in dst])
        if mover == "kernel":
            gather_table = gather_table.uploaded(torch.device(device))
            scatter_table = scatter_table.uploaded(torch.device(device))
        sizes = tuple(r.info().block_nbytes for r in src)
        run_shape = (gather_table.runs_per_block, gather_table.run_bytes)
        batches, spans = _pull_plan(sizes, num_blocks, staging_bytes, run_shape)
        ring = [torch.zeros(staging_bytes, dtype=torch.uint8, device=device) for _ in range(RING)]
        index = blocks.block_index(src_ids, torch.device(device))
        src_index = torch.tensor(src_ids, device=device)
        dst_index = torch.tensor(dst_ids, device=device)
        for i, batch in enumerate(batches):
            staging = ring[i % RING]
            move(gather_table, src_index, spans[i], staging, to_staging=True)
            expected = torch.zeros_like(staging)
            for piece, offset in batch:
                blocks.gather(src[piece.region], index, piece, expected[offset:])
            size = blocks.batch_nbytes(batch)
            assert torch.equal(expected[:size], staging[:size]), f"case {num_blocks}: batch {i} differs"
            move(scatter_table, dst_index, spans[i], staging, to_staging=False)
        for s, d in zip(src, dst, strict=True):
            for a, b in zip(src_ids, dst_ids, strict=True):
                assert torch.equal(s.tensor.select(1, a), d.tensor.select(1, b))
        untouched = sorted(set(range(20)) - set(dst_ids))
        assert all(not d.tensor[:, untouched].any() for d in dst), "a scatter wrote outside its blocks"


def test_host_addresses_follow_the_wire_order():
    ring_round_trip("cpu", "host")


@needs_triton
def test_kernel_matches_torch_copies():
    if torch.cuda.is_available():
        ring_round_trip("cuda", "kernel")
        assert gpu_copy.kernel_round_trip(torch.device("cuda"))
        return
    code = (
        "import torch, test_kv_gpu_copy as t; t.ring_round_trip('cpu', 'kernel'); "
        "assert t.gpu_copy.kernel_round_trip(torch.device('cpu'))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_batch_spans_cover_each_batch_once_in_order():
    sizes, num_blocks = (2048, 2048, 2048), 7
    batches, spans = _pull_plan(sizes, num_blocks, 10 << 10, (2, 1024))
    assert [first for first, _ in spans] == sorted(first for first, _ in spans)
    assert sum(count for _, count in spans) == 3 * num_blocks * 2
    assert all(first + count == after for (first, count), (after, _) in zip(spans, spans[1:]))


def test_padded_pieces_are_not_one_span():
    piece_a, piece_b = blocks.Piece(0, 0, 1, 1024), blocks.Piece(1, 0, 1, 1024)
    with pytest.raises(ValueError):
        gpu_copy.batch_spans(2, 512, 1, [[(piece_a, 0), (piece_b, 1088)]])


def test_regions_without_long_aligned_runs_use_torch_copies():
    cpu_like = BlockRegion(torch.zeros(8, 2, 4, 16, dtype=torch.float16), 0)
    assert gpu_copy.RunTable.build([cpu_like]) is None  # CPU tensors never qualify
    tiny_runs = BlockRegion(torch.zeros(2, 8, 4, 2, 8, dtype=torch.float16), 1)  # 128-byte runs
    assert gpu_copy.describe(tiny_runs) is None
    odd_block = BlockRegion(torch.zeros(8, 3, 272, dtype=torch.float16), 0)  # one 1632-byte run
    described = gpu_copy.describe(odd_block)
    assert described is not None and gpu_copy.RunTable.from_runs([described]) is None  # 1632 % 64
