"""The handshake every transport runs before moving blocks: wire version, a challenge-response
cluster-token proof, and KV layout compatibility, checked on both sides.

A sink asks for a `Challenge` (the source's engine id, wire version and a fresh random nonce,
single use: sessions.ChallengeTable), then sends its `PeerHello`, whose proof is an HMAC of the
cluster token over a `Transcript` (both engine ids, the source's nonce and one of the sink's own).
The source checks it (`verify_hello`) and answers with its own hello, proved over the same
transcript, which the sink checks the same way. So two handshakes never carry the same proofs, a
recorded one replayed is refused (its nonce was used), and the raw token never crosses the wire.
A mismatch is refused with a `KVTransportError` that says which field differs. Pure functions and
values; the transports carry them (wire.py for gRPC).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

from pdserve.kv.transport import heads
from pdserve.kv.transport.errors import AuthenticationError, IncompatiblePeerError, WireVersionError
from pdserve.kv.transport.regions import COMPAT_FIELDS, KVLayoutSpec, RegionInfo

__all__ = [
    "NONCE_BYTES",
    "WIRE_VERSION",
    "Challenge",
    "PeerHello",
    "PeerInfo",
    "Transcript",
    "check_compatible",
    "check_version",
    "make_hello",
    "new_nonce",
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
# 5: challenge-response handshake (the Challenge RPC; HandshakeRequest carries both nonces and
#    the proofs cover them and both engine ids), so a recorded handshake cannot be replayed.
WIRE_VERSION = 5
# 32 bytes (256 bits) of randomness per nonce: never repeats in practice, cheap to send.
NONCE_BYTES = 32


def new_nonce() -> bytes:
    """A fresh random nonce; one per challenge and one per sink hello."""
    return secrets.token_bytes(NONCE_BYTES)


def check_compatible(local: KVLayoutSpec, remote: KVLayoutSpec) -> None:
    """Raises IncompatiblePeerError naming the first field that differs, then any TP sizes and
    ranks that cannot exchange KV heads; called at handshake."""
    for name in COMPAT_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise IncompatiblePeerError(name, mine, theirs)
    heads.check_tp(local, remote)


@dataclass(frozen=True, slots=True)
class Challenge:
    """What a source issues before a handshake: who it is, which version it speaks, the nonce."""

    wire_version: int
    engine_id: str
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Transcript:
    """What both proofs of one handshake cover; both sides build the same one."""

    client_engine_id: str
    server_engine_id: str
    server_nonce: bytes
    client_nonce: bytes

    def engine_id(self, role: str) -> str:
        """The engine id of the side speaking as `role` ("client" or "server")."""
        return self.client_engine_id if role == "client" else self.server_engine_id


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


def token_proof(cluster_token: str, role: str, wire_version: int, transcript: Transcript) -> bytes:
    """HMAC of the cluster token over who is speaking, in which handshake; the raw token never
    crosses the wire.

    `role` ("client" or "server") keeps one side's proof from being replayed as the other's; the
    transcript's nonces keep it from being replayed in another handshake. Each field is
    length-prefixed, so no two transcripts encode alike.
    """
    parts = (
        b"pdserve.kv",
        role.encode(),
        str(wire_version).encode(),
        transcript.client_engine_id.encode(),
        transcript.server_engine_id.encode(),
        transcript.server_nonce,
        transcript.client_nonce,
    )
    message = b"".join(struct.pack("!I", len(part)) + part for part in parts)
    return hmac.new(cluster_token.encode(), message, hashlib.sha256).digest()


def make_hello(
    layout: KVLayoutSpec, cluster_token: str, role: str, version: int, transcript: Transcript
) -> PeerHello:
    """Builds this side's half of a handshake; called once per handshake."""
    proof = token_proof(cluster_token, role, version, transcript)
    return PeerHello(version, layout.compat_hash(), layout, transcript.engine_id(role), proof)


def check_version(theirs: int, peer_engine_id: str, version: int) -> None:
    """Raises WireVersionError naming both versions when they differ."""
    if theirs != version:
        raise WireVersionError(
            f"wire version mismatch: this side speaks {version}, peer {peer_engine_id!r} speaks {theirs}"
        )


def verify_hello(
    local: KVLayoutSpec,
    cluster_token: str,
    role: str,
    hello: PeerHello,
    version: int,
    transcript: Transcript,
) -> None:
    """Checks a peer's hello: wire version, then token, then layout. Raises a KVTransportError.

    Called by every transport on both sides of a handshake; `role` is the peer's role.
    """
    check_version(hello.wire_version, hello.engine_id, version)
    expected = token_proof(cluster_token, role, hello.wire_version, transcript)
    if hello.engine_id != transcript.engine_id(role) or not hmac.compare_digest(expected, hello.token_proof):
        raise AuthenticationError(f"peer {hello.engine_id!r} refused: cluster token does not match")
    if hello.compat_hash != local.compat_hash():
        check_compatible(local, hello.layout)
        raise IncompatiblePeerError("compat_hash", local.compat_hash(), hello.compat_hash)
    check_compatible(local, hello.layout)  # the hash leaves TP out
