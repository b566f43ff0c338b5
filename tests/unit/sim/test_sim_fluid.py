import numpy as np
import pytest

import pdserve.autoscaler.policy as policy
from conftest import workload
from pdserve.autoscaler.policy import PoolBounds, ScalingPolicy
from pdserve.scheduler.perf_model import PerfModel
from pdserve.slo import SloTargets
from pdserve.sim.arrivals import CurveArrivals, WorkloadArrivals, flat
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.fluid import FluidConfig, FluidSimulation
from pdserve.sim.histogram import LatencyHistogram
from pdserve.sim.results import LatencyRecorder, run_json
from pdserve.sim.runner import SimConfig, Simulation, Topology
from pdserve.sim.workload import at_rate, concat

pytestmark = pytest.mark.unit


def fluid(config, wl, goodput=None, **kw):
    return FluidSimulation(config, FluidConfig(**kw), goodput).run(WorkloadArrivals(wl))


def test_a_lone_request_has_the_per_request_simulators_timeline(profile):
    run = fluid(SimConfig(profile, Topology.colocated(1)), workload((0.0, 200, 5)))
    body = run.summary()
    assert body["completed"] == 1
    assert body["median_ttft_ms"] == pytest.approx(250, rel=0.003)  # 10 ms step + 200 ms + 40 ms
    # 10 ms + 1 ms x batch 1; the fluid step that holds the end of the prefill also counts its
    # tail as prefill time, which stretches the first decode steps a little.
    assert body["median_tpot_ms"] == pytest.approx(11, rel=0.05)


def test_fluid_mode_calls_the_production_routing_and_scaling_functions(profile, production_calls):
    calls = production_calls
    wl = at_rate("random", 50, 10.0, input_len=100, output_len=10)
    bounds = PoolBounds(1, 3)
    fluid(SimConfig(profile, Topology.disaggregated(1, 1, bounds, bounds),
                    slo=SloTargets.from_s(1.0, 0.05), autoscale_interval_s=1.0), wl)
    # Single engines and sparse arrivals: every cohort is one request.
    assert calls["place"] == 50 and calls["place_colocated"] == 0
    assert calls["decide"] >= 2 * 4
    fluid(SimConfig(profile, Topology.colocated(2)), wl)
    assert calls["place_colocated"] == 50


def _des(config, wl, goodput):
    sim = Simulation(config)
    recorder = LatencyRecorder(len(wl), config.profile.response_of)
    sim.on_request_done = recorder
    return run_json(sim.run(wl), goodput, recorder=recorder)


# The H200 / Llama-3.1-8B calibration's lines (../shared/calibration), rounded.
H200 = EngineProfile(PerfModel(prefill_tokens_per_s=44_500.0, decode_step_s=0.0049,
                               decode_step_per_seq_s=0.000035, prefill_overhead_s=0.0065,
                               transfer_bytes_per_s=347.6e9), num_kv_blocks=52_900, name="h200")


@pytest.mark.parametrize("topology", [Topology.colocated(4), Topology.disaggregated(2, 4)])
def test_fluid_agrees_with_the_per_request_simulator_on_a_moderate_load(topology):
    # Chat traffic at 10 req/s per serving engine (the speed target's density).
    wl = at_rate("chat", 3000, 40.0, seed=4)
    goodput = SloTargets(ttft_ms=100, tpot_ms=8)
    config = SimConfig(H200, topology, SloTargets.from_s(0.1, 0.008), record_itls=False,
                       keep_requests=False)
    des = _des(config, wl, goodput)
    got = fluid(config, wl, goodput).summary()
    for key in ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms"):
        assert got[key] == pytest.approx(des[key], rel=0.10), key
    assert got["slo_attainment"]["all"] == pytest.approx(des["slo_attainment"]["all"], abs=0.05)
    assert got["simulation"]["gpu_hours"] == pytest.approx(des["simulation"]["gpu_hours"],
                                                           rel=0.02)


def test_fluid_autoscaler_adds_engines_under_load_and_drains_them_after(profile):
    heavy = at_rate("random", 600, 8.0, input_len=300, output_len=20, seed=1)
    light = at_rate("random", 100, 0.5, input_len=50, output_len=5, seed=2)
    light = type(light)(light.arrivals + heavy.arrivals[-1] + 1, light.prompts, light.outputs)
    config = SimConfig(profile, Topology.colocated(1, PoolBounds(1, 6)),
                       slo=SloTargets.from_s(0.5, 0.05),
                       scaling=ScalingPolicy(downscale_cooldown_s=20.0), autoscale_interval_s=2.0)
    run = fluid(config, concat([heavy, light]))
    pressure = {policy.TTFT_BREACH, policy.PREFILL_LOAD, policy.TPOT_BREACH, policy.KV_PRESSURE}
    ups = [d for _, d in run.decisions if d.delta > 0]
    downs = [d for _, d in run.decisions if d.delta < 0]
    assert ups and all(d.reason in pressure for d in ups)
    assert downs and all(d.reason == policy.IDLE for d in downs)
    assert run.gpu_hours() < 6 * run.end_s / 3600
    assert run.summary()["completed"] + run.summary()["failed"] == 700


def test_large_groups_route_cohorts_not_requests(profile):
    # 32 engines in 4 groups of 8: a cohort carries up to 8 requests, the books its totals.
    wl = at_rate("random", 4000, 200.0, input_len=50, output_len=10, seed=5)
    run = fluid(SimConfig(profile.with_(num_kv_blocks=100_000), Topology.colocated(32)), wl,
                max_groups=4)
    assert run.summary()["completed"] == 4000
    assert len(run.groups) == 4
    assert run.route_calls < 4000 / 4


def test_histogram_percentiles_match_numpy_within_half_a_bin():
    values = np.random.default_rng(0).lognormal(-3, 1, 20_000)
    hist = LatencyHistogram()
    hist.add(values[:7000])
    hist.add(values[7000:])
    stats = hist.stats((50, 90, 99))
    assert stats.mean_ms == pytest.approx(values.mean() * 1e3, rel=1e-9)
    assert stats.std_ms == pytest.approx(values.std() * 1e3, rel=1e-6)
    for p, v in stats.percentiles_ms:
        assert v == pytest.approx(np.percentile(values, p) * 1e3, rel=0.003)


def test_curve_arrivals_stream_the_expected_poisson_count_in_time_order():
    src = CurveArrivals(flat(50.0, 100.0), "chat", seed=1, block_s=7.0)
    times = np.concatenate([src.take(t, t + 0.5)[0] for t in np.arange(0, 100, 0.5)])
    assert src.done
    assert len(times) == src.drawn
    assert abs(len(times) - 5000) < 4 * np.sqrt(5000)
    assert np.all(np.diff(times) >= 0)
