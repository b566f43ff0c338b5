"""Engines of one host slowing each other in the simulator (EngineProfile.interference,
SimConfig.shared_host): a step started while another engine runs one takes the shared factor."""

import math

import pytest

from conftest import sim_cli, workload
from pdserve.sim import cli
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.runner import SimConfig, Topology, simulate

pytestmark = pytest.mark.unit

# one request decodes 40 tokens while a second one's 400-token prompt prefills beside it
WL = workload((0.0, 100, 40), (0.3, 400, 1))


def windows(engine, requests):
    """(start, end) of each step of a prefill engine that prefilled one prompt per step."""
    return [(r.prefill_start, end) for r, end in zip(requests, engine.step_ends, strict=True)]


def decode_steps(engine):
    """(start, seconds) of the decode engine's back-to-back steps (the first one follows a pull)."""
    ends = engine.step_ends
    return [(a, b - a) for a, b in zip(ends, ends[1:])]


def test_decode_steps_beside_a_prefill_take_the_shared_factor(profile):
    slowed = profile.with_(interference={"decode": (math.log(1.5), 0.0)})
    plain = simulate(SimConfig(slowed, Topology.disaggregated(1, 1)), WL)
    shared = simulate(SimConfig(slowed, Topology.disaggregated(1, 1), shared_host=True), WL)
    # on hosts of their own (the default) the profile's interference changes nothing
    base = simulate(SimConfig(profile, Topology.disaggregated(1, 1)), WL)
    assert [r.finish for r in plain.requests] == [r.finish for r in base.requests]
    prefill, decode = (next(e for e in shared.engines if e.pool == pool) for pool in ("prefill", "decode"))
    busy = windows(prefill, shared.requests)
    beside = 0
    for start, seconds in decode_steps(decode):
        inside = any(a < start < b for a, b in busy)
        beside += inside
        assert seconds == pytest.approx(0.011 * (1.5 if inside else 1.0))  # 10 ms + 1 ms per request
    assert beside >= 10
    # the prefill pool has no interference: its steps take the model's time
    assert [r.first_token for r in shared.requests] == [r.first_token for r in plain.requests]
    assert shared.requests[0].finish == pytest.approx(plain.requests[0].finish + beside * 0.0055)


def test_a_fit_share_makes_lone_steps_faster_than_the_model(profile):
    # half of the fit's steps ran shared at twice the time: the model is their mean, 1.5x a lone one
    slowed = profile.with_(interference={"decode": (math.log(2.0), 0.5)})
    run = simulate(SimConfig(slowed, Topology.disaggregated(1, 1), shared_host=True),
                   workload((0.0, 100, 20)))
    decode = next(e for e in run.engines if e.pool == "decode")
    assert all(s == pytest.approx(0.011 / 1.5) for _, s in decode_steps(decode))


def test_a_profile_reads_its_interference_by_pool():
    data = {"prefill_tokens_per_s": 1000, "ttft_single_ms": {"100": 150},
            "tpot_ms_by_batch": {"1": 11, "2": 12},
            "step_fit": {"decode_step_s": 0.01, "decode_step_per_seq_s": 0.001,
                         "prefill_tokens_per_s": 1000, "steps": 900, "mixed_steps": 10,
                         "residual_p50_s": 0.001,
                         "interference": {"decode": {"slowdown": 0.1, "shared": 0.3, "steps": 90}}}}
    assert EngineProfile.from_json(data).interference == {"decode": (0.1, 0.3)}
    with pytest.raises(ValueError, match="interference"):
        EngineProfile.from_json(data).with_(interference={"decode": (0.1, 1.5)})


def test_the_cli_puts_engines_on_one_host_and_refuses_it_where_it_cannot(tmp_path):
    base, tpot = sim_cli(tmp_path,
                         interference={"decode": {"slowdown": 0.3, "shared": 0.2, "steps": 90}})

    assert tpot("--shared-host") != tpot()
    with pytest.raises(SystemExit, match="cells"):
        cli.main([*base, "--shared-host", "--cells", "2"])
    with pytest.raises(SystemExit, match="fluid"):
        cli.main([*base, "--sim-mode", "fluid", "--shared-host"])
