"""Fluid mode vs the per-request simulator (DES) on workloads small enough for the DES.

The same requests (one seeded workload) go through `Simulation` (per request) and
`FluidSimulation` (steps, cohorts, engine groups) on the H200 / Llama-3.1-8B profile; the table
gives TTFT / TPOT p50/p90/p99, SLO attainment, goodput and GPU-hours of each and the relative
difference of fluid from DES. Workloads:
- `colocated`: 4 colocated engines, chat shape, Poisson 40 req/s;
- `disaggregated`: 2P4D, chat shape, Poisson 40 req/s (prefill pool ~50% busy);
- `autoscaled`: colocated, autoscaled 1..8 engines from 2, chat at 20 req/s with three
  surges to 3x over 40 minutes (GPU-hours and scaling decisions come from the autoscaler).

    .venv/bin/python benchmarks/sim_fluid_agreement.py --out benchmarks/results/sim/2026-11-26-speed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.autoscaler.policy import PoolBounds  # noqa: E402
from pdserve.slo import SloTargets  # noqa: E402
from pdserve.sim.arrivals import WorkloadArrivals  # noqa: E402
from pdserve.sim.engine_profile import EngineProfile  # noqa: E402
from pdserve.sim.fluid import FluidConfig, FluidSimulation  # noqa: E402
from pdserve.sim.results import LatencyRecorder, run_json  # noqa: E402
from pdserve.sim.runner import SimConfig, Simulation, Topology  # noqa: E402
from pdserve.sim.workload import RateCurve, at_rate, bursty, from_curve  # noqa: E402

CALIBRATION = Path(__file__).resolve().parent / "profiles/h200-vllm0.24-llama8b.json"
METRICS = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
           "p99_tpot_ms", "attainment", "request_goodput", "gpu_hours")
SLO = SloTargets.from_s(0.1, 0.008)  # tight enough that attainment is not trivially 1 (H200: ~40 ms / 6 ms)
GOODPUT = SloTargets(ttft_ms=100, tpot_ms=8)


def workloads():
    yield "colocated", Topology.colocated(4), at_rate("chat", 8000, 40.0, seed=1)
    yield "disaggregated", Topology.disaggregated(2, 4), at_rate("chat", 8000, 40.0, seed=2)
    surges = bursty(RateCurve((0.0, 2400.0), (20.0, 20.0)), 3, 3.0, 240.0, seed=3)
    yield ("autoscaled", Topology.colocated(2, PoolBounds(1, 8)),
           from_curve(surges, "chat", seed=3))


def flatten(body: dict) -> dict:
    out = {k: body.get(k) for k in METRICS if k in body}
    out["attainment"] = body["slo_attainment"]["all"]
    out["gpu_hours"] = body["simulation"]["gpu_hours"]
    out["completed"] = body["completed"]
    out["failed"] = body["failed"]
    out["scaling_decisions"] = len(body["simulation"]["scaling_decisions"])
    return out


def compare(name: str, topology: Topology, workload, profile: EngineProfile) -> dict:
    config = SimConfig(profile, topology, SLO, record_itls=False, keep_requests=False)
    sim = Simulation(config)
    recorder = LatencyRecorder(len(workload), profile.response_of)
    sim.on_request_done = recorder
    wall = time.perf_counter()
    des = flatten(run_json(sim.run(workload), GOODPUT, recorder=recorder))
    des_wall = time.perf_counter() - wall
    wall = time.perf_counter()
    fluid_run = FluidSimulation(config, FluidConfig(), GOODPUT).run(WorkloadArrivals(workload))
    fluid = flatten(fluid_run.summary())
    fluid_wall = time.perf_counter() - wall
    diff = {k: (fluid[k] - des[k]) / des[k] if des[k] else None for k in METRICS}
    return {"workload": name, "topology": topology.name, "requests": len(workload),
            "des": des, "fluid": fluid, "relative_difference": diff,
            "wall_s": {"des": des_wall, "fluid": fluid_wall}}


def table(rows: list[dict]) -> str:
    head = "| workload | metric | DES | fluid | fluid vs DES |\n|---|---|---|---|---|\n"
    lines = []
    for r in rows:
        for k in METRICS:
            d = r["relative_difference"][k]
            lines.append(f"| {r['workload']} ({r['topology']}, {r['requests']} req) | {k} | "
                         f"{r['des'][k]:.4g} | {r['fluid'][k]:.4g} | "
                         f"{'' if d is None else f'{d:+.1%}'} |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="folder for agreement.json/.md")
    args = parser.parse_args()
    data = json.loads(CALIBRATION.read_text())
    profile = EngineProfile.from_json(data, num_kv_blocks=52900, name="h200-llama8b")
    rows = []
    for name, topology, workload in workloads():
        rows.append(compare(name, topology, workload, profile))
        print(f"{name}: done ({rows[-1]['wall_s']})", flush=True)
    md = table(rows)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agreement.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "slo_s": [SLO.ttft_s, SLO.tpot_s],
         "goodput_ms": GOODPUT.as_dict(), "rows": rows}, indent=1) + "\n")
    (args.out / "agreement.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
