"""pdserve.sim.validation.actor_replay: an engine's actor-side submissions replayed through one simulated
engine, run by run."""

import numpy as np
import pytest

from pdserve.scheduler.perf_model import PerfModel
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.validation import actor_replay as replay

pytestmark = pytest.mark.unit

# 10 ms + tokens / 1000 per step, no async scheduling: a lone 100-token prompt takes 110 ms.
PROFILE = EngineProfile(perf=PerfModel(prefill_tokens_per_s=1000.0, decode_step_s=0.010))


def test_runs_are_split_at_pauses_and_replayed_apart():
    # Run 1: 25 requests 1 s apart, each out 300 ms after the actor took it. Run 2, after a
    # 5 s pause: 25 pairs 50 ms apart, 1 s between pairs; the second of a pair waits for the
    # first's step (110 ms) in the simulated engine: 110 and 170 ms.
    first_run = [(float(i), i + 0.3) for i in range(25)]
    start = 30.0
    second_run = [(start + i + d, start + i + d + 0.2) for i in range(25) for d in (0.0, 0.05)]
    rows = replay.compare(PROFILE, first_run + second_run, prompt=100, output=1, prefill_leg=True)
    assert [r["requests"] for r in rows] == [25, 50]
    one, two = rows
    assert one["measured_mean"] == pytest.approx(300.0) and one["sim_mean"] == pytest.approx(110.0)
    assert one["rate"] == pytest.approx(25 / 24)
    assert two["measured_p50"] == pytest.approx(200.0)
    assert two["sim_mean"] == pytest.approx((110.0 + 170.0) / 2)
    # Short runs (a warm-up) are left out.
    assert replay.compare(PROFILE, first_run[:5], 100, 1, True) == []


def test_a_colocated_engine_decodes_what_it_prefilled():
    # Two full legs 50 ms apart: the second joins after the first's prefill, beside its decode.
    sims, starts = replay.replay(PROFILE, np.array([0.0, 0.05]), prompt=100, output=4, prefill_leg=False)
    assert starts == pytest.approx([0.0, 0.06])  # the second waits for the first step to end
    assert sims[0] == pytest.approx(0.110)
    assert sims[1] == pytest.approx(0.110 + 0.110 - 0.05)  # its step: 10 ms + 100 tokens, beside a decode
