"""One-launch gathers and scatters (gpu_copy) move the same bytes as the per-piece torch copies.

On a CUDA machine the kernel runs on the GPU; elsewhere the same kernel runs in Triton's CPU
interpreter in a child process (TRITON_INTERPRET must be set before Triton is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kv.transport import blocks, gpu_copy
from pdserve.kv.transport.base import BlockRegion
from pdserve.kv.transport.nccl import plan

pytestmark = pytest.mark.unit
needs_triton = pytest.mark.skipif(gpu_copy.triton is None, reason="needs Triton")


def round_trip(device: str) -> None:
    """Gathers random blocks of 3 vLLM-GPU-shaped regions into two alternating staging buffers,
    checks each batch against blocks.gather, scatters into other regions and checks the blocks."""
    generator = torch.Generator().manual_seed(0)

    def regions(seed_offset: int) -> list[BlockRegion]:
        shape = (2, 20, 4, 2, 64)  # [K/V, blocks, block tokens, heads, head dim]: 2 runs of 1 KiB
        tensors = [torch.randn(shape, generator=generator) + seed_offset for _ in range(3)]
        tensors = [t.to(torch.bfloat16) for t in tensors]
        return [BlockRegion(t.to(device), 1) for t in tensors]

    src, dst = regions(0), [BlockRegion(torch.zeros_like(r.tensor), 1) for r in regions(1)]
    src_ids, dst_ids = [5, 1, 7, 19, 3], [0, 2, 4, 6, 8]
    sizes = [r.info().block_nbytes for r in src]
    batches = plan(sizes, len(src_ids), 2 * sizes[0])
    staging = [torch.zeros(4 * sizes[0], dtype=torch.uint8, device=device) for _ in range(2)]
    pointers = [s.data_ptr() for s in staging]
    gather_table = gpu_copy.RunTable.from_runs([gpu_copy._describe(r) for r in src])
    scatter_table = gpu_copy.RunTable.from_runs([gpu_copy._describe(r) for r in dst])
    gathers, spans = gather_table.plan(src_ids, batches, pointers, to_staging=True)
    scatters, _ = scatter_table.plan(dst_ids, batches, pointers, to_staging=False)
    gathers = gpu_copy.upload(gathers, torch.device(device))
    scatters = gpu_copy.upload(scatters, torch.device(device))
    index = blocks.block_index(src_ids, torch.device(device))
    for i, batch in enumerate(batches):
        gpu_copy.copy_runs(gathers, spans[i], 1024)
        expected = torch.zeros_like(staging[i % 2])
        for piece, offset in batch:
            blocks.gather(src[piece.region], index, piece, expected[offset:])
        size = blocks.batch_nbytes(batch)
        assert torch.equal(expected[:size], staging[i % 2][:size]), f"batch {i} differs"
        gpu_copy.copy_runs(scatters, spans[i], 1024)
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(s.tensor.select(1, a), d.tensor.select(1, b))


@needs_triton
def test_runs_match_torch_copies():
    if torch.cuda.is_available():
        round_trip("cuda")
        return
    code = "import test_kv_gpu_copy as t; t.round_trip('cpu')"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_regions_without_long_aligned_runs_use_torch_copies():
    cpu_like = BlockRegion(torch.zeros(8, 2, 4, 16, dtype=torch.float16), 0)
    assert gpu_copy.RunTable.build([cpu_like]) is None  # CPU tensors never qualify
    tiny_runs = BlockRegion(torch.zeros(2, 8, 4, 2, 8, dtype=torch.float16), 1)  # 128-byte runs
    assert gpu_copy._describe(tiny_runs) is None
