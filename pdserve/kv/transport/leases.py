"""Pins of a prefill worker's KV blocks, with leases, shared by every BlockSource.

Lifecycle of one pin: `pin` (request finished prefill) -> zero or more reads (`acquire` ...
`finish_read`, one per pull) -> its end, exactly once: a pull that asked to release, `release`,
or lease expiry. At its end `on_release(request_id, reason)` fires so the engine can free the
blocks. A lease that expires during a read waits for the read to finish: blocks are never handed
back while a transport is still copying out of them.

Who may end a pin remotely: the first read claims it for the reader (a transport session), and
from then on only the sessions that read it may release it (`release_share` with `releaser`); a
pin nobody has read yet may be released by any authenticated session (a decode side that gives
a request up before pulling it, or a prefill rank whose heads no decode rank reads).

A reaper thread sleeps until the earliest lease deadline; it starts with the first pin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

logger = logging.getLogger(__name__)


class ReleaseReason(Enum):
    """Why a pin ended; passed to the source's `on_release` callback."""

    PULLED = "pulled"  # a sink pulled the blocks and asked to release them
    REMOTE = "remote"  # a sink sent Release (e.g. the decode side aborted)
    LOCAL = "local"  # the source's owner called release()
    LEASE_EXPIRED = "lease_expired"  # nobody released it in time


@dataclass(slots=True)
class _Pin:
    block_ids: frozenset[int]
    ordered: tuple[int, ...]
    deadline: float
    readers: int = 0
    ended_by: ReleaseReason | None = None  # set when the pin ended while a read was in flight
    released_by: set[int] = field(default_factory=set)  # sink TP ranks that released a share
    claimed_by: set[str] = field(default_factory=set)  # sessions that read it


class PinTable:
    """Thread-safe table of pinned requests. Callbacks run outside the lock, on the thread
    that ended the pin (a server thread, the reaper, or the caller of `release`)."""

    def __init__(self, on_release: Callable[[str, ReleaseReason], None] | None):
        self._on_release = on_release
        self._pins: dict[str, _Pin] = {}
        self._wakeup = threading.Condition()
        self._reaper: threading.Thread | None = None
        self._closed = False

    def pin(self, request_id: str, block_ids: Sequence[int], lease_s: float) -> None:
        """Pins (or re-pins, renewing the lease); called by BlockSource.pin. Never blocks."""
        with self._wakeup:
            if self._closed:
                raise RuntimeError("the block source is closed")
            self._pins[request_id] = _Pin(frozenset(block_ids), tuple(block_ids), time.monotonic() + lease_s)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="kv-lease-reaper", daemon=True)
                self._reaper.start()
            self._wakeup.notify()

    def renew(self, request_id: str, lease_s: float) -> bool:
        """Extends a live pin's lease to at least `lease_s` from now; False if it is not pinned
        (released, expired or never pinned). Never blocks."""
        with self._wakeup:
            pin = self._pins.get(request_id)
            if pin is None or pin.ended_by is not None:
                return False
            pin.deadline = max(pin.deadline, time.monotonic() + lease_s)
            self._wakeup.notify()
            return True

    def blocks(self, request_id: str) -> tuple[int, ...] | None:
        """The pinned blocks of a live pin, in pin order, or None."""
        with self._wakeup:
            pin = self._pins.get(request_id)
            return pin.ordered if pin is not None and pin.ended_by is None else None

    def acquire(self, request_id: str, block_ids: Sequence[int], reader: str | None = None) -> None:
        """Starts a read of `block_ids` by session `reader` (which claims the pin); raises
        LookupError if not pinned, ValueError if a block is not part of the pin. Called by a
        transport once per pull, before the first byte."""
        with self._wakeup:
            pin = self._pins.get(request_id)
            if pin is None or pin.ended_by is not None:
                raise LookupError(f"unknown request id {request_id!r}: not pinned, released or expired")
            missing = [b for b in block_ids if b not in pin.block_ids]
            if missing:
                raise ValueError(f"blocks {missing[:5]} are not pinned for request {request_id!r}")
            pin.readers += 1
            if reader is not None:
                pin.claimed_by.add(reader)

    def finish_read(self, request_id: str, release: ReleaseReason | None = None) -> None:
        """Ends a read started by `acquire`, ending the pin with `release` if given. Called by a
        transport once per acquired pull, whether it succeeded or not."""
        fire: ReleaseReason | None = None
        with self._wakeup:
            pin = self._pins.get(request_id)
            if pin is None:
                return
            pin.readers -= 1
            if release is not None and pin.ended_by is None:
                pin.ended_by = release
            if pin.readers == 0 and pin.ended_by is not None:
                del self._pins[request_id]
                fire = pin.ended_by
        if fire is not None:
            self._fire(request_id, fire)

    def release(self, request_id: str, reason: ReleaseReason) -> bool:
        """Ends a pin; False if it was not pinned. The callback is deferred while a read runs."""
        with self._wakeup:
            pin = self._pins.get(request_id)
            if pin is None or pin.ended_by is not None:
                return False
            pin.ended_by = reason
            if pin.readers > 0:
                return True
            del self._pins[request_id]
        self._fire(request_id, reason)
        return True

    def release_share(
        self,
        request_id: str,
        reason: ReleaseReason,
        rank: int,
        needed: frozenset[int],
        releaser: str | None = None,
    ) -> bool:
        """Records that sink rank `rank` released the pin; ends it (as `release`) once every
        rank in `needed` has. False if it was not pinned. Several decode ranks read one prefill
        rank's pin when their TP sizes differ; the pin must outlive all of their pulls. Raises
        PermissionError when session `releaser` did not read a pin that others did."""
        with self._wakeup:
            pin = self._pins.get(request_id)
            if pin is None or pin.ended_by is not None:
                return False
            if releaser is not None and pin.claimed_by and releaser not in pin.claimed_by:
                raise PermissionError(f"request {request_id!r} was pulled by another session")
            pin.released_by.add(rank)
            if not needed <= pin.released_by:
                return True
        return self.release(request_id, reason)

    def close(self) -> None:
        """Drops every pin without callbacks and stops the reaper; called by BlockSource.close."""
        with self._wakeup:
            self._closed = True
            self._pins.clear()
            self._wakeup.notify()
        if self._reaper is not None:
            self._reaper.join(timeout=1.0)

    def _fire(self, request_id: str, reason: ReleaseReason) -> None:
        if self._on_release is None:
            return
        try:
            self._on_release(request_id, reason)
        except Exception:
            logger.exception("on_release callback failed for %s", request_id)

    def _reap(self) -> None:
        while True:
            expired: list[str] = []
            with self._wakeup:
                if self._closed:
                    return
                now = time.monotonic()
                live = [(p.deadline, rid) for rid, p in self._pins.items() if p.ended_by is None]
                for deadline, rid in live:
                    if deadline <= now:
                        expired.append(rid)
                if not expired:
                    next_deadline = min((d for d, _ in live), default=None)
                    self._wakeup.wait(None if next_deadline is None else next_deadline - now)
                    continue
            for rid in expired:
                if self.release(rid, ReleaseReason.LEASE_EXPIRED):
                    logger.info("KV lease expired for request %s; blocks released", rid)
