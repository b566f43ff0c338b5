"""What a KV source remembers of its peers between calls: the challenges it issued and the
sessions it opened.

Lifecycle of one peer: `ChallengeTable.issue` (a nonce bound to the peer's connection) ->
`ChallengeTable.redeem` (once, by the handshake that answers it, within `CHALLENGE_TTL_S`) ->
`SessionTable.open` (a session id bound to the same connection) -> `SessionTable.get` on every
later call, which refuses the id from any other connection. Both tables are bounded (oldest
dropped first), so a flood of unauthenticated challenges costs a fixed amount of memory.

A "peer" here is the transport's name for the connection a call came on (gRPC's
`context.peer()`, e.g. "ipv4:10.0.0.7:51234"); a session id copied to another connection is
worth nothing there.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kv.transport.defaults import DEFAULT_NCCL_MAX_PAIRS, DEFAULT_NCCL_MAX_PAIRS_PER_SESSION
from pdserve.kv.transport.errors import AuthenticationError, PairLimitError
from pdserve.kv.transport.handshake import new_nonce
from pdserve.kv.transport.regions import KVLayoutSpec

__all__ = ["CHALLENGE_TTL_S", "ChallengeTable", "PairBudget", "Session", "SessionTable"]

# A sink answers a challenge within one round trip; 10 s is twice the handshake timeout.
CHALLENGE_TTL_S = 10.0
# Challenges outstanding at once; far above the handshakes of any legitimate set of sinks.
MAX_PENDING_CHALLENGES = 1024
# Sessions kept per source (oldest dropped first); one per sink process it ever talked to.
MAX_SESSIONS = 4096


class ChallengeTable:
    """Nonces issued and not yet redeemed. Thread-safe; server threads call it."""

    def __init__(
        self,
        ttl_s: float = CHALLENGE_TTL_S,
        capacity: int = MAX_PENDING_CHALLENGES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ttl_s, self._capacity, self._clock = ttl_s, capacity, clock
        self._pending: OrderedDict[bytes, tuple[str, float]] = OrderedDict()  # nonce -> (peer, deadline)
        self._lock = threading.Lock()

    def issue(self, peer: str) -> bytes:
        """A fresh nonce for `peer`; once per Challenge call."""
        nonce = new_nonce()
        with self._lock:
            self._pending[nonce] = (peer, self._clock() + self._ttl_s)
            while len(self._pending) > self._capacity:
                self._pending.popitem(last=False)
        return nonce

    def redeem(self, nonce: bytes, peer: str) -> None:
        """Uses up a nonce; raises AuthenticationError unless it was issued to `peer`, is unused
        and has not expired. Once per Handshake call, before the proof is checked."""
        with self._lock:
            issued = self._pending.pop(nonce, None)
        if issued is None or issued[0] != peer or self._clock() > issued[1]:
            raise AuthenticationError(
                "handshake refused: its challenge is unknown, used, expired or was issued to another "
                "connection (a replayed handshake?)"
            )


@dataclass(slots=True)
class Session:
    """One handshaken sink connection, as the source sees it."""

    session_id: str
    peer: str  # the connection that handshook; the id is valid from there only
    engine_id: str
    layout: KVLayoutSpec
    pairs: set[str] = field(default_factory=set)  # live NCCL pairs it set up


class SessionTable:
    """Open sessions by id. Thread-safe; server threads call it."""

    def __init__(self, capacity: int = MAX_SESSIONS):
        self._capacity = capacity
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, peer: str, engine_id: str, layout: KVLayoutSpec) -> Session:
        """A fresh session for an accepted handshake."""
        session = Session(secrets.token_hex(16), peer, engine_id, layout)
        with self._lock:
            self._sessions[session.session_id] = session
            while len(self._sessions) > self._capacity:
                self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None, peer: str) -> Session | None:
        """The session with this id if it was opened on `peer`'s connection, else None."""
        with self._lock:
            session = self._sessions.get(session_id) if session_id is not None else None
        if session is None or session.peer != peer:
            return None
        return session


class PairBudget:
    """The NCCL pairs a source holds, by session: a pair counts from its SetupCommunicator
    until its thread ends, so staging memory is bounded by `max_pairs` rings. Thread-safe."""

    def __init__(
        self,
        max_pairs: int = DEFAULT_NCCL_MAX_PAIRS,
        max_per_session: int = DEFAULT_NCCL_MAX_PAIRS_PER_SESSION,
    ):
        if max_pairs < 1 or max_per_session < 1:
            raise ValueError(f"pair limits must be positive, got {max_pairs} and {max_per_session}")
        self.max_pairs, self.max_per_session = max_pairs, max_per_session
        self._pair_ids: set[str] = set()
        self._lock = threading.Lock()

    def reserve(self, session: Session, pair_id: str) -> None:
        """Counts a new pair; raises PairLimitError past a limit, ValueError for a pair id in
        use. Server thread, once per SetupCommunicator, before anything is allocated."""
        with self._lock:
            if pair_id in self._pair_ids:
                raise ValueError(f"pair {pair_id!r} already exists")
            if len(session.pairs) >= self.max_per_session:
                raise PairLimitError(
                    f"session of {session.engine_id!r} already holds {len(session.pairs)} NCCL pairs "
                    f"(limit {self.max_per_session})"
                )
            if len(self._pair_ids) >= self.max_pairs:
                raise PairLimitError(f"this KV source already holds {self.max_pairs} NCCL pairs")
            self._pair_ids.add(pair_id)
            session.pairs.add(pair_id)

    def release(self, session: Session, pair_id: str) -> None:
        """Uncounts a pair that ended (or failed to start); its thread or its set-up, once."""
        with self._lock:
            self._pair_ids.discard(pair_id)
            session.pairs.discard(pair_id)
