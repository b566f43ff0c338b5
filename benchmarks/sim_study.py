"""Study: pdserve's autoscaler vs static provisioning for peak vs a reactive TTFT-only rule,
over a bursty day of traffic at large scale, in the simulator.

Deployment: H200 engines with the Llama-3.1-8B calibration profile (`profiles/`, a copy of
../shared/calibration), colocated, long-context requests (the harness's `summarization` shape:
Mooncake conversation trace statistics, mean 12k prompt / 343 output tokens). Traffic: a diurnal
curve peaking at `--peak-rate` req/s at 14:00 with a trough of 25% at 02:00, plus `--bursts`
random surges of 2x for 10 minutes (1-minute ramps). SLO: TTFT <= 1500 ms and TPOT <= 30 ms
(router, autoscaler and attainment alike). The deployment is simulated as one sampled cell of
1/`--cells` of engines and traffic (pdserve.sim.cells); GPU-hours are multiplied back. Engine
start-up: the profile's 38.8 s (vLLM start on a warm node; node provisioning is not included).

Arms (bounds and static sizes are per cell; x cells for the deployment):
- static-peak: enough engines for the burst peak all day (7: the smallest colocated size with
  >= 99% attainment at 2 x 6 req/s, found with pdserve.sim.search);
- static-base: enough for the diurnal peak without bursts (4: >= 99% at 6 req/s);
- pdserve: the production Autoscaler (policy.decide), bounds [1, max], from 2 engines;
- ttft-only: reactive p99-TTFT rule (pdserve.sim.baselines), same bounds and start;
- pdserve-tuned: the production autoscaler with a stricter scale-down (downscale_utilization
  0.3, 12 intervals) and a floor of 2 engines per cell;
- pdserve-disagg: the same tuned policy on a disaggregated deployment (prefill 1-8, decode 1-4
  per cell, from 2P1D), each pool scaled on its own signals.

    .venv/bin/python benchmarks/sim_study.py --out benchmarks/results/sim/study --arm pdserve \
        --seeds 0 1 2 3 4
    ... (one process per arm; they are independent) ...
    .venv/bin/python benchmarks/sim_study.py --out benchmarks/results/sim/study --report

One day is one draw: the surges fall at other hours and the arrivals differ with `--seeds`, and
an autoscaled arm's GPU-hours move by a fifth between days (a decision taken a minute earlier
or later changes the rest of the day). So every arm runs the same days, and the report puts
each arm's spread over them beside the first day's full table: the first seed's run is kept
whole (`ARM.json`: every scaling decision, pool sizes over time; `study.png`), every seed's
summary in `seeds/ARM-seedS.json`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.autoscaler.policy import PoolBounds, ScalingPolicy  # noqa: E402
from pdserve.bench.metrics import SLOTargets  # noqa: E402
from pdserve.bench.report import save_json  # noqa: E402
from pdserve.scheduler.routing import SloTargets  # noqa: E402
from pdserve.sim.cells import scale_totals  # noqa: E402
from pdserve.sim.engine_profile import EngineProfile, h200_kv_blocks  # noqa: E402
from pdserve.sim.results import LatencyRecorder, run_json  # noqa: E402
from pdserve.sim.runner import SimConfig, Simulation, Topology  # noqa: E402
from pdserve.sim.workload import bursty, diurnal, from_curve  # noqa: E402

CALIBRATION = Path(__file__).resolve().parent / "profiles/h200-vllm0.24-llama8b.json"
SHAPE = "summarization"
SLO = SloTargets(ttft_s=1.5, tpot_s=0.03)
GOODPUT = SLOTargets(ttft_ms=1500, tpot_ms=30)
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


def profile() -> EngineProfile:
    data = json.loads(CALIBRATION.read_text())
    return EngineProfile.from_json(data, num_kv_blocks=h200_kv_blocks(data), block_size=16,
                                   max_num_batched_tokens=8192, name="h200-vllm0.24-llama8b")


def day_curve(args, seed: int):
    return bursty(diurnal(args.peak_rate), args.bursts, 2.0, 600.0, 60.0, seed=seed)


def workload(args, seed: int):
    curve = day_curve(args, seed)
    cell_curve = curve.scaled(1.0 / args.cells)
    # Thinning the whole day's arrivals would need all of them in memory; a Poisson process
    # thinned by 1/cells is the Poisson process of the scaled curve, so draw that directly.
    return curve, from_curve(cell_curve, SHAPE, seed=seed)


@functools.cache
def source_commit() -> str:
    """The commit the study ran on ("+dirty" with uncommitted changes), so a recorded result can be
    told from the code that would produce it today."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pdserve", "benchmarks/sim_study.py"],
                               cwd=root, check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_day(args, seed: int) -> dict:
    start, bounds, scaler, changes = ARMS[args.arm]
    curve, wl = workload(args, seed)
    if isinstance(start, dict):
        topo = Topology(start, {p: PoolBounds(*b) for p, b in bounds.items()})
    else:
        topo = Topology.colocated(start, PoolBounds(*bounds) if bounds else None)
    config = SimConfig(profile(), topo, SLO, scaling=ScalingPolicy(**changes),
                       autoscaler=scaler or "pdserve", autoscale_interval_s=10.0,
                       record_itls=False, keep_requests=False)
    sim = Simulation(config)
    rec = LatencyRecorder(len(wl), config.profile.response_of)
    sim.on_request_done = rec
    cpu = time.process_time()
    run = sim.run(wl)
    cpu = time.process_time() - cpu
    body = run_json(run, GOODPUT, (50, 90, 99), recorder=rec, label=args.arm)
    body = scale_totals(body, args.cells)
    body["simulation"].update(cpu_s=cpu, arm=args.arm, seed=seed, commit=source_commit())
    body["hourly"] = hourly(wl.arrivals, rec)
    body["command"] = " ".join(sys.argv)
    print(f"{args.arm} seed {seed}: {len(wl)} requests in {cpu:.0f} CPU s; attainment "
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


def run_arm(args) -> None:
    for i, seed in enumerate(args.seeds):
        body = run_day(args, seed)
        if i == 0:
            save_json(body, args.out / f"{args.arm}.json")
        save_json(day_summary(body), args.out / "seeds" / f"{args.arm}-seed{seed}.json")


def hourly(arrivals: np.ndarray, rec: LatencyRecorder) -> list[dict]:
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


def report(args) -> None:
    rows, bodies = [], {}
    for arm in ARMS:
        path = args.out / f"{arm}.json"
        if not path.exists():
            continue
        b = json.loads(path.read_text())
        bodies[arm] = b
        s = b["simulation"]
        worst = min((h["attainment"] for h in b["hourly"] if h["attainment"] is not None),
                    default=None)
        rows.append(f"| {arm} | {s['gpu_hours']:.0f} | {b['slo_attainment']['all'] * 100:.2f}% "
                    f"| {worst * 100:.1f}% | {b['p99_ttft_ms']:.0f} | {b['p99_tpot_ms']:.1f} "
                    f"| {b['failed']} | {len(s['scaling_decisions'])} | {s['cpu_s']:.0f} |")
    seeds = sorted({b["simulation"].get("seed", 0) for b in bodies.values()})
    head = (f"Day of seed {', '.join(map(str, seeds))}:\n\n"
            "| arm | GPU-hours | SLO attainment (all) | worst hour | p99 TTFT ms | p99 TPOT ms "
            "| failed | scaling decisions (per cell) | CPU s |\n|---|---|---|---|---|---|---|---|---|")
    table = head + "\n" + "\n".join(rows)
    spread = spread_table(args.out / "seeds")
    if spread:
        table += "\n\n" + spread
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    if bodies:
        plot(args, bodies, seeds[0])


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


def plot(args, bodies: dict, seed: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = day_curve(args, seed)
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    t = np.linspace(0, 86400, 2000)
    ax0.plot(t / 3600, curve.rate(t), color="black")
    ax0.set_ylabel("requests/s (deployment)")
    for arm, b in bodies.items():
        pts = [p for p in b["simulation"]["pool_sizes"]]
        times = sorted({p["t_s"] for p in pts})
        total: dict[float, int] = {}
        for p in pts:  # disaggregated runs sample each pool: add them up per time
            total[p["t_s"]] = total.get(p["t_s"], 0) + p["ready"] + p["starting"] + p["draining"]
        ax1.step([t / 3600 for t in times], [total[t] * args.cells for t in times],
                 where="post", label=arm)
        hrs = b["hourly"]
        ax2.plot([h["hour"] + 0.5 for h in hrs], [h["attainment"] for h in hrs], marker="o",
                 label=arm)
    ax1.set_ylabel("GPUs provisioned")
    ax1.legend(fontsize=8)
    ax2.set_ylabel("hourly SLO attainment")
    ax2.set_xlabel("hour of day")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "study.png", dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm", choices=sorted(ARMS))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--peak-rate", type=float, default=600.0)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="days to simulate (surge times and arrivals); the first is kept whole")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        run_arm(args)
    if args.report:
        report(args)
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
