"""The bursty-day study: pdserve's autoscaler against static provisioning and a reactive rule.

A day of diurnal traffic with random 2x surges (`Traffic`) is simulated for one arm (`ARMS`) on H200
engines with the Llama-3.1-8B calibration profile (`h200_profile`), as one sampled cell of
1/`cells` of the engines and the traffic (pdserve.sim.cells), GPU-hours multiplied back.
`run_day` gives the day's result; `day_summary` what the spread over days needs; `spread_table`
each arm over the days every arm ran, against static-peak on the same day. The arms, the SLO and
the program that records and reports the study are in `benchmarks/sim_study.py`.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.autoscaler.policy import PoolBounds, ScalingPolicy
from pdserve.slo import SloTargets
from pdserve.sim.cells import scale_totals
from pdserve.sim.engine_profile import EngineProfile, h200_kv_blocks
from pdserve.sim.results import LatencyRecorder, run_json
from pdserve.sim.runner import SimConfig, Simulation, Topology
from pdserve.sim.workload import RateCurve, Workload, bursty, diurnal, from_curve

SHAPE = "summarization"
SLO = SloTargets.from_s(1.5, 0.03)
GOODPUT = SloTargets(ttft_ms=1500, tpot_ms=30)
ARMS = {  # name: (initial engines per cell, bounds per cell or None, autoscaler, policy changes)
    "static-peak": (7, None, None, {}),
    "static-base": (4, None, None, {}),
    "pdserve": (2, (1, 10), "pdserve", {}),
    "ttft-only": (2, (1, 10), "ttft_only", {}),
    # The production policy with a stricter scale-down rule, floor 2 (what the default arm's
    # flapping at the trough suggests).
    "pdserve-tuned": (2, (2, 10), "pdserve", {"downscale_utilization": 0.3,
                                              "downscale_intervals": 12}),
    # Disaggregated: prefill and decode pools scaled on their own signals (same tuned policy).
    "pdserve-disagg": ({"prefill": 2, "decode": 1}, {"prefill": (1, 8), "decode": (1, 4)},
                       "pdserve", {"downscale_utilization": 0.3, "downscale_intervals": 12}),
}

@dataclass(frozen=True, slots=True)
class Traffic:
    """The deployment's day of traffic, and how finely it is sampled."""

    peak_rate: float = 600.0  # req/s over the whole deployment at 14:00 (the trough is 25% at 02:00)
    bursts: int = 6  # random surges of 2x for 10 minutes (1-minute ramps)
    cells: int = 100  # simulated as one cell of 1/cells of the engines and the traffic


def h200_profile(calibration: Path) -> EngineProfile:
    """The study's engine: the H200 calibration file (benchmarks/profiles/) with vLLM's KV on an
    H200, 16-token blocks and 8192 batched tokens."""
    data = json.loads(calibration.read_text())
    return EngineProfile.from_json(data, num_kv_blocks=h200_kv_blocks(data), block_size=16,
                                   max_num_batched_tokens=8192, name="h200-vllm0.24-llama8b")


def day_curve(traffic: Traffic, seed: int) -> RateCurve:
    """The deployment's request rate over the day of `seed` (the surges fall where the seed says)."""
    return bursty(diurnal(traffic.peak_rate), traffic.bursts, 2.0, 600.0, 60.0, seed=seed)


def workload(traffic: Traffic, seed: int) -> tuple[RateCurve, Workload]:
    """The day's curve, and one cell's arrivals (1/cells of the traffic)."""
    curve = day_curve(traffic, seed)
    cell_curve = curve.scaled(1.0 / traffic.cells)
    # Thinning the whole day's arrivals would need all of them in memory; a Poisson process
    # thinned by 1/cells is the Poisson process of the scaled curve, so draw that directly.
    return curve, from_curve(cell_curve, SHAPE, seed=seed)


@functools.cache
def source_commit() -> str:
    """The commit the study ran on ("+dirty" with uncommitted changes), so a recorded result can be
    told from the code that would produce it today."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pdserve", "benchmarks/sim_study.py"],
                               cwd=root, check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_day(arm: str, traffic: Traffic, seed: int, profile: EngineProfile, command: str = "") -> dict:
    """One arm's day: the harness's result JSON for the whole deployment (cell totals multiplied
    back), with the simulation's record, each hour's attainment and the command that ran it."""
    start, bounds, scaler, changes = ARMS[arm]
    _, wl = workload(traffic, seed)
    if isinstance(start, dict):
        topo = Topology(start, {p: PoolBounds(*b) for p, b in bounds.items()})
    else:
        topo = Topology.colocated(start, PoolBounds(*bounds) if bounds else None)
    config = SimConfig(profile, topo, SLO, scaling=ScalingPolicy(**changes),
                       autoscaler=scaler or "pdserve", autoscale_interval_s=10.0,
                       record_itls=False, keep_requests=False)
    sim = Simulation(config)
    rec = LatencyRecorder(len(wl), config.profile.response_of)
    sim.on_request_done = rec
    cpu = time.process_time()
    run = sim.run(wl)
    cpu = time.process_time() - cpu
    body = run_json(run, GOODPUT, (50, 90, 99), recorder=rec, label=arm)
    body = scale_totals(body, traffic.cells)
    body["simulation"].update(cpu_s=cpu, arm=arm, seed=seed, commit=source_commit())
    body["hourly"] = hourly(wl.arrivals, rec)
    body["command"] = command
    print(f"{arm} seed {seed}: {len(wl)} requests in {cpu:.0f} CPU s; attainment "
          f"{body['slo_attainment']}; GPU-h {body['simulation']['gpu_hours']:.0f}", flush=True)
    return body


def day_summary(body: dict) -> dict:
    """What the spread table needs from one day, without the per-sample series."""
    s = body["simulation"]
    hours = [h["attainment"] for h in body["hourly"] if h["attainment"] is not None]
    return {
        "arm": s["arm"], "seed": s["seed"], "commit": s["commit"], "command": body["command"],
        "gpu_hours": s["gpu_hours"], "gpu_hours_by_pool": s["gpu_hours_by_pool"],
        "slo_attainment": body["slo_attainment"], "worst_hour": min(hours, default=None),
        "hourly_attainment": hours, "p99_ttft_ms": body["p99_ttft_ms"],
        "p99_tpot_ms": body["p99_tpot_ms"], "completed": body["completed"], "failed": body["failed"],
        "scaling_decisions": len(s["scaling_decisions"]),
        "decision_reasons": dict(Counter(d["reason"] for d in s["scaling_decisions"])),
        "cpu_s": s["cpu_s"],
    }


def hourly(arrivals: np.ndarray, rec: LatencyRecorder) -> list[dict]:
    """Each hour of the day: requests arrived, the share meeting both targets, p99 TTFT."""
    ok = ~np.isnan(rec.ttft)
    tpot = np.where(np.isnan(rec.tpot), 0.0, rec.tpot)
    good = ok & (rec.ttft <= SLO.ttft_s) & (tpot <= SLO.tpot_s)
    hours = (arrivals // 3600).astype(int)
    out = []
    for h in range(int(hours.max()) + 1 if len(hours) else 0):
        m = hours == h
        out.append({"hour": h, "requests": int(m.sum()),
                    "attainment": float(good[m].mean()) if m.any() else None,
                    "p99_ttft_ms": float(np.nanpercentile(rec.ttft[m], 99) * 1000)
                    if (m & ok).any() else None})
    return out


def spread_table(folder: Path) -> str:
    """Each arm over the days every arm ran: median [min - max], and its GPU-hours against
    static-peak's on the same day."""
    days: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.glob("*-seed*.json")):
        d = json.loads(path.read_text())
        days.setdefault(d["arm"], {})[d["seed"]] = d
    if not days:
        return ""
    common = sorted(set.intersection(*(set(v) for v in days.values())))
    if not common:
        return ""

    def spread(values, fmt):
        return f"{fmt(statistics.median(values))} [{fmt(min(values))} - {fmt(max(values))}]"

    pct = lambda v: f"{v * 100:.2f}%"  # noqa: E731
    pct1 = lambda v: f"{v * 100:.1f}%"  # noqa: E731
    whole = lambda v: f"{v:.0f}"  # noqa: E731
    ref = days.get("static-peak")
    rows = []
    for arm in ARMS:
        if arm not in days:
            continue
        ds = [days[arm][s] for s in common]
        vs_peak = (spread([d["gpu_hours"] / ref[d["seed"]]["gpu_hours"] - 1 for d in ds],
                          lambda v: f"{v * 100:+.0f}%") if ref else "")
        rows.append(f"| {arm} | {spread([d['gpu_hours'] for d in ds], whole)} | {vs_peak} "
                    f"| {spread([d['slo_attainment']['all'] for d in ds], pct)} "
                    f"| {spread([d['worst_hour'] for d in ds], pct1)} "
                    f"| {spread([d['failed'] for d in ds], whole)} "
                    f"| {spread([d['scaling_decisions'] for d in ds], whole)} |")
    commits = sorted({d["commit"] for v in days.values() for d in v.values()})
    return (f"Over {len(common)} days (seeds {', '.join(map(str, common))}; commit "
            f"{', '.join(commits)}), median [min - max]:\n\n"
            "| arm | GPU-hours | vs static-peak, same day | SLO attainment (all) | worst hour "
            "| failed | scaling decisions (per cell) |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(rows))
