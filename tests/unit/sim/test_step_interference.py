"""Engines of one host slowing each other: the fit from step traces, and the factors the simulator
applies (pdserve.sim.calibration.step_interference)."""

import math

import pytest

from pdserve.engine.step_trace import Step
from pdserve.sim.calibration.step_fit import fit_replicas
from pdserve.sim.calibration.step_interference import fit_interference, interference_factors

pytestmark = pytest.mark.unit

PREFILLS = [(1.0 + 2.0 * i, 1.5 + 2.0 * i) for i in range(10)]  # the prefill engine's steps


def prefill_trace():
    return [Step(t=b, prefill_tokens=256, prefill_reqs=1, decode_reqs=0, busy_s=b - a, pending=0,
                 context_tokens=256, arrived=[a - 0.01]) for a, b in PREFILLS]


def decode_trace(alone=0.050, shared=0.055, admitted=None):
    """Back-to-back one-request decode steps over 20 s: `shared` long where they start inside a
    prefill, `alone` otherwise; `admitted` (seconds) for steps starting at whole seconds + 0.2,
    which admit a request."""
    steps, t = [], 0.0
    while t < 21.0:
        inside = any(a <= t < b for a, b in PREFILLS)
        took = shared if inside else alone
        arrived = None
        if admitted and any(a + 0.2 <= t < a + 0.2 + alone for a, _ in PREFILLS):
            took, arrived = admitted, [t + 0.001]
        steps.append(Step(t=t + took, prefill_tokens=0, prefill_reqs=0, decode_reqs=1, busy_s=took,
                          pending=1, context_tokens=300, arrived=arrived))
        t += took
    return steps


def test_a_decode_engine_slowed_beside_the_prefill_engine():
    fit = fit_interference({"prefill-0": prefill_trace(), "decode-0": decode_trace()})
    decode = fit["decode"]
    assert decode["slowdown"] == pytest.approx(math.log(0.055 / 0.050), abs=1e-4)
    # 5 of the 21 s are inside a prefill, at 55 ms a step against 50: ~23% of the steps
    assert decode["shared"] == pytest.approx(5 / 0.055 / (5 / 0.055 + 16 / 0.050), abs=0.02)
    # the decode engine never rests: no prefill ran alone, so that role has no fit
    assert "prefill" not in fit


def test_steps_that_admitted_requests_do_not_count():
    plain = fit_interference({"prefill-0": prefill_trace(), "decode-0": decode_trace()})
    slow = fit_interference({"prefill-0": prefill_trace(),
                             "decode-0": decode_trace(admitted=0.2)})
    assert slow["decode"]["slowdown"] == plain["decode"]["slowdown"]


def test_engines_that_do_not_slow_each_other_fit_zero():
    fit = fit_interference({"prefill-0": prefill_trace(), "decode-0": decode_trace(shared=0.050)})
    assert fit["decode"]["slowdown"] == 0.0


def test_one_engine_or_too_few_matched_steps_give_no_fit():
    assert fit_interference({"decode-0": decode_trace()}) is None
    assert fit_interference({"prefill-0": prefill_trace(), "decode-0": decode_trace()[:40]}) is None
    # the deployment's step fit carries it
    assert fit_replicas({"prefill-0": prefill_trace(), "decode-0": decode_trace()}).interference \
        == fit_interference({"prefill-0": prefill_trace(), "decode-0": decode_trace()})


def test_the_factors_keep_the_fits_mean_step():
    alone, shared = interference_factors(math.log(2.0), 0.5)
    assert (alone, shared) == pytest.approx((1 / 1.5, 2 / 1.5))
    assert 0.5 * alone + 0.5 * shared == pytest.approx(1.0)
    assert interference_factors(0.2, 0.0) == pytest.approx((1.0, math.exp(0.2)))
