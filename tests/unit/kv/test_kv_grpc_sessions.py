"""gRPC-specific security: a challenge-response handshake that cannot be replayed, and sessions
that every data call needs, valid only from the connection that handshook."""

from __future__ import annotations

import grpc
import pytest
from kv_helpers import LAYOUT, TOKEN, WAIT_S, kv_regions

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.proto import kv_transfer_pb2_grpc as pb_grpc
from pdserve.kv.transport import grpc as grpc_transport
from pdserve.kv.transport import wire
from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.errors import WireVersionError
from pdserve.kv.transport.grpc import GrpcSink, GrpcSource
from pdserve.kv.transport.handshake import WIRE_VERSION, Transcript, make_hello, new_nonce
from pdserve.kv.transport.sessions import SessionTable

pytestmark = pytest.mark.unit


def own_connection(address: str) -> grpc.Channel:
    """A channel with its own TCP connection (channels of one process share one by default)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def handshake(
    stub: pb_grpc.KVTransferStub, *, version: int = WIRE_VERSION, engine_id: str = "decode-0"
) -> tuple[pb.HandshakeRequest, pb.HandshakeResponse]:
    """A sink's Challenge and Handshake, by hand: the request sent and the reply."""
    asked = pb.ChallengeRequest(wire_version=version, engine_id=engine_id)
    challenge = wire.challenge_from_response(stub.Challenge(asked, timeout=5))
    transcript = Transcript(engine_id, challenge.engine_id, challenge.nonce, new_nonce())
    request = wire.hello_to_request(make_hello(LAYOUT, TOKEN, "client", version, transcript), transcript)
    return request, stub.Handshake(request, timeout=5)


@pytest.fixture
def source_stub():
    source = GrpcSource(LAYOUT, kv_regions(4, seed=1), engine_id="prefill-0", cluster_token=TOKEN)
    source.pin("req-1", [1])
    channel = own_connection(source.address)
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


def test_two_handshakes_carry_different_proofs(source_stub):
    _, stub = source_stub
    first, first_reply = handshake(stub)
    second, second_reply = handshake(stub)

    assert first.token_proof != second.token_proof
    assert first_reply.token_proof != second_reply.token_proof
    assert first_reply.session_id != second_reply.session_id
    assert TOKEN.encode() not in first.SerializeToString() + first_reply.SerializeToString()


def test_a_replayed_handshake_is_refused_and_opens_no_session(source_stub):
    source, stub = source_stub
    recorded, _ = handshake(stub)
    attacker = own_connection(source.address)
    try:
        for replay_stub in (pb_grpc.KVTransferStub(attacker), stub):  # another connection, then the same
            with pytest.raises(grpc.RpcError) as refused:
                replay_stub.Handshake(recorded, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "replayed handshake" in refused.value.details()
    finally:
        attacker.close()
    assert source.pinned_blocks("req-1") == (1,)


def test_a_session_id_is_refused_from_another_connection(source_stub):
    source, stub = source_stub
    _, reply = handshake(stub)
    metadata = ((wire.SESSION_KEY, reply.session_id),)
    thief = own_connection(source.address)
    try:
        request = pb.PullBlocksRequest(request_id="req-1", block_ids=[1], release_after=True)
        with pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.KVTransferStub(thief).PullBlocks(request, timeout=5, metadata=metadata))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        thief.close()
    assert source.pinned_blocks("req-1") == (1,)
    assert len(list(stub.PullBlocks(request, timeout=5, metadata=metadata))) > 0  # the owner may
    assert source.pinned_blocks("req-1") is None


def test_refused_handshake_names_the_problem_in_its_status(source_stub):
    _, stub = source_stub
    with pytest.raises(grpc.RpcError) as refused:
        stub.Challenge(pb.ChallengeRequest(wire_version=WIRE_VERSION + 7, engine_id="decode-0"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"peer 'decode-0' speaks {WIRE_VERSION + 7}" in refused.value.details()


def test_a_peer_of_the_last_version_is_refused_by_version_not_by_the_missing_challenge(source_stub):
    _, stub = source_stub
    old = pb.HandshakeRequest(wire_version=WIRE_VERSION - 1, engine_id="decode-0", token_proof=b"x" * 32)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Handshake(old, timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    expected = f"this side speaks {WIRE_VERSION}, peer 'decode-0' speaks {WIRE_VERSION - 1}"
    assert expected in refused.value.details()


def test_plain_grpc_source_does_not_serve_the_nccl_side_channel(source_stub):
    _, stub = source_stub
    _, reply = handshake(stub)
    metadata = ((wire.SESSION_KEY, reply.session_id),)
    with pytest.raises(grpc.RpcError) as refused:
        stub.SetupCommunicator(
            pb.SetupCommunicatorRequest(pair_id="p", backend="gloo"), timeout=5, metadata=metadata
        )
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_release_of_a_request_another_session_pulled_is_refused(source_stub):
    source, stub = source_stub
    _, reader = handshake(stub, engine_id="decode-0")
    _, other = handshake(stub, engine_id="decode-1")
    pull = pb.PullBlocksRequest(request_id="req-1", block_ids=[1], release_after=False)
    list(stub.PullBlocks(pull, timeout=5, metadata=((wire.SESSION_KEY, reader.session_id),)))

    with pytest.raises(grpc.RpcError) as refused:
        stub.Release(
            pb.ReleaseRequest(request_id="req-1"), timeout=5, metadata=((wire.SESSION_KEY, other.session_id),)
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert source.pinned_blocks("req-1") == (1,)
    released = stub.Release(
        pb.ReleaseRequest(request_id="req-1"), timeout=5, metadata=((wire.SESSION_KEY, reader.session_id),)
    )
    assert released.released and source.pinned_blocks("req-1") is None


def test_a_pin_nobody_pulled_may_be_released_by_any_session(source_stub):
    # The decode side gave the request up before pulling it: the pin need not wait for its lease.
    source, stub = source_stub
    _, session = handshake(stub)
    released = stub.Release(
        pb.ReleaseRequest(request_id="req-1"), timeout=5, metadata=((wire.SESSION_KEY, session.session_id),)
    )
    assert released.released and source.pinned_blocks("req-1") is None


@pytest.mark.parametrize("rpc", ["Challenge", "Handshake"])
def test_an_oversized_message_before_authentication_is_refused(source_stub, rpc):
    source, stub = source_stub
    for size in (100 << 10, 2 << 20):  # past the handshake's limit, past the server's
        request = (pb.ChallengeRequest if rpc == "Challenge" else pb.HandshakeRequest)(
            wire_version=WIRE_VERSION, engine_id="x" * size
        )
        with pytest.raises(grpc.RpcError) as refused:
            getattr(stub, rpc)(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _, reply = handshake(stub)  # the source still serves
    assert reply.session_id


def test_calls_past_the_concurrency_cap_are_refused(slow_gather):
    slow_gather(0.5)  # each chunk waits: the pull holds its call for ~1.5 s
    source = GrpcSource(
        LAYOUT, kv_regions(4, seed=1), engine_id="prefill-0", cluster_token=TOKEN, max_concurrent_rpcs=1
    )
    source.pin("req-1", [1, 2, 3])
    channel = own_connection(source.address)
    try:
        stub = pb_grpc.KVTransferStub(channel)
        _, session = handshake(stub)
        metadata = ((wire.SESSION_KEY, session.session_id),)
        request = pb.PullBlocksRequest(request_id="req-1", block_ids=[1, 2, 3], max_chunk_bytes=1)
        stream = stub.PullBlocks(request, timeout=5, metadata=metadata)
        next(stream)  # the stream is open, two chunks to go: it holds the one slot
        with pytest.raises(grpc.RpcError) as refused:
            stub.Challenge(pb.ChallengeRequest(wire_version=WIRE_VERSION, engine_id="d"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream.cancel()
    finally:
        channel.close()
        source.close()


def test_a_sink_whose_session_the_source_forgot_handshakes_again_and_pulls(source_stub):
    source, _ = source_stub
    sink = GrpcSink(LAYOUT, kv_regions(4, seed=2, sink_side=True), engine_id="decode-0", cluster_token=TOKEN)
    try:
        sink.handshake(source.address)
        source.sessions = SessionTable()  # as after a reconnect: the old session is refused
        transfer = sink.start_pull(source.address, "req-1", [1], [2])
        assert transfer.wait(WAIT_S) is TransferState.DONE, transfer.error
    finally:
        sink.close()


def test_a_source_of_the_last_version_is_refused_naming_the_versions(monkeypatch):
    # A v4 source has no Challenge call: the generated servicer's default answers UNIMPLEMENTED.
    monkeypatch.setattr(grpc_transport._Servicer, "Challenge", pb_grpc.KVTransferServicer.Challenge)
    source = GrpcSource(LAYOUT, kv_regions(4, seed=1), engine_id="prefill-0", cluster_token=TOKEN)
    sink = GrpcSink(LAYOUT, kv_regions(4, seed=2, sink_side=True), engine_id="decode-0", cluster_token=TOKEN)
    try:
        with pytest.raises(WireVersionError, match=f"this side speaks {WIRE_VERSION}, the source at"):
            sink.handshake(source.address)
    finally:
        sink.close()
        source.close()
