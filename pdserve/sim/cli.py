"""`pdserve sim {run,search,profile}`: the simulator on the command line.

`add_parser(subparsers)` registers `sim` on the pdserve CLI (as `pdserve.bench.cli` does);
`main(argv)` runs the same commands standalone (`python -m pdserve.sim.cli run ...`).
Workload flags keep the benchmark harness's names (`--dataset-name`, `--random-input-len`,
`--num-prompts`, `--request-rate`, `--burstiness`, `--goodput`, `--save-result`), plus what only
a simulation needs: rate curves over a day, a topology, an engine profile.

    pdserve sim run --profile benchmarks/profiles/h200-vllm0.24-llama8b.json \
        --prefill 2 --decode 4 --dataset-name chat --num-prompts 20000 --request-rate 40 \
        --ttft-ms 500 --tpot-ms 50 --save-result out.json --plot-dir plots/
    pdserve sim search --profile ... --dataset-name chat --num-prompts 5000 --request-rate 30 \
        --ttft-ms 500 --tpot-ms 50 --attainment 0.9 --max-engines 12 --autoscale
    pdserve sim profile --base-url http://127.0.0.1:8000 --model-dir DIR --num-kv-blocks 182 \
        --max-num-batched-tokens 2048 ...
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from pdserve.autoscaler.policy import PoolBounds, ScalingPolicy
from pdserve.bench.report import save_json
from pdserve.slo import SloTargets
from pdserve.sim import profile as profile_cmd
from pdserve.sim.arrivals import CurveArrivals, WorkloadArrivals
from pdserve.sim.cells import scale_totals, split
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.fluid import FluidConfig, FluidSimulation
from pdserve.sim.results import LatencyRecorder, bench_result, plot_pool_sizes, run_json
from pdserve.sim.runner import SimConfig, Simulation, Topology
from pdserve.sim.search import search_autoscaled, search_static
from pdserve.sim.workload import Workload, at_rate, bursty, diurnal, from_curve, mooncake

_DESCRIPTION = ("Simulate a deployment on virtual time with pdserve's own routing and autoscaling "
                "(latency distributions, SLO attainment, goodput, GPU-hours, scaling decisions).")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `sim` and its `run`/`search`/`profile` subcommands."""
    sim = subparsers.add_parser("sim", help=_DESCRIPTION, description=_DESCRIPTION)
    _add_commands(sim)
    return sim


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdserve.sim.cli", description=_DESCRIPTION)
    _add_commands(parser)
    return parser


def _add_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="sim_command", metavar="{run,search,profile}",
                                     required=True)
    run = commands.add_parser("run", help="simulate one deployment on one workload")
    _profile_args(run)
    _workload_args(run)
    _topology_args(run)
    _slo_args(run)
    run.add_argument("--cells", type=int, default=1,
                     help="simulate 1/N of engines and traffic, multiply totals (large runs)")
    run.add_argument("--sim-mode", choices=["des", "fluid"], default="des",
                     help="des: request by request (exact engine model); fluid: time steps, "
                     "cohorts and engine groups (a day over 1000 GPUs in minutes; fluid.py)")
    run.add_argument("--fluid-step-ms", type=float, default=100.0,
                     help="fluid step (1000 for day-long runs over hundreds of engines)")
    run.add_argument("--fluid-groups", type=int, default=16,
                     help="most engine groups per pool the router sees (4 for 1000 engines)")
    run.add_argument("--fluid-cohort-per-engine", type=float, default=1.0,
                     help="cohort size cap in requests per engine of the smallest group")
    run.add_argument("--record-itls", action="store_true",
                     help="keep per-token gaps (ITL metrics); memory grows with engine steps")
    run.add_argument("--step-noise", type=int, nargs="?", const=0, metavar="SEED",
                     help="steps wander as the profile's step trace showed (step_fit.noise), "
                     "drawn from SEED (default 0); off: every step takes the model's time")
    run.add_argument("--shared-host", action="store_true",
                     help="every engine on one host (a CPU box): steps that run beside another "
                     "engine's take longer, as the profile's step trace showed (step_fit.interference)")
    run.add_argument("--save-result", type=Path, help="result JSON (harness keys + simulation)")
    run.add_argument("--plot-dir", type=Path, help="write pool-size and latency plots here")
    run.set_defaults(handler=_run)

    search = commands.add_parser("search", help="cheapest static xPyD (and autoscaler settings) "
                                 "meeting an SLO attainment goal")
    _profile_args(search)
    _workload_args(search)
    _slo_args(search)
    search.add_argument("--attainment", type=float, default=0.9,
                        help="share of requests that must meet every --goodput target")
    search.add_argument("--max-engines", type=int, default=16)
    search.add_argument("--no-colocated", action="store_true")
    search.add_argument("--no-disaggregated", action="store_true")
    search.add_argument("--autoscale", action="store_true",
                        help="then tune autoscaler bounds/target utilisation around the winner")
    search.add_argument("--save-result", type=Path)
    search.set_defaults(handler=_search)

    prof = commands.add_parser("profile", help="record an engine profile from a live endpoint")
    profile_cmd.build_parser(prof)
    prof.set_defaults(handler=profile_cmd.run)


def _profile_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine profile")
    g.add_argument("--profile", type=Path, required=True,
                   help="calibration/profile JSON (e.g. benchmarks/profiles/h200-vllm0.24-llama8b.json)")
    g.add_argument("--num-kv-blocks", type=int, help="override the profile's KV blocks per engine")
    g.add_argument("--block-size", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--startup-s", type=float, help="engine start-up delay (default: the profile's)")
    g.add_argument("--gpus-per-engine", type=int)


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (harness names)")
    g.add_argument("--dataset-name", default="random",
                   choices=["random", "chat", "code", "summarization", "mooncake"])
    g.add_argument("--dataset-path", help="Mooncake-format JSONL trace (--dataset-name mooncake)")
    g.add_argument("--trace-speedup", type=float, default=1.0)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--length-scale", type=float, default=1.0)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--request-rate", type=float, default=math.inf)
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--rate-curve", choices=["diurnal"],
                   help="arrivals follow a day-long curve instead of --request-rate/--num-prompts")
    g.add_argument("--peak-rate", type=float, default=100.0)
    g.add_argument("--trough-ratio", type=float, default=0.25)
    g.add_argument("--duration-h", type=float, default=24.0)
    g.add_argument("--bursts", type=int, default=0, help="random surges added to the curve")
    g.add_argument("--burst-factor", type=float, default=2.0)
    g.add_argument("--burst-min", type=float, default=10.0, help="minutes each surge lasts")


def _topology_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology")
    g.add_argument("--mode", choices=["colocated", "disaggregated"], default=None,
                   help="default: disaggregated when --prefill/--decode are given")
    g.add_argument("--replicas", type=int, default=1)
    g.add_argument("--prefill", type=int)
    g.add_argument("--decode", type=int)
    g.add_argument("--autoscale", action="store_true")
    for pool in ("replicas", "prefill", "decode"):
        g.add_argument(f"--min-{pool}", type=int, default=1)
        g.add_argument(f"--max-{pool}", type=int)
    g.add_argument("--autoscale-interval-s", type=float, default=10.0)
    g.add_argument("--target-utilization", type=float, default=0.8)
    g.add_argument("--max-gpus", type=int, help="--autoscale: GPUs the pools share (a fixed "
                   "cluster, as autoscale.max_gpus); with --cells N, each cell gets 1/N of them")


def _slo_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLO")
    g.add_argument("--ttft-ms", type=float, help="router/autoscaler TTFT target")
    g.add_argument("--tpot-ms", type=float, help="router/autoscaler TPOT target")
    g.add_argument("--slo-percentile", type=float, default=90.0)
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="goodput/attainment targets (default: --ttft-ms and --tpot-ms)")
    g.add_argument("--metric-percentiles", default="50,90,99")


def load_profile(args: argparse.Namespace) -> EngineProfile:
    return EngineProfile.load(args.profile, num_kv_blocks=args.num_kv_blocks,
                              block_size=args.block_size,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs, startup_s=args.startup_s,
                              gpus=args.gpus_per_engine)


def build_workload(args: argparse.Namespace) -> Workload:
    lengths = dict(input_len=args.random_input_len, output_len=args.random_output_len,
                   range_ratio=args.random_range_ratio, length_scale=args.length_scale,
                   max_model_len=args.max_model_len)
    if args.dataset_name == "mooncake":
        if not args.dataset_path:
            raise SystemExit("--dataset-name mooncake needs --dataset-path")
        return mooncake(args.dataset_path, args.num_prompts, args.trace_speedup)
    if args.rate_curve:
        curve = diurnal(args.peak_rate, args.trough_ratio, args.duration_h * 3600)
        if args.bursts:
            curve = bursty(curve, args.bursts, args.burst_factor, args.burst_min * 60,
                           seed=args.seed)
        return from_curve(curve, args.dataset_name, args.seed, args.burstiness, **lengths)
    return at_rate(args.dataset_name, args.num_prompts, args.request_rate, args.burstiness,
                   args.seed, **lengths)


def build_topology(args: argparse.Namespace) -> Topology:
    mode = args.mode or ("disaggregated" if args.prefill or args.decode else "colocated")
    if mode == "colocated":
        bounds = (PoolBounds(args.min_replicas, args.max_replicas or args.replicas)
                  if args.autoscale else None)
        return Topology.colocated(args.replicas, bounds)
    prefill, decode = args.prefill or 1, args.decode or 1
    pb = db = None
    if args.autoscale:
        pb = PoolBounds(args.min_prefill, args.max_prefill or prefill)
        db = PoolBounds(args.min_decode, args.max_decode or decode)
    return Topology.disaggregated(prefill, decode, pb, db)


def _slos(args: argparse.Namespace) -> tuple[SloTargets | None, SloTargets]:
    slo = None
    if args.ttft_ms and args.tpot_ms:
        slo = SloTargets(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, percentile=args.slo_percentile)
    if args.goodput:
        goodput = SloTargets.parse(args.goodput)
    else:
        goodput = SloTargets(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)
    return slo, goodput


def _percentiles(args: argparse.Namespace) -> tuple[float, ...]:
    return tuple(float(p) for p in args.metric_percentiles.split(","))


def _run(args: argparse.Namespace) -> int:
    if args.sim_mode == "fluid":
        return _run_fluid(args)
    if args.shared_host and args.cells != 1:
        raise SystemExit("--shared-host puts every engine on one host: leave --cells at 1")
    profile = load_profile(args)
    slo, goodput = _slos(args)
    topology = build_topology(args)
    workload = build_workload(args)
    cell = split(topology, workload, args.cells)
    large = len(cell.workload) > 200_000 or not args.record_itls and args.cells > 1
    config = SimConfig(profile, cell.topology, slo, scaling=ScalingPolicy(
        target_utilization=args.target_utilization), autoscale_interval_s=args.autoscale_interval_s,
        record_itls=args.record_itls, keep_requests=not large, step_noise=args.step_noise,
        shared_host=args.shared_host,
        max_gpus=None if args.max_gpus is None else max(1, args.max_gpus // args.cells))
    sim = Simulation(config)
    recorder = None
    if large:
        recorder = LatencyRecorder(len(cell.workload), profile.response_of)
        sim.on_request_done = recorder
    run = sim.run(cell.workload)
    body = run_json(run, goodput, _percentiles(args), recorder=recorder, label="sim",
                    dataset_name=args.dataset_name, request_rate=args.request_rate,
                    burstiness=args.burstiness)
    body = scale_totals(body, args.cells)
    body["command"] = _command_line(args)
    _print_summary(body)
    if args.save_result:
        save_json(body, args.save_result)
    if args.plot_dir:
        plot_pool_sizes(run, args.plot_dir / "pool_sizes.png")
        if not large:
            from pdserve.bench.plots import plot_latency_cdfs
            plot_latency_cdfs(bench_result(run, goodput, _percentiles(args)),
                              args.plot_dir / "latency_cdf.png", f"simulated {run.config.topology.name}")
    return 0


def _run_fluid(args: argparse.Namespace) -> int:
    if args.cells != 1:
        raise SystemExit("--sim-mode fluid simulates every engine: leave --cells at 1")
    if args.step_noise is not None:
        raise SystemExit("--sim-mode fluid has no engine steps to vary: leave out --step-noise")
    if args.shared_host:
        raise SystemExit("--sim-mode fluid has no engine steps to slow: leave out --shared-host")
    profile = load_profile(args)
    slo, goodput = _slos(args)
    config = SimConfig(profile, build_topology(args), slo, scaling=ScalingPolicy(
        target_utilization=args.target_utilization),
        autoscale_interval_s=args.autoscale_interval_s, max_gpus=args.max_gpus)
    fluid = FluidConfig(step_s=args.fluid_step_ms / 1000, max_groups=args.fluid_groups,
                        cohort_per_engine=args.fluid_cohort_per_engine)
    if args.rate_curve and args.dataset_name != "mooncake":
        if args.burstiness != 1.0:
            raise SystemExit("--sim-mode fluid draws rate curves as Poisson: --burstiness 1")
        curve = diurnal(args.peak_rate, args.trough_ratio, args.duration_h * 3600)
        if args.bursts:
            curve = bursty(curve, args.bursts, args.burst_factor, args.burst_min * 60,
                           seed=args.seed)
        arrivals = CurveArrivals(curve, args.dataset_name, args.seed,
                                 input_len=args.random_input_len,
                                 output_len=args.random_output_len,
                                 range_ratio=args.random_range_ratio,
                                 length_scale=args.length_scale, max_model_len=args.max_model_len)
    else:
        arrivals = WorkloadArrivals(build_workload(args))
    run = FluidSimulation(config, fluid, goodput).run(arrivals)
    body = run.summary(_percentiles(args))
    body["command"] = _command_line(args)
    _print_summary(body)
    if args.save_result:
        save_json(body, args.save_result)
    if args.plot_dir:
        plot_pool_sizes(run, args.plot_dir / "pool_sizes.png")
    return 0


def _print_summary(body: dict) -> None:
    sim = body["simulation"]
    keys = ["completed", "failed", "request_throughput", "request_goodput", "median_ttft_ms",
            "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms"]
    mode = "fluid" if sim.get("mode") == "fluid" else f"{sim.get('cells', 1)} cell(s)"
    print(f"{sim['topology']} ({mode}), profile {sim['profile']}")
    for k in keys:
        if body.get(k) is not None:
            print(f"  {k:<24} {body[k]:.4g}" if isinstance(body[k], float) else f"  {k:<24} {body[k]}")
    print(f"  slo_attainment           {body.get('slo_attainment')}")
    print(f"  gpu_hours                {sim['gpu_hours']:.3f}  {sim['gpu_hours_by_pool']}")
    print(f"  scaling decisions        {len(sim['scaling_decisions'])}; rejected {sim['rejected']}")
    print(f"  simulated {sim['simulated_s']:.0f} s in {sim['wall_s']:.1f} s wall "
          f"({sim['simulated_requests_per_wall_s'] or 0:.0f} requests/s)")


def _search(args: argparse.Namespace) -> int:
    profile = load_profile(args)
    slo, goodput = _slos(args)
    if not goodput:
        raise SystemExit("search needs targets: --ttft-ms/--tpot-ms or --goodput")
    workload = build_workload(args)
    base = SimConfig(profile, Topology.colocated(1), slo)

    def log(t):
        name = t.topology.name if not t.topology.bounds else "autoscaled " + ",".join(
            f"{p}[{b.min_replicas}-{b.max_replicas}]" for p, b in t.topology.bounds.items())
        print(f"  {name:<16} attainment {t.attainment:.3f}  goodput {t.goodput:.2f} "
              f"req/s  p90 TTFT {t.p90_ttft_ms:.0f} ms  p90 TPOT {t.p90_tpot_ms:.1f} ms"
              + (f"  autoscaled util {t.target_utilization} GPU-h {t.gpu_hours:.3f}"
                 if t.target_utilization is not None else ""), flush=True)

    best, trials = search_static(base, workload, goodput, args.attainment, args.max_engines,
                                 not args.no_colocated, not args.no_disaggregated, log)
    out: dict[str, Any] = {"command": _command_line(args), "goal": args.attainment,
                           "goodput_slos": goodput.as_dict(),
                           "best_static": best.as_dict() if best else None,
                           "trials": [t.as_dict() for t in trials]}
    if best is None:
        print(f"no topology up to {args.max_engines} engines reaches {args.attainment:.0%}")
    else:
        print(f"cheapest static: {best.topology.name} ({sum(best.topology.pools.values())} "
              f"engine(s)), attainment {best.attainment:.3f}")
        if args.autoscale and slo is not None:
            auto, auto_trials = search_autoscaled(base, workload, goodput, args.attainment, best,
                                                  log=log)
            out["best_autoscaled"] = auto.as_dict() if auto else None
            out["autoscaled_trials"] = [t.as_dict() for t in auto_trials]
            if auto:
                print(f"autoscaled: bounds {out['best_autoscaled']['bounds']}, target "
                      f"utilisation {auto.target_utilization}: {auto.gpu_hours:.3f} GPU-h vs "
                      f"{best.gpu_hours:.3f} static")
    if args.save_result:
        save_json(out, args.save_result)
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """How this result was made, for the saved JSON: the command as typed, or as `main` got it."""
    given = getattr(args, "argv", None)
    if given is not None:
        return shlex.join(["pdserve", "sim", *given])
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.handler(args) or 0


if __name__ == "__main__":
    sys.exit(main())
