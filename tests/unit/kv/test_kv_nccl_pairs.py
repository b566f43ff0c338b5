"""NCCL-path specifics (over gloo on CPU): pairs are set up lazily and rebuilt after breaking."""

from __future__ import annotations

import gc
import time
import weakref

import grpc
import msgpack
import pytest
from kv_helpers import LAYOUT, TOKEN, WAIT_S, assert_blocks_equal, kv_regions

from pdserve.kv.transport import nccl_direct
from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.errors import KVTransportError
from pdserve.kv.transport.nccl import NcclSink, NcclSource, plan
from pdserve.kv.transport.nccl_pair import (
    decode_settings, offered_backend, pair_api, resolve_api,
)

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


def test_pair_settings_of_an_older_source_mean_two_buffers_over_torch():
    decoded = decode_settings(settings())
    assert decoded["staging_buffers"] == 2 and decoded["nccl_min_channels"] == 0
    assert decoded["nccl_api"] == "torch"


@pytest.mark.parametrize("bad", [{"staging_buffers": 1}, {"staging_buffers": 99}, {"nccl_min_channels": -1},
                                 {"staging_buffers": "4"}, {"nccl_min_channels": True},
                                 {"nccl_api": "nvshmem"}, {"nccl_api": 1}])  # fmt: skip
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
            # `header_sent` once its send returned, which may be after the source read it),
            # queues its sends before it answers, and the sink reads that answer after the data.
            began = ours.started_at + ours.thread_start
            assert began <= theirs.header_read <= theirs.queued <= theirs.replied <= theirs.done
            assert theirs.replied <= ours.started_at + ours.reply_read
            assert 0 < ours.thread_start <= ours.header_sent <= ours.queued <= ours.data_done <= ours.reply_read
    finally:
        sink.close()
        source.close()


@pytest.mark.parametrize(
    ("offer", "source_api", "chosen"),
    [("nccl+direct", "direct", "direct"), ("nccl+direct", "torch", "torch"),
     ("nccl", "direct", "torch"), ("gloo", "torch", "torch")],
)  # fmt: skip
def test_a_pair_runs_direct_only_when_the_sink_offers_it_and_the_source_uses_it(offer, source_api, chosen):
    backend = offer.partition("+")[0]
    assert pair_api(offer, backend, source_api) == chosen


@pytest.mark.parametrize("offer", ["gloo", "nccl+gloo", "nccl+", "nccl+direct+x"])
def test_a_setup_request_for_another_backend_or_a_malformed_offer_is_refused(offer):
    with pytest.raises(KVTransportError, match="backend mismatch"):
        pair_api(offer, "nccl", "direct")


def test_a_sink_offers_direct_only_with_a_direct_api():
    assert offered_backend("nccl", "direct") == "nccl+direct"
    assert offered_backend("nccl", "torch") == offered_backend("nccl", "auto") == "nccl"
    assert offered_backend("gloo", "torch") == "gloo"


def test_gloo_endpoints_always_use_torch_and_bad_options_are_refused():
    assert resolve_api("auto", "gloo") == resolve_api("direct", "gloo") == "torch"
    with pytest.raises(ValueError, match="auto, direct or torch"):
        resolve_api("fast", "nccl")


def test_nccl_api_without_a_usable_library_falls_back_to_torch_or_refuses_direct(monkeypatch):
    monkeypatch.setattr(nccl_direct, "available", lambda: False)
    assert resolve_api("auto", "nccl") == "torch"
    with pytest.raises(ValueError, match="cannot be used"):
        resolve_api("direct", "nccl")
    monkeypatch.setattr(nccl_direct, "available", lambda: True)
    assert resolve_api("auto", "nccl") == "direct"
    assert resolve_api("auto", "nccl", min_channels=32) == "torch"  # only torch's group sets channels
    with pytest.raises(ValueError, match="nccl_min_channels"):
        resolve_api("direct", "nccl", min_channels=32)
    assert resolve_api("torch", "nccl") == "torch"


def test_a_missing_nccl_library_is_a_clear_error_not_a_crash(monkeypatch):
    monkeypatch.setattr(nccl_direct, "_lib", None)
    monkeypatch.setattr(nccl_direct, "_lib_error", None)
    monkeypatch.setenv(nccl_direct.LIBRARY_ENV, "/nonexistent/libnccl.so.2")
    with pytest.raises(KVTransportError, match="cannot use NCCL library '/nonexistent/libnccl.so.2'"):
        nccl_direct.library()
    assert not nccl_direct.available()


def test_a_sink_refuses_a_direct_pair_it_did_not_offer(pair_ends, monkeypatch):
    source, sink = pair_ends
    # White box: this gloo source answers as a direct-NCCL source would.
    monkeypatch.setattr("pdserve.kv.transport.nccl.pair_api", lambda *args: "direct")
    source.pin("r", [1])
    transfer = sink.start_pull(source.address, "r", [1], [1])
    assert transfer.wait(WAIT_S) is TransferState.FAILED
    assert "did not offer" in transfer.error


def test_pair_set_ups_past_the_session_and_source_limits_are_refused():
    source = NcclSource(
        LAYOUT, kv_regions(16, seed=1), engine_id="prefill-0", cluster_token=TOKEN, pair_timeout_s=5,
        max_pairs=2, max_pairs_per_session=1,
    )
    sinks = [
        NcclSink(LAYOUT, kv_regions(16, seed=2, sink_side=True), engine_id=f"decode-{i}", cluster_token=TOKEN)
        for i in range(3)
    ]
    try:
        for i, sink in enumerate(sinks[:2]):
            assert pull(source, sinks[i], f"req-{i}", [i + 1])[0] is TransferState.DONE
        # A second pair on one session (white box: the sink would reuse its pair).
        with pytest.raises(grpc.RpcError) as refused:
            sinks[0]._setup_pair(sinks[0].session(source.address))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 1" in refused.value.details()
        # A third session: the source holds its two pairs already.
        state, transfer = pull(source, sinks[2], "req-2", [3])
        assert state is TransferState.FAILED and "already holds 2 NCCL pairs" in transfer.error
        assert len(source._pairs) == 2
    finally:
        for sink in sinks:
            sink.close()
        source.close()


def test_a_sink_drops_a_pair_whose_source_closed_and_frees_its_staging(pair_ends):
    source, sink = pair_ends
    assert pull(source, sink, "first", [1, 2])[0] is TransferState.DONE
    (pair,) = sink._pairs.values()
    staging = weakref.ref(pair.staging[0])
    del pair

    source.close()
    deadline = time.monotonic() + WAIT_S
    while sink._pairs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sink._pairs
    gc.collect()
    assert staging() is None
