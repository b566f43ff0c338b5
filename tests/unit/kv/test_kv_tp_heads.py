"""Prefill and decode of different TP sizes: which KV heads each rank pulls from where
(hand-computed), refusals, and head slices moved byte for byte by every transport (NCCL code
over gloo on CPU)."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import WAIT_S, TransportFactory, block_bytes

from pdserve.kv.connector.layout import build_layout
from pdserve.kv.transport import heads
from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.errors import IncompatiblePeerError
from pdserve.kv.transport.leases import ReleaseReason
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

pytestmark = pytest.mark.unit

TOTAL_HEADS = 4
NUM_BLOCKS = 6


def shares(total: int, source_tp: int, sink_tp: int, sink_rank: int) -> list[tuple[int, range]]:
    return [(s.rank, s.heads) for s in heads.sources_for(total, source_tp, sink_tp, sink_rank)]


# ---- head ranges (pure) ----------------------------------------------------------------------


def test_vllm_head_split_with_and_without_replication():
    assert [heads.rank_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [heads.rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert heads.split_problem(8, 3) is not None and heads.split_problem(2, 4) is None
    with pytest.raises(ValueError, match="do not split evenly"):
        heads.rank_heads(8, 3, 0)


def test_tp1_to_tp2_each_decode_rank_takes_half_the_heads_of_prefill_rank_0():
    assert shares(8, 1, 2, 0) == [(0, range(0, 4))]
    assert shares(8, 1, 2, 1) == [(0, range(4, 8))]
    assert heads.releasers_of(8, 1, 0, 2) == {0, 1}  # the pin waits for both decode ranks


def test_tp2_to_tp1_the_decode_rank_takes_each_half_from_its_prefill_rank():
    assert shares(8, 2, 1, 0) == [(0, range(0, 4)), (1, range(4, 8))]
    assert heads.releasers_of(8, 2, 0, 1) == heads.releasers_of(8, 2, 1, 1) == {0}


def test_tp2_to_tp4_and_equal_tp_pair_rank_with_rank_inside_the_share():
    assert [shares(8, 2, 4, d) for d in range(4)] == [
        [(0, range(0, 2))],
        [(0, range(2, 4))],
        [(1, range(4, 6))],
        [(1, range(6, 8))],
    ]
    assert [shares(8, 2, 2, d) for d in range(2)] == [[(0, range(0, 4))], [(1, range(4, 8))]]
    # Replicated heads (TP 4 over 2 heads) at equal TP: rank r still pulls from rank r.
    assert [shares(2, 4, 4, d) for d in range(4)] == [[(d, range(d // 2, d // 2 + 1))] for d in range(4)]


def test_a_replica_nobody_reads_is_released_by_one_decode_rank():
    # Prefill TP 4 over 2 heads (ranks 0,1 hold head 0; 2,3 head 1), decode TP 1.
    assert shares(2, 4, 1, 0) == [(0, range(0, 1)), (2, range(1, 2))]
    assert heads.release_targets(2, 4, 1, 0) == (0, 1, 2, 3)


# ---- layouts and refusals --------------------------------------------------------------------


def kv_regions(tp_size: int, *, seed: int) -> list[BlockRegion]:
    """Two layer-like regions holding this rank's share of TOTAL_HEADS heads: FlashAttention's
    [2, blocks, block_size, heads, head_dim] (head slices are 16 short runs: torch path) and
    vLLM 0.32's [blocks, heads, block_size, 2*head_dim] (a head slice is one run: memmove)."""
    generator = torch.Generator().manual_seed(seed)
    h = TOTAL_HEADS // tp_size
    flash = torch.randn(2, NUM_BLOCKS, 4, h, 32, generator=generator).half()
    bhnc = torch.randn(NUM_BLOCKS, h, 4, 128, generator=generator).bfloat16()
    return [BlockRegion(flash, block_dim=1, heads_dim=3), BlockRegion(bhnc, block_dim=0, heads_dim=1)]


def layout_of(
    regions: list[BlockRegion], tp_size: int, tp_rank: int, total: int = TOTAL_HEADS
) -> KVLayoutSpec:
    return build_layout(
        regions, model_id="m", block_size=4, tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=total
    )


def test_layout_is_the_same_at_every_tp_size_and_marks_the_heads_axis():
    tp1, tp2 = layout_of(kv_regions(1, seed=0), 1, 0), layout_of(kv_regions(2, seed=0), 2, 1)
    assert tp1.kv_layout == tp2.kv_layout == "block=2x4x[4]x32|[4]x4x128"
    assert tp1.compat_hash() == tp2.compat_hash()
    assert heads.num_kv_heads(tp1) == TOTAL_HEADS


def test_heads_that_do_not_match_the_rank_share_are_not_declared():
    unknown = layout_of(kv_regions(2, seed=0), 1, 0)  # 2 heads per region, but TP 1 of 4 heads
    assert heads.num_kv_heads(unknown) == 0
    with pytest.raises(IncompatiblePeerError, match="equal tensor_parallel_size"):
        heads.check_tp(unknown, KVLayoutSpec("m", "x", 4, unknown.kv_layout, 2, 0))


def test_uneven_splits_and_disjoint_ranks_are_refused_naming_tp():
    tp1 = layout_of(kv_regions(1, seed=0), 1, 0)
    with pytest.raises(IncompatiblePeerError, match="do not split evenly") as refused:
        heads.check_tp(tp1, KVLayoutSpec("m", tp1.dtype, 4, tp1.kv_layout, 3, 0))
    assert refused.value.field == "tp_size"
    tp2_rank0, tp2_rank1 = (layout_of(kv_regions(2, seed=0), 2, r) for r in (0, 1))
    with pytest.raises(IncompatiblePeerError, match="no KV heads in common"):
        heads.check_tp(tp2_rank0, tp2_rank1)


def test_views_are_the_head_slice_both_ranks_hold():
    regions = kv_regions(1, seed=0)
    full = layout_of(regions, 1, 0)
    peer = layout_of(kv_regions(2, seed=0), 2, 1)
    flash, bhnc = heads.peer_regions(regions, full, peer)
    assert torch.equal(flash.tensor, regions[0].tensor[:, :, :, 2:4])
    assert torch.equal(bhnc.tensor, regions[1].tensor[:, 2:4])
    assert flash.info().block_shape == (2, 4, 2, 32)
    whole = tuple(regions)
    assert heads.peer_regions(whole, full, full) is whole  # equal TP: the endpoint's own regions


# ---- transports move head slices -------------------------------------------------------------

SRC_IDS, DST_IDS = [1, 4, 2], [5, 0, 3]


def source_at(factory: TransportFactory, tp_size: int, tp_rank: int, *, seed: int):
    regions = kv_regions(tp_size, seed=seed)
    source = factory.source(regions, layout=layout_of(regions, tp_size, tp_rank))
    source.pin("req", SRC_IDS)
    return source, regions


def sink_at(factory: TransportFactory, tp_size: int, tp_rank: int, *, seed: int):
    regions = kv_regions(tp_size, seed=seed)
    return factory.sink(regions, layout=layout_of(regions, tp_size, tp_rank)), regions


def heads_slice(region: BlockRegion, start: int, count: int) -> BlockRegion:
    return region.narrow_heads(start, count)


def test_tp1_source_serves_each_tp2_sink_its_heads_and_waits_for_both(kv_transport: TransportFactory):
    source, full = source_at(kv_transport, 1, 0, seed=1)
    sinks = [sink_at(kv_transport, 2, r, seed=10 + r) for r in range(2)]
    before = [[r.tensor.clone() for r in regions] for _, regions in sinks]

    for rank, (sink, _) in enumerate(sinks):
        transfer = sink.start_pull(source.address, "req", SRC_IDS, DST_IDS, release=False)
        assert transfer.wait(WAIT_S) is TransferState.DONE, transfer.error
        sink.release_remote(source.address, "req")
        if rank == 0:
            # One of two readers released: the pin (and the source's blocks) must stay.
            assert source.pinned_blocks("req") == tuple(SRC_IDS)
    assert kv_transport.release_event.wait(WAIT_S)
    assert kv_transport.released == [("req", ReleaseReason.REMOTE)]

    for rank, (_, regions) in enumerate(sinks):
        for i, region in enumerate(regions):
            src = heads_slice(full[i], 2 * rank, 2)
            for s, d in zip(SRC_IDS, DST_IDS, strict=True):
                assert torch.equal(block_bytes(src, s), block_bytes(region, d)), (rank, i, s, d)
            untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
            sel = torch.tensor(untouched)
            old = before[rank][i].index_select(region.block_dim, sel)
            assert torch.equal(region.tensor.index_select(region.block_dim, sel), old)


def test_tp1_sink_fills_each_half_from_its_tp2_source(kv_transport: TransportFactory):
    sources = [source_at(kv_transport, 2, r, seed=20 + r) for r in range(2)]
    sink, full = sink_at(kv_transport, 1, 0, seed=2)
    before = [r.tensor.clone() for r in full]

    transfers = [sink.start_pull(src.address, "req", SRC_IDS, DST_IDS) for src, _ in sources]
    for transfer in transfers:
        assert transfer.wait(WAIT_S) is TransferState.DONE, transfer.error

    for rank, (_, regions) in enumerate(sources):
        for i, region in enumerate(regions):
            dst = heads_slice(full[i], 2 * rank, 2)
            for s, d in zip(SRC_IDS, DST_IDS, strict=True):
                assert torch.equal(block_bytes(region, s), block_bytes(dst, d)), (rank, i, s, d)
    for i, region in enumerate(full):
        sel = torch.tensor([b for b in range(NUM_BLOCKS) if b not in DST_IDS])
        old = before[i].index_select(region.block_dim, sel)
        assert torch.equal(region.tensor.index_select(region.block_dim, sel), old)
    assert kv_transport.release_event.wait(WAIT_S)
    assert {reason for _, reason in kv_transport.released} == {ReleaseReason.PULLED}


def test_ranks_without_common_heads_are_refused_at_handshake(kv_transport: TransportFactory):
    source, _ = source_at(kv_transport, 2, 0, seed=1)
    sink, _ = sink_at(kv_transport, 2, 1, seed=2)
    with pytest.raises(IncompatiblePeerError, match="no KV heads in common"):
        sink.handshake(source.address)
