"""The one small interface that every KV transport implements.

Roles, as the vLLM connector's worker side uses them:

- A prefill worker owns a `BlockSource`. It registers its KV cache tensors once (`BlockRegion`s),
  `pin`s a request's blocks when the request finishes prefill, and serves pulls of those blocks
  until the decode side releases them, the source's engine releases them, or the lease expires.
  Whenever a pin ends, `on_release(request_id, reason)` tells the engine it may reuse the blocks.
- A decode worker owns a `BlockSink` over its own KV cache tensors. `start_pull` returns at once
  with a `KVTransfer` handle; the worker polls `handle.state` each step until DONE or FAILED.

Transfer failures never raise into the caller: they end the handle in FAILED with an error string
and the caller applies its policy (recompute or fail the request). Control-plane calls such as
`BlockSink.handshake` do raise `KVTransportError`s.

Every transport checks `WIRE_VERSION`, the cluster token and the `KVLayoutSpec` compatibility hash
at handshake, and refuses a mismatch with a message that names what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Self

import torch

from pdserve.errors import PdserveError
from pdserve.kv.transport.leases import PinTable, ReleaseReason

__all__ = [
    "DEFAULT_LEASE_S",
    "WIRE_VERSION",
    "AuthenticationError",
    "BlockRegion",
    "BlockSink",
    "BlockSource",
    "IncompatiblePeerError",
    "KVLayoutSpec",
    "KVTransfer",
    "KVTransportError",
    "PeerHello",
    "PeerInfo",
    "RegionInfo",
    "ReleaseReason",
    "TransferState",
    "WireVersionError",
    "check_compatible",
    "check_regions",
]

# Bump on any change to the messages or to the byte order of blocks on the wire; peers speaking
# another version are refused at handshake rather than misreading each other's bytes.
# 2: NCCL pulls are driven over a per-pair control connection (PullBlocksNccl is no longer used).
# 3: TP sizes may differ: the compatibility hash leaves TP out, kv_layout marks the heads axis,
#    and a pull moves the head slice both ranks hold (heads.py).
# 4: an NCCL sink may offer "nccl+direct" in SetupCommunicatorRequest.backend and the source
#    names the pair's API in its settings (nccl_pair); a v3 source would refuse that offer.
WIRE_VERSION = 4
# A pinned request's blocks are freed after this long even if no decode worker pulls them, so a
# lost decode request cannot leak prefill KV. 30 s is ~100x a slow CPU pull of a long prompt.
DEFAULT_LEASE_S = 30.0
# Largest bytes of one block of one region. gRPC must hold a whole block in one message and NCCL
# in its staging buffer; realistic blocks are KiBs to a few MiB (a CPU block of SmolLM2: 192 KiB).
MAX_BLOCK_NBYTES = 256 << 20


class KVTransportError(PdserveError):
    """A peer was refused or could not be reached (control plane)."""


class WireVersionError(KVTransportError):
    """The peer speaks another wire version."""


class AuthenticationError(KVTransportError):
    """The peer did not prove knowledge of this cluster's token."""


class IncompatiblePeerError(KVTransportError):
    """The peer lays out KV differently; `field` names the first differing field."""

    def __init__(
        self, field: str, local: object = None, remote: object = None, *, message: str | None = None
    ):
        super().__init__(
            message or f"incompatible KV peer: {field} differs (local {local!r}, remote {remote!r})"
        )
        self.field = field


class TransferState(Enum):
    """Progress of one pull, as the connector polls it."""

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class KVLayoutSpec:
    """What must match for two engines to exchange KV blocks byte for byte.

    `kv_layout` describes a block TP-independently (heads axis as "[total heads]", heads.py);
    `tp_size` and `tp_rank` may differ between peers whose KV heads intersect (`heads.check_tp`).
    """

    model: str
    dtype: str
    block_size: int
    kv_layout: str
    tp_size: int = 1
    tp_rank: int = 0
    num_layers: int = 0

    def compat_hash(self) -> str:
        """Stable sha256 of every field but the TP ones; called once per handshake on each side."""
        fields = {name: getattr(self, name) for name in _HASHED_FIELDS}
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"pdserve.kv.layout\0" + canonical.encode()).hexdigest()


# Fields that must be equal on both sides; TP is checked by heads.check_tp instead.
_HASHED_FIELDS = tuple(f.name for f in dataclasses.fields(KVLayoutSpec) if not f.name.startswith("tp_"))


def check_compatible(local: KVLayoutSpec, remote: KVLayoutSpec) -> None:
    """Raises IncompatiblePeerError naming the first field that differs, then any TP sizes and
    ranks that cannot exchange KV heads; called at handshake."""
    from pdserve.kv.transport import heads

    for name in _HASHED_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise IncompatiblePeerError(name, mine, theirs)
    heads.check_tp(local, remote)


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """The wire description of one region: the shape and dtype of one of its blocks."""

    block_shape: tuple[int, ...]
    dtype: str
    block_nbytes: int


def check_regions(local: Sequence[RegionInfo], remote: Sequence[RegionInfo]) -> None:
    """Raises IncompatiblePeerError unless both sides register the same regions; handshake only."""
    if len(local) != len(remote):
        raise IncompatiblePeerError("regions", f"{len(local)} regions", f"{len(remote)} regions")
    for i, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        for name in ("block_shape", "dtype", "block_nbytes"):
            if getattr(mine, name) != getattr(theirs, name):
                raise IncompatiblePeerError(
                    f"regions[{i}].{name}", getattr(mine, name), getattr(theirs, name)
                )


@dataclass(frozen=True, slots=True)
class BlockRegion:
    """One registered KV tensor; block b of it is `tensor.select(block_dim, b)`.

    Built by the connector in `register_kv_caches`, one per layer tensor (or one per shared buffer).
    The transport copies whole blocks; it never assumes the block dim is first or that a block is
    contiguous in memory. `heads_dim`, when known, is the tensor's KV-heads axis: pulls between
    different TP sizes move a head slice of each block (`narrow_heads`).
    """

    tensor: torch.Tensor
    block_dim: int = 0
    heads_dim: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.block_dim < self.tensor.dim():
            raise ValueError(f"block_dim {self.block_dim} out of range for shape {tuple(self.tensor.shape)}")
        if self.heads_dim is not None and (
            self.heads_dim == self.block_dim or not 0 <= self.heads_dim < self.tensor.dim()
        ):
            raise ValueError(f"heads_dim {self.heads_dim} invalid for shape {tuple(self.tensor.shape)}")
        if self.info().block_nbytes > MAX_BLOCK_NBYTES:
            raise ValueError(f"a block of {self.info().block_nbytes} bytes exceeds {MAX_BLOCK_NBYTES}")

    @property
    def num_blocks(self) -> int:
        """How many blocks the region holds."""
        return self.tensor.shape[self.block_dim]

    def narrow_heads(self, start: int, count: int) -> BlockRegion:
        """A view of heads [start, start+count) of this region's own heads; at handshake."""
        if self.heads_dim is None:
            raise ValueError("this region has no known KV heads axis")
        view = self.tensor.narrow(self.heads_dim, start, count)
        return BlockRegion(view, self.block_dim, self.heads_dim)

    def info(self) -> RegionInfo:
        """The region's wire description; cheap, called at construction and handshake."""
        shape = tuple(s for d, s in enumerate(self.tensor.shape) if d != self.block_dim)
        nbytes = self.tensor.element_size() * int(torch.Size(shape).numel())
        return RegionInfo(
            block_shape=shape, dtype=str(self.tensor.dtype).removeprefix("torch."), block_nbytes=nbytes
        )


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


class KVTransfer:
    """Progress of one pull. A transport thread writes it; the connector polls it without blocking.

    Thread-safe. `state` moves PENDING -> TRANSFERRING -> DONE or FAILED and never back.
    """

    def __init__(self, request_id: str, remote_address: str, num_blocks: int):
        self.request_id = request_id
        self.remote_address = remote_address
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._state = TransferState.PENDING
        self._error: str | None = None
        self._bytes_moved = 0
        self._started = time.monotonic()
        self._ended: float | None = None

    @property
    def state(self) -> TransferState:
        """Current state; the connector reads it every engine step (never blocks)."""
        return self._state

    @property
    def error(self) -> str | None:
        """Why the pull failed, or None; set together with FAILED."""
        return self._error

    @property
    def bytes_moved(self) -> int:
        """Bytes written into local blocks so far."""
        return self._bytes_moved

    @property
    def elapsed_s(self) -> float:
        """Seconds from `start_pull` until now, or until the pull ended."""
        end = self._ended if self._ended is not None else time.monotonic()
        return end - self._started

    @property
    def done(self) -> bool:
        """True once the state is DONE or FAILED."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> TransferState:
        """Blocks up to `timeout` s for the end; for tests, benchmarks and synchronous callers."""
        self._finished.wait(timeout)
        return self._state

    def set_transferring(self) -> None:
        """Transports only: the first bytes are about to move."""
        with self._lock:
            if self._state is TransferState.PENDING:
                self._state = TransferState.TRANSFERRING

    def add_bytes(self, nbytes: int) -> None:
        """Transports only: `nbytes` more bytes are in local blocks."""
        with self._lock:
            self._bytes_moved += nbytes

    def finish(self, error: str | None = None) -> None:
        """Transports only: ends the pull, FAILED if `error` is given. Later calls are ignored."""
        with self._lock:
            if self._finished.is_set():
                return
            self._error = error
            self._state = TransferState.FAILED if error is not None else TransferState.DONE
            self._ended = time.monotonic()
            self._finished.set()

    def __repr__(self) -> str:
        return (
            f"KVTransfer({self.request_id!r} from {self.remote_address}, {self._state.value}, "
            f"{self._bytes_moved} B, {self.elapsed_s:.3f} s, error={self._error!r})"
        )


ReleaseCallback = Callable[[str, ReleaseReason], None]


class BlockSource(ABC):
    """Prefill side: serves pinned blocks of registered regions to sinks.

    Built once per worker in the connector's `register_kv_caches`; serving starts in the
    constructor and stops in `close`. Pinning and leases are shared by every transport.
    """

    # The version this endpoint speaks; tests override it on an instance to play an old peer.
    wire_version: int = WIRE_VERSION

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        cluster_token: str,
        on_release: ReleaseCallback | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ):
        self.layout = layout
        self.regions = tuple(regions)
        self.engine_id = engine_id
        self._cluster_token = cluster_token
        self._lease_s = lease_s
        self._pins = PinTable(on_release)
        self._views: dict[tuple[int, int], tuple[BlockRegion, ...]] = {}

    @property
    @abstractmethod
    def address(self) -> str:
        """Where sinks reach this source; goes into the request's kv_transfer_params."""

    @abstractmethod
    def close(self) -> None:
        """Stops serving and drops all pins without callbacks; called once at worker shutdown."""

    def pin(self, request_id: str, block_ids: Sequence[int], lease_s: float | None = None) -> None:
        """Keeps `block_ids` readable for `request_id` until released or the lease expires.

        Called by the connector once per finished prefill request; never blocks. Pinning again
        replaces the block list and renews the lease.
        """
        limit = min((r.num_blocks for r in self.regions), default=0)
        bad = [b for b in block_ids if not 0 <= b < limit]
        if bad:
            raise ValueError(f"block ids {bad[:5]} out of range [0, {limit})")
        self._pins.pin(request_id, block_ids, self._lease_s if lease_s is None else lease_s)

    def release(self, request_id: str) -> bool:
        """Unpins now (e.g. the request was aborted); False if it was not pinned. Never blocks.

        `on_release(request_id, ReleaseReason.LOCAL)` fires before this returns.
        """
        return self._pins.release(request_id, ReleaseReason.LOCAL)

    def pinned_blocks(self, request_id: str) -> tuple[int, ...] | None:
        """The blocks pinned for a request, or None; for the connector's bookkeeping and tests."""
        return self._pins.blocks(request_id)

    def open_read(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Transports only: a pull of `block_ids` starts. Raises LookupError (request not pinned)
        or ValueError (a block not in the pin); the blocks stay pinned until `close_read`."""
        self._pins.acquire(request_id, block_ids)

    def close_read(self, request_id: str, *, release: bool) -> None:
        """Transports only: the pull opened by `open_read` ended; `release` ends the pin too
        (reason PULLED). Called exactly once per successful `open_read`, even on failure."""
        self._pins.finish_read(request_id, ReleaseReason.PULLED if release else None)

    def release_by_peer(self, request_id: str, peer: KVLayoutSpec | None = None) -> bool:
        """Transports only: a sink sent Release; False if the request was not pinned. With the
        sink's layout, the pin ends once every rank of the sink's TP group that must release it
        has (heads.releasers_of); a lone rank of equal TP ends it at once."""
        from pdserve.kv.transport import heads

        total = heads.num_kv_heads(self.layout)
        if peer is None or not total:
            return self._pins.release(request_id, ReleaseReason.REMOTE)
        needed = heads.releasers_of(total, self.layout.tp_size, self.layout.tp_rank, peer.tp_size)
        return self._pins.release_share(request_id, ReleaseReason.REMOTE, peer.tp_rank, needed)

    def regions_for(self, peer: KVLayoutSpec) -> tuple[BlockRegion, ...]:
        """The views of the regions that pulls by `peer` move (heads.peer_regions), cached per
        peer TP rank; called at handshake, after the hello was verified."""
        from pdserve.kv.transport import heads

        key = (peer.tp_size, peer.tp_rank)
        if key not in self._views:
            self._views[key] = heads.peer_regions(self.regions, self.layout, peer)
        return self._views[key]

    def accept_hello(self, hello: PeerHello) -> PeerHello:
        """Checks a sink's hello and answers with this source's; raises KVTransportError.

        Called by the transport's server side once per handshake.
        """
        verify_hello(self.layout, self._cluster_token, "client", hello, self.wire_version)
        return make_hello(self.layout, self._cluster_token, "server", self.engine_id, self.wire_version)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockSink(ABC):
    """Decode side: pulls named remote blocks into local blocks of its registered regions.

    Built once per worker in the connector's `register_kv_caches`; `close` at shutdown.
    """

    wire_version: int = WIRE_VERSION

    def __init__(
        self, layout: KVLayoutSpec, regions: Sequence[BlockRegion], *, engine_id: str, cluster_token: str
    ):
        self.layout = layout
        self.regions = tuple(regions)
        self.region_infos = tuple(r.info() for r in self.regions)
        self.engine_id = engine_id
        self._cluster_token = cluster_token
        self._views: dict[tuple[int, int], tuple[BlockRegion, ...]] = {}

    @abstractmethod
    def handshake(self, remote_address: str) -> PeerInfo:
        """Connects to a source and checks it (cached per address); raises KVTransportError.

        Optional: `start_pull` handshakes on first use. Blocks for one round trip at most.
        """

    @abstractmethod
    def release_remote(self, remote_address: str, request_id: str) -> None:
        """Asks a source to unpin a request that will not be pulled (decode-side abort).

        Fire and forget: returns at once; failures are logged, the source's lease covers them.
        """

    @abstractmethod
    def close(self) -> None:
        """Stops transport threads and closes connections; called once at worker shutdown."""

    @abstractmethod
    def _submit(
        self, transfer: KVTransfer, src_block_ids: list[int], dst_block_ids: list[int], release: bool
    ) -> None:
        """Starts moving the blocks in the background and returns at once."""

    def start_pull(
        self,
        remote_address: str,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        release: bool = True,
    ) -> KVTransfer:
        """Starts pulling remote blocks `src_block_ids[i]` into local blocks `dst_block_ids[i]`.

        Called by the connector's worker side once per request to load (`start_load_kv`). Never
        blocks on the network and never raises: bad arguments and transport errors end the
        returned handle in FAILED. With `release`, the source unpins the blocks once it has sent
        them all (saving a Release round trip); its `on_release` may fire just after DONE here.
        """
        transfer = KVTransfer(request_id, remote_address, len(dst_block_ids))
        problem = self._check_block_ids(list(src_block_ids), list(dst_block_ids))
        if problem is not None:
            transfer.finish(problem)
            return transfer
        try:
            self._submit(transfer, list(src_block_ids), list(dst_block_ids), release)
        except Exception as exc:  # noqa: BLE001 - the contract: failures are state, not exceptions
            transfer.finish(f"could not start pull: {type(exc).__name__}: {exc}")
        return transfer

    def _check_block_ids(self, src: list[int], dst: list[int]) -> str | None:
        if len(src) != len(dst):
            return f"{len(src)} source blocks but {len(dst)} destination blocks"
        if len(set(dst)) != len(dst):
            return "destination block ids repeat"
        limit = min(r.num_blocks for r in self.regions) if self.regions else 0
        bad = [b for b in dst if not 0 <= b < limit]
        if bad:
            return f"destination block ids {bad[:5]} out of range [0, {limit})"
        if any(b < 0 for b in src):
            return "negative source block id"
        return None

    def regions_for(self, peer: KVLayoutSpec) -> tuple[BlockRegion, ...]:
        """The views of the local regions that pulls from `peer` fill (heads.peer_regions),
        cached per peer TP rank; called at handshake, after the hello was verified."""
        from pdserve.kv.transport import heads

        key = (peer.tp_size, peer.tp_rank)
        if key not in self._views:
            self._views[key] = heads.peer_regions(self.regions, self.layout, peer)
        return self._views[key]

    def _verify_source(self, address: str, hello: PeerHello, regions: Sequence[RegionInfo]) -> PeerInfo:
        """Checks the source's half of a handshake (`regions`: what the source moves for this
        sink); shared by every sink."""
        verify_hello(self.layout, self._cluster_token, "server", hello, self.wire_version)
        check_regions([r.info() for r in self.regions_for(hello.layout)], regions)
        return PeerInfo(address, hello.engine_id, hello.layout, tuple(regions))

    def _hello(self) -> PeerHello:
        return make_hello(self.layout, self._cluster_token, "client", self.engine_id, self.wire_version)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
