"""Routing policy: which engine serves a request.

Pure functions of plain values (no Ray, no clocks), so the same code is unit-tested, simulated
and run in the frontend. Colocated mode picks the least-loaded healthy engine; the
disaggregated placement (prefill + decode engine) builds on the same snapshot values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the router knows about one engine when a request arrives."""

    replica_id: str
    in_flight: int  # requests the frontend has sent and not seen finish
    num_waiting: int = 0  # engine-reported queue (may lag by one stats interval)
    kv_cache_usage: float = 0.0
    healthy: bool = True


def pick_least_loaded(loads: Sequence[ReplicaLoad]) -> str | None:
    """The healthy engine with the fewest outstanding requests; None when none is healthy.

    Ties break on KV usage (less memory pressure keeps decode steps short), then on id so the
    choice is deterministic for the same snapshot.
    """
    healthy = [load for load in loads if load.healthy]
    if not healthy:
        return None
    best = min(
        healthy,
        key=lambda l: (l.in_flight + l.num_waiting, l.kv_cache_usage, l.replica_id),
    )
    return best.replica_id
