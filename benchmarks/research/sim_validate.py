"""Validate the simulator: predicted vs measured TTFT/TPOT percentiles and goodput.

CPU (this machine): each measured run (a `pdserve bench serve` result JSON) is replayed in the
simulator request for request (its own arrival offsets, prompt and output lengths), on the
topology it ran (colocated x1 or 1P1D), with the engine profile recorded from the CPU service,
and scored with the harness's metrics and the run's goodput SLOs.

Refitted (`--refit-trace DIR`): the profile's step_fit is redone with the current fit code on the
profile's own steps (those before the first measured run), for a profile recorded by older code.

With step noise (`--noise-seeds K`): each run is simulated K times, its steps wandering as the
profile's step trace showed (`step_fit.noise`, pdserve.sim.calibration.step_noise), and each metric's
median over the K is compared; the lowest and highest simulated values are kept (`sim_range`).

On one host (`--shared-host`): the engines ran on one machine, and where the fit found them
slowing each other (`step_fit.interference`, pdserve.sim.calibration.step_interference) a simulated step
that starts while the other engine runs one takes longer (`SimConfig.shared_host`).

Fitted under load (`--fit-trace DIR --fit-run RUN.json...`): the profile's `step_fit` is refitted
on the engines' step traces (`--step-trace` of sim_profile_cpu.py) recorded during the given
runs, and every --measured run is predicted with it; the runs not fitted on are held out (the
table marks the others "(fit)"). With --trace-runs listing every run of the trace, the fit runs
need not be among --measured: fit on one repeat, predict another. On two shared cores the
benchmark client and the frontend slow the engines down, which a profile taken before the load
does not see. A run's steps are found from its wall-clock start and duration, counted back from
the trace's end (the last run).

GPU: the calibration file's `colocated_serving_isl2048_osl256_poisson` table (plain vLLM 0.24 on
one H200, Llama-3.1-8B shape) against the simulator fed the same file's profile, 1000 Poisson
requests of 2048 in / 256 out per rate (vllm bench's default count; the file does not say).

The replay, the comparison and the refits are pdserve.sim.validation (`measured_runs`, `refit`).

    .venv/bin/python benchmarks/research/sim_validate.py --profile benchmarks/results/sim/cpu-profile/colocated.json \\
        --arm colocated --measured benchmarks/results/cpu/2026-11-26-compare/colocated-rate*.json \\
        --out benchmarks/results/sim/validation-colocated
    .venv/bin/python benchmarks/research/sim_validate.py --gpu /work/shared/calibration/h200-vllm0.24-llama8b.json \\
        --out benchmarks/results/sim/validation-gpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.slo import SloTargets  # noqa: E402
from pdserve.bench.report import result_json  # noqa: E402
from pdserve.sim.calibration.trace_reader import read_steps  # noqa: E402
from pdserve.sim.engine_profile import EngineProfile, h200_kv_blocks  # noqa: E402
from pdserve.sim.results import bench_result, run_json  # noqa: E402
from pdserve.sim.runner import SimConfig, Topology, simulate  # noqa: E402
from pdserve.sim.validation.measured_runs import (  # noqa: E402
    METRICS, compare, compare_seeds, measured_outcomes, pooled_metrics, replay, topology,
)
from pdserve.sim.validation.refit import fitted_on_runs, refitted_profile, run_windows  # noqa: E402
from pdserve.sim.workload import at_rate  # noqa: E402


def cpu(args: argparse.Namespace) -> list[dict]:
    data = json.loads(Path(args.profile).read_text())
    if args.refit_trace:
        runs = [json.loads(Path(p).read_text()) for p in args.trace_runs or args.measured]
        data = refitted_profile(data, read_steps(args.refit_trace), runs)
        (args.out / "profile-refitted.json").write_text(json.dumps(data, indent=1))
    if args.fit_trace:
        traces = read_steps(args.fit_trace)
        placed = [str(p) for p in args.trace_runs or args.measured]
        windows = run_windows(traces, [json.loads(Path(p).read_text()) for p in placed])
        data = fitted_on_runs(data, traces, [windows[placed.index(str(p))] for p in args.fit_run])
        (args.out / "profile-fitted-on-run.json").write_text(json.dumps(data, indent=1))
    profile = EngineProfile.from_json(data, name=Path(args.profile).stem)
    rows, pools = [], {}
    for path in args.measured:
        measured = json.loads(Path(path).read_text())
        slo = SloTargets(**{f"{k}_ms": v for k, v in (measured.get("goodput_slos") or {}).items()})
        seeds = range(args.noise_seeds) if args.noise_seeds else [None]
        results = [bench_result(simulate(SimConfig(profile, topology(args.arm), step_noise=seed,
                                                   shared_host=args.shared_host),
                                         replay(measured)), slo, percentiles=(50, 90, 99))
                   for seed in seeds]
        fitted_on = str(path) in {str(p) for p in args.fit_run}
        rows.append({"run": str(path), "arm": args.arm, "rate": measured["request_rate"],
                     "metrics": compare_seeds([result_json(r) for r in results], measured),
                     "fitted_on": fitted_on, **({"noise_seeds": len(seeds)} if args.noise_seeds else {})})
        if args.pool_repeats:
            pool = pools.setdefault(measured["request_rate"], {"runs": [], "slo": slo, "fit": False,
                                                               "measured": [[], 0.0], "sim": [[], 0.0]})
            pool["runs"].append(str(path))
            pool["fit"] |= fitted_on
            pool["measured"][0].extend(measured_outcomes(measured))
            pool["measured"][1] += measured["duration"]
            for result in results:  # with step noise, every seed's requests and durations
                pool["sim"][0].extend(result.outcomes)
                pool["sim"][1] += result.duration_s
    for rate, pool in sorted(pools.items()):
        if len(pool["runs"]) < 2:
            continue
        pooled = {key: pooled_metrics(*pool[key], pool["slo"]) for key in ("measured", "sim")}
        rows.append({"run": "pooled: " + " ".join(pool["runs"]), "arm": args.arm, "rate": rate,
                     "metrics": compare(pooled["sim"], pooled["measured"]), "fitted_on": pool["fit"],
                     "pooled": len(pool["runs"])})
    return rows


def gpu(args: argparse.Namespace) -> list[dict]:
    data = json.loads(Path(args.gpu).read_text())
    table = data["colocated_serving_isl2048_osl256_poisson"]["by_rate_req_s"]
    # vLLM's default 0.9 of 141 GB minus 16 GB of bf16 weights, 16-token blocks.
    profile = EngineProfile.from_json(data, num_kv_blocks=h200_kv_blocks(data), block_size=16,
                                      max_num_batched_tokens=8192, name="h200-llama8b")
    rows = []
    for rate, point in table.items():
        wl = at_rate("random", args.gpu_prompts, float(rate), input_len=2048, output_len=256)
        run = simulate(SimConfig(profile, Topology.colocated(1), record_itls=False), wl)
        sim = run_json(run, None, percentiles=(50, 90, 99))
        measured = {"median_ttft_ms": point["ttft_ms_p50_p90_p99"][0],
                    "p90_ttft_ms": point["ttft_ms_p50_p90_p99"][1],
                    "p99_ttft_ms": point["ttft_ms_p50_p90_p99"][2],
                    "median_tpot_ms": point["tpot_ms_p50_p90_p99"][0],
                    "p90_tpot_ms": point["tpot_ms_p50_p90_p99"][1],
                    "request_throughput": point["throughput"]}
        row = {k: {"measured": v, "sim": sim[k], "error_pct": (sim[k] - v) / v * 100}
               for k, v in measured.items()}
        rows.append({"run": "calibration", "arm": "vllm colocated H200", "rate": float(rate),
                     "metrics": row})
    return rows


def markdown(rows: list[dict]) -> str:
    keys = sorted({k for r in rows for k in r["metrics"]}, key=lambda k: (
        list(METRICS) + ["p99_ttft_ms", "request_throughput"]).index(k))
    head = "| arm | rate | " + " | ".join(f"{k} meas / sim (err)" for k in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        cells = []
        for k in keys:
            c = r["metrics"].get(k)
            if c is None:
                cells.append("-")
                continue
            err = "" if c["error_pct"] is None else f" ({c['error_pct']:+.0f}%)"
            cells.append(f"{c['measured']:.4g} / {c['sim']:.4g}{err}")
        rate = f"{r['rate']}{' (fit)' if r.get('fitted_on') else ''}"
        if r.get("pooled"):
            rate += f" ({r['pooled']} runs pooled)"
        lines.append(f"| {r['arm']} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--arm", choices=["colocated", "disaggregated", "disaggregated-pinned"],
                        default="colocated")
    parser.add_argument("--measured", nargs="*", default=[])
    parser.add_argument("--fit-trace", type=Path, help="step trace dir of the measured runs")
    parser.add_argument("--fit-run", type=Path, nargs="*", default=[],
                        help="with --fit-trace: the runs (of --trace-runs, else of --measured) "
                        "whose steps the step model is refitted on")
    parser.add_argument("--refit-trace", type=Path, help="step trace dir of the profile and the "
                        "measured runs: redo the profile's step_fit with today's fit code on the "
                        "profile's own steps (those before the first measured run)")
    parser.add_argument("--trace-runs", nargs="*", default=[],
                        help="with --refit-trace or --fit-trace: every run the trace holds, "
                        "in order, when "
                        "--measured is a subset (the runs are placed on the trace's clock from "
                        "its end, which is the last run's)")
    parser.add_argument("--pool-repeats", action="store_true",
                        help="also score each rate over the requests of all its --measured runs "
                        "together (percentiles over every request, goodput and throughput over "
                        "the summed durations), simulated and measured alike")
    parser.add_argument("--noise-seeds", type=int, default=0, metavar="K",
                        help="simulate each run K times with the profile's step noise on (seeds "
                        "0..K-1: pdserve.sim.calibration.step_noise) and compare the median of each metric; "
                        "its range over the seeds is kept (sim_range)")
    parser.add_argument("--shared-host", action="store_true",
                        help="the engines shared the machine: steps beside the other engine's take "
                        "longer where the fit found it (step_fit.interference)")
    parser.add_argument("--gpu", type=Path, help="calibration JSON with a serving table")
    parser.add_argument("--gpu-prompts", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if bool(args.fit_trace) != bool(args.fit_run):
        parser.error("--fit-trace and --fit-run go together")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = (cpu(args) if args.measured else []) + (gpu(args) if args.gpu else [])
    (args.out / "validation.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "profile": str(args.profile), "rows": rows}, indent=1))
    table = markdown(rows)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
