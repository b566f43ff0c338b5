"""Step noise in the simulator: read from a profile's step fit by pool, off unless asked for,
seeded, and each pool's own."""


import numpy as np
import pytest

from conftest import PERF, sim_cli, workload
from pdserve.sim import cli
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.runner import SimConfig, Topology, simulate
from pdserve.sim.workload import at_rate

pytestmark = pytest.mark.unit

NOISE = {"all": {"components": [[0.02, 0.05], [0.01, 2.0]], "steps": 900},
         "decode": {"components": [[0.04, 0.05]], "steps": 800}}


def test_a_profile_takes_its_noise_by_pool_and_falls_back_to_all_engines():
    data = {"prefill_tokens_per_s": 1000, "ttft_single_ms": {"100": 150},
            "tpot_ms_by_batch": {"1": 11, "2": 12},
            "step_fit": {"decode_step_s": 0.01, "decode_step_per_seq_s": 0.001,
                         "prefill_tokens_per_s": 1000, "steps": 900, "mixed_steps": 10,
                         "residual_p50_s": 0.001, "noise": NOISE}}
    p = EngineProfile.from_json(data)
    assert p.noise_of("decode") == ((0.04, 0.05),)
    assert p.noise_of("prefill") == p.noise_of("colocated") == ((0.02, 0.05), (0.01, 2.0))
    assert EngineProfile.from_json({**data, "step_fit": {**data["step_fit"], "noise": None}}
                                   ).noise_of("decode") == ()
    with pytest.raises(ValueError, match="step_noise"):
        EngineProfile(PERF, step_noise={"all": ((-0.1, 1.0),)})
    with pytest.raises(ValueError, match="step_noise"):
        EngineProfile(PERF, step_noise={"all": ((0.1, 0.0),)})


def noisy(profile, noise=None):
    parts = noise or {"all": ((0.03, 0.05), (0.01, 2.0))}
    return profile.with_(step_noise=parts)


def timeline(run):
    return [(r.first_token, r.finish) for r in run.requests]


def test_noise_is_off_unless_the_run_asks_and_then_repeats_under_its_seed(profile):
    wl = at_rate("random", 40, 5.0, seed=1, input_len=200, output_len=20)
    plain = simulate(SimConfig(profile, Topology.disaggregated(1, 1)), wl)
    # a profile with noise, simulated without a seed: the model's own times, exactly
    quiet = simulate(SimConfig(noisy(profile), Topology.disaggregated(1, 1)), wl)
    assert timeline(quiet) == timeline(plain)
    runs = [simulate(SimConfig(noisy(profile), Topology.disaggregated(1, 1), step_noise=seed), wl)
            for seed in (3, 3, 4)]
    assert timeline(runs[0]) == timeline(runs[1])
    assert timeline(runs[0]) != timeline(runs[2]) != timeline(plain)
    # the wandering keeps the engines' mean step time: their busy time within a few percent
    busy = sum(e.busy_s for e in plain.engines)
    assert np.mean([sum(e.busy_s for e in r.engines) for r in runs]) == pytest.approx(busy, rel=0.1)


def test_each_pool_draws_its_own_noise(profile):
    wl = workload((0.0, 200, 6), (1.0, 300, 6))
    # only the decode pool wanders: every prefill step takes the model's time
    run = simulate(SimConfig(noisy(profile, {"decode": ((0.05, 0.1),)}), Topology.disaggregated(1, 1),
                             step_noise=0), wl)
    plain = simulate(SimConfig(profile, Topology.disaggregated(1, 1)), wl)
    assert [r.first_token for r in run.requests] == [r.first_token for r in plain.requests]
    assert [r.finish for r in run.requests] != [r.finish for r in plain.requests]


def test_the_cli_turns_noise_on_with_a_seed_and_refuses_it_in_fluid_mode(tmp_path):
    base, tpot = sim_cli(tmp_path, noise=NOISE)

    assert tpot() == tpot()
    assert tpot("--step-noise") == tpot("--step-noise", "0") != tpot()
    assert tpot("--step-noise", "5") != tpot("--step-noise", "0")
    with pytest.raises(SystemExit, match="fluid"):
        cli.main([*base, "--sim-mode", "fluid", "--step-noise"])
