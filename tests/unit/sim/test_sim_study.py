"""pdserve.sim.study (benchmarks/sim_study.py): days under a seed, the spread over days, and the recorded study."""

import json
from pathlib import Path

import pytest

from pdserve.sim import study

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
RECORDED = BENCHMARKS / "results" / "sim" / "study"
CALIBRATION = BENCHMARKS / "profiles" / "h200-vllm0.24-llama8b.json"


def day(arm: str, seed: int, cells: int = 1000) -> dict:
    """One arm's day at the study's traffic (600 req/s peak, 6 bursts), as `day_summary` gives it."""
    traffic = study.Traffic(peak_rate=600.0, bursts=6, cells=cells)
    return study.day_summary(study.run_day(arm, traffic, seed, study.h200_profile(CALIBRATION)))


def test_a_day_repeats_under_its_seed_and_another_seed_is_another_day():
    a = day("pdserve", seed=3)
    b = day("pdserve", seed=3)
    c = day("pdserve", seed=4)
    for key in ("gpu_hours", "slo_attainment", "completed", "scaling_decisions", "hourly_attainment"):
        assert a[key] == b[key]
    assert a["completed"] != c["completed"]  # other arrivals
    assert a["seed"] == 3 and a["arm"] == "pdserve" and len(a["hourly_attainment"]) == 24
    assert sum(a["decision_reasons"].values()) == a["scaling_decisions"] > 0


def _day(folder: Path, arm: str, seed: int, gpu_hours: float, attainment: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{arm}-seed{seed}.json").write_text(json.dumps({
        "arm": arm, "seed": seed, "commit": "abc", "command": "x", "gpu_hours": gpu_hours,
        "slo_attainment": {"all": attainment}, "worst_hour": attainment - 0.01, "failed": seed,
        "scaling_decisions": 10 * seed}))


def test_spread_over_the_days_every_arm_ran_against_static_peak_on_the_same_day(tmp_path):
    for seed, (peak, auto) in enumerate([(100, 50), (200, 150), (100, 80)]):
        _day(tmp_path, "static-peak", seed, peak, 0.999)
        _day(tmp_path, "pdserve", seed, auto, 0.98 + seed / 100)
    _day(tmp_path, "pdserve", 9, 1.0, 0.5)  # a day static-peak did not run: left out
    table = study.spread_table(tmp_path)
    assert "Over 3 days (seeds 0, 1, 2; commit abc)" in table
    row = next(line for line in table.splitlines() if line.startswith("| pdserve |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "80 [50 - 150]"
    assert cells[2] == "-25% [-50% - -20%]"  # 50/100, 150/200, 80/100 on their own days
    assert cells[3] == "99.00% [98.00% - 100.00%]"
    assert cells[5] == "1 [0 - 2]" and cells[6] == "10 [0 - 20]"
    assert study.spread_table(tmp_path / "none") == ""


def test_the_recorded_study_is_what_the_code_gives_today():
    """The recorded first day of the tuned arm, simulated again: any change to the simulator or the
    production policy that moves it must re-record the study (its README section gives the
    commands), so the results never describe code that no longer exists."""
    recorded = json.loads((RECORDED / "seeds" / "pdserve-tuned-seed0.json").read_text())
    if not CALIBRATION.exists():
        pytest.fail(f"{CALIBRATION} is missing")
    now = day("pdserve-tuned", seed=0, cells=100)
    stale = (f"benchmarks/results/sim/study was recorded on {recorded['commit']} and no longer "
             f"matches the code: re-record it (benchmarks/results/sim/README.md, section 3)")
    assert now["completed"] == recorded["completed"], stale
    assert now["scaling_decisions"] == recorded["scaling_decisions"], stale
    assert now["gpu_hours"] == pytest.approx(recorded["gpu_hours"], rel=1e-9), stale
    assert now["slo_attainment"]["all"] == pytest.approx(recorded["slo_attainment"]["all"], rel=1e-9), stale
