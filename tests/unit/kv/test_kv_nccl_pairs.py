"""NCCL-path specifics (over gloo on CPU): pairs are set up lazily and rebuilt after breaking."""

from __future__ import annotations

import pytest
from kv_helpers import LAYOUT, TOKEN, WAIT_S, assert_blocks_equal, kv_regions

from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.nccl import NcclSink, NcclSource, plan

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
