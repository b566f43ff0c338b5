import json

import pytest

import pdserve.autoscaler.controller as controller
import pdserve.autoscaler.policy as policy
import pdserve.scheduler.routing as routing
import pdserve.scheduler.ledger as ledger
from conftest import workload
from pdserve.autoscaler.policy import PoolBounds, ScalingPolicy
from pdserve.slo import SloTargets
from pdserve.scheduler.routing import RoutingPolicy
from pdserve.sim.results import bench_result, run_json
from pdserve.sim.runner import SimConfig, Topology, simulate
from pdserve.sim.workload import at_rate, concat

pytestmark = pytest.mark.unit


def test_colocated_request_timeline_as_the_client_sees_it(profile):
    run = simulate(SimConfig(profile, Topology.colocated(1)), workload((0.0, 200, 5)))
    out = bench_result(run).outcomes[0]
    assert out.success
    assert out.ttft_s == pytest.approx(0.21 + 0.04)  # prefill step + response path
    assert out.itls_s == pytest.approx((0.011,) * 4)
    assert out.e2el_s == pytest.approx(0.21 + 4 * 0.011 + 0.04)


def test_disaggregated_request_prefills_remotely_then_pulls_the_kv(profile):
    config = SimConfig(profile, Topology.disaggregated(1, 1),
                       routing=RoutingPolicy(local_prefill_max_tokens=0))
    run = simulate(config, workload((0.0, 200, 3)))
    out = bench_result(run).outcomes[0]
    req = run.requests[0]
    assert req.prefill_engine.pool == "prefill" and req.decode_engine.pool == "decode"
    assert out.ttft_s == pytest.approx(0.21 + 0.04)  # first token streams from the prefill engine
    # The pull of 200 tokens x 1000 B at 1 MB/s = 0.2 s, then two decode steps at batch 1.
    assert out.itls_s == pytest.approx((0.2 + 0.011, 0.011))
    assert run.engines[0].kv_used == 0 and run.engines[1].kv_used == 0


def test_one_token_requests_free_their_prefill_blocks(profile):
    config = SimConfig(profile, Topology.disaggregated(1, 1),
                       routing=RoutingPolicy(local_prefill_max_tokens=0))
    run = simulate(config, workload((0.0, 200, 1), (0.5, 200, 1)))
    assert [r.decode_engine.pool for r in run.requests] == ["decode", "decode"]
    assert all(e.kv_used == 0 for e in run.engines)
    assert all(e.idle for e in run.engines)


def test_same_seed_same_result_other_seed_other_result(profile):
    def once(seed):
        wl = at_rate("random", 300, 20.0, seed=seed, input_len=300, output_len=40, range_ratio=0.5)
        run = simulate(SimConfig(profile, Topology.disaggregated(1, 2), slo=SloTargets.from_s(1.0, 0.05)),
                       wl)
        body = run_json(run, SloTargets(ttft_ms=1000, tpot_ms=50), per_request=True)
        body["simulation"].pop("wall_s")
        body["simulation"].pop("simulated_requests_per_wall_s")
        return json.dumps(body, sort_keys=True)

    assert once(7) == once(7)
    assert once(7) != once(8)


def test_the_scheduler_and_controller_use_the_very_routing_and_policy_functions():
    # The ledger module uses the very functions of routing.py (not copies) ...
    assert ledger.place is routing.place and ledger.place_colocated is routing.place_colocated
    assert controller.decide is policy.decide


def test_the_simulator_calls_the_production_routing_and_scaling_functions(profile, production_calls):
    # ... and the simulator reaches them through the ledger and the controller.
    calls = production_calls
    wl = at_rate("random", 50, 10.0, input_len=100, output_len=10)
    bounds = PoolBounds(1, 3)
    simulate(SimConfig(profile, Topology.disaggregated(1, 1, bounds, bounds),
                       slo=SloTargets.from_s(1.0, 0.05), autoscale_interval_s=1.0), wl)
    assert calls["place"] == 50 and calls["place_colocated"] == 0
    assert calls["decide"] >= 2 * 4  # both pools, every second of a ~5 s run
    simulate(SimConfig(profile, Topology.colocated(2)), wl)
    assert calls["place_colocated"] == 50


def test_autoscaler_adds_engines_under_load_and_drains_them_after(profile):
    heavy = at_rate("random", 600, 8.0, input_len=300, output_len=20, seed=1)
    light = at_rate("random", 100, 0.5, input_len=50, output_len=5, seed=2)
    light = type(light)(light.arrivals + heavy.arrivals[-1] + 1, light.prompts, light.outputs)
    config = SimConfig(profile, Topology.colocated(1, PoolBounds(1, 6)),
                       slo=SloTargets.from_s(0.5, 0.05),
                       scaling=ScalingPolicy(downscale_cooldown_s=20.0), autoscale_interval_s=2.0)
    run = simulate(config, concat([heavy, light]))
    ups = [(t, d) for t, d in run.decisions if d.delta > 0]
    downs = [(t, d) for t, d in run.decisions if d.delta < 0]
    pressure = {policy.TTFT_BREACH, policy.PREFILL_LOAD, policy.TPOT_BREACH, policy.KV_PRESSURE}
    assert ups and all(d.reason in pressure for _, d in ups)
    assert downs and all(d.reason == policy.IDLE for _, d in downs)
    added = [e for e in run.engines if e.replica_id != "colocated-0"]
    first_added = min(e.created for e in added)
    # A new engine takes no request before its start-up delay is over.
    served = [r for r in run.requests if r.decode_engine in added]
    assert served and min(r.arrival for r in served) >= first_added + profile.startup_s
    drained = [e for e in run.engines if e.draining]
    assert len(drained) == len(downs)
    assert all(e.removed is not None for e in drained)  # drained engines go away once idle
    # Never more than the upper bound provisioned at once (draining engines included).
    for t in [e.created for e in run.engines]:
        alive = [e for e in run.engines if e.created <= t and (e.removed is None or e.removed > t)]
        assert len(alive) <= 6
    assert run.gpu_hours() < 6 * run.end_s / 3600


def test_a_gpu_budget_caps_what_the_autoscaled_pools_hold_together(profile):
    heavy = at_rate("random", 600, 8.0, input_len=300, output_len=20, seed=1)
    bounds = PoolBounds(1, 4)
    config = SimConfig(profile, Topology.disaggregated(1, 1, bounds, bounds),
                       slo=SloTargets.from_s(0.5, 0.05), autoscale_interval_s=2.0,
                       scaling=ScalingPolicy(upscale_cooldown_s=4.0), max_gpus=3)
    run = simulate(config, heavy)
    assert any(d.delta > 0 for _, d in run.decisions)  # it did want more than 1P1D
    # Never more engines at once than the budget's GPUs; without it the pools grow past it.
    for t in [e.created for e in run.engines]:
        alive = [e for e in run.engines if e.created <= t and (e.removed is None or e.removed > t)]
        assert len(alive) <= 3
    unbounded = simulate(SimConfig(profile, Topology.disaggregated(1, 1, bounds, bounds),
                                   slo=SloTargets.from_s(0.5, 0.05), autoscale_interval_s=2.0,
                                   scaling=ScalingPolicy(upscale_cooldown_s=4.0)), heavy)
    assert len(unbounded.engines) > 3


def test_at_the_budget_a_gpu_moves_from_the_pool_that_can_spare_it(profile):
    # Long prompts with 2-token answers grow prefill (and decode: their token 2 waits for the
    # pull), then short prompts with long answers breach decode's TPOT at the 4-GPU budget
    # while prefill idles: a prefill engine drains so that decode can grow into its GPU.
    prefill_heavy = at_rate("random", 660, 5.5, input_len=500, output_len=2, seed=1)
    decode_heavy = at_rate("random", 1800, 6.0, input_len=50, output_len=200, seed=2)
    decode_heavy = type(decode_heavy)(decode_heavy.arrivals + prefill_heavy.arrivals[-1] + 1,
                                      decode_heavy.prompts, decode_heavy.outputs)
    bounds = PoolBounds(1, 3)
    config = SimConfig(profile, Topology.disaggregated(1, 1, bounds, bounds),
                       slo=SloTargets.from_s(0.5, 0.05), autoscale_interval_s=2.0,
                       scaling=ScalingPolicy(upscale_cooldown_s=4.0), max_gpus=4, record_itls=False)
    run = simulate(config, concat([prefill_heavy, decode_heavy]))
    moved = [(t, d) for t, d in run.decisions if d.reason == policy.REBALANCE]
    assert moved and all(d.pool == "prefill" and d.delta == -1 for _, d in moved)
    t_moved = moved[0][0]
    assert t_moved > decode_heavy.arrivals[0]  # in the decode-heavy phase
    grown = [d for t, d in run.decisions if t > t_moved and d.pool == "decode" and d.delta > 0]
    assert grown and max(d.target for d in grown) == 3  # into the GPU prefill gave up
    for t in [e.created for e in run.engines]:
        alive = [e for e in run.engines if e.created <= t and (e.removed is None or e.removed > t)]
        assert len(alive) <= 4


def test_rejections_count_as_failed_requests(profile):
    # One engine, a tight TTFT target and a burst: admission control refuses some requests.
    wl = at_rate("random", 100, float("inf"), input_len=500, output_len=5)
    run = simulate(SimConfig(profile, Topology.colocated(1), slo=SloTargets.from_s(0.2, 0.05)), wl)
    body = run_json(run, SloTargets(ttft_ms=200))
    assert run.rejected.get("ttft_slo", 0) > 0
    assert body["failed"] == run.rejected["ttft_slo"]
    assert body["slo_attainment"]["ttft"] < 1.0


def test_results_carry_the_harness_keys(profile):
    wl = at_rate("random", 40, 5.0, input_len=100, output_len=10)
    body = run_json(simulate(SimConfig(profile, Topology.colocated(1)), wl),
                    SloTargets(ttft_ms=500, tpot_ms=50), percentiles=(90, 99))
    for key in ("completed", "request_goodput", "median_ttft_ms", "p99_tpot_ms", "p90_itl_ms",
                "mean_e2el_ms", "slo_attainment", "output_throughput"):
        assert key in body
    assert body["completed"] == 40 and body["simulation"]["gpu_hours"] > 0
