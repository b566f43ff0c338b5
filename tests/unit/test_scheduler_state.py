"""Performance model (calibration seed, online fit), SLO tracker, prefix index, and the
GlobalScheduler's request accounting."""

import json
from pathlib import Path

import pytest

from pdserve.scheduler.perf_model import LineFit, OnlineFit, PerfModel, fit_line, fit_line_robust
from pdserve.scheduler.prefix import PrefixIndex, block_hashes
from pdserve.scheduler.routing import Placement, SloTargets
from pdserve.scheduler.scheduler import BusyLog, GlobalScheduler
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


def test_scheduler_accounting_drives_routing_and_drains():
    sched = GlobalScheduler(["prefill", "decode"],
                            PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                            SloTargets(1.0, 0.05), prefix_block_size=16)
    for pool in ("prefill", "decode"):
        for i in range(2):
            sched.add_engine(pool, f"{pool}-{i}", 16, 1000)
    prompt = list(range(500))
    first = sched.route(prompt, 20)
    assert isinstance(first, Placement) and first.prefill == "prefill-0"
    ticket = sched.prefill_started("prefill", first.prefill, 500, now=0.0)
    sched.pin("prefill", first.prefill)
    # prefill-0 now has 500 tokens queued: the next (different) prompt goes to prefill-1.
    assert sched.route(list(range(1000, 1500)), 20).prefill == "prefill-1"
    sched.first_token(ticket, now=0.5)
    sched.remember_prefix(first.prefill, prompt)
    # The same prompt again: prefill-0 has it cached (496 of 500 tokens in full blocks).
    assert sched.cached_tokens("prefill-0", prompt) == 496
    assert sched.route(prompt, 20).prefill == "prefill-0"
    state = sched.engine("prefill", "prefill-0")
    assert state.queued_prefill_tokens == 0 and not state.idle  # still pinned
    sched.unpin("prefill", "prefill-0")
    assert state.idle
    # A draining engine gets nothing new.
    state.draining = True
    assert sched.route(prompt, 20).prefill == "prefill-1"


def test_a_model_taught_by_a_burst_that_idle_engines_are_slow_is_corrected_after_it():
    # 4 x H100, 2026-11-27: in a burst the fitted model learned that a lone 2048-token prefill
    # takes seconds; admission then refused every request, so nothing new was observed and the
    # service refused everything, on idle engines, until it was stopped.
    sched = GlobalScheduler(["prefill", "decode"],
                            PerfModel(prefill_tokens_per_s=40_000, decode_step_s=0.01),
                            SloTargets(0.5, 0.02), prefix_aware=False)
    sched.add_engine("prefill", "p0", 16, 100_000)
    sched.add_engine("decode", "d0", 16, 100_000)
    for i in range(100):  # the burst: every leg took 3 s to its first token, every pull 3 s
        ticket = sched.prefill_started("prefill", "p0", 2048, now=float(i))
        sched.first_token(ticket, now=i + 3.0)
        sched.transfer_observed(2048, 3.0)
    assert sched.model("prefill").prefill_s(2048) > 4 * 0.5  # beyond what admission allows
    # Nothing queued: admitted whatever the model says, and what it observes corrects it.
    for i in range(200):
        placement = sched.route(list(range(i, i + 2048)), 256)
        assert isinstance(placement, Placement) and placement.prefill == "p0"
        ticket = sched.prefill_started("prefill", "p0", 2048, now=1000.0 + i)
        sched.first_token(ticket, now=1000.0 + i + 0.06)
    assert sched.model("prefill").prefill_s(2048) < 0.2
    # The 3 s pulls delay token 2, not the first: they are not in the predicted TTFT.
    assert sched.route(list(range(2048)), 256).predicted_ttft_s < 0.2


def test_simultaneous_placements_spread_over_decode_engines():
    sched = GlobalScheduler(["prefill", "decode"],
                            PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01),
                            prefix_aware=False)
    sched.add_engine("prefill", "prefill-0", 16, 1000)
    for i in range(2):
        sched.add_engine("decode", f"decode-{i}", 16, 1000)
    # 16 requests placed before any reaches its decode engine (all still prefilling): the
    # placements themselves count, so a flat decode cost still splits them evenly.
    chosen = []
    for n in range(16):
        placement = sched.route(list(range(n, n + 20)), 8)
        sched.reserve(placement)
        chosen.append(placement.decode)
    assert chosen.count("decode-0") == chosen.count("decode-1") == 8


def _without_caches(sched: GlobalScheduler) -> GlobalScheduler:
    """Forget every cached engine load and fitted model, as if the scheduler had no caches."""
    for pool in sched._pools.values():
        pool._model, pool._model_counts = None, (-1, -1, -1)
        for state in pool.engines.values():
            state._load_key = ()
    return sched


@pytest.mark.parametrize("pools", [("prefill", "decode"), ("colocated",)])
def test_cached_loads_and_models_route_exactly_as_uncached(pools):
    # Two schedulers take the same random book changes (through the scheduler and by direct
    # writes to engine state, as the backend and the simulators make them); one forgets its
    # caches before every routing call. Every placement must be the same.
    import random

    rng = random.Random(7)
    seed = PerfModel(prefill_tokens_per_s=5000, decode_step_s=0.01, decode_step_per_seq_s=0.001)
    cached, uncached = (GlobalScheduler(list(pools), seed, SloTargets(0.5, 0.05),
                                        prefix_block_size=16) for _ in range(2))
    ids = {pool: [f"{pool}-{i}" for i in range(4)] for pool in pools}
    for sched in (cached, uncached):
        for pool in pools:
            for rid in ids[pool]:
                sched.add_engine(pool, rid, 16, 400, ready=rid[-1] != "3")
    tickets = {id(cached): [], id(uncached): []}

    def change(sched: GlobalScheduler, op: int, pool: str, rid: str, r: list[float]) -> None:
        state = sched.engine(pool, rid) if rid in sched._pools[pool].engines else None
        mine = tickets[id(sched)]
        if op == 0:
            mine.append(sched.prefill_started(pool, rid, int(r[0] * 3000) + 1, now=r[1]))
        elif op == 1 and mine:
            sched.first_token(mine.pop(int(r[0] * len(mine))), now=r[1] + 1.0)
        elif op == 2:
            sched.decode_started(pool, rid)
            sched.token_gap(pool, rid, 0.01 + r[0] * 0.02, 1)
        elif op == 3:
            sched.decode_finished(pool, rid)
        elif op == 4:
            sched.update_engine(pool, rid, kv_usage=r[0])
        elif op == 5:
            (sched.pin if r[0] < 0.5 else sched.unpin)(pool, rid)
        elif op == 6:
            sched.transfer_observed(int(r[0] * 4000) + 1, 0.001 + r[1] * 0.01)
        elif op == 7 and state is not None:  # direct writes, fractional as the fluid mode's
            state.queued_prefill_tokens += r[0] * 100
            state.num_decoding += r[1]
        elif op == 8 and state is not None:
            state.draining = r[0] < 0.3
            state.healthy = r[1] > 0.1
        elif op == 9:
            sched.mark_ready(pool, rid)
        elif op == 10:
            sched.remove_engine(pool, rid)
            sched.add_engine(pool, rid, 16, 300 + int(r[0] * 200))

    placements = []
    for _ in range(3000):
        op, pool = rng.randrange(12), rng.choice(pools)
        rid, r = rng.choice(ids[pool]), [rng.random(), rng.random()]
        if op == 11:
            prompt = list(range(rng.randrange(1, 3000)))
            max_tokens = rng.randrange(1, 600)
            got = cached.route(prompt, max_tokens)
            assert got == _without_caches(uncached).route(prompt, max_tokens)
            placements.append(got)
            for sched in (cached, uncached):
                if isinstance(got, Placement):
                    sched.reserve(got)
                    sched.remember_prefix(got.prefill or got.decode, prompt)
            continue
        for sched in (cached, uncached):
            change(sched, op, pool, rid, r)
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
    sched = GlobalScheduler(["prefill", "decode"], PerfModel(prefill_tokens_per_s=1e6, decode_step_s=0.01),
                            SloTargets(0.5, 0.02), window_s=10.0, prefix_aware=False)
    for i in range(2):
        sched.add_engine("prefill", f"p{i}", 16, 1000)
    for k in range(100):  # each engine: a 2048-token prompt every 0.2 s, 0.12 s in prefill
        t = k * 0.1
        ticket = sched.prefill_started("prefill", f"p{k % 2}", 2048, now=t)
        sched.first_token(ticket, now=t + 0.12, observe=False)
    signals = sched.signals("prefill", now=10.0)
    modelled = 10 * 2048 / (2 * 1e6)
    assert modelled < 0.05
    assert signals.prefill_utilization == pytest.approx(0.6, abs=0.02)
