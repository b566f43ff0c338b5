"""Moving runs of blocks between registered regions and flat byte buffers.

The wire form of a pull is the same for every transport: for each region in registration order,
the pulled blocks in the order named, each block's bytes contiguous and in row-major order of its
block shape (`tensor.select(block_dim, b)`). That form is independent of where the block dim sits
in either side's tensor, so a sink may register differently strided tensors than its source.

A pull is cut into `Piece`s (a run of whole blocks of one region), and pieces are packed into
batches that fit a staging buffer. Both ends compute the same plan from the same inputs, so the
NCCL path needs no per-batch metadata on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv.transport.base import BlockRegion

# Pieces start at multiples of this inside a staging buffer, so any dtype can view its bytes
# (a view needs the offset aligned to the element size; 64 also matches a cache line).
ALIGN_BYTES = 64


@dataclass(frozen=True, slots=True)
class Piece:
    """Blocks `first .. first+count-1` of a pull's block list, in region `region`."""

    region: int
    first: int
    count: int
    nbytes: int


def plan_pieces(block_nbytes: Sequence[int], num_blocks: int, max_piece_bytes: int) -> list[Piece]:
    """Cuts a pull of `num_blocks` blocks into pieces of at most `max_piece_bytes` (but always at
    least one whole block). Called once per pull by both ends; pure."""
    pieces: list[Piece] = []
    for region, nbytes in enumerate(block_nbytes):
        per_piece = max(1, max_piece_bytes // nbytes)
        for first in range(0, num_blocks, per_piece):
            count = min(per_piece, num_blocks - first)
            pieces.append(Piece(region, first, count, count * nbytes))
    return pieces


def pack_batches(pieces: Sequence[Piece], capacity: int) -> list[list[tuple[Piece, int]]]:
    """Greedily packs pieces, in order, into batches of at most `capacity` bytes; each entry is
    (piece, byte offset in the staging buffer). A piece larger than `capacity` gets a batch of
    its own, so callers size staging to at least the largest block. Pure."""
    batches: list[list[tuple[Piece, int]]] = []
    current: list[tuple[Piece, int]] = []
    used = 0
    for piece in pieces:
        offset = _aligned(used)
        if current and offset + piece.nbytes > capacity:
            batches.append(current)
            current, offset = [], 0
        current.append((piece, offset))
        used = offset + piece.nbytes
    if current:
        batches.append(current)
    return batches


def batch_nbytes(batch: Sequence[tuple[Piece, int]]) -> int:
    """Bytes a batch occupies in staging (end of its last piece)."""
    piece, offset = batch[-1]
    return offset + piece.nbytes


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """The block ids as an index tensor on `device`; built once per pull and region device."""
    return torch.tensor(list(block_ids), dtype=torch.long, device=device)


def gather(region: BlockRegion, index: torch.Tensor, piece: Piece, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copies a piece's blocks out of `region` into wire form, as flat uint8.

    One index_select kernel, written straight into `out` (a uint8 staging slice on the region's
    device) when given. Called by sources once per piece; blocks on the copy only.
    """
    blocks = region.tensor.movedim(region.block_dim, 0)
    ids = index[piece.first : piece.first + piece.count]
    if out is None:
        return torch.index_select(blocks, 0, ids).reshape(-1).view(torch.uint8)
    target = _typed_view(out, region, piece)
    torch.index_select(blocks, 0, ids, out=target)
    return out[: piece.nbytes]


def scatter(region: BlockRegion, index: torch.Tensor, piece: Piece, data: torch.Tensor) -> None:
    """Writes a piece in wire form (flat uint8, any device) into `region`'s blocks in place.

    One index_copy_ kernel through a block-dim-first view of the region. Called by sinks once
    per piece; copies `data` to the region's device first when it lives elsewhere.
    """
    if data.device != region.tensor.device:
        data = data[: piece.nbytes].to(region.tensor.device)
    blocks = region.tensor.movedim(region.block_dim, 0)
    ids = index[piece.first : piece.first + piece.count]
    blocks.index_copy_(0, ids, _typed_view(data, region, piece))


def _typed_view(flat: torch.Tensor, region: BlockRegion, piece: Piece) -> torch.Tensor:
    block_shape = region.tensor.movedim(region.block_dim, 0).shape[1:]
    return flat[: piece.nbytes].view(region.tensor.dtype).view(piece.count, *block_shape)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES
