"""What the ingress replicas and the controller exchange: one view of the engines, shared.

Several ingress replicas (`ingress.py`) place requests at once, each with its own request
ledger, so that no request waits on another process to be placed. What keeps their placements
as good as one frontend's is this exchange, every `api.sync_interval_s`, with the controller
(`controller.py`):

- each replica sends its own books per engine (`EngineBooks`: prompt tokens queued for prefill,
  requests decoding, placements not yet finished, ...), the autoscaling signals of its own
  traffic per pool, and the engines it saw die;
- the controller sums every replica's books per engine, and answers each replica with the
  engines of the deployment (`EngineEntry`: started, draining, gone), the OTHER replicas' books
  per engine (the total less its own), and the deployment's health.

A replica's router sees its own placements at once and the others' at most one sync interval
(plus the call) late: the double booking this allows is bounded by what the other replicas
place within one interval, and the engine's own KV usage report (every second) corrects it.
The controller's books are only what the replicas last reported; a replica that stops
reporting (dead) drops out after `REPORT_STALE_S`. Pure values and functions: no Ray here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.types import EngineInfo
from pdserve.scheduler.registry import EngineRegistry
from pdserve.scheduler.types import PoolSignals

# A replica that has not reported for this long no longer counts (its books, its signals).
REPORT_STALE_S = 10.0
INGRESS_PREFIX = "pdserve-ingress-"  # the replicas' actor names: pdserve-ingress-0, ...


def ingress_name(index: int) -> str:
    return f"{INGRESS_PREFIX}{index}"

EngineKey = tuple[str, str]  # (pool, replica id)


@dataclass(frozen=True, slots=True)
class EngineBooks:
    """One frontend's work on one engine (the request ledger's counts)."""

    queued_prefill_tokens: float = 0
    num_prefilling: int = 0
    num_decoding: float = 0
    pins: int = 0
    reserved: int = 0
    in_flight: int = 0
    # Seconds since the engine last showed progress to this frontend, when it has legs in
    # flight there (None: none in flight). Ages, not times: clocks differ between processes.
    progress_age_s: float | None = None

    def __add__(self, other: EngineBooks) -> EngineBooks:
        ages = [a for a in (self.progress_age_s, other.progress_age_s) if a is not None]
        return EngineBooks(
            self.queued_prefill_tokens + other.queued_prefill_tokens,
            self.num_prefilling + other.num_prefilling, self.num_decoding + other.num_decoding,
            self.pins + other.pins, self.reserved + other.reserved,
            self.in_flight + other.in_flight, min(ages) if ages else None)

    def __sub__(self, other: EngineBooks) -> EngineBooks:
        return EngineBooks(
            max(self.queued_prefill_tokens - other.queued_prefill_tokens, 0),
            max(self.num_prefilling - other.num_prefilling, 0),
            max(self.num_decoding - other.num_decoding, 0), max(self.pins - other.pins, 0),
            max(self.reserved - other.reserved, 0), max(self.in_flight - other.in_flight, 0))


@dataclass(frozen=True, slots=True)
class IngressReport:
    """What one ingress replica sends at each sync."""

    name: str  # ingress-0
    books: Mapping[EngineKey, EngineBooks]
    signals: Mapping[str, PoolSignals]  # per pool, of this replica's traffic
    dead: tuple[EngineKey, ...] = ()  # engines whose actor or stream this replica saw die


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine of the deployment as the controller knows it."""

    pool: str
    replica_id: str
    info: EngineInfo | None  # None while starting
    draining: bool = False

    @property
    def key(self) -> EngineKey:
        return self.pool, self.replica_id


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The controller's answer to one replica's report."""

    controller: str  # the controller's incarnation: a change means it restarted
    engines: tuple[EngineEntry, ...]
    peers: Mapping[EngineKey, EngineBooks]  # the other replicas' books per engine
    health: dict[str, Any]
    # pools with engines starting (or about to: a replacement in its back-off)
    capacity_coming: frozenset[str] = field(default_factory=frozenset)


def books_of(registry: EngineRegistry, now: float) -> dict[EngineKey, EngineBooks]:
    """This frontend's own books per engine, from its ledger's registry."""
    books = {}
    for e in registry:
        age = now - e.last_progress if e.in_flight > 0 else None
        books[e.pool, e.replica_id] = EngineBooks(
            e.queued_prefill_tokens, e.num_prefilling, e.num_decoding, e.pins, e.reserved,
            e.in_flight, age)
    return books


def total(reports: Iterable[Mapping[EngineKey, EngineBooks]]) -> dict[EngineKey, EngineBooks]:
    """Every replica's books summed per engine."""
    sums: dict[EngineKey, EngineBooks] = {}
    for books in reports:
        for key, b in books.items():
            sums[key] = sums[key] + b if key in sums else b
    return sums


def peers(totals: Mapping[EngineKey, EngineBooks],
          own: Mapping[EngineKey, EngineBooks]) -> dict[EngineKey, EngineBooks]:
    """The other replicas' books per engine: the total less `own`."""
    return {key: b - own[key] if key in own else b for key, b in totals.items()}


def apply_peers(registry: EngineRegistry, peer_books: Mapping[EngineKey, EngineBooks]) -> None:
    """Give a replica's router the other replicas' work on each engine (none: zero)."""
    for e in registry:
        b = peer_books.get((e.pool, e.replica_id), EngineBooks())
        registry.set_peers(e.pool, e.replica_id, b.queued_prefill_tokens, b.num_decoding,
                           b.reserved)


def apply_totals(registry: EngineRegistry, totals: Mapping[EngineKey, EngineBooks],
                 now: float) -> None:
    """The controller's books: every replica's work on each engine, so that its supervisor
    (hung engines) and drains (idle engines) see the whole deployment."""
    for e in registry:
        b = totals.get((e.pool, e.replica_id), EngineBooks())
        e.queued_prefill_tokens, e.num_prefilling = b.queued_prefill_tokens, b.num_prefilling
        e.num_decoding, e.pins, e.reserved, e.in_flight = (b.num_decoding, b.pins, b.reserved,
                                                           b.in_flight)
        if b.progress_age_s is not None:
            e.last_progress = now - b.progress_age_s
        elif e.in_flight == 0:
            e.last_progress = now


def merge_signals(pool: str, parts: Iterable[PoolSignals], replicas: int,
                  starting: int) -> PoolSignals:
    """One pool's autoscaling signals from every replica's share of the traffic: the engine
    counts are the controller's; samples and utilizations (each replica's arrivals, busy
    time and decoding requests are its own share) add up; the percentiles are the worst
    replica's (a conservative merge); KV usage (every replica sees the engines' own report)
    is the highest."""
    parts = list(parts)
    ttft = [p.ttft_s for p in parts if p.ttft_s is not None]
    tpot = [p.tpot_s for p in parts if p.tpot_s is not None]
    return PoolSignals(
        pool=pool, replicas=replicas, starting=starting,
        samples=sum(p.samples for p in parts), ttft_s=max(ttft) if ttft else None,
        tpot_s=max(tpot) if tpot else None,
        prefill_utilization=sum(p.prefill_utilization for p in parts),
        decode_utilization=sum(p.decode_utilization for p in parts),
        kv_usage=max((p.kv_usage for p in parts), default=0.0))

