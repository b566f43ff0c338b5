"""Study: pdserve's autoscaler vs static provisioning for peak vs a reactive TTFT-only rule,
over a bursty day of traffic at large scale, in the simulator.

Deployment: H200 engines with the Llama-3.1-8B calibration profile (../shared/calibration),
colocated, long-context requests (the harness's `summarization` shape: Mooncake conversation
trace statistics, mean 12k prompt / 343 output tokens). Traffic: a diurnal curve peaking at
`--peak-rate` req/s at 14:00 with a trough of 25% at 02:00, plus `--bursts` random surges of 2x
for 10 minutes (1-minute ramps). SLO: TTFT <= 1500 ms and TPOT <= 30 ms (router, autoscaler and
attainment alike). The deployment is simulated as one sampled cell of 1/`--cells` of engines
and traffic (pdserve.sim.cells); GPU-hours are multiplied back. Engine start-up: the profile's
38.8 s (vLLM start on a warm node; node provisioning is not included).

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

    .venv/bin/python benchmarks/sim_study.py --out benchmarks/results/sim/study --arm pdserve
    ... (one process per arm; they are independent) ...
    .venv/bin/python benchmarks/sim_study.py --out benchmarks/results/sim/study --report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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

CALIBRATION = Path(__file__).resolve().parents[2] / "shared/calibration/h200-vllm0.24-llama8b.json"
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


def workload(args):
    curve = bursty(diurnal(args.peak_rate), args.bursts, 2.0, 600.0, 60.0, seed=args.seed)
    cell_curve = curve.scaled(1.0 / args.cells)
    # Thinning the whole day's arrivals would need all of them in memory; a Poisson process
    # thinned by 1/cells is the Poisson process of the scaled curve, so draw that directly.
    return curve, from_curve(cell_curve, SHAPE, seed=args.seed)


def run_arm(args) -> None:
    start, bounds, scaler, changes = ARMS[args.arm]
    curve, wl = workload(args)
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
    body["simulation"]["cpu_s"] = cpu
    body["simulation"]["arm"] = args.arm
    body["hourly"] = hourly(wl.arrivals, rec)
    body["command"] = " ".join(sys.argv)
    save_json(body, args.out / f"{args.arm}.json")
    print(f"{args.arm}: {len(wl)} requests in {cpu:.0f} CPU s; attainment "
          f"{body['slo_attainment']}; GPU-h {body['simulation']['gpu_hours']:.0f}", flush=True)


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
    head = ("| arm | GPU-hours | SLO attainment (all) | worst hour | p99 TTFT ms | p99 TPOT ms "
            "| failed | scaling decisions (per cell) | CPU s |\n|---|---|---|---|---|---|---|---|---|")
    table = head + "\n" + "\n".join(rows)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    plot(args, bodies)


def plot(args, bodies: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, _ = workload(argparse.Namespace(**{**vars(args), "cells": args.cells}))
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
    parser.add_argument("--seed", type=int, default=0)
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
