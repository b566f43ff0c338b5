"""Every transport (fake, gRPC, NCCL over gloo) against the same interface contract."""

from __future__ import annotations

import random
import time

import pytest
from kv_helpers import WAIT_S, assert_blocks_equal, kv_regions, other_layout

from pdserve.kv.transport.base import KVTransfer, TransferState
from pdserve.kv.transport.errors import AuthenticationError, IncompatiblePeerError, WireVersionError
from pdserve.kv.transport.leases import ReleaseReason

pytestmark = pytest.mark.unit


def pull_and_wait(sink, source, request_id, src_ids, dst_ids, **kwargs) -> KVTransfer:
    transfer = sink.start_pull(source.address, request_id, src_ids, dst_ids, **kwargs)
    assert transfer.wait(WAIT_S) in (TransferState.DONE, TransferState.FAILED), f"pull hung: {transfer}"
    return transfer


def test_moves_random_blocks_between_differently_laid_out_tensors(kv_transport):
    src_regions, dst_regions = kv_regions(32, seed=1), kv_regions(24, seed=2, sink_side=True)
    source, sink = kv_transport.source(src_regions), kv_transport.sink(dst_regions)
    rng = random.Random(0)
    src_ids = rng.sample(range(32), 9)  # non-contiguous, unordered
    dst_ids = rng.sample(range(24), 9)
    source.pin("req-1", src_ids + [0, 31])

    transfer = pull_and_wait(sink, source, "req-1", src_ids, dst_ids)

    assert transfer.state is TransferState.DONE, transfer.error
    assert_blocks_equal(src_regions, src_ids, dst_regions, dst_ids)
    assert transfer.bytes_moved == 9 * sum(r.info().block_nbytes for r in src_regions)
    assert transfer.error is None and transfer.elapsed_s > 0


def test_later_pulls_reuse_the_connection_and_stay_correct(kv_transport):
    src_regions, dst_regions = kv_regions(16, seed=3), kv_regions(16, seed=4, sink_side=True)
    source, sink = kv_transport.source(src_regions), kv_transport.sink(dst_regions)
    for n, (src_ids, dst_ids) in enumerate(
        [([1, 2, 3], [9, 10, 11]), ([15, 0], [0, 15]), (list(range(16)), list(range(15, -1, -1)))]
    ):
        source.pin(f"req-{n}", src_ids)
        transfer = pull_and_wait(sink, source, f"req-{n}", src_ids, dst_ids)
        assert transfer.state is TransferState.DONE, transfer.error
        assert_blocks_equal(src_regions, src_ids, dst_regions, dst_ids)


def test_concurrent_pulls_all_complete(kv_transport):
    src_regions, dst_regions = kv_regions(24, seed=5), kv_regions(24, seed=6, sink_side=True)
    source, sink = kv_transport.source(src_regions), kv_transport.sink(dst_regions)
    plans = [
        (f"req-{i}", list(range(i * 4, i * 4 + 4)), list(range(20 - i * 4, 24 - i * 4))) for i in range(5)
    ]
    for request_id, src_ids, _ in plans:
        source.pin(request_id, src_ids)
    transfers = [sink.start_pull(source.address, rid, s, d) for rid, s, d in plans]
    for transfer in transfers:
        assert transfer.wait(WAIT_S) is TransferState.DONE, transfer.error
    for _, src_ids, dst_ids in plans:
        assert_blocks_equal(src_regions, src_ids, dst_regions, dst_ids)


def test_start_pull_returns_before_the_data_moves(kv_transport, slow_gather):
    slow_gather(0.1)  # the source needs at least 0.1 s for each of its several pieces
    source, sink = (
        kv_transport.source(kv_regions(8, seed=7)),
        kv_transport.sink(kv_regions(8, seed=8, sink_side=True)),
    )
    source.pin("req-1", [1, 2])
    transfer = sink.start_pull(source.address, "req-1", [1, 2], [3, 4])
    assert transfer.state in (TransferState.PENDING, TransferState.TRANSFERRING)
    assert transfer.wait(WAIT_S) is TransferState.DONE, transfer.error


def test_incompatible_peer_is_refused_naming_the_field(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True), layout=other_layout(block_size=16))
    source.pin("req-1", [1])

    with pytest.raises(IncompatiblePeerError) as refused:
        sink.handshake(source.address)
    assert refused.value.field == "block_size"
    transfer = pull_and_wait(sink, source, "req-1", [1], [2])
    assert transfer.state is TransferState.FAILED
    assert "block_size" in transfer.error


def test_mismatched_region_shapes_are_refused(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True)[:2])
    with pytest.raises(IncompatiblePeerError) as refused:
        sink.handshake(source.address)
    assert refused.value.field == "regions"


def test_wrong_cluster_token_is_refused(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True), token="not-the-secret")
    source.pin("req-1", [1])

    with pytest.raises(AuthenticationError, match="cluster token"):
        sink.handshake(source.address)
    transfer = pull_and_wait(sink, source, "req-1", [1], [2])
    assert transfer.state is TransferState.FAILED
    assert "cluster token" in transfer.error
    assert source.pinned_blocks("req-1") == (1,)


@pytest.mark.parametrize("newer_side", ["sink", "source"])
def test_wire_version_mismatch_is_refused(kv_transport, newer_side):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    (sink if newer_side == "sink" else source).wire_version += 1

    with pytest.raises(WireVersionError, match="wire version mismatch"):
        sink.handshake(source.address)


def test_lease_expiry_calls_the_release_callback(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    source.pin("req-1", [1, 2], lease_s=0.2)

    assert kv_transport.release_event.wait(WAIT_S)
    assert kv_transport.released == [("req-1", ReleaseReason.LEASE_EXPIRED)]
    assert source.pinned_blocks("req-1") is None
    transfer = pull_and_wait(sink, source, "req-1", [1, 2], [3, 4])
    assert transfer.state is TransferState.FAILED
    assert "unknown request id" in transfer.error


def test_local_release_frees_the_blocks(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    source.pin("req-1", [1, 2])

    assert source.release("req-1") is True
    assert source.release("req-1") is False
    assert kv_transport.released == [("req-1", ReleaseReason.LOCAL)]
    assert pull_and_wait(sink, source, "req-1", [1], [3]).state is TransferState.FAILED


def test_remote_release_frees_the_blocks(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    source.pin("req-1", [1, 2])

    sink.release_remote(source.address, "req-1")

    assert kv_transport.release_event.wait(WAIT_S)
    assert kv_transport.released == [("req-1", ReleaseReason.REMOTE)]
    assert source.pinned_blocks("req-1") is None


def test_a_pull_releases_the_blocks_only_when_asked(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    source.pin("keep", [1, 2])
    source.pin("free", [3])

    assert pull_and_wait(sink, source, "keep", [1, 2], [1, 2], release=False).state is TransferState.DONE
    assert pull_and_wait(sink, source, "free", [3], [3]).state is TransferState.DONE

    # The source unpins once its last send completes, which may be just after the sink's DONE.
    assert kv_transport.release_event.wait(WAIT_S)
    assert source.pinned_blocks("keep") == (1, 2)
    assert source.pinned_blocks("free") is None
    assert kv_transport.released == [("free", ReleaseReason.PULLED)]


@pytest.mark.parametrize(
    ("request_id", "src_ids", "expected"),
    [("nobody", [1], "unknown request id"), ("req-1", [5], "not pinned")],
)
def test_pull_of_unpinned_blocks_fails(kv_transport, request_id, src_ids, expected):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    source.pin("req-1", [1, 2])

    transfer = pull_and_wait(sink, source, request_id, src_ids, [0])

    assert transfer.state is TransferState.FAILED
    assert expected in transfer.error
    assert source.pinned_blocks("req-1") == (1, 2)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "expected"),
    [([1, 2], [3], "2 source blocks but 1"), ([1], [99], "out of range"), ([1, 2], [3, 3], "repeat")],
)
def test_bad_block_lists_fail_without_raising(kv_transport, src_ids, dst_ids, expected):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    transfer = sink.start_pull(source.address, "req-1", src_ids, dst_ids)
    assert transfer.state is TransferState.FAILED
    assert expected in transfer.error


def test_unreachable_source_fails(kv_transport):
    source = kv_transport.source(kv_regions(8, seed=1))
    sink = kv_transport.sink(kv_regions(8, seed=2, sink_side=True))
    address = source.address
    source.close()

    transfer = sink.start_pull(address, "req-1", [1], [2])

    assert transfer.wait(WAIT_S) is TransferState.FAILED
    assert transfer.error


def test_source_killed_mid_stream_fails_without_hanging(kv_transport, slow_gather):
    slow_gather(0.05)
    src_regions = kv_regions(16, seed=1)
    source = kv_transport.source(src_regions, small_pieces=True)
    sink = kv_transport.sink(kv_regions(16, seed=2, sink_side=True), small_pieces=True)
    source.pin("req-1", list(range(16)))
    transfer = sink.start_pull(source.address, "req-1", list(range(16)), list(range(16)))
    deadline = time.monotonic() + WAIT_S
    while transfer.bytes_moved == 0 and not transfer.done and time.monotonic() < deadline:
        time.sleep(0.01)

    source.close()

    assert transfer.wait(WAIT_S) is TransferState.FAILED, transfer
    assert transfer.error
    assert 0 < transfer.bytes_moved < 16 * sum(r.info().block_nbytes for r in src_regions)
