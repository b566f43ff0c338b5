"""From vLLM's KV cache tensors to the transport's regions and compatibility spec.

vLLM hands `register_kv_caches` one tensor per attention layer. Where the block dimension sits
depends on the attention backend (CPU: [num_blocks, kv_heads, block_size, 2*head_dim], layers
being views of one buffer; FlashAttention: [2, num_blocks, block_size, kv_heads, head_dim]), so
it is found by size. Blocks are moved as opaque bytes: the layout spec and the per-region block
shapes, checked at handshake, guarantee both sides agree on what those bytes mean.

The KV-heads axis (compat.heads_axis) is recorded on each region and written into the layout
as "[total heads]", so engines of different TP sizes can exchange head slices (transport.heads).
When any layer's axis is not recognised, none is recorded: such engines need equal TP sizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdserve.kv.connector.compat import KVHeads, heads_axis
from pdserve.kv.transport import heads as kv_heads
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

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


def build_regions(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, heads: KVHeads | None = None
) -> list[BlockRegion]:
    """One region per distinct layer tensor, in vLLM's layer order (the same on both sides).

    Layers sharing one tensor (cross-layer KV sharing) are registered once. A kernel-split block
    dim ([.., num_blocks*r, ..]) is viewed as [.., num_blocks, r, ..] so that block b of the
    region is scheduler block b. With `heads`, each region records its KV-heads axis if every
    layer's is recognised. Called once per worker at engine start.
    """
    regions: list[BlockRegion] = []
    axes: list[int | None] = []
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
        axis = heads_axis(tuple(tensor.shape), heads) if heads is not None else None
        if per_block > 1:
            tensor = tensor.unflatten(dim, (num_blocks, per_block))
            axis = axis + 1 if axis is not None and axis > dim else axis
        regions.append(BlockRegion(tensor, block_dim=dim))
        axes.append(axis if axis != dim else None)
    if regions and all(a is not None for a in axes):
        regions = [BlockRegion(r.tensor, r.block_dim, a) for r, a in zip(regions, axes, strict=True)]
    return regions


def build_layout(
    regions: list[BlockRegion],
    *,
    model_id: str,
    block_size: int,
    tp_rank: int,
    tp_size: int,
    num_kv_heads: int = 0,
) -> KVLayoutSpec:
    """The spec a peer must match byte for byte; called once per worker at engine start.
    `num_kv_heads` (the model's) is declared only if the regions record their heads axis and
    hold exactly this rank's share of the heads."""
    infos = [r.info() for r in regions]
    dtypes = sorted({i.dtype for i in infos})
    total = num_kv_heads if _holds_rank_share(regions, num_kv_heads, tp_rank, tp_size) else 0
    shapes = sorted({_block_form(r, total) for r in regions})
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


def _holds_rank_share(regions: list[BlockRegion], total: int, tp_rank: int, tp_size: int) -> bool:
    if not regions or total < 1 or kv_heads.split_problem(total, tp_size) is not None:
        return False
    share = len(kv_heads.rank_heads(total, tp_size, tp_rank))
    return all(r.heads_dim is not None and r.tensor.shape[r.heads_dim] == share for r in regions)


def _block_form(region: BlockRegion, total: int) -> str:
    """A region's block shape, its heads axis written as "[total]" when declared."""
    shape = region.info().block_shape
    if not total or region.heads_dim is None:
        return "x".join(map(str, shape))
    axis = region.heads_dim - (region.heads_dim > region.block_dim)  # block shape drops block_dim
    return kv_heads.heads_form(shape, axis, total)
