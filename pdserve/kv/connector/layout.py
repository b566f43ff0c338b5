"""From vLLM's KV cache tensors to the transport's regions and compatibility spec.

vLLM hands `register_kv_caches` one tensor per attention layer. Where the block dimension sits
depends on the attention backend (CPU: [num_blocks, kv_heads, block_size, 2*head_dim], layers
being views of one buffer; FlashAttention: [2, num_blocks, block_size, kv_heads, head_dim]), so
it is found by size. Blocks are moved as opaque bytes: the layout spec and the per-region block
shapes, checked at handshake, guarantee both sides agree on what those bytes mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdserve.kv.transport.base import BlockRegion, KVLayoutSpec

__all__ = ["build_layout", "build_regions", "find_block_dim"]


def find_block_dim(shape: tuple[int, ...], num_blocks: int) -> tuple[int, int]:
    """(block dim, kernel blocks per scheduler block) of a KV tensor holding `num_blocks` blocks.

    Prefers a dim of exactly `num_blocks` (the first two dims first: every vLLM backend puts it
    there); else a dim that is a multiple (a backend whose kernel block is smaller than the
    scheduler's). Raises ValueError when none fits.
    """
    exact = [d for d, size in enumerate(shape) if size == num_blocks]
    if exact:
        return exact[0], 1
    multiples = [d for d, size in enumerate(shape) if size > num_blocks and size % num_blocks == 0]
    if multiples:
        return multiples[0], shape[multiples[0]] // num_blocks
    raise ValueError(f"no dimension of KV tensor shape {shape} holds {num_blocks} blocks")


def build_regions(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[BlockRegion]:
    """One region per distinct layer tensor, in vLLM's layer order (the same on both sides).

    Layers sharing one tensor (cross-layer KV sharing) are registered once. A kernel-split block
    dim ([.., num_blocks*r, ..]) is viewed as [.., num_blocks, r, ..] so that block b of the
    region is scheduler block b. Called once per worker at engine start.
    """
    regions: list[BlockRegion] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in kv_caches.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key in seen:
            continue
        seen.add(key)
        try:
            dim, per_block = find_block_dim(tuple(tensor.shape), num_blocks)
        except ValueError as exc:
            raise ValueError(f"KV cache of layer {name}: {exc}") from None
        if per_block > 1:
            tensor = tensor.unflatten(dim, (num_blocks, per_block))
        regions.append(BlockRegion(tensor, block_dim=dim))
    return regions


def build_layout(
    regions: list[BlockRegion], *, model_id: str, block_size: int, tp_rank: int, tp_size: int
) -> KVLayoutSpec:
    """The spec a peer must match byte for byte; called once per worker at engine start."""
    infos = [r.info() for r in regions]
    dtypes = sorted({i.dtype for i in infos})
    shapes = sorted({"x".join(map(str, i.block_shape)) for i in infos})
    # Where the block dim sits does not matter: the wire form of a block is its row-major bytes.
    kv_layout = f"block={'|'.join(shapes)}"
    return KVLayoutSpec(
        model=model_id,
        dtype=",".join(dtypes),
        block_size=block_size,
        kv_layout=kv_layout,
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_layers=len(regions),
    )
