"""Simulator speed: simulated requests per wall-clock second on one core, and what the issue's
target (a day at 10k requests/s over 1000 GPUs = 864M requests) would take at that speed.

Per-request simulator (DES) scenarios below, and the fluid mode's (pdserve.sim.fluid):
`fluid-global:SECONDS` is 1000 colocated engines at a flat 10k req/s for that long, and
`fluid-day` the whole target day (a diurnal curve peaking at 10k req/s, or `--flat-day` for a
flat 10k), autoscaled, one process, one core. How far the two modes agree on the same moderate
workloads is benchmarks/sim_fluid_agreement.py.

Traffic: the chat shape (Azure conversation statistics) on the H200 / Llama-3.1-8B profile at
10 requests/s per engine (the target's density: 10k req/s over 1000 GPUs), colocated engines,
production routing on every request. Scenarios:
- `global`: all 1000 engines behind one RequestLedger (what the target literally asks);
- `cell16` / `cell4`: one sampled cell of 16 or 4 engines (pdserve.sim.cells), whose result
  stands for the whole deployment: a day of the target needs one cell-day of 1/cells traffic.

    .venv/bin/python benchmarks/sim_speed.py --out benchmarks/results/sim/speed.json
    .venv/bin/python benchmarks/sim_speed.py --scenarios cell4:300 fluid-global:120 fluid-day \
        --out benchmarks/results/sim/2026-11-26-speed/speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.slo import SloTargets  # noqa: E402
from pdserve.sim.engine_profile import EngineProfile, h200_kv_blocks  # noqa: E402
from pdserve.sim.results import LatencyRecorder  # noqa: E402
from pdserve.sim.runner import SimConfig, Simulation, Topology  # noqa: E402
from pdserve.sim.workload import at_rate  # noqa: E402

CALIBRATION = Path(__file__).resolve().parent / "profiles/h200-vllm0.24-llama8b.json"
TARGET_REQUESTS = 10_000 * 86_400
TARGET_GPUS = 1000


def measure(engines: int, seconds: float, profile: EngineProfile) -> dict:
    rate = 10.0 * engines
    count = int(rate * seconds)
    wl = at_rate("chat", count, rate, seed=0)
    sim = Simulation(SimConfig(profile, Topology.colocated(engines), SloTargets.from_s(0.5, 0.05),
                               record_itls=False, keep_requests=False))
    sim.on_request_done = LatencyRecorder(count, profile.response_of)
    started = time.process_time()
    wall = time.perf_counter()
    run = sim.run(wl)
    cpu = time.process_time() - started
    wall = time.perf_counter() - wall
    per_s = count / cpu
    wall_per_s = count / wall
    cells = TARGET_GPUS / engines
    one_cell_requests = TARGET_REQUESTS / cells
    return {"engines": engines, "request_rate": rate, "requests": count,
            "simulated_s": run.end_s, "events": run.events, "cpu_s": cpu, "wall_s": wall,
            "simulated_requests_per_cpu_s": per_s, "simulated_requests_per_wall_s": wall_per_s,
            "target_cells": cells,
            "target_hours_one_sampled_cell": one_cell_requests / per_s / 3600,
            "target_hours_every_cell": TARGET_REQUESTS / per_s / 3600}


def measure_fluid(name: str, seconds: float, profile: EngineProfile, flat_day: bool) -> dict:
    """1000 engines at the target density, fluid mode; `fluid-day` autoscales over a day."""
    from pdserve.autoscaler.policy import PoolBounds
    from pdserve.sim.arrivals import CurveArrivals, flat
    from pdserve.sim.fluid import FluidConfig, FluidSimulation
    from pdserve.sim.workload import diurnal

    if name == "fluid-day":
        curve = flat(10_000.0, 86_400.0) if flat_day else diurnal(10_000.0, 0.25)
        topology = Topology.colocated(TARGET_GPUS, PoolBounds(100, TARGET_GPUS))
    else:
        curve = flat(10_000.0, seconds)
        topology = Topology.colocated(TARGET_GPUS)
    fluid = FluidConfig(step_s=1.0, max_groups=4, cohort_per_engine=4.0, resolve_every_s=5.0)
    sim = FluidSimulation(SimConfig(profile, topology, SloTargets.from_s(0.3, 0.03)), fluid,
                          SloTargets(ttft_ms=300, tpot_ms=30))
    started = time.process_time()
    wall = time.perf_counter()
    run = sim.run(CurveArrivals(curve, "chat", seed=0))
    cpu = time.process_time() - started
    wall = time.perf_counter() - wall
    body = run.summary()
    keep = ("completed", "failed", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "slo_attainment")
    return {"engines": TARGET_GPUS, "curve": "flat 10k/s" if flat_day or name != "fluid-day"
            else "diurnal, peak 10k/s, trough 2.5k/s", "requests": run.requests,
            "simulated_s": run.end_s, "cpu_s": cpu, "wall_s": wall,
            "simulated_requests_per_cpu_s": run.requests / cpu,
            "simulated_requests_per_wall_s": run.requests / wall,
            "target_hours_every_cell": TARGET_REQUESTS / (run.requests / cpu) / 3600,
            "target_hours_one_sampled_cell": TARGET_REQUESTS / (run.requests / cpu) / 3600,
            "gpu_hours": run.gpu_hours(), "scaling_decisions": len(run.decisions),
            "fluid": body["simulation"]["fluid"], **{k: body.get(k) for k in keep}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", nargs="+", default=["cell4:300", "cell16:120", "global:1"],
                        help="name:simulated-seconds; name is cellN, global, fluid-global or "
                        "fluid-day (a whole day, no seconds)")
    parser.add_argument("--flat-day", action="store_true",
                        help="fluid-day at a flat 10k req/s instead of the diurnal curve")
    args = parser.parse_args()
    data = json.loads(CALIBRATION.read_text())
    profile = EngineProfile.from_json(data, num_kv_blocks=h200_kv_blocks(data), block_size=16,
                                      max_num_batched_tokens=8192, name="h200-llama8b")
    results = {}
    for spec in args.scenarios:
        name, _, seconds = spec.partition(":")
        if name.startswith("fluid"):
            results[name] = r = measure_fluid(name, float(seconds or 0), profile, args.flat_day)
            print(f"{name:>12}: {r['requests']} requests ({r['simulated_s']:.0f} s simulated, "
                  f"{r['curve']}) in {r['cpu_s']:.1f} CPU s, {r['wall_s']:.1f} wall s = "
                  f"{r['simulated_requests_per_cpu_s']:.0f} req/CPU-s "
                  f"({r['simulated_requests_per_wall_s']:.0f} req/wall-s); target day: "
                  f"{r['target_hours_every_cell'] * 60:.1f} min", flush=True)
            continue
        engines = TARGET_GPUS if name == "global" else int(name.removeprefix("cell"))
        results[name] = measure(engines, float(seconds), profile)
        r = results[name]
        print(f"{name:>7}: {r['engines']} engines, {r['requests']} requests ({r['simulated_s']:.0f} s "
              f"simulated) in {r['cpu_s']:.1f} CPU s = {r['simulated_requests_per_cpu_s']:.0f} "
              f"req/CPU-s; target day: {r['target_hours_one_sampled_cell']:.2f} h for one sampled "
              f"cell, {r['target_hours_every_cell']:.0f} h for all", flush=True)
    load = os.getloadavg()
    out = {"command": " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores "
           f"(shared; load average {load[0]:.1f} at the end)", "python": platform.python_version(),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'scenario':<14}{'requests':>12}{'req/CPU-s':>12}{'req/wall-s':>12}{'target day':>14}")
    for name, r in results.items():
        print(f"{name:<14}{r['requests']:>12}{r['simulated_requests_per_cpu_s']:>12.0f}"
              f"{r.get('simulated_requests_per_wall_s', 0):>12.0f}"
              f"{r['target_hours_every_cell']:>12.2f} h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
