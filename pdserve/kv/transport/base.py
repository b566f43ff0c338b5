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
`BlockSink.handshake` do raise `KVTransportError`s (errors.py).

Every transport checks `WIRE_VERSION`, the cluster token (a challenge-response proof, mutual) and
the `KVLayoutSpec` compatibility hash at handshake (handshake.py), and refuses a mismatch with a
message that names what differs. What
the blocks are (layout, regions) lives in regions.py, which heads.py builds on.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Self

from pdserve.kv.transport import heads
from pdserve.kv.transport.defaults import DEFAULT_LEASE_S
from pdserve.kv.transport.errors import AuthenticationError
from pdserve.kv.transport.handshake import (
    NONCE_BYTES, WIRE_VERSION, Challenge, PeerHello, PeerInfo, Transcript, check_version, make_hello,
    new_nonce, verify_hello,
)
from pdserve.kv.transport.leases import PinTable, ReleaseReason
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec, RegionInfo, check_regions
from pdserve.kv.transport.sessions import ChallengeTable

__all__ = [
    "BlockSink",
    "BlockSource",
    "KVTransfer",
    "ReleaseCallback",
    "TransferState",
]


class TransferState(Enum):
    """Progress of one pull, as the connector polls it."""

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


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
        self._challenges = ChallengeTable()
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

    def renew(self, request_id: str) -> bool:
        """Restarts a live pin's lease (a decode leg still waits for its engine to take it);
        False if it is not pinned. Never blocks."""
        return self._pins.renew(request_id, self._lease_s)

    def pinned_blocks(self, request_id: str) -> tuple[int, ...] | None:
        """The blocks pinned for a request, or None; for the connector's bookkeeping and tests."""
        return self._pins.blocks(request_id)

    def open_read(self, request_id: str, block_ids: Sequence[int], reader: str | None = None) -> None:
        """Transports only: a pull of `block_ids` by session `reader` starts. Raises LookupError
        (request not pinned) or ValueError (a block not in the pin); the blocks stay pinned
        until `close_read`."""
        self._pins.acquire(request_id, block_ids, reader)

    def close_read(self, request_id: str, *, release: bool) -> None:
        """Transports only: the pull opened by `open_read` ended; `release` ends the pin too
        (reason PULLED). Called exactly once per successful `open_read`, even on failure."""
        self._pins.finish_read(request_id, ReleaseReason.PULLED if release else None)

    def release_by_peer(
        self, request_id: str, peer: KVLayoutSpec | None = None, releaser: str | None = None
    ) -> bool:
        """Transports only: a sink (session `releaser`) sent Release; False if the request was
        not pinned, PermissionError if other sessions read it and this one did not. With the
        sink's layout, the pin ends once every rank of the sink's TP group that must release it
        has (heads.releasers_of); a lone rank of equal TP ends it at once."""
        total = heads.num_kv_heads(self.layout)
        if peer is None or not total:
            needed, rank = frozenset({0}), 0
        else:
            needed = heads.releasers_of(total, self.layout.tp_size, self.layout.tp_rank, peer.tp_size)
            rank = peer.tp_rank
        return self._pins.release_share(request_id, ReleaseReason.REMOTE, rank, needed, releaser)

    def regions_for(self, peer: KVLayoutSpec) -> tuple[BlockRegion, ...]:
        """The views of the regions that pulls by `peer` move (heads.peer_regions), cached per
        peer TP rank; called at handshake, after the hello was verified."""
        key = (peer.tp_size, peer.tp_rank)
        if key not in self._views:
            self._views[key] = heads.peer_regions(self.regions, self.layout, peer)
        return self._views[key]

    def issue_challenge(self, wire_version: int, peer_engine_id: str, peer: str) -> Challenge:
        """A fresh single-use nonce for the handshake that `peer` (the connection's name) sends
        next; raises WireVersionError when the sink speaks another version. Called by the
        transport's server side once per handshake, before `accept_hello`."""
        check_version(wire_version, peer_engine_id, self.wire_version)
        return Challenge(self.wire_version, self.engine_id, self._challenges.issue(peer))

    def accept_hello(
        self, hello: PeerHello, server_nonce: bytes, client_nonce: bytes, peer: str
    ) -> PeerHello:
        """Checks a sink's hello (version, then the challenge it answers, then its proof and
        layout) and answers with this source's, proved over the same transcript; raises
        KVTransportError. Called by the transport's server side once per handshake."""
        check_version(hello.wire_version, hello.engine_id, self.wire_version)
        self._challenges.redeem(server_nonce, peer)
        if len(client_nonce) != NONCE_BYTES:
            raise AuthenticationError(f"peer {hello.engine_id!r} refused: malformed client nonce")
        transcript = Transcript(hello.engine_id, self.engine_id, server_nonce, client_nonce)
        verify_hello(self.layout, self._cluster_token, "client", hello, self.wire_version, transcript)
        return make_hello(self.layout, self._cluster_token, "server", self.wire_version, transcript)

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
        # Blocks every region holds; computed once (regions never change), read by every pull.
        self.num_blocks = min((r.num_blocks for r in self.regions), default=0)
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
        limit = self.num_blocks
        bad = [b for b in dst if not 0 <= b < limit]
        if bad:
            return f"destination block ids {bad[:5]} out of range [0, {limit})"
        if any(b < 0 for b in src):
            return "negative source block id"
        return None

    def regions_for(self, peer: KVLayoutSpec) -> tuple[BlockRegion, ...]:
        """The views of the local regions that pulls from `peer` fill (heads.peer_regions),
        cached per peer TP rank; called at handshake, after the hello was verified."""
        key = (peer.tp_size, peer.tp_rank)
        if key not in self._views:
            self._views[key] = heads.peer_regions(self.regions, self.layout, peer)
        return self._views[key]

    def _verify_source(
        self, address: str, hello: PeerHello, regions: Sequence[RegionInfo], transcript: Transcript
    ) -> PeerInfo:
        """Checks the source's half of a handshake (`regions`: what the source moves for this
        sink); shared by every sink."""
        verify_hello(self.layout, self._cluster_token, "server", hello, self.wire_version, transcript)
        check_regions([r.info() for r in self.regions_for(hello.layout)], regions)
        return PeerInfo(address, hello.engine_id, hello.layout, tuple(regions))

    def _hello(self, challenge: Challenge) -> tuple[PeerHello, Transcript]:
        """This sink's answer to a source's challenge (raises WireVersionError when the source
        speaks another version), and the transcript the source's answer must prove."""
        check_version(challenge.wire_version, challenge.engine_id, self.wire_version)
        transcript = Transcript(self.engine_id, challenge.engine_id, challenge.nonce, new_nonce())
        hello = make_hello(self.layout, self._cluster_token, "client", self.wire_version, transcript)
        return hello, transcript

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
