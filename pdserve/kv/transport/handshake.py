"""The handshake every transport runs before moving blocks: wire version, cluster-token proof and
KV layout compatibility, checked on both sides.

A sink sends its `PeerHello`; the source checks it (`verify_hello`) and answers with its own,
which the sink checks the same way. A mismatch is refused with a `KVTransportError` that says
which field differs. Pure functions and values; the transports carry them (wire.py for gRPC).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from pdserve.kv.transport import heads
from pdserve.kv.transport.errors import AuthenticationError, IncompatiblePeerError, WireVersionError
from pdserve.kv.transport.regions import COMPAT_FIELDS, KVLayoutSpec, RegionInfo

__all__ = [
    "WIRE_VERSION",
    "PeerHello",
    "PeerInfo",
    "check_compatible",
    "make_hello",
    "token_proof",
    "verify_hello",
]

# Bump on any change to the messages or to the byte order of blocks on the wire; peers speaking
# another version are refused at handshake rather than misreading each other's bytes.
# 2: NCCL pulls are driven over a per-pair control connection (the PullBlocksNccl RPC went away).
# 3: TP sizes may differ: the compatibility hash leaves TP out, kv_layout marks the heads axis,
#    and a pull moves the head slice both ranks hold (heads.py).
# 4: an NCCL sink may offer "nccl+direct" in SetupCommunicatorRequest.backend and the source
#    names the pair's API in its settings (nccl_pair); a v3 source would refuse that offer.
WIRE_VERSION = 4


def check_compatible(local: KVLayoutSpec, remote: KVLayoutSpec) -> None:
    """Raises IncompatiblePeerError naming the first field that differs, then any TP sizes and
    ranks that cannot exchange KV heads; called at handshake."""
    for name in COMPAT_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise IncompatiblePeerError(name, mine, theirs)
    heads.check_tp(local, remote)


@dataclass(frozen=True, slots=True)
class PeerHello:
    """What one side of a handshake presents: the fields of HandshakeRequest/Response."""

    wire_version: int
    compat_hash: str
    layout: KVLayoutSpec
    engine_id: str
    token_proof: bytes


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """A source that a sink has handshaken with; returned by `BlockSink.handshake`."""

    address: str
    engine_id: str
    layout: KVLayoutSpec
    regions: tuple[RegionInfo, ...]


def token_proof(cluster_token: str, role: str, wire_version: int, engine_id: str) -> bytes:
    """HMAC of the cluster token over who is speaking; the raw token never crosses the wire.

    `role` ("client" or "server") keeps one side's proof from being replayed as the other's.
    """
    message = f"pdserve.kv|{role}|{wire_version}|{engine_id}".encode()
    return hmac.new(cluster_token.encode(), message, hashlib.sha256).digest()


def make_hello(
    layout: KVLayoutSpec, cluster_token: str, role: str, engine_id: str, version: int
) -> PeerHello:
    """Builds this side's half of a handshake; called once per handshake."""
    proof = token_proof(cluster_token, role, version, engine_id)
    return PeerHello(version, layout.compat_hash(), layout, engine_id, proof)


def verify_hello(local: KVLayoutSpec, cluster_token: str, role: str, hello: PeerHello, version: int) -> None:
    """Checks a peer's hello: wire version, then token, then layout. Raises a KVTransportError.

    Called by every transport on both sides of a handshake; `role` is the peer's role.
    """
    if hello.wire_version != version:
        raise WireVersionError(
            f"wire version mismatch: this side speaks {version}, "
            f"peer {hello.engine_id!r} speaks {hello.wire_version}"
        )
    expected = token_proof(cluster_token, role, hello.wire_version, hello.engine_id)
    if not hmac.compare_digest(expected, hello.token_proof):
        raise AuthenticationError(f"peer {hello.engine_id!r} refused: cluster token does not match")
    if hello.compat_hash != local.compat_hash():
        check_compatible(local, hello.layout)
        raise IncompatiblePeerError("compat_hash", local.compat_hash(), hello.compat_hash)
    check_compatible(local, hello.layout)  # the hash leaves TP out
