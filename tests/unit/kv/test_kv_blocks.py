"""Planning a pull into pieces and staging batches, and the wire form of blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.transport import blocks
from pdserve.kv.transport.regions import BlockRegion

pytestmark = pytest.mark.unit


def test_pieces_cover_every_block_of_every_region_once():
    pieces = blocks.plan_pieces([100, 30], num_blocks=7, max_piece_bytes=250)
    for region, nbytes in enumerate([100, 30]):
        covered = [b for p in pieces if p.region == region for b in range(p.first, p.first + p.count)]
        assert covered == list(range(7))
        assert all(p.nbytes == p.count * nbytes <= max(250, nbytes) for p in pieces if p.region == region)


def test_a_block_larger_than_a_piece_still_travels_whole():
    pieces = blocks.plan_pieces([1000], num_blocks=3, max_piece_bytes=10)
    assert [(p.first, p.count, p.nbytes) for p in pieces] == [(0, 1, 1000), (1, 1, 1000), (2, 1, 1000)]


def test_batches_fit_capacity_and_align_offsets():
    pieces = blocks.plan_pieces([100, 30], num_blocks=7, max_piece_bytes=256)
    batches = blocks.pack_batches(pieces, capacity=256)
    assert [p for batch in batches for p, _ in batch] == pieces
    for batch in batches:
        assert blocks.batch_nbytes(batch) <= 256
        assert all(offset % blocks.ALIGN_BYTES == 0 for _, offset in batch)


def test_wire_form_is_block_major_whatever_the_block_dim():
    kv = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)  # [k/v, block, elems]
    region = BlockRegion(kv, block_dim=1)
    piece = blocks.Piece(region=0, first=0, count=2, nbytes=2 * 6 * 4)
    wire = blocks.gather(region, blocks.block_index([4, 1], torch.device("cpu")), piece)
    assert wire.view(torch.float32).tolist() == kv[:, 4].flatten().tolist() + kv[:, 1].flatten().tolist()


def test_scatter_writes_through_a_strided_view():
    buffer = torch.zeros(6, 2, 4)  # [block, layer, elems]: one layer is a strided view
    layer = BlockRegion(buffer[:, 1], block_dim=0)
    piece = blocks.Piece(region=0, first=0, count=2, nbytes=2 * 4 * 4)
    data = torch.arange(8, dtype=torch.float32).view(torch.uint8)
    blocks.scatter(layer, blocks.block_index([5, 0], torch.device("cpu")), piece, data)
    assert buffer[5, 1].tolist() == [0, 1, 2, 3] and buffer[0, 1].tolist() == [4, 5, 6, 7]
    assert buffer[:, 0].abs().sum() == 0


@pytest.mark.parametrize(
    ("tensor", "block_dim"),
    [
        (torch.randn(2, 6, 16, 2, 32).half(), 1),  # GPU-style [2, blocks, ...]: two runs per block
        (torch.randn(6, 3, 2, 4, 64).bfloat16()[:, 1], 0),  # one layer of a shared CPU buffer
        (torch.randn(6, 64, 8).transpose(1, 2), 0),  # no long runs: the torch path
    ],
)
def test_cpu_fast_path_and_torch_path_agree_on_the_wire_form(tensor, block_dim):
    region = BlockRegion(tensor, block_dim)
    ids = [4, 0, 5]
    nbytes = region.info().block_nbytes
    piece = blocks.Piece(region=0, first=0, count=3, nbytes=3 * nbytes)
    index = blocks.block_index(ids, torch.device("cpu"))
    expected = torch.cat(
        [tensor.select(block_dim, b).contiguous().reshape(-1).view(torch.uint8) for b in ids]
    )

    assert torch.equal(blocks.gather(region, index, piece), expected)
    assert blocks.gather_bytes(region, index, piece) == bytes(expected.tolist())

    target = BlockRegion(torch.zeros_like(tensor), block_dim)
    blocks.scatter_bytes(target, index, piece, bytes(expected.tolist()))
    for b in ids:
        assert torch.equal(target.tensor.select(block_dim, b), tensor.select(block_dim, b))
