"""`pdserve bench {serve,sweep,compare,tune,chaos}`: the benchmark harness on the command line.

`add_parser(subparsers)` registers `bench` on the pdserve CLI; `main(argv)` runs the same commands
standalone (`python -m pdserve.bench.cli serve ...`). Flags that `vllm bench serve` also has keep its names
and defaults (`--base-url`, `--endpoint`, `--model`, `--tokenizer`, `--dataset-name`, `--random-input-len`,
`--num-prompts`, `--request-rate`, `--burstiness`, `--max-concurrency`, `--goodput`, `--save-result`, ...),
so a vllm command line works after swapping the program name. Differences: `--percentile-metrics`
defaults to all four latency metrics and `--metric-percentiles` to "90,99"; synthetic and trace datasets
default to `--ignore-eos` (vllm does this for random) and `--no-ignore-eos` turns it off; without
`--tokenizer`, the embedded model's served name finds the embedded checkpoint's tokenizer (tokenizer.py).

`tune` is the one command that starts servers itself: for each candidate deployment and engine knobs
(tune.py) it starts `pdserve serve`, runs a goodput search against it and stops it (service.py); it writes
`tune.json` (what `--resume` reads), `tune.csv` and `tune.png` into --result-dir, and the services' logs
under `logs/`. `chaos` (chaos.py) soaks a running service while killing its engines.

Every flag is validated before any request is sent: a bad value is an argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench import chaos, cli_args
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.client import EndpointConfig, fetch_first_model
from pdserve.slo import SloTargets
from pdserve.bench.report import (
    default_result_filename,
    format_summary,
    json_safe,
    result_json,
    save_csv,
    save_json,
)
from pdserve.bench.runner import BenchmarkError, BenchmarkResult, RunConfig, run_benchmark
from pdserve.bench.service import ServeProcess, ServiceStartError
from pdserve.bench.sweep import (
    ComparisonRow,
    GoodputResult,
    GoodputSearch,
    NamedTarget,
    SweepPoint,
    comparison_row_of_goodput,
    comparison_row_of_run,
    format_comparison,
    max_rate_meeting,
    search_goodput,
    sweep_rates,
)
from pdserve.bench.tokenizer import HFTokenizer, find_tokenizer
from pdserve.bench.tune import (
    Candidate,
    Probe,
    Trial,
    TrialStatus,
    TuneRecord,
    TuneSettings,
    best_per_deployment,
    format_ranking,
    plan_candidates,
    rank_trials,
    resumable_trials,
    run_tuning,
    trial_to_dict,
)
from pdserve.bench.workloads import (
    SHAPES,
    BenchRequest,
    PromptBuilder,
    PromptFormat,
    UniformLengths,
    mooncake_requests,
    read_mooncake_trace,
    shape_requests,
    synthetic_requests,
)

_DESCRIPTION = "Benchmark any OpenAI-compatible endpoint (vllm bench serve metrics, goodput, SLO attainment)."


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` and its `serve`/`sweep`/`compare` subcommands on an argparse subparsers object."""
    bench = subparsers.add_parser("bench", help=_DESCRIPTION, description=_DESCRIPTION)
    _add_commands(bench)
    return bench


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser used by `main` (same subcommands as `pdserve bench`)."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.cli", description=_DESCRIPTION)
    _add_commands(parser)
    return parser


def _add_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(
        dest="bench_command", metavar="{serve,sweep,compare,tune,chaos}", required=True
    )
    serve = commands.add_parser("serve", help="one benchmark run, like vllm bench serve")
    cli_args.add_run_args(serve)
    sweep = commands.add_parser("sweep", help="SLO attainment over request rates, or a goodput search")
    cli_args.add_run_args(sweep)
    cli_args.add_sweep_args(sweep)
    compare = commands.add_parser("compare", help="the same workload against several named endpoints")
    cli_args.add_run_args(compare, with_target=False)
    cli_args.add_sweep_args(compare)
    cli_args.add_compare_args(compare)
    tune = commands.add_parser(
        "tune", help="search pool split (xPyD vs colocated) and engine knobs for max goodput per GPU"
    )
    cli_args.add_run_args(tune, with_target=False)
    cli_args.add_tune_args(tune)
    for sub, command in ((serve, "serve"), (sweep, "sweep"), (compare, "compare"), (tune, "tune")):
        # `func` and `handler`: the two names parent CLIs dispatch on (pdserve's own uses `handler`).
        sub.set_defaults(func=run_command, handler=run_command, bench_command=command, bench_parser=sub)
    chaos.add_parser(commands)  # its own flags and handler: it kills a running service's engines


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Validate the parsed flags (argparse errors on bad ones), then run the chosen command."""
    cli_args.validate(args, args.bench_parser)
    commands = {"serve": _serve, "sweep": _sweep, "compare": _compare, "tune": _tune}
    try:
        return asyncio.run(commands[args.bench_command](args))
    except (BenchmarkError, ConnectionError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


# --- shared setup -------------------------------------------------------------------------------------


async def _resolve_model(args: argparse.Namespace, base_url: str) -> str:
    if args.model:
        return args.model
    model = await fetch_first_model(base_url, args.api_key)
    print(f"Model not specified; using the server's first model: {model}")
    return model


def _workload(args: argparse.Namespace, tokenizer: HFTokenizer,
              seed: int | None = None) -> list[BenchRequest]:
    """The requests of the chosen dataset, deterministic in the seed (default --seed)."""
    seed = args.seed if seed is None else seed
    builder = PromptBuilder(tokenizer, PromptFormat(args.prompt_format))
    if args.dataset_name == "mooncake":
        records = read_mooncake_trace(args.dataset_path, limit=args.num_prompts)
        return mooncake_requests(builder, records, seed)
    if args.dataset_name in SHAPES:
        shape = SHAPES[args.dataset_name]
        return shape_requests(
            builder, shape, args.num_prompts, seed, args.length_scale, args.max_model_len
        )
    inputs = UniformLengths.from_range_ratio(args.random_input_len, args.random_range_ratio)
    outputs = UniformLengths.from_range_ratio(args.random_output_len, args.random_range_ratio)
    return synthetic_requests(builder, inputs, outputs, args.num_prompts, seed, args.max_model_len)


def _run_config(
    args: argparse.Namespace, base_url: str, model: str, label: str | None, tokenizer_id: str
) -> RunConfig:
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else True
    endpoint = EndpointConfig(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body or {},
    )
    use_trace = args.dataset_name == "mooncake" and math.isinf(args.request_rate)
    arrivals = ArrivalSpec(args.request_rate, args.burstiness, use_trace, args.trace_speedup)
    return RunConfig(
        endpoint=endpoint,
        arrivals=arrivals,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        arrival_seed=args.arrival_seed,
        percentiles=tuple(args.metric_percentiles),
        slo=SloTargets.parse(args.goodput or []),
        disable_tqdm=args.disable_tqdm,
        label=label,
        dataset_name=args.dataset_name,
        tokenizer_id=tokenizer_id,
    )


async def _prepare(
    args: argparse.Namespace, base_url: str, label: str | None
) -> tuple[RunConfig, HFTokenizer]:
    """The run's config and tokenizer; each run then builds its requests (`_workload`)."""
    model = await _resolve_model(args, base_url)
    tokenizer = await find_tokenizer(model, base_url, explicit=args.tokenizer, api_key=args.api_key,
                                     trust_remote_code=args.trust_remote_code)
    if not args.tokenizer and tokenizer.name != model:
        print(f"Tokenizer for {model}: {tokenizer.name}")
    return _run_config(args, base_url, model, label, tokenizer.name), tokenizer


async def _run(config: RunConfig, requests: list[BenchRequest], tokenizer: HFTokenizer) -> BenchmarkResult:
    return await run_benchmark(config, requests, count_tokens=lambda text: len(tokenizer.encode(text)))


def _save_run(args: argparse.Namespace, result: BenchmarkResult, tag: str | None = None) -> None:
    """JSON (vllm keys) plus per-request CSV and latency-CDF PNG beside it, when --save-result is on.

    A run that is one of many (sweep probes, compare targets) gets `tag` appended to --result-filename,
    so the runs do not overwrite each other; default file names already differ by label and rate.
    """
    if not args.save_result:
        return
    filename = default_result_filename(result)
    if args.result_filename:
        stem = Path(args.result_filename)
        filename = f"{stem.stem}-{tag}{stem.suffix or '.json'}" if tag else args.result_filename
    path = Path(args.result_dir or ".") / filename
    save_json(result_json(result, args.percentile_metrics, args.save_detailed), path)
    save_csv(result, path.with_suffix(".csv"))
    if not args.no_plots:
        from pdserve.bench.plots import plot_latency_cdfs  # matplotlib: ~0.5 s, only when plotting

        plot_latency_cdfs(result, path.with_suffix(".cdf.png"))
    print(f"Saved {path} (+ .csv{'' if args.no_plots else ', .cdf.png'})")


# --- commands -----------------------------------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> int:
    config, tokenizer = await _prepare(args, cli_args.base_url(args), args.label)
    result = await _run(config, _workload(args, tokenizer), tokenizer)
    print(format_summary(result, args.percentile_metrics))
    _save_run(args, result)
    return 0


async def _rate_points(
    args: argparse.Namespace, config: RunConfig, tokenizer: HFTokenizer
) -> list[SweepPoint] | tuple[SweepPoint, ...]:
    """Sweep --request-rates, or run a goodput search when --search-goodput is set."""
    name = config.label or config.backend
    run_at = _prober(args, config, tokenizer, name, name)
    if args.search_goodput:
        found = await search_goodput(run_at, _search_settings(args), args.num_gpus)
        return found.points
    return await sweep_rates(run_at, sorted(args.request_rates))


def _prober(args: argparse.Namespace, config: RunConfig, tokenizer: HFTokenizer, name: str,
            tag: str) -> Callable[[float], Awaitable[BenchmarkResult]]:
    """One benchmark run per probed rate, saved under `tag`.

    Probe k sends prompts of its own, drawn with seed --seed + k (probe 0 sends what `serve`
    would): the probes run back to back against one server, and with the same prompts every
    probe after the first would find them in the prefix cache and overstate what the server
    sustains (on the CPU engine, a 256-token random prompt found 128 tokens cached).
    """
    probes = 0

    async def run_at(rate: float) -> BenchmarkResult:
        nonlocal probes
        seed, probes = args.seed + probes, probes + 1
        requests = _workload(args, tokenizer, seed)
        result = await _run(replace(config.at_rate(rate), seed=seed), requests, tokenizer)
        attainment = result.metrics.attainment.all if result.metrics.attainment else 0.0
        print(f"[{name}] rate {rate:.3f} req/s: SLO attainment {attainment:.1%}", flush=True)
        _save_run(args, result, tag=f"{tag}-{rate:g}qps")
        return result

    return run_at


def _search_settings(args: argparse.Namespace) -> GoodputSearch:
    return GoodputSearch(
        target_attainment=args.target_attainment,
        start_rate=args.search_start_rate,
        growth=args.search_growth,
        max_rate=args.search_max_rate,
        rel_tolerance=args.search_tolerance,
        max_probes=args.search_max_probes,
    )


async def _sweep(args: argparse.Namespace) -> int:
    config, tokenizer = await _prepare(args, cli_args.base_url(args), args.label)
    points = await _rate_points(args, config, tokenizer)
    name = config.label or config.backend
    best = max_rate_meeting(points, args.target_attainment)
    print(_sweep_table(points))
    print(
        f"Max rate with >= {args.target_attainment:.0%} SLO attainment: {best:.3f} req/s "
        f"({best / args.num_gpus:.3f} req/s per GPU over {args.num_gpus} GPU(s))"
    )
    _save_summary(args, "sweep", {name: points}, {name: args.num_gpus})
    return 0


def _sweep_table(points: Sequence[SweepPoint]) -> str:
    lines = [f"{'rate (req/s)':>12}  {'attainment':>10}  {'goodput (req/s)':>15}  {'throughput (req/s)':>18}"]
    for point in sorted(points, key=lambda p: p.request_rate):
        metrics = point.result.metrics
        lines.append(
            f"{point.request_rate:>12.3f}  {point.attainment:>10.1%}  "
            f"{metrics.request_goodput:>15.3f}  {metrics.request_throughput:>18.3f}"
        )
    return "\n".join(lines)


async def _compare(args: argparse.Namespace) -> int:
    targets = [NamedTarget.parse(spec) for spec in args.target]
    series: dict[str, list[SweepPoint] | tuple[SweepPoint, ...]] = {}
    rows: list[ComparisonRow] = []
    for target in targets:
        config, tokenizer = await _prepare(args, target.base_url, target.name)
        if args.search_goodput or args.request_rates:
            points = await _rate_points(args, config, tokenizer)
            series[target.name] = points
            rows.append(_goodput_row(args, target, points))
        else:
            result = await _run(config, _workload(args, tokenizer), tokenizer)
            _save_run(args, result, tag=target.name)
            rows.append(comparison_row_of_run(target.name, target.num_gpus, result))
    print(format_comparison(rows))
    if series:
        _save_summary(args, "compare", series, {t.name: t.num_gpus for t in targets})
    return 0


def _goodput_row(
    args: argparse.Namespace, target: NamedTarget, points: Sequence[SweepPoint]
) -> ComparisonRow:
    best = max_rate_meeting(points, args.target_attainment)
    return comparison_row_of_goodput(target.name, GoodputResult(best, tuple(points), target.num_gpus))


def _save_summary(
    args: argparse.Namespace,
    kind: str,
    series: dict[str, Sequence[SweepPoint]],
    num_gpus: dict[str, int],
) -> None:
    """A small JSON of every probed point per system, and the attainment-vs-rate PNG."""
    if not args.save_result:
        return
    first = next(iter(series.values()))[0].result
    stem = Path(args.result_dir or ".") / f"{kind}-{first.config.endpoint.model.split('/')[-1]}-{first.date}"
    summary = {
        name: {
            "num_gpus": num_gpus[name],
            "max_rate_meeting_target": max_rate_meeting(points, args.target_attainment),
            "points": [_point_summary(p) for p in sorted(points, key=lambda p: p.request_rate)],
        }
        for name, points in series.items()
    }
    summary_meta = {"target_attainment": args.target_attainment, "goodput_slos": first.config.slo.as_dict()}
    save_json({**summary_meta, "systems": summary}, stem.with_suffix(".json"))
    if not args.no_plots:
        from pdserve.bench.plots import plot_attainment_vs_rate

        plot_attainment_vs_rate(series, stem.with_suffix(".png"), args.target_attainment, num_gpus)
    print(f"Saved {stem.with_suffix('.json')}")


def _point_summary(point: SweepPoint) -> dict[str, Any]:
    metrics = point.result.metrics
    return {
        "request_rate": point.request_rate,
        "slo_attainment": metrics.attainment.as_dict() if metrics.attainment else None,
        "request_goodput": metrics.request_goodput,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "completed": metrics.completed,
        "failed": metrics.failed,
    }


# --- tune ---------------------------------------------------------------------------------------------


def _tune_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that makes two trials comparable; `--resume` refuses a record made with other values."""
    names = ("endpoint", "model", "dataset_name", "dataset_path", "prompt_format", "num_prompts",
             "random_input_len", "random_output_len", "random_range_ratio", "length_scale", "max_model_len",
             "seed", "burstiness", "max_concurrency", "num_warmups", "ignore_eos", "temperature",
             "extra_body", "target_attainment", "search_start_rate", "search_max_rate", "search_growth",
             "search_tolerance", "search_max_probes", "num_cpus_per_engine", "gpus_per_engine")
    settings = {name: getattr(args, name) for name in names}
    settings["goodput"] = SloTargets.parse(args.goodput).as_dict()
    settings["serve_args"] = cli_args.passthrough_serve_args(args)
    return json_safe(settings)  # as save_json writes it, so a resumed record compares equal


async def _tune(args: argparse.Namespace) -> int:
    """Run the tuner; SIGTERM cancels it as Ctrl-C does, so the candidate's service is stopped, not leaked
    (services run in their own session: a signal to the tuner's process group does not reach them).

    SIGINT gets the same handler when it is ignored, as in a tuner started in the background (`cmd &`,
    nohup): an ignored signal stays ignored across exec, and the services must get SIGINT to shut down
    in order; a handled one is reset to the default in the child.
    """
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signals.append(signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await _tune_candidates(args)
    except asyncio.CancelledError:
        print("Interrupted: the running candidate's service was stopped; --resume continues from tune.json",
              file=sys.stderr)
        return 130
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _tune_candidates(args: argparse.Namespace) -> int:
    out = Path(args.result_dir or ".")
    record_path = out / "tune.json"
    settings = _tune_settings(args)
    previous = {}
    if args.resume and record_path.exists():
        previous = resumable_trials(json.loads(record_path.read_text()), settings)
        print(f"Resuming: {len(previous)} trial(s) recorded in {record_path}")
    plan = plan_candidates(args.deployment_list, args.num_seqs_list, args.num_batched_tokens_list)
    tune_settings = TuneSettings(
        prune_drop=None if args.no_prune else args.prune_drop, gpus_per_engine=args.gpus_per_engine
    )
    meta = {"command": _command_line(), "machine": _machine(),
            "load_average_at_start": os.getloadavg()}
    planned = {c.key for c in plan}
    # Recorded trials outside this plan stay in the record (a resume with a narrower grid loses nothing).
    done: list[Trial] = [t for key, t in previous.items() if key not in planned]

    def record(trial: Trial) -> None:
        done.append(trial)
        _print_trial(trial)
        partial = record_path.with_suffix(".json.tmp")
        save_json(TuneRecord(settings, done, meta).to_dict(), partial)
        partial.replace(record_path)  # atomic: an interrupted write never corrupts what --resume reads

    print(f"Tuning {len(plan)} candidate(s): {', '.join(c.key for c in plan)}")
    trials = await run_tuning(
        plan, lambda c: _evaluate_candidate(args, c, tune_settings), tune_settings, previous, record
    )
    print(format_ranking(trials))
    best = best_per_deployment(trials)
    if best:
        print("\nBest of each deployment:")
        print(format_comparison([_deployment_row(t) for t in best]))
    _save_tune_outputs(args, trials, out)
    return 0


async def _evaluate_candidate(
    args: argparse.Namespace, candidate: Candidate, settings: TuneSettings
) -> Trial:
    """Start the candidate's service, search its goodput, stop it; a failure becomes a FAILED trial."""
    num_gpus = settings.num_gpus(candidate)
    serve_args = [*candidate.deployment.serve_args(), *candidate.knobs.serve_args(),
                  *cli_args.passthrough_serve_args(args)]
    if candidate.deployment.adaptive:
        serve_args += cli_args.slo_serve_args(args, serve_args)
    log = Path(args.result_dir or ".") / "logs" / f"{candidate.slug}.log"
    began = time.monotonic()
    print(f"[{candidate.key}] starting pdserve serve {' '.join(serve_args)}", flush=True)
    try:
        service = await _start_service(args, candidate, serve_args, log)
    except ServiceStartError as exc:
        return Trial(candidate, TrialStatus.FAILED, num_gpus, error=_error_summary(exc),
                     wall_s=time.monotonic() - began, load_1m=os.getloadavg()[0])
    start_s = time.monotonic() - began
    print(f"[{candidate.key}] healthy after {start_s:.1f} s", flush=True)
    try:
        config, tokenizer = await _prepare(args, service.base_url, candidate.slug)
        run_at = _prober(args, config, tokenizer, candidate.key, candidate.slug)
        found = await search_goodput(run_at, _search_settings(args), num_gpus)
    except (BenchmarkError, ConnectionError, OSError) as exc:
        return Trial(candidate, TrialStatus.FAILED, num_gpus, error=_error_summary(exc),
                     start_s=start_s, wall_s=time.monotonic() - began, load_1m=os.getloadavg()[0])
    finally:
        service.stop()  # synchronous: runs even when the search is cancelled (Ctrl-C)
    probes = tuple(Probe(p.request_rate, p.attainment, _per_target(p.result)) for p in found.points)
    return Trial(candidate, TrialStatus.OK, num_gpus, found.max_goodput_rate, probes,
                 start_s=start_s, wall_s=time.monotonic() - began, load_1m=os.getloadavg()[0])


def _per_target(result: BenchmarkResult) -> tuple[tuple[str, float], ...]:
    attainment = result.metrics.attainment
    return attainment.per_slo if attainment is not None else ()


async def _start_service(
    args: argparse.Namespace, candidate: Candidate, serve_args: list[str], log: Path
) -> ServeProcess:
    """Start the candidate's service, retrying --start-retries times: on a shared host a local Ray can
    time out starting under load, which says nothing about the candidate."""
    for attempt in range(args.start_retries + 1):
        try:
            return await ServeProcess.start(serve_args, log, args.start_timeout)
        except ServiceStartError as exc:
            if attempt == args.start_retries:
                raise
            print(f"[{candidate.key}] start failed ({_error_summary(exc)}); retrying", flush=True)
    raise AssertionError("unreachable")


def _error_summary(exc: Exception) -> str:
    """First line of the error, plus the last line of the log tail it carries (usually the cause)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def _print_trial(trial: Trial) -> None:
    if trial.status is TrialStatus.OK:
        outcome = f"max goodput {trial.max_goodput_rate:.3f} req/s ({trial.goodput_per_gpu:.3f} per GPU)"
    else:
        outcome = trial.status.value + (f": {trial.error}" if trial.error else "")
    print(f"[{trial.candidate.key}] {outcome}", flush=True)


def _deployment_row(trial: Trial) -> ComparisonRow:
    values = (("max goodput req/s", trial.max_goodput_rate), ("per GPU", trial.goodput_per_gpu))
    return ComparisonRow(f"{trial.candidate.deployment.name} ({trial.candidate.knobs.name})",
                         trial.num_gpus, values)


def _save_tune_outputs(args: argparse.Namespace, trials: Sequence[Trial], out: Path) -> None:
    """tune.csv (one row per candidate) and, unless --no-plots, tune.png (goodput per GPU, ranked)."""
    columns = ("key", "deployment", "max_num_seqs", "max_num_batched_tokens", "status", "num_gpus",
               "max_goodput_rate", "goodput_per_gpu", "probes", "by_target", "start_s", "wall_s", "load_1m",
               "error")
    with (out / "tune.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for trial in rank_trials(trials):
            row = trial_to_dict(trial)
            probes = row["probes"]
            row["probes"] = ";".join(f"{p['request_rate']:g}:{p['slo_attainment']:.3f}" for p in probes)
            row["by_target"] = ";".join(
                ",".join(f"{name}={share:.3f}" for name, share in p["by_target"].items()) for p in probes
            )
            writer.writerow([row[c] for c in columns])
    measured = [t for t in rank_trials(trials) if t.status is TrialStatus.OK]
    if measured and not args.no_plots:
        from pdserve.bench.plots import plot_goodput_ranking

        bars = [(t.candidate.key, t.candidate.deployment.name, t.goodput_per_gpu) for t in measured]
        plot_goodput_ranking(bars, out / "tune.png")
    print(f"Saved {out / 'tune.json'} (+ tune.csv{'' if args.no_plots else ', tune.png'}, logs/)")


def _command_line() -> str:
    """This invocation as a user would type it (`python -m pdserve` shows up as pdserve/__main__.py)."""
    program = Path(sys.argv[0])
    if program.name == "__main__.py" and program.parent.name == "pdserve":
        return shlex.join(["pdserve", *sys.argv[1:]])
    if program.name == "cli.py" and program.parent.name == "bench":
        return shlex.join(["python", "-m", "pdserve.bench.cli", *sys.argv[1:]])
    return shlex.join(sys.argv)


def _machine() -> str:
    host = f"{platform.node()} {platform.machine()}"
    return f"{host}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
