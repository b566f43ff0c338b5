"""Performance model (calibration seed, online fit), SLO tracker, prefix index, and the request
ledger's books."""

import json
from pathlib import Path

import pytest

from pdserve.scheduler.perf_model import LineFit, OnlineFit, PerfModel, fit_line, fit_line_robust
from pdserve.scheduler.prefix import PrefixIndex, block_hashes
from pdserve.engine.types import Leg
from pdserve.scheduler.ledger import RequestLedger
from pdserve.scheduler.registry import BusyLog
from pdserve.scheduler.routing import Placement
from pdserve.slo import SloTargets
from tests.unit.scripted_ledger import Script
from pdserve.scheduler.slo import SloTracker, percentile_of

pytestmark = pytest.mark.unit

# The team's H200 measurement (../shared/calibration), as the repository carries it.
CALIBRATION = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles" / "h200-vllm0.24-llama8b.json"


def test_model_from_a_calibration_profile():
    data = {"prefill_tokens_per_s": {"a": 40000, "b": 50000, "c": 45000},
            "ttft_single_ms": {"1000": 32.0, "2000": 54.0},
            "tpot_ms_by_batch": {"1": 5.0, "101": 15.0},
            "kv_bytes_per_token": 1000, "transfer": {"bytes_per_s": 1e9, "overhead_s": 0.002}}
    m = PerfModel.from_calibration(data)
    assert m.prefill_tokens_per_s == 45000
    # overhead = mean(32 - 1000/45, 54 - 2000/45) ms
    assert m.prefill_overhead_s == pytest.approx(((0.032 - 1000 / 45000) + (0.054 - 2000 / 45000)) / 2)
    assert (m.decode_step_s, m.decode_step_per_seq_s) == pytest.approx((0.0049, 0.0001))
    assert m.transfer_s(1000) == pytest.approx(0.002 + 0.001)
    assert m.max_batch_for_tpot(0.0149) == 100


def test_the_shared_h200_profile_reproduces_its_own_numbers():
    m = PerfModel.load(CALIBRATION)
    data = json.loads(CALIBRATION.read_text())
    for batch, ms in data["tpot_ms_by_batch"].items():
        assert m.decode_step_time(int(batch)) * 1000 == pytest.approx(ms, rel=0.15)
    assert m.prefill_s(2048) * 1000 == pytest.approx(data["ttft_single_ms"]["2048"], rel=0.2)


def test_fit_line_and_weighted_online_fit_recover_a_line():
    assert fit_line([(0, 1), (1, 3), (2, 5)]) == pytest.approx((1, 2))
    fit = LineFit(intercept=0.0, slope=0.0, decay=1.0, prior_weight=1.0)
    for x in range(1, 200):
        fit.observe(x, 0.01 + 0.002 * x)
    a, b = fit.line()
    assert a == pytest.approx(0.01, abs=2e-3) and b == pytest.approx(0.002, rel=0.02)


def test_online_fit_moves_from_the_seed_to_what_it_observes():
    seed = PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.05, decode_step_per_seq_s=0.0)
    fit = OnlineFit(seed)
    assert fit.model() == seed
    for tokens in (100, 400, 800, 1600) * 20:  # truly 4000 tok/s + 20 ms
        fit.observe_prefill(tokens, 0.02 + tokens / 4000)
    for batch in (1, 4, 8, 16) * 20:  # truly 10 ms + 1 ms per request
        fit.observe_decode(batch, 0.010 + 0.001 * batch)
    m = fit.model()
    assert m.prefill_tokens_per_s == pytest.approx(4000, rel=0.1)
    assert m.prefill_overhead_s == pytest.approx(0.02, abs=0.01)
    assert m.decode_step_time(8) == pytest.approx(0.018, rel=0.1)


def test_slo_tracker_percentiles_and_window():
    t = SloTracker(window_s=10)
    for i in range(100):
        t.record_ttft("prefill", now=float(i) / 10, ttft_s=i / 100)
    s = t.summary("prefill", now=9.9, percentile=90, ttft_target_s=0.495)
    assert s.count == 100 and s.ttft_p_s == pytest.approx(percentile_of([i / 100 for i in range(100)], 90))
    assert s.ttft_attainment == pytest.approx(0.5)
    # 15 s later only samples newer than 14.9 - 10 s remain: none.
    assert t.summary("prefill", now=24.9).count == 0
    assert percentile_of([1, 2, 3, 4], 50) == 2.5 and percentile_of([], 90) is None


def test_prefix_index_matches_leading_blocks_and_evicts_lru():
    prompt = list(range(64))
    hashes = block_hashes(prompt, 16)
    assert len(hashes) == 4 and len(block_hashes(prompt[:15], 16)) == 0
    # A prompt that shares the first 2 blocks and differs after hits 32 tokens.
    other = block_hashes(prompt[:32] + [999] * 32, 16)
    index = PrefixIndex(16, capacity_blocks=6)
    index.insert("e0", hashes)
    assert index.cached_tokens("e0", other) == 32 and index.cached_tokens("e1", other) == 0
    # Hashes chain: the same block after a different prefix is not a hit.
    assert index.cached_tokens("e0", block_hashes([7] * 16 + prompt[16:32], 16)) == 0
    index.insert("e0", block_hashes([5] * 48, 16))  # 3 more blocks: the oldest one goes
    assert index.cached_tokens("e0", hashes) == 0


def test_ledger_books_drive_routing_and_drains():
    ledger = RequestLedger(["prefill", "decode"],
                           PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                           SloTargets.from_s(1.0, 0.05), prefix_block_size=16)
    for pool in ("prefill", "decode"):
        for i in range(2):
            ledger.engines.add(pool, f"{pool}-{i}", 16, 1000)
    prompt = list(range(500))
    first = ledger.admit("a", prompt, 20, now=0.0)
    assert first.placement.prefill == "prefill-0" and len(first.hashes) == 31
    ledger.leg_started(first, Leg.PREFILL, now=0.0)
    state = ledger.engine("prefill", "prefill-0")
    assert (state.queued_prefill_tokens, state.pins, state.reserved, state.in_flight) == (500, 1, 1, 1)
    # prefill-0 now has 500 tokens queued: the next (different) prompt goes to prefill-1.
    assert ledger.place(500, 20).prefill == "prefill-1"
    ledger.leg_output(first, Leg.PREFILL, now=0.5, tokens=1, finished=True)
    ledger.leg_finished(first, Leg.PREFILL, now=0.5, finish_reason="length")
    # The same prompt again: prefill-0 has it cached (496 of 500 tokens in full blocks), and
    # its uncached remainder is all it would queue.
    again = ledger.admit("b", prompt, 20, now=0.6)
    assert again.placement.prefill == "prefill-0"
    ledger.leg_started(again, Leg.PREFILL, now=0.6)
    assert state.queued_prefill_tokens == 4
    ledger.request_finished(again, 0.7, 0, "abort")
    assert state.queued_prefill_tokens == 0 and not state.idle  # "a" is still pinned and placed
    decode = ledger.engine("decode", first.placement.decode)
    ledger.leg_started(first, Leg.DECODE, now=0.6)
    assert decode.num_decoding == 1
    ledger.leg_output(first, Leg.DECODE, now=0.65, tokens=1)  # pulled: the pin goes
    assert state.pins == 0 and not state.idle  # still reserved until the request ends
    ledger.leg_finished(first, Leg.DECODE, now=1.0, finish_reason="length")
    timing = ledger.request_finished(first, now=1.0, output_tokens=20, finish_reason="length")
    assert state.idle and decode.idle
    assert timing.ttft_s == pytest.approx(0.5) and timing.tpot_s == pytest.approx(0.5 / 19)
    # A draining engine gets nothing new.
    ledger.engines.drain("prefill", "prefill-0")
    assert ledger.place(500, 20).prefill == "prefill-1"


def test_one_timer_for_the_slo_tracker_and_the_request_timing():
    ledger = RequestLedger(["colocated"], PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                           SloTargets.from_s(1.0, 0.05), prefix_aware=False)
    ledger.engines.add("colocated", "c0", 16, 1000)
    adm = ledger.admit("r", range(100), 5, now=10.0)
    ledger.leg_started(adm, Leg.FULL, 10.0)
    ledger.leg_output(adm, Leg.FULL, 10.3, 1)
    for k in range(1, 5):
        ledger.leg_output(adm, Leg.FULL, 10.3 + 0.1 * k, 1, finished=k == 4)
    ledger.leg_finished(adm, Leg.FULL, 10.7, "length")
    timing = ledger.request_finished(adm, 10.7, 5, "length")
    summary = ledger.tracker.summary("colocated", 10.7, 50)
    assert summary.ttft_p_s == pytest.approx(timing.ttft_s) == pytest.approx(0.3)
    assert summary.tpot_p_s == pytest.approx(timing.tpot_s) == pytest.approx(0.1)
    assert timing.e2e_s == pytest.approx(0.7)


def test_a_model_taught_by_a_burst_that_idle_engines_are_slow_is_corrected_after_it():
    # 4 x H100, 2026-11-27: in a burst the fitted model learned that a lone 2048-token prefill
    # takes seconds; admission then refused every request, so nothing new was observed and the
    # service refused everything, on idle engines, until it was stopped.
    sched = RequestLedger(["prefill", "decode"],
                          PerfModel(prefill_tokens_per_s=40_000, decode_step_s=0.01),
                          SloTargets.from_s(0.5, 0.02), prefix_aware=False)
    sched.engines.add("prefill", "p0", 16, 100_000)
    sched.engines.add("decode", "decode-0", 16, 100_000)
    script = Script(sched)
    for i in range(100):  # the burst: every leg took 3 s to its first token, every pull 3 s
        script.prefill("p0", 2048, float(i), i + 3.0, observe=True)
        script.pull(2048, float(i), 3.0, prefill="p0")
    assert sched.model("prefill").prefill_s(2048) > 4 * 0.5  # beyond what admission allows
    # Nothing queued: admitted whatever the model says, and what it observes corrects it.
    for i in range(200):
        placement = sched.place(2048, 256)
        assert isinstance(placement, Placement) and placement.prefill == "p0"
        script.prefill("p0", 2048, 1000.0 + i, 1000.0 + i + 0.06, observe=True)
    assert sched.model("prefill").prefill_s(2048) < 0.2
    # The 3 s pulls delay token 2, not the first: they are not in the predicted TTFT.
    assert sched.place(2048, 256).predicted_ttft_s < 0.2


def test_simultaneous_placements_spread_over_decode_engines():
    sched = RequestLedger(["prefill", "decode"],
                          PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                          prefix_aware=False)
    sched.engines.add("prefill", "prefill-0", 16, 1000)
    for i in range(2):
        sched.engines.add("decode", f"decode-{i}", 16, 1000)
    # 16 requests placed before any reaches its decode engine (all still prefilling): the
    # placements themselves count, so a flat decode cost still splits them evenly.
    chosen = [sched.admit(f"r{n}", list(range(n, n + 20)), 8, now=0.0).placement.decode
              for n in range(16)]
    assert chosen.count("decode-0") == chosen.count("decode-1") == 8


def _without_caches(sched: RequestLedger) -> RequestLedger:
    """Forget every cached engine load and fitted model, as if the ledger had no caches."""
    for pool in sched._pools.values():
        pool._model, pool._model_counts = None, (-1, -1, -1)
    for state in sched.engines:
        state._load_key = ()
    return sched


@pytest.mark.parametrize("pools", [("prefill", "decode"), ("colocated",)])
def test_cached_loads_and_models_route_exactly_as_uncached(pools):
    # Two ledgers take the same random lifecycle events (and the direct resyncs the fluid
    # simulator makes); one forgets its caches before every routing call. Every placement
    # must be the same.
    import random

    rng = random.Random(7)
    seed = PerfModel(prefill_tokens_per_s=5000, decode_step_s=0.01, decode_step_per_seq_s=0.001)
    cached, uncached = (RequestLedger(list(pools), seed, SloTargets.from_s(0.5, 0.05),
                                      prefix_block_size=16) for _ in range(2))
    ids = {pool: [f"{pool}-{i}" for i in range(4)] for pool in pools}
    for sched in (cached, uncached):
        for pool in pools:
            for rid in ids[pool]:
                sched.engines.add(pool, rid, 16, 400, ready=rid[-1] != "3")
    live = {id(cached): [], id(uncached): []}  # (admission, its current leg) in order

    def change(sched: RequestLedger, op: int, pool: str, rid: str, r: list[float], t: float) -> None:
        mine = live[id(sched)]
        if op in (0, 1, 2, 3) and mine:
            adm, leg = mine[int(r[0] * len(mine))]
            if op == 0:
                sched.leg_output(adm, leg, t, 1)
            elif op == 1:
                sched.leg_output(adm, leg, t, 1)
                sched.leg_finished(adm, leg, t, "length")
                if leg is Leg.PREFILL and adm.max_tokens > 1:
                    sched.leg_started(adm, Leg.DECODE, t)
                    mine[mine.index((adm, leg))] = (adm, Leg.DECODE)
            elif op == 2:
                sched.decode_gap(*adm.engine_of(leg), 0.01 + r[1] * 0.02, 1)
            else:
                mine.remove((adm, leg))
                sched.request_finished(adm, t, 2, "length")
        elif op == 4 and sched.engines.get(pool, rid) is not None:
            sched.engines.report(pool, rid, kv_usage=r[0])
        elif op == 7 and sched.engines.get(pool, rid) is not None:  # fractional, as fluid's
            record = sched.engine(pool, rid)
            sched.resync(pool, rid, queued_prefill_tokens=record.queued_prefill_tokens + r[0] * 100,
                         num_decoding=record.num_decoding + r[1])
        elif op == 8 and sched.engines.get(pool, rid) is not None:
            sched.engines.report(pool, rid, healthy=r[1] > 0.1)
            if r[0] < 0.3:
                sched.engines.drain(pool, rid)
        elif op == 9 and sched.engines.get(pool, rid) is not None:
            sched.engines.mark_ready(pool, rid)
        elif op == 10:  # an engine goes and a new one comes under the same name
            for adm, leg in [x for x in mine if rid in (x[0].placement.decode, x[0].placement.prefill)]:
                mine.remove((adm, leg))
                sched.request_finished(adm, t, 0, "abort")
            sched.remove_engine(pool, rid)
            sched.engines.add(pool, rid, 16, 300 + int(r[0] * 200))

    placements = []
    for step in range(3000):
        op, pool = rng.randrange(12), rng.choice(pools)
        rid, r = rng.choice(ids[pool]), [rng.random(), rng.random()]
        if op == 11:
            prompt = list(range(rng.randrange(1, 3000)))
            max_tokens = rng.randrange(1, 600)
            got = cached.place(len(prompt), max_tokens)
            assert got == _without_caches(uncached).place(len(prompt), max_tokens)
            placements.append(got)
            if isinstance(got, Placement):
                for sched in (cached, uncached):
                    adm = sched.admit(f"r{step}", prompt, max_tokens, float(step), placement=got)
                    sched.leg_started(adm, adm.first_leg, float(step))
                    live[id(sched)].append((adm, adm.first_leg))
            continue
        for sched in (cached, uncached):
            change(sched, op, pool, rid, r, float(step))
    # The sequence exercised the choice: placements landed on most engines.
    assert len(placements) > 200
    assert len({p.decode for p in placements if isinstance(p, Placement)}) >= 3


def test_the_calibration_decode_line_is_not_dragged_by_one_noisy_batch_size():
    clean = [(1, 6.0), (8, 6.7), (32, 9.1), (64, 12.3), (128, 18.7)]  # 5.9 + 0.1 ms/seq
    noisy = [(1, 6.0), (8, 12.7), (32, 9.1), (64, 12.3), (128, 18.7)]  # batch 8 timed badly
    assert fit_line_robust(clean) == pytest.approx(fit_line(clean), abs=0.05)
    intercept, slope = fit_line_robust(noisy)
    assert intercept == pytest.approx(5.9, abs=0.15) and slope == pytest.approx(0.1, abs=0.005)
    assert fit_line(noisy)[0] > 7  # least squares is lifted by the outlier
    model = PerfModel.from_calibration({"prefill_tokens_per_s": 10_000,
                                        "tpot_ms_by_batch": {str(b): ms for b, ms in noisy}})
    assert model.decode_step_s == pytest.approx(intercept / 1000)
    assert fit_line_robust([(1, 2.0), (3, 4.0)]) == pytest.approx(fit_line([(1, 2.0), (3, 4.0)]))


def test_busy_log_measures_the_share_of_the_window_with_a_prompt_in_prefill():
    log = BusyLog()
    log.start(0.0)
    log.start(1.0)  # already busy: the span still starts at 0
    log.stop(2.0, keep_s=10.0)
    log.start(5.0)
    assert log.fraction(6.0, window_s=10.0) == pytest.approx(0.3)  # 2 s closed + 1 s open
    assert log.fraction(6.0, window_s=4.0) == pytest.approx(0.25)  # only [2, 6]: the open second
    log.stop(30.0, keep_s=10.0)  # the [0, 2] span fell out of the window and is dropped
    assert list(log.spans) == [(5.0, 30.0)]
    assert log.fraction(30.0, window_s=10.0) == 1.0


def test_prefill_load_is_at_least_the_measured_busy_share_when_the_model_overstates_capacity():
    sched = RequestLedger(["prefill", "decode"], PerfModel(prefill_tokens_per_s=1e6, decode_step_s=0.01),
                          SloTargets.from_s(0.5, 0.02), window_s=10.0, prefix_aware=False)
    for i in range(2):
        sched.engines.add("prefill", f"p{i}", 16, 1000)
    sched.engines.add("decode", "decode-0", 16, 1000)
    script = Script(sched)
    for k in range(100):  # each engine: a 2048-token prompt every 0.2 s, 0.12 s in prefill
        t = k * 0.1
        script.prefill(f"p{k % 2}", 2048, t, t + 0.12)
    signals = sched.signals("prefill", now=10.0)
    modelled = 10 * 2048 / (2 * 1e6)
    assert modelled < 0.05
    assert signals.prefill_utilization == pytest.approx(0.6, abs=0.02)


def test_a_request_id_is_admitted_once_at_a_time():
    ledger = RequestLedger(["colocated"], PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                           prefix_aware=False)
    ledger.engines.add("colocated", "c0", 16, 1000)
    first = ledger.admit("r", range(10), 4, now=0.0)
    with pytest.raises(ValueError, match="already admitted"):
        ledger.admit("r", range(10), 4, now=0.1)
    ledger.request_finished(first, 0.2, 0, "abort")
    assert ledger.admit("r", range(10), 4, now=0.3).request_id == "r"  # free again once finished


def test_the_request_end_closes_a_leg_its_backend_left_open_after_its_first_output():
    ledger = RequestLedger(["prefill", "decode"], PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                           prefix_aware=False)
    ledger.engines.add("prefill", "p0", 16, 1000)
    ledger.engines.add("decode", "d0", 16, 1000)
    adm = Script(ledger, decode="d0").admit("p0", 100, 8, now=0.0)
    ledger.leg_started(adm, Leg.PREFILL, 0.0)
    ledger.leg_output(adm, Leg.PREFILL, 0.1, 1, finished=True)  # first token; leg never closed
    prefill = ledger.engine("prefill", "p0")
    assert (prefill.in_flight, prefill.pins) == (1, 1)
    ledger.request_finished(adm, 0.2, 1, "abort")
    assert prefill.idle and ledger.engine("decode", "d0").idle
