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
summary in `seeds/ARM-seedS.json`. The study's days are pdserve.sim.study.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import save_json  # noqa: E402
from pdserve.sim.study import (  # noqa: E402
    ARMS, Traffic, day_curve, day_summary, h200_profile, run_day, spread_table,
)

CALIBRATION = Path(__file__).resolve().parent / "profiles/h200-vllm0.24-llama8b.json"


def traffic(args: argparse.Namespace) -> Traffic:
    return Traffic(args.peak_rate, args.bursts, args.cells)


def run_arm(args) -> None:
    profile = h200_profile(CALIBRATION)
    for i, seed in enumerate(args.seeds):
        body = run_day(args.arm, traffic(args), seed, profile, command=" ".join(sys.argv))
        if i == 0:
            save_json(body, args.out / f"{args.arm}.json")
        save_json(day_summary(body), args.out / "seeds" / f"{args.arm}-seed{seed}.json")


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


def plot(args, bodies: dict, seed: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = day_curve(traffic(args), seed)
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
