"""Ingress replicas share one view of the engines (pdserve/serving/cluster.py): each routes with
its own ledger plus the other replicas' books, as the controller sums them.

The placement tests run real request ledgers (one per replica) through the exchange's pure
functions, the way the controller and `IngressControl` apply them, and compare with one ledger
that saw every request: the single-frontend placement the replicas must match.
"""

from __future__ import annotations

import pytest

from pdserve.scheduler.ledger import RequestLedger
from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.types import PoolSignals
from pdserve.serving.cluster import (
    EngineBooks, apply_peers, apply_totals, books_of, merge_signals, peers, total,
)

pytestmark = pytest.mark.unit

POOL = "colocated"
ENGINES = ("colocated-0", "colocated-1")


def replica_ledger() -> RequestLedger:
    ledger = RequestLedger([POOL], PerfModel(prefill_tokens_per_s=1000.0, decode_step_s=0.02),
                           prefix_aware=False)
    for rid in ENGINES:
        ledger.engines.add(POOL, rid, 16, 10_000)
    return ledger


def admit(ledger: RequestLedger, request_id: str, prompt_tokens: int, now: float = 0.0) -> str:
    """Place and start a request; the engine it went to."""
    admission = ledger.admit(request_id, list(range(prompt_tokens)), 16, now)
    ledger.leg_started(admission, admission.first_leg, now)
    return admission.placement.decode


def exchange(ledgers: list[RequestLedger], now: float = 0.0) -> None:
    """One sync round: every replica reports, each gets the others' books (controller.sync)."""
    reports = [books_of(ledger.engines, now) for ledger in ledgers]
    totals = total(reports)
    for ledger, own in zip(ledgers, reports, strict=True):
        apply_peers(ledger.engines, peers(totals, own))


def test_books_add_and_subtract_per_engine():
    a = EngineBooks(100, 1, 2, 1, 3, 2, 0.5)
    b = EngineBooks(50, 0, 1, 0, 1, 1, 0.2)
    assert a + b == EngineBooks(150, 1, 3, 1, 4, 3, 0.2)  # the freshest progress counts
    assert (a + b) - b == EngineBooks(100, 1, 2, 1, 3, 2, None)
    assert b - a == EngineBooks()  # never below zero


def test_peers_are_the_total_less_the_replicas_own():
    key = (POOL, "colocated-0")
    mine = {key: EngineBooks(queued_prefill_tokens=100, reserved=1)}
    theirs = {key: EngineBooks(queued_prefill_tokens=300, reserved=2),
              (POOL, "colocated-1"): EngineBooks(num_decoding=4)}
    others = peers(total([mine, theirs]), mine)
    assert others[key] == EngineBooks(queued_prefill_tokens=300, reserved=2)
    assert others[POOL, "colocated-1"] == EngineBooks(num_decoding=4)


def test_a_replica_routes_around_another_replicas_queue_once_synced():
    """Replica A sends an 8000-token prompt to colocated-0; replica B's next prompt goes where a
    single frontend would send it (colocated-1), which B sees only through the exchange."""
    single = replica_ledger()
    assert admit(single, "long", 8000) == "colocated-0"
    assert admit(single, "short", 500) == "colocated-1"

    a, b = replica_ledger(), replica_ledger()
    assert admit(a, "long", 8000) == "colocated-0"
    unsynced = replica_ledger()  # B without the exchange would queue behind A's prompt
    assert admit(unsynced, "short", 500) == "colocated-0"
    exchange([a, b])
    assert admit(b, "short", 500) == "colocated-1"


def test_a_burst_split_over_two_replicas_lands_as_one_frontend_would_place_it():
    """Prompts of mixed lengths arrive alternately at two replicas that sync after each one
    (a sync interval shorter than the gap between arrivals): each engine gets the same queued
    prompt tokens as when one ledger placed them all."""
    prompts = [4000, 300, 2500, 2500, 600, 7000, 1200, 800]
    single = replica_ledger()
    alone = [admit(single, f"r{i}", n) for i, n in enumerate(prompts)]
    replicas = [replica_ledger(), replica_ledger()]
    shared = []
    for i, n in enumerate(prompts):
        shared.append(admit(replicas[i % 2], f"r{i}", n))
        exchange(replicas)
    assert shared == alone
    for rid in ENGINES:
        merged = sum(r.engines[POOL, rid].queued_prefill_tokens for r in replicas)
        assert merged == single.engines[POOL, rid].queued_prefill_tokens


def test_the_controllers_books_are_every_replicas_work():
    """The controller's registry (supervision, drains) sums the replicas: an engine is idle
    only when no replica has work on it, and hung when work sits there without progress."""
    a, b = replica_ledger(), replica_ledger()
    admit(a, "x", 100, now=10.0)
    admit(b, "y", 100, now=12.0)
    controller = replica_ledger()
    apply_totals(controller.engines, total([books_of(a.engines, 20.0),
                                            books_of(b.engines, 20.0)]), now=50.0)
    record = controller.engines[POOL, "colocated-0"]
    assert (record.in_flight, record.reserved, record.queued_prefill_tokens) == (2, 2, 200)
    # Ages, not the replicas' clocks: the freshest progress any replica saw (B's, 8 s before).
    assert record.last_progress == pytest.approx(50.0 - 8.0)
    assert not record.idle and controller.engines[POOL, "colocated-1"].idle


def test_signals_merge_the_replicas_shares():
    parts = [PoolSignals(POOL, 2, samples=10, ttft_s=0.2, tpot_s=0.02, prefill_utilization=0.3,
                         decode_utilization=0.2, kv_usage=0.4),
             PoolSignals(POOL, 2, samples=5, ttft_s=0.5, tpot_s=None, prefill_utilization=0.4,
                         decode_utilization=0.1, kv_usage=0.5)]
    merged = merge_signals(POOL, parts, replicas=3, starting=1)
    assert merged == PoolSignals(POOL, 3, starting=1, samples=15, ttft_s=0.5, tpot_s=0.02,
                                 prefill_utilization=pytest.approx(0.7),
                                 decode_utilization=pytest.approx(0.3), kv_usage=0.5)
    assert merge_signals(POOL, [], 2, 0) == PoolSignals(POOL, 2)
