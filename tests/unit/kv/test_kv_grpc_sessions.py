"""gRPC-specific security: every data call needs a session from an accepted handshake."""

from __future__ import annotations

import grpc
import pytest
from kv_helpers import LAYOUT, TOKEN, kv_regions

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.proto import kv_transfer_pb2_grpc as pb_grpc
from pdserve.kv.transport import wire
from pdserve.kv.transport.grpc import GrpcSource
from pdserve.kv.transport.handshake import WIRE_VERSION, make_hello

pytestmark = pytest.mark.unit


@pytest.fixture
def source_stub():
    source = GrpcSource(LAYOUT, kv_regions(4, seed=1), engine_id="prefill-0", cluster_token=TOKEN)
    source.pin("req-1", [1])
    channel = grpc.insecure_channel(source.address)
    yield source, pb_grpc.KVTransferStub(channel)
    channel.close()
    source.close()


def test_pull_without_a_session_is_refused(source_stub):
    source, stub = source_stub
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.PullBlocks(pb.PullBlocksRequest(request_id="req-1", block_ids=[1]), timeout=5))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as refused:
        stub.Release(
            pb.ReleaseRequest(request_id="req-1"), timeout=5, metadata=((wire.SESSION_KEY, "forged"),)
        )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert source.pinned_blocks("req-1") == (1,)


def test_refused_handshake_names_the_problem_in_its_status(source_stub):
    _, stub = source_stub
    hello = make_hello(LAYOUT, TOKEN, "client", "decode-0", WIRE_VERSION + 7)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Handshake(wire.hello_to_request(hello), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"peer 'decode-0' speaks {WIRE_VERSION + 7}" in refused.value.details()


def test_plain_grpc_source_does_not_serve_the_nccl_side_channel(source_stub):
    _, stub = source_stub
    reply = stub.Handshake(
        wire.hello_to_request(make_hello(LAYOUT, TOKEN, "client", "d", WIRE_VERSION)), timeout=5
    )
    metadata = ((wire.SESSION_KEY, reply.session_id),)
    with pytest.raises(grpc.RpcError) as refused:
        stub.SetupCommunicator(
            pb.SetupCommunicatorRequest(pair_id="p", backend="gloo"), timeout=5, metadata=metadata
        )
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
