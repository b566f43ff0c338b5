"""NCCL-path specifics (over gloo on CPU): pairs are set up lazily and rebuilt after breaking."""

from __future__ import annotations

import msgpack
import pytest
from kv_helpers import LAYOUT, TOKEN, WAIT_S, assert_blocks_equal, kv_regions

from pdserve.kv.transport.base import KVTransportError, TransferState
from pdserve.kv.transport.nccl import NcclSink, NcclSource, plan
from pdserve.kv.transport.nccl_pair import decode_settings

pytestmark = pytest.mark.unit


@pytest.fixture
def pair_ends():
    source = NcclSource(
        LAYOUT, kv_regions(16, seed=1), engine_id="prefill-0", cluster_token=TOKEN, pair_timeout_s=5
    )
    sink = NcclSink(LAYOUT, kv_regions(16, seed=2, sink_side=True), engine_id="decode-0", cluster_token=TOKEN)
    yield source, sink
    sink.close()
    source.close()


def pull(source, sink, request_id, ids):
    source.pin(request_id, ids)
    transfer = sink.start_pull(source.address, request_id, ids, ids)
    return transfer.wait(WAIT_S), transfer


def test_a_broken_pair_fails_one_pull_and_the_next_pull_builds_a_new_pair(pair_ends):
    source, sink = pair_ends
    assert pull(source, sink, "first", [1, 2])[0] is TransferState.DONE
    for pair, _ in list(source._pairs.values()):  # white box: break the source's end of the pair
        pair.abort()

    state, broken = pull(source, sink, "second", [3, 4])
    assert state is TransferState.FAILED and "gloo receive" in broken.error

    state, recovered = pull(source, sink, "third", [5, 6, 7])
    assert state is TransferState.DONE, recovered.error
    assert_blocks_equal(source.regions, [5, 6, 7], sink.regions, [5, 6, 7])


def test_both_ends_plan_the_same_batches_within_the_staging_buffer():
    batches = plan([64 << 10, 64 << 10, 192 << 10], num_blocks=100, staging_bytes=1 << 20)
    assert all(sum(p.nbytes for p, _ in b) <= 1 << 20 for b in batches)
    assert sum(p.nbytes for b in batches for p, _ in b) == 100 * (320 << 10)


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_a_deep_ring_of_small_batches_moves_every_block(buffers):
    source = NcclSource(
        LAYOUT,
        kv_regions(32, seed=3),
        engine_id="prefill-ring",
        cluster_token=TOKEN,
        staging_bytes=4 << 10,  # a few blocks per batch: many batches cycle the ring
        staging_buffers=buffers,
    )
    sink_regions = kv_regions(32, seed=4, sink_side=True)
    sink = NcclSink(LAYOUT, sink_regions, engine_id="decode-ring", cluster_token=TOKEN)
    try:
        ids = [31, 0, 7, 12, 3, 19, 25, 8, 1, 30, 17, 22]
        state, transfer = pull(source, sink, "ring", ids)
        assert state is TransferState.DONE, transfer.error
        assert len(plan([r.info().block_nbytes for r in source.regions], len(ids), 4 << 10)) > 2 * buffers
        assert_blocks_equal(source.regions, ids, sink.regions, ids)
        (pair,) = sink._pairs.values()
        assert len(pair.staging) == buffers  # the sink adopted the source's ring
    finally:
        sink.close()
        source.close()


def settings(**changes):
    base = {"timeout_s": 5.0, "staging_bytes": 1 << 20, "control_port": 5000, "control_key": b"k" * 32}
    return msgpack.packb({**base, **changes}, use_bin_type=True)


def test_pair_settings_of_an_older_source_mean_two_buffers():
    decoded = decode_settings(settings())
    assert decoded["staging_buffers"] == 2 and decoded["nccl_min_channels"] == 0


@pytest.mark.parametrize("bad", [{"staging_buffers": 1}, {"staging_buffers": 99}, {"nccl_min_channels": -1},
                                 {"staging_buffers": "4"}, {"nccl_min_channels": True}])  # fmt: skip
def test_pair_settings_out_of_range_are_refused(bad):
    with pytest.raises(KVTransportError):
        decode_settings(settings(**bad))


def test_traced_ends_record_each_pull_in_phase_order_on_one_clock():
    source = NcclSource(
        LAYOUT, kv_regions(16, seed=1), engine_id="prefill-0", cluster_token=TOKEN, trace=True
    )
    sink = NcclSink(
        LAYOUT, kv_regions(16, seed=2, sink_side=True), engine_id="decode-0", cluster_token=TOKEN, trace=True
    )
    try:
        for request_id in ("first", "second"):
            assert pull(source, sink, request_id, [1, 2, 3])[0] is TransferState.DONE
        # The sink's pull can end before the source's thread stamps its own end: wait for it.
        theirs_all = source.completed_traces()
        assert [t.request_id for t in sink.traces] == [t.request_id for t in theirs_all] == ["first", "second"]
        for ours, theirs in zip(sink.traces, theirs_all):
            # The source reads the header after the sink's pull began (the sink stamps
            # `header_sent` once its send returned, which may be after the source read it) and
            # finishes sending before the sink reads the reply that follows the data.
            began = ours.started_at + ours.thread_start
            assert began <= theirs.header_read <= theirs.replied <= theirs.queued <= theirs.done
            assert theirs.replied <= ours.started_at + ours.reply_read
            assert 0 < ours.thread_start <= ours.header_sent <= ours.queued <= ours.data_done <= ours.reply_read
    finally:
        sink.close()
        source.close()
