"""The engine registry: the one place that holds each engine's state as the frontend sees it.

An `EngineRecord` is everything routing, draining and health need to know of one engine: its
size (KV blocks), its lifecycle (starting -> ready -> draining -> removed; healthy or not), the
work the frontend has sent it and not yet seen come back (queued prefill tokens, legs in
flight, requests decoding, KV pins still to be pulled, placements not yet finished) and what
the engine last reported (KV usage). The request ledger (`ledger.py`) writes the request
counts; backends and simulators write only the lifecycle and the reports, through the
registry's methods. Everybody else reads.

Time comes in as arguments, never from a clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.scheduler.routing import EngineLoad

# Stats calls in a row an engine may miss before routing skips it (it comes back on an answer):
# one miss is a busy host, several a wedged engine.
STATS_MISSES_UNROUTABLE = 3


@dataclass(slots=True)
class BusyLog:
    """When one engine had a prompt in prefill: the spans that ended within the last window
    and the open one. Its busy fraction is that engine's measured prefill utilization."""

    since: float | None = None  # start of the open span (a prompt is in prefill now)
    spans: deque[tuple[float, float]] = field(default_factory=deque)

    def start(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def stop(self, now: float, keep_s: float) -> None:
        if self.since is not None:
            self.spans.append((self.since, now))
            self.since = None
        while self.spans and self.spans[0][1] < now - keep_s:
            self.spans.popleft()

    def fraction(self, now: float, window_s: float) -> float:
        """Share of the last `window_s` seconds with a prompt in prefill (0..1)."""
        lo = now - window_s
        busy = sum(min(end, now) - max(start, lo) for start, end in self.spans if end > lo)
        if self.since is not None:
            busy += now - max(self.since, lo)
        return min(max(busy, 0.0) / window_s, 1.0)


@dataclass(slots=True)
class EngineRecord:
    replica_id: str
    pool: str
    block_size: int
    num_kv_blocks: int
    # Written by the request ledger (float in the fluid simulator, whose engine groups spread
    # a group's load over its engines).
    queued_prefill_tokens: float = 0
    num_prefilling: int = 0
    num_decoding: float = 0
    pins: int = 0  # prefilled requests whose KV a decode engine has not pulled yet
    reserved: int = 0  # requests placed here whose leg has not finished (may not have begun)
    in_flight: int = 0  # legs submitted to the engine and not ended
    # The same counts of the other frontends' requests (ingress replicas: `set_peers`), as the
    # controller last summed them: at most one sync interval old.
    peer_queued_prefill_tokens: float = 0
    peer_num_decoding: float = 0
    peer_reserved: int = 0
    # Written by backends and simulators through the registry.
    kv_usage: float = 0.0
    healthy: bool = True  # False once the engine is known dead: no more routing to it
    answering: bool = True  # its last stats call came back in time (else: slow or wedged)
    stats_misses: int = 0  # stats calls in a row that did not come back in time
    # When it last showed progress: an output of any leg, or work arriving while it had none.
    # An engine with legs in flight and no progress for long is hung (the supervisor's check).
    last_progress: float = 0.0
    ready: bool = True  # False while starting
    draining: bool = False
    busy: BusyLog = field(default_factory=BusyLog)  # prefill in flight (leg start..first output)
    # `load()` and the fields it was built from: the router reads every engine on every
    # request, while a request changes the books of one or two (the fluid simulator routes ~30
    # cohorts a step over the same few engines).
    _load: EngineLoad | None = field(default=None, init=False, repr=False, compare=False)
    _load_key: tuple = field(default=(), init=False, repr=False, compare=False)

    @property
    def accepting(self) -> bool:
        return (self.healthy and self.ready and not self.draining
                and self.stats_misses < STATS_MISSES_UNROUTABLE)

    @property
    def starting(self) -> bool:
        """Started and not up yet (a dead one is not coming)."""
        return self.healthy and not self.ready

    @property
    def idle(self) -> bool:
        """Nothing runs, is placed or waits to be pulled here: a draining engine may stop."""
        return (self.num_prefilling == 0 and self.num_decoding == 0 and self.pins == 0
                and self.reserved == 0 and self.in_flight == 0)

    def load(self) -> EngineLoad:
        queued = self.queued_prefill_tokens + self.peer_queued_prefill_tokens
        decoding = self.num_decoding + self.peer_num_decoding
        reserved = self.reserved + self.peer_reserved
        key = (self.replica_id, queued, decoding, reserved,
               self.kv_usage, self.num_kv_blocks, self.block_size, self.healthy, self.ready,
               self.draining, self.stats_misses >= STATS_MISSES_UNROUTABLE)
        if key == self._load_key:
            return self._load
        # Blocks the frontend has committed but the engine's last report may not show yet are
        # not tracked: the engine's usage lags by one stats interval at most.
        free = math.floor(self.num_kv_blocks * (1.0 - self.kv_usage))
        # Requests placed here but still prefilling elsewhere will join this engine's batch:
        # counting them keeps a burst of simultaneous placements from piling onto one engine.
        batch = max(decoding, reserved)
        self._load = EngineLoad(self.replica_id, queued, batch, free,
                                self.block_size, self.healthy, self.accepting)
        self._load_key = key
        return self._load


class EngineRegistry:
    """Engines by pool, with their lifecycle and reports."""

    def __init__(self, pools: list[str]) -> None:
        self._pools: dict[str, dict[str, EngineRecord]] = {name: {} for name in pools}

    def add(self, pool: str, replica_id: str, block_size: int, num_kv_blocks: int,
            ready: bool = True) -> EngineRecord:
        """A new engine (starting when not `ready`), or an existing one registered again."""
        record = EngineRecord(replica_id, pool, block_size, max(num_kv_blocks, 1), ready=ready)
        self._pools[pool][replica_id] = record
        return record

    def mark_ready(self, pool: str, replica_id: str, block_size: int | None = None,
                   num_kv_blocks: int | None = None) -> None:
        """A starting engine has started (and now knows its KV size): route to it from now on."""
        record = self._pools[pool][replica_id]
        if block_size is not None:
            record.block_size = block_size
        if num_kv_blocks is not None:
            record.num_kv_blocks = max(num_kv_blocks, 1)
        record.ready = True

    def drain(self, pool: str, replica_id: str) -> EngineRecord:
        """Stop routing to the engine; it may be removed once `idle`."""
        record = self._pools[pool][replica_id]
        record.draining = True
        return record

    def remove(self, pool: str, replica_id: str) -> None:
        self._pools[pool].pop(replica_id, None)

    def report(self, pool: str, replica_id: str, *, kv_usage: float | None = None,
               healthy: bool | None = None, answering: bool | None = None) -> None:
        """What an engine (or its absence) just told the frontend; unknown engines are ignored
        (a report can race the engine's removal)."""
        record = self._pools[pool].get(replica_id)
        if record is None:
            return
        if kv_usage is not None:
            record.kv_usage = kv_usage
        if healthy is not None:
            record.healthy = healthy
        if answering is not None:
            record.answering = answering
            record.stats_misses = 0 if answering else record.stats_misses + 1

    def set_peers(self, pool: str, replica_id: str, queued_prefill_tokens: float,
                  num_decoding: float, reserved: int) -> None:
        """The other frontends' work on this engine (ingress replicas), as last synced."""
        record = self._pools[pool].get(replica_id)
        if record is not None:
            record.peer_queued_prefill_tokens = queued_prefill_tokens
            record.peer_num_decoding = num_decoding
            record.peer_reserved = reserved

    def get(self, pool: str, replica_id: str) -> EngineRecord | None:
        return self._pools[pool].get(replica_id)

    def __getitem__(self, key: tuple[str, str]) -> EngineRecord:
        pool, replica_id = key
        return self._pools[pool][replica_id]

    def engines(self, pool: str) -> list[EngineRecord]:
        return list(self._pools[pool].values())

    def __iter__(self) -> Iterator[EngineRecord]:
        for engines in self._pools.values():
            yield from engines.values()

    def loads(self, pool: str) -> list[EngineLoad]:
        return [e.load() for e in self._pools[pool].values()]
