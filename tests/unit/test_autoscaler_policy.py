"""The pure per-pool scaling policy, and the Autoscaler over a RequestLedger fed scripted
request timings (no Ray, no clocks)."""

import pytest

from pdserve.autoscaler.controller import Autoscaler
from pdserve.autoscaler.policy import (
    PoolBounds, PoolSignals, ScalingPolicy, ScalingState, decide,
)
from pdserve.scheduler.perf_model import PerfModel
from pdserve.slo import SloTargets
from tests.unit.scripted_ledger import Script
from pdserve.scheduler.ledger import RequestLedger

pytestmark = pytest.mark.unit

TTFT, TPOT = 0.5, 0.05
POLICY = ScalingPolicy(upscale_intervals=2, downscale_intervals=3, upscale_cooldown_s=10,
                       downscale_cooldown_s=30)
BOUNDS = PoolBounds(1, 4)


def run(signals_seq, bounds=BOUNDS, policy=POLICY, step_s=5.0, state=ScalingState()):
    """Feed one signal per interval; apply each decision to the replica count."""
    replicas = signals_seq[0].replicas
    out = []
    for i, s in enumerate(signals_seq):
        s = PoolSignals(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "replicas": replicas})
        decision, state = decide(s, state, bounds, TTFT, TPOT, now=i * step_s, policy=policy)
        replicas = decision.target
        out.append(decision)
    return out


def test_ttft_breach_scales_prefill_after_it_persists():
    hot = PoolSignals("prefill", replicas=1, samples=50, ttft_s=1.2, prefill_utilization=0.9)
    first, second = run([hot, hot])
    assert first.direction == "none" and first.reason == "pending"
    assert second.direction == "up" and second.reason in ("ttft_breach", "prefill_load")
    # A breach alone adds one engine (a backlog inflates latency after capacity is back)...
    assert second.target == 2
    # ...a measured load of 2.0 engines' worth asks for ceil(2.0 / 0.8) = 3.
    loaded = PoolSignals("prefill", replicas=1, samples=50, ttft_s=1.2, prefill_utilization=2.0)
    assert run([loaded, loaded])[-1].target == 3


def test_tpot_pressure_never_moves_the_prefill_pool_and_vice_versa():
    slow_decode = PoolSignals("prefill", replicas=2, samples=50, ttft_s=0.1, tpot_s=0.5,
                              kv_usage=0.99, decode_utilization=3.0)
    assert all(d.direction != "up" for d in run([slow_decode] * 5))
    slow_prefill = PoolSignals("decode", replicas=2, samples=50, ttft_s=5.0, tpot_s=0.01,
                               prefill_utilization=5.0)
    assert all(d.direction != "up" for d in run([slow_prefill] * 5))


def test_tpot_breach_and_kv_pressure_scale_decode():
    tpot = PoolSignals("decode", replicas=1, samples=50, tpot_s=0.08, decode_utilization=0.7)
    # A model-predicted decode load alone (no measured breach) buys no engine.
    modelled = PoolSignals("decode", replicas=1, samples=50, tpot_s=0.02, decode_utilization=3.0)
    assert {d.direction for d in run([modelled] * 5)} == {"none"}
    assert run([tpot, tpot])[-1].reason == "tpot_breach"
    kv = PoolSignals("decode", replicas=2, samples=0, kv_usage=0.95)
    decisions = run([kv, kv])
    assert decisions[-1].direction == "up" and decisions[-1].reason == "kv_pressure"


def test_idle_pools_shrink_one_engine_at_a_time_down_to_min():
    idle = PoolSignals("decode", replicas=3, samples=20, tpot_s=0.01, kv_usage=0.05,
                       decode_utilization=0.05)
    decisions = run([idle] * 40)
    downs = [(i, d.target) for i, d in enumerate(decisions) if d.direction == "down"]
    # Three quiet intervals, then one engine; then the 30 s cooldown (6 intervals) between steps.
    assert downs[0] == (2, 2)
    assert downs[1][1] == 1 and downs[1][0] - downs[0][0] >= 6
    assert len(downs) == 2 and decisions[-1].target == 1


def test_steady_load_does_not_oscillate():
    # 60% load: above the 50% low-water mark with one engine fewer, below the 80% target.
    steady = PoolSignals("prefill", replicas=3, samples=100, ttft_s=0.35, prefill_utilization=0.6)
    decisions = run([steady] * 100)
    assert {d.direction for d in decisions} == {"none"}
    # A load that alternates around the target does not flap either: a breach must persist.
    hot = PoolSignals("prefill", replicas=3, samples=100, ttft_s=0.6, prefill_utilization=0.85)
    assert {d.direction for d in run([steady, hot] * 50)} == {"none"}


def test_bounds_are_respected():
    hot = PoolSignals("prefill", replicas=3, samples=100, ttft_s=5.0, prefill_utilization=10.0)
    decisions = run([hot] * 20, bounds=PoolBounds(1, 4))
    assert max(d.target for d in decisions) == 4
    assert decisions[-1].reason == "at_max"
    # Outside the bounds (a config change), the policy moves back in at once.
    below = decide(PoolSignals("decode", replicas=0), ScalingState(), PoolBounds(2, 5), TTFT,
                   TPOT, now=0)[0]
    assert (below.target, below.reason) == (2, "below_min")
    above = decide(PoolSignals("decode", replicas=7), ScalingState(), PoolBounds(1, 5), TTFT,
                   TPOT, now=0)[0]
    assert (above.target, above.reason) == (5, "above_max")


def test_no_scale_up_while_an_engine_is_still_starting():
    booting = PoolSignals("prefill", replicas=2, starting=1, samples=100, ttft_s=3.0,
                          prefill_utilization=2.0)
    assert {d.reason for d in run([booting] * 5)} == {"pending"}


def test_too_few_samples_do_not_count_as_a_latency_breach():
    sparse = PoolSignals("prefill", replicas=1, samples=2, ttft_s=9.0)
    assert {d.direction for d in run([sparse] * 5)} == {"none"}


# --- the Autoscaler over the scheduler's real signals --------------------------------------

MODEL = PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01, decode_step_per_seq_s=0.001)


def scheduler() -> RequestLedger:
    sched = RequestLedger(["prefill", "decode"], MODEL, SloTargets.from_s(TTFT, TPOT), window_s=30,
                          prefix_aware=False)
    for pool in ("prefill", "decode"):
        sched.engines.add(pool, f"{pool}-0", 16, 10_000)
    return sched


def test_a_ttft_breach_grows_prefill_only():
    sched = scheduler()
    scaler = Autoscaler({"prefill": BOUNDS, "decode": BOUNDS}, SloTargets.from_s(TTFT, TPOT), POLICY)
    for t in range(20):  # slow first tokens, fast decode
        Script(sched).finished(float(t), 2.0, 0.02)
    first = {d.pool: d for d in scaler.evaluate(sched, now=20.0)}
    second = {d.pool: d for d in scaler.evaluate(sched, now=25.0)}
    assert first["prefill"].reason == "pending"
    assert second["prefill"].direction == "up" and second["prefill"].reason == "ttft_breach"
    assert second["decode"].direction == "none"


def test_a_tpot_breach_grows_decode_only():
    sched = scheduler()
    scaler = Autoscaler({"prefill": BOUNDS, "decode": BOUNDS}, SloTargets.from_s(TTFT, TPOT), POLICY)
    for t in range(20):
        Script(sched).finished(float(t), 0.1, 0.2)
    scaler.evaluate(sched, now=20.0)
    decisions = {d.pool: d for d in scaler.evaluate(sched, now=25.0)}
    assert decisions["decode"].reason == "tpot_breach" and decisions["decode"].direction == "up"
    assert decisions["prefill"].direction == "none"


def test_prefill_load_from_arrivals_grows_prefill_before_latency_breaks():
    sched = scheduler()
    for t in range(30):  # 3000 prompt tokens/s against one engine's 1000 tok/s
        Script(sched).prefill("prefill-0", 3000, float(t), t + 0.2)
    signals = sched.signals("prefill", now=30.0)
    assert signals.prefill_utilization == pytest.approx(3.0)
    scaler = Autoscaler({"prefill": BOUNDS, "decode": BOUNDS}, SloTargets.from_s(TTFT, TPOT), POLICY)
    scaler.evaluate(sched, now=30.0)
    up = {d.pool: d for d in scaler.evaluate(sched, now=35.0)}["prefill"]
    # 3 engines' worth of load at 80% each: 4 engines (the max).
    assert (up.reason, up.target) == ("prefill_load", 4)


def test_requests_still_waiting_past_the_target_count_as_a_breach():
    sched = scheduler()
    for t in range(10):  # fast so far...
        Script(sched).finished(float(t), 0.1, 0.02)
    # ...but 5 prefills dispatched at t=9 have no first token at t=11 (2 s > 0.5 s target).
    for _ in range(5):
        Script(sched).prefill("prefill-0", 100, 9.0)
    signals = sched.signals("prefill", now=11.0)
    assert signals.ttft_s > TTFT and signals.samples == 15


# --- a shared GPU budget (autoscale.max_gpus) ---------------------------------------------


def breach_both(sched, t0: float) -> None:
    """Slow first tokens and slow decode at once: both pools want an engine."""
    for t in range(20):
        Script(sched).finished(t0 + t, 2.0, 0.2)


def test_a_gpu_budget_grants_what_fits_and_the_other_pool_waits_without_a_cooldown():
    sched = scheduler()
    scaler = Autoscaler({"prefill": BOUNDS, "decode": BOUNDS}, SloTargets.from_s(TTFT, TPOT), POLICY, max_gpus=3)
    breach_both(sched, 0.0)
    scaler.evaluate(sched, now=20.0)
    decisions = {d.pool: d for d in scaler.evaluate(sched, now=25.0)}
    # 2 engines held, 3 GPUs: one of the two scale-ups fits.
    assert sum(d.target for d in decisions.values()) == 3
    grown = next(d for d in decisions.values() if d.direction == "up")
    waiting = next(d for d in decisions.values() if d.direction == "none")
    assert waiting.reason == "at_budget" and "3 GPUs" in waiting.detail
    # The grown pool's engine now holds the third GPU: the other pool still waits.
    sched.engines.add(grown.pool, f"{grown.pool}-1", 16, 10_000)
    again = {d.pool: d for d in scaler.evaluate(sched, now=26.0)}
    assert again[waiting.pool].reason == "at_budget" and again[grown.pool].direction == "none"
    # Once a GPU frees (the grown pool's engine goes), the waiting pool scales on the very next
    # evaluation: its pressure streak was kept and no cooldown started.
    sched.remove_engine(grown.pool, f"{grown.pool}-1")
    freed = {d.pool: d for d in scaler.evaluate(sched, now=27.0)}
    assert freed[waiting.pool].direction == "up"


def test_a_gpu_budget_counts_each_engines_gpus_and_serves_latency_breaches_first():
    sched = scheduler()
    for t in range(30):  # prompt load (a forecast, not a breach) on prefill...
        Script(sched).prefill("prefill-0", 3000, float(t), t + 0.2)
    for t in range(20):  # ...and a measured TPOT breach on decode
        Script(sched).finished(float(t), 0.1, 0.2)
    # decode engines are TP2: 1 + 2 GPUs held, budget 5: the decode breach takes the 2 left.
    scaler = Autoscaler({"prefill": BOUNDS, "decode": BOUNDS}, SloTargets.from_s(TTFT, TPOT), POLICY, max_gpus=5,
                        gpus_per_engine={"decode": 2})
    scaler.evaluate(sched, now=30.0)
    decisions = {d.pool: d for d in scaler.evaluate(sched, now=35.0)}
    assert (decisions["decode"].reason, decisions["decode"].target) == ("tpot_breach", 2)
    assert (decisions["prefill"].reason, decisions["prefill"].target) == ("at_budget", 1)


def test_without_a_budget_both_pools_scale():
    sched = scheduler()
    scaler = Autoscaler({"prefill": BOUNDS, "decode": BOUNDS}, SloTargets.from_s(TTFT, TPOT), POLICY)
    breach_both(sched, 0.0)
    scaler.evaluate(sched, now=20.0)
    assert {d.direction for d in scaler.evaluate(sched, now=25.0)} == {"up"}


def three_prefill_one_decode(prompt_tokens_per_s: float, ttft_s: float, prefill_s: float = 0.1) -> RequestLedger:
    """3P1D on a 4-GPU budget: prompt load on prefill (each prompt in prefill for `prefill_s`,
    a prompt per engine every 3 s), a measured TPOT breach on decode."""
    sched = scheduler()
    for i in (1, 2):
        sched.engines.add("prefill", f"prefill-{i}", 16, 10_000)
    for t in range(30):
        Script(sched).prefill(f"prefill-{t % 3}", int(prompt_tokens_per_s), float(t), t + prefill_s)
        Script(sched).finished(float(t), ttft_s, 0.2)
    return sched


def test_a_pool_breaching_at_the_budget_takes_a_gpu_from_a_pool_that_can_spare_one():
    # 1200 prompt tokens/s over 3 engines of 1000 tok/s: ~0.4 each, ~0.6 with two (< 0.8).
    sched = three_prefill_one_decode(1200, ttft_s=0.1)
    scaler = Autoscaler({"prefill": PoolBounds(1, 3), "decode": PoolBounds(1, 3)}, SloTargets.from_s(TTFT, TPOT), POLICY,
                        max_gpus=4)
    scaler.evaluate(sched, now=30.0)
    decisions = {d.pool: d for d in scaler.evaluate(sched, now=30.5)}
    assert decisions["decode"].reason == "at_budget"
    prefill = decisions["prefill"]
    assert (prefill.reason, prefill.target) == ("rebalance", 2)
    assert "decode at the 4-GPU budget" in prefill.detail and "0.58 with 2" in prefill.detail
    # The drained prefill engine frees its GPU: decode scales on the next evaluation, and prefill
    # gives nothing more (it is cooling down, and two engines are what its load needs).
    sched.remove_engine("prefill", "prefill-2")
    after = {d.pool: d for d in scaler.evaluate(sched, now=31.0)}
    assert (after["decode"].direction, after["decode"].target) == ("up", 2)
    assert after["prefill"].direction == "none"


@pytest.mark.parametrize("prompt_tokens_per_s, ttft_s, prefill_s", [
    (2000, 0.1, 0.1),  # ~0.65 each now, ~1.0 with two engines: none to spare
    (1200, 0.9, 0.1),  # load to spare, but prefill breaches its own TTFT target
    # The model says ~0.4 each (~0.6 with two) but each engine had a prompt in prefill 60% of
    # the time: ~0.9 with two. 4 x H100, 2026-11-27: a fitted rate above what the engines
    # sustained read two busy prefill engines as 0.37, and the rebalance drained one of them.
    (1200, 0.1, 1.8),
])
def test_no_gpu_moves_from_a_pool_that_cannot_spare_it(prompt_tokens_per_s, ttft_s, prefill_s):
    sched = three_prefill_one_decode(prompt_tokens_per_s, ttft_s, prefill_s)
    scaler = Autoscaler({"prefill": PoolBounds(1, 3), "decode": PoolBounds(1, 3)}, SloTargets.from_s(TTFT, TPOT), POLICY,
                        max_gpus=4)
    for now in (30.0, 30.5, 31.0):
        decisions = {d.pool: d for d in scaler.evaluate(sched, now=now)}
        assert decisions["prefill"].target == 3 and decisions["decode"].target == 1
