"""pdserve.sim.calibration.step_noise: the window averages of the log speed, the fit, and the
process the simulator draws."""

import math
import random

import numpy as np
import pytest

from pdserve.engine.step_trace import Step
from pdserve.sim.calibration.step_fit import fit_replicas
from pdserve.sim.calibration.step_noise import (
    StepNoise, fit_noise_by_role, fit_step_noise, role, window_cov, window_var)

pytestmark = pytest.mark.unit


def test_a_window_average_keeps_the_variance_of_a_short_window_and_loses_it_over_a_long_one():
    assert float(window_var(1.0, 1e-9)) == pytest.approx(1.0)
    # 2 (x - 1 + e^-x) / x^2 at x = 2, by hand
    assert float(window_var(0.5, 1.0)) == pytest.approx(2 * (2 - 1 + math.exp(-2)) / 4)
    assert float(window_var(1.0, 1000.0)) == pytest.approx(2 / 1000, rel=0.01)
    # the series and the exact form meet where the code switches between them
    assert float(window_var(1.0, 0.99e-4)) == pytest.approx(float(window_var(1.0, 1.01e-4)), rel=1e-6)


def test_two_windows_covary_by_their_gap_and_a_window_with_itself_by_its_variance():
    a0, a1 = np.array([0.0]), np.array([0.1])
    same = window_cov(0.2, a0, a1, a0, a1)
    assert float(same[0]) == pytest.approx(float(window_var(0.2, 0.1)))
    # two windows of 0.1 s, 0.3 s apart: tau^2 (1 - e^-L/tau)^2 e^-gap/tau / L^2, by hand
    tau, length, gap = 0.2, 0.1, 0.3
    by_hand = tau ** 2 * (1 - math.exp(-length / tau)) ** 2 * math.exp(-gap / tau) / length ** 2
    apart = window_cov(tau, a0, a1, np.array([0.4]), np.array([0.5]))
    assert float(apart[0]) == pytest.approx(by_hand)
    far = window_cov(tau, a0, a1, np.array([100.0]), np.array([100.1]))
    assert float(far[0]) == pytest.approx(0.0, abs=1e-12)


def drawn_trace(components, seed=0, steps=6000, kinds=((0, 1, 0.085), (0, 2, 0.095), (256, 0, 1.2)),
                idle=0.0, replica_seed=None):
    """Steps of known kinds whose times wander as `components` say (StepNoise itself draws them)."""
    noise = StepNoise(components, random.Random(replica_seed if replica_seed is not None else seed))
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for i in range(steps):
        tokens, decode, base = rng.choice(kinds) if rng.random() < 0.1 else kinds[0]
        busy = base * noise.factor(t, base)
        # the requests a step starts reached the scheduler just before it (the trace records when)
        arrived = [t - 0.0003] if tokens or i % 50 == 0 else None
        t += busy
        out.append(Step(t=t, prefill_tokens=tokens, prefill_reqs=1 if tokens else 0,
                        decode_reqs=decode, busy_s=busy, pending=1, context_tokens=300,
                        arrived=arrived))
        t += max(idle, 0.0005)  # the engine core between steps
    return out


def test_the_fit_finds_the_variance_and_time_constants_the_trace_was_drawn_with():
    truth = [(0.025, 0.15), (0.015, 6.0)]
    fit = fit_step_noise([drawn_trace(truth, seed=s) for s in range(3)])
    assert fit is not None and fit["steps"] == 18000
    (fast_var, fast_tau), (slow_var, slow_tau) = sorted(fit["components"], key=lambda c: c[1])
    # the time constants on the fit's grid (steps of x1.58): within two steps of the truth
    assert 0.15 / 2.6 < fast_tau < 0.15 * 2.6 and 6.0 / 2.6 < slow_tau < 6.0 * 2.6
    # what a step sees: the spread of a decode step's and a prefill step's log time
    for length in (0.085, 1.2):
        fitted = sum(v * float(window_var(tau, length)) for v, tau in fit["components"])
        true = sum(v * float(window_var(tau, length)) for v, tau in truth)
        assert fitted == pytest.approx(true, rel=0.25)


def test_steady_steps_have_no_noise_and_short_traces_no_fit():
    steady = [Step(t=0.1 * (i + 1), prefill_tokens=0, prefill_reqs=0, decode_reqs=1, busy_s=0.1,
                   pending=1, context_tokens=100) for i in range(500)]
    assert fit_step_noise([steady]) is None
    assert fit_step_noise([drawn_trace([(0.02, 0.2)], steps=150)]) is None
    untimed = [Step(t=s.t, prefill_tokens=0, prefill_reqs=0, decode_reqs=1) for s in steady]
    assert fit_step_noise([untimed]) is None  # traces from before busy_s


def test_steps_that_admitted_requests_are_left_out_and_traces_without_arrivals_give_no_fit():
    trace = drawn_trace([(0.02, 0.2)], steps=1000)
    assert fit_step_noise([trace])["steps"] == 1000
    # a request reached the scheduler during every fifth step: those steps do not count
    admitting = [Step(**{**vars_of(s), "arrived": [s.t - s.busy_s / 2]}) if i % 5 == 0 else s
                 for i, s in enumerate(trace)]
    assert fit_step_noise([admitting])["steps"] == 800
    # a trace that records no arrivals cannot tell admissions from noise
    blind = [Step(**{**vars_of(s), "arrived": None}) for s in trace]
    assert fit_step_noise([blind]) is None


def vars_of(step):
    return {k: getattr(step, k) for k in step.__slots__}


def test_each_role_gets_its_own_fit_and_all_engines_one_together():
    traces = {"prefill-0": drawn_trace([(0.01, 2.0)], seed=1, kinds=((256, 0, 1.2),), idle=2.0,
                                       steps=400),
              "decode-0": drawn_trace([(0.03, 0.15)], seed=2)}
    fits = fit_noise_by_role(traces)
    assert set(fits) == {"all", "prefill", "decode"}
    assert role("prefill-3") == "prefill" and role("decode-0") == "decode"
    assert role("colocated-1") == "colocated" and role("replica-0") == "colocated"

    def spread(parts, length):
        return sum(v * float(window_var(tau, length)) for v, tau in parts)

    # each role's fit holds for its own steps (a trace of 1.2 s steps cannot tell what a 85 ms
    # step would see, and the simulator does not ask it)
    assert spread(fits["prefill"]["components"], 1.2) == pytest.approx(spread([(0.01, 2.0)], 1.2),
                                                                       rel=0.3)
    assert spread(fits["decode"]["components"], 0.085) == pytest.approx(
        spread([(0.03, 0.15)], 0.085), rel=0.3)
    assert fit_replicas(traces).noise == fits


def test_the_process_repeats_under_its_seed_and_keeps_the_mean_step_time():
    parts = [(0.025, 0.15), (0.015, 6.0)]

    def factors(seed, n=40000, length=0.085):
        noise, t, out = StepNoise(parts, random.Random(seed)), 0.0, []
        for _ in range(n):
            out.append(noise.factor(t, length))
            t += length * out[-1]
        return np.array(out)

    a, b = factors(7), factors(7)
    assert (a == b).all()
    assert not (factors(8) == a).all()
    means = [factors(s).mean() for s in range(4)]
    assert np.mean(means) == pytest.approx(1.0, abs=0.02)
    logs = np.log(factors(3))
    expected = math.sqrt(sum(v * float(window_var(tau, 0.085)) for v, tau in parts))
    assert logs.std() == pytest.approx(expected, rel=0.1)
    # a slow step is followed by slow steps (the trace that motivated this: 0.74 on the CPU)
    assert np.corrcoef(logs[:-1], logs[1:])[0, 1] > 0.5
    assert StepNoise(parts, random.Random(0)).factor(0.0, 0.0) == 1.0
