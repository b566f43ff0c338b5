"""Conversions between the transport's dataclasses and the generated protobuf messages.

Used by the gRPC and NCCL transports on every handshake; also the one place that maps refusals
(KVTransportError subclasses) to gRPC status codes and trailing metadata and back, so a sink
raises the same exception class, naming the same field, that the source raised.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.transport.errors import (
    AuthenticationError,
    IncompatiblePeerError,
    KVTransportError,
    WireVersionError,
)
from pdserve.kv.transport.handshake import Challenge, PeerHello, Transcript
from pdserve.kv.transport.regions import KVLayoutSpec, RegionInfo

# Metadata keys; gRPC requires lower case. The session key rides on every call after Handshake.
SESSION_KEY = "x-pdserve-session"
ERROR_KIND_KEY = "x-pdserve-error-kind"
ERROR_FIELD_KEY = "x-pdserve-error-field"

_REFUSALS: dict[type[KVTransportError], tuple[grpc.StatusCode, str]] = {
    WireVersionError: (grpc.StatusCode.FAILED_PRECONDITION, "wire_version"),
    AuthenticationError: (grpc.StatusCode.UNAUTHENTICATED, "auth"),
    IncompatiblePeerError: (grpc.StatusCode.FAILED_PRECONDITION, "incompatible"),
}


def layout_to_proto(layout: KVLayoutSpec) -> pb.LayoutSpec:
    """The wire form of a layout spec."""
    return pb.LayoutSpec(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        kv_layout=layout.kv_layout,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        num_layers=layout.num_layers,
    )


def layout_from_proto(message: pb.LayoutSpec) -> KVLayoutSpec:
    """A layout spec from its wire form."""
    return KVLayoutSpec(
        model=message.model,
        dtype=message.dtype,
        block_size=message.block_size,
        kv_layout=message.kv_layout,
        tp_size=message.tp_size,
        tp_rank=message.tp_rank,
        num_layers=message.num_layers,
    )


def challenge_to_response(challenge: Challenge) -> pb.ChallengeResponse:
    """A source's challenge as the Challenge response."""
    return pb.ChallengeResponse(
        wire_version=challenge.wire_version, engine_id=challenge.engine_id, nonce=challenge.nonce
    )


def challenge_from_response(message: pb.ChallengeResponse) -> Challenge:
    """The challenge a source issued."""
    return Challenge(message.wire_version, message.engine_id, message.nonce)


def hello_to_request(hello: PeerHello, transcript: Transcript) -> pb.HandshakeRequest:
    """A sink's hello, answering the challenge in `transcript`, as the Handshake request."""
    return pb.HandshakeRequest(
        wire_version=hello.wire_version,
        compat_hash=hello.compat_hash,
        layout=layout_to_proto(hello.layout),
        engine_id=hello.engine_id,
        token_proof=hello.token_proof,
        server_nonce=transcript.server_nonce,
        client_nonce=transcript.client_nonce,
    )


def hello_from_message(message: pb.HandshakeRequest | pb.HandshakeResponse) -> PeerHello:
    """The hello carried by either handshake message."""
    return PeerHello(
        wire_version=message.wire_version,
        compat_hash=message.compat_hash,
        layout=layout_from_proto(message.layout),
        engine_id=message.engine_id,
        token_proof=message.token_proof,
    )


def hello_to_response(
    hello: PeerHello, session_id: str, regions: Sequence[RegionInfo]
) -> pb.HandshakeResponse:
    """A source's hello, session and regions as the Handshake response."""
    return pb.HandshakeResponse(
        wire_version=hello.wire_version,
        compat_hash=hello.compat_hash,
        layout=layout_to_proto(hello.layout),
        engine_id=hello.engine_id,
        session_id=session_id,
        regions=[
            pb.RegionInfo(block_shape=list(r.block_shape), dtype=r.dtype, block_nbytes=r.block_nbytes)
            for r in regions
        ],
        token_proof=hello.token_proof,
    )


def regions_from_response(message: pb.HandshakeResponse) -> list[RegionInfo]:
    """The source's regions from its Handshake response."""
    return [RegionInfo(tuple(r.block_shape), r.dtype, r.block_nbytes) for r in message.regions]


def refusal_status(error: KVTransportError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code and trailing metadata a server answers a refused handshake with."""
    for cls, (code, kind) in _REFUSALS.items():
        if isinstance(error, cls):
            field = getattr(error, "field", "")
            return code, ((ERROR_KIND_KEY, kind), (ERROR_FIELD_KEY, field))
    return grpc.StatusCode.FAILED_PRECONDITION, ((ERROR_KIND_KEY, "other"),)


def error_from_rpc(error: grpc.RpcError, address: str) -> KVTransportError:
    """The KVTransportError a sink raises for a failed call to the source at `address`."""
    details = f"source at {address} refused: {error.details()}"  # type: ignore[attr-defined]
    trailing = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    kind = trailing.get(ERROR_KIND_KEY)
    if kind == "wire_version":
        return WireVersionError(details)
    if kind == "auth":
        return AuthenticationError(details)
    if kind == "incompatible":
        return IncompatiblePeerError(trailing.get(ERROR_FIELD_KEY, "?"), message=details)
    code = error.code()  # type: ignore[attr-defined]
    return KVTransportError(f"call to KV source at {address} failed: {code.name}: {error.details()}")  # type: ignore[attr-defined]
