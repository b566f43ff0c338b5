"""pdserve.sim.validation (refit, measured_runs, gpu_runs): which steps a refitted step model sees
(the profile's own, one repeat's runs, a window of the trace)."""

import json
from pathlib import Path

import pytest

from pdserve.engine.step_trace import Step, StepTraceWriter
from pdserve.sim.validation import gpu_runs, measured_runs, refit

pytestmark = pytest.mark.unit


def engine(step_s: float, t0: float, steps: int, batch: int = 4) -> list[Step]:
    """Back-to-back decode steps of `step_s` each from `t0`."""
    return [Step(t0 + step_s * (i + 1), 0, 0, batch, pending=batch) for i in range(steps)]


def write_trace(directory: Path, steps: list[Step]) -> Path:
    writer = StepTraceWriter(directory, "colocated-0")
    for s in steps:
        writer.record(s)
    writer.close()
    return directory


def test_runs_are_placed_on_the_trace_clock_and_fitted_alone(tmp_path):
    # A quiet profile (10 ms steps, t 0-2 s), then two runs under load: 20 ms steps from
    # t=100 s for 10 s and 30 ms steps from t=200 s for 10 s. Wall-clock starts 100 s apart.
    steps = engine(0.010, 0.0, 200) + engine(0.020, 100.0, 500) + engine(0.030, 200.0, 333)
    traces = {"colocated-0": steps}
    runs = [{"date": "20261127-110000", "duration": 10.0},
            {"date": "20261127-110140", "duration": 10.0}]
    windows = refit.run_windows(traces, runs)
    assert windows[1][1] == pytest.approx(210.0, abs=1.1)
    assert windows[0][0] == pytest.approx(99.0, abs=1.1)
    first = refit.fitted_on_runs({}, traces, [windows[0]])["step_fit"]
    assert first["decode_step_s"] + 4 * first["decode_step_per_seq_s"] == pytest.approx(0.020)
    second = refit.fitted_on_runs({}, traces, [windows[1]])["step_fit"]
    assert second["decode_step_s"] + 4 * second["decode_step_per_seq_s"] == pytest.approx(0.030)
    # The profile's own steps: everything before the first run.
    own = refit.refitted_profile({"step_fit": {"since": 0.0}}, traces, runs)["step_fit"]
    assert own["decode_step_s"] + 4 * own["decode_step_per_seq_s"] == pytest.approx(0.010)
    assert own["recorded_fit"] == {"since": 0.0}


def test_a_profile_is_refitted_on_its_recorded_steps_or_a_given_window(tmp_path):
    trace = write_trace(tmp_path / "steps", engine(0.010, 0.0, 200) + engine(0.030, 100.0, 200))
    profile = {"step_fit": {"decode_step_s": 1.0, "since": 50.0}}
    later = refit.refit(profile, trace)["step_fit"]
    assert later["decode_step_s"] + 4 * later["decode_step_per_seq_s"] == pytest.approx(0.030)
    assert later["recorded_fit"] == profile["step_fit"]
    early = refit.refit(profile, trace, since=0.0, until=10.0)["step_fit"]
    assert early["decode_step_s"] + 4 * early["decode_step_per_seq_s"] == pytest.approx(0.010)
    # A packed trace (proof.sh's profile-steps.tar.xz) reads the same.
    import tarfile
    packed = tmp_path / "profile-steps.tar.xz"
    with tarfile.open(packed, "w:xz") as tar:
        tar.add(trace, arcname="steps")
    assert refit.refit(profile, packed)["step_fit"]["steps"] == later["steps"]
    json.dumps(later)  # what the script writes


def bench_json(rate, ttfts, latencies, outputs, duration, slo=None):
    n = len(ttfts)
    return {"request_rate": rate, "duration": duration, "input_lens": [100] * n,
            "output_lens": outputs, "start_times": [float(i) for i in range(n)], "ttfts": ttfts,
            "itls": [[0.1] * (o - 1) for o in outputs], "latencies": latencies,
            "errors": [""] * n, "goodput_slos": slo or {"ttft": 500.0, "tpot": 200.0}}


def test_pooled_repeats_score_every_request_of_a_rate_together():
    from pdserve.slo import SloTargets

    slo = SloTargets(ttft_ms=500.0, tpot_ms=200.0)
    r1 = bench_json(1.0, [0.2, 0.4, 0.6], [1.1, 1.3, 1.5], [10, 10, 10], 4.0)
    r2 = bench_json(1.0, [0.8, 1.0], [1.7, 1.9], [10, 10], 6.0)
    one = measured_runs.pooled_metrics(measured_runs.measured_outcomes(r1), 4.0, slo)
    assert one["median_ttft_ms"] == pytest.approx(400.0)
    assert one["request_goodput"] == pytest.approx(2 / 4.0)  # 0.2 and 0.4 s meet 500 ms
    pooled = measured_runs.measured_outcomes(r1) + measured_runs.measured_outcomes(r2)
    both = measured_runs.pooled_metrics(pooled, 10.0, slo)
    assert both["median_ttft_ms"] == pytest.approx(600.0)  # the median of all five requests
    assert both["median_tpot_ms"] == pytest.approx(100.0)  # (1.1 - 0.2) / 9, and so on
    assert both["request_goodput"] == pytest.approx(2 / 10.0)
    assert both["output_throughput"] == pytest.approx(50 / 10.0)


def prefill_engine(t0: float, groups: int, handoff: float) -> list[Step]:
    """A prefill engine's steps of 2048-token prompts at 3 ms + tokens / 40k: in each group, a
    step after a pause, then one 10 ms after it that runs `handoff` longer per prompt the step
    before prefilled (pulled meanwhile); one prompt then two in even groups, two then one in
    odd ones."""
    steps, t = [], t0
    for g in range(groups):
        first, second = (1, 2) if g % 2 == 0 else (2, 1)
        busy = 0.003 + first * 2048 / 40000
        t += 1.0 + busy
        steps.append(Step(t, first * 2048, first, 0, busy_s=busy, pending=0))
        busy = 0.003 + second * 2048 / 40000 + handoff * first
        t += 0.010 + busy
        steps.append(Step(t, second * 2048, second, 0, busy_s=busy, pending=0))
    return steps


def test_the_handoff_is_fitted_on_other_runs_prefill_engines(tmp_path):
    runs = []
    for i, handoff in enumerate((0.0008, 0.0010)):
        writer = StepTraceWriter(tmp_path / f"run{i}", "prefill-0")
        for s in prefill_engine(100.0 * i, 12, handoff):
            writer.record(s)
        writer.close()
        runs.append(tmp_path / f"run{i}")
    assert refit.handoff_of(runs) == pytest.approx(0.0009, abs=1e-6)
    colocated = write_trace(tmp_path / "colocated", engine(0.010, 0.0, 50))
    with pytest.raises(ValueError, match="no prefill engine"):
        refit.handoff_of([colocated])


def test_with_step_noise_each_metric_is_the_median_over_the_seeds_with_its_range():
    measured = {"median_ttft_ms": 100.0, "p90_ttft_ms": 200.0}
    sims = [{"median_ttft_ms": v, "p90_ttft_ms": 2 * v} for v in (90.0, 130.0, 110.0)]
    row = measured_runs.compare_seeds(sims, measured)
    assert row["median_ttft_ms"]["sim"] == 110.0 and row["median_ttft_ms"]["sim_range"] == [90.0, 130.0]
    assert row["p90_ttft_ms"]["error_pct"] == pytest.approx(10.0)
    # one simulation (no noise): the plain comparison, no range
    assert measured_runs.compare_seeds(sims[:1], measured) == measured_runs.compare(sims[0], measured)


def test_the_gpu_validation_takes_the_median_of_the_seeded_runs():
    runs = [{"median_ttft_ms": t, "p90_ttft_ms": t, "median_tpot_ms": 8.0, "p90_tpot_ms": 9.0,
             "request_throughput": 10.0, "slo_attainment": {"all": a}, "failed": f}
            for t, a, f in ((50.0, 0.9, 0), (70.0, 0.7, 2), (60.0, 0.8, 0), (65.0, 0.95, 0))]
    out = gpu_runs.median_result(runs)
    assert out["median_ttft_ms"] == 62.5 and out["slo_attainment"]["all"] == pytest.approx(0.85)
    assert out["failed"] == 2 and out["request_throughput"] == 10.0
