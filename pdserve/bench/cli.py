"""`pdserve bench {serve,sweep,compare}`: the benchmark harness on the command line.

`add_parser(subparsers)` registers `bench` on the pdserve CLI; `main(argv)` runs the same commands
standalone (`python -m pdserve.bench.cli serve ...`). Flags that `vllm bench serve` also has keep its names
and defaults (`--base-url`, `--endpoint`, `--model`, `--tokenizer`, `--dataset-name`, `--random-input-len`,
`--num-prompts`, `--request-rate`, `--burstiness`, `--max-concurrency`, `--goodput`, `--save-result`, ...),
so a vllm command line works after swapping the program name. Differences: `--percentile-metrics`
defaults to all four latency metrics and `--metric-percentiles` to "90,99"; synthetic and trace datasets
default to `--ignore-eos` (vllm does this for random) and `--no-ignore-eos` turns it off.

Every flag is validated before any request is sent: a bad value is an argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench import cli_args
from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.client import EndpointConfig, fetch_first_model
from pdserve.bench.metrics import SLOTargets
from pdserve.bench.report import (
    default_result_filename,
    format_summary,
    result_json,
    save_csv,
    save_json,
)
from pdserve.bench.runner import BenchmarkError, BenchmarkResult, RunConfig, run_benchmark
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
from pdserve.bench.tokenizer import HFTokenizer, load_tokenizer
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
    commands = parser.add_subparsers(dest="bench_command", metavar="{serve,sweep,compare}", required=True)
    serve = commands.add_parser("serve", help="one benchmark run, like vllm bench serve")
    cli_args.add_run_args(serve)
    sweep = commands.add_parser("sweep", help="SLO attainment over request rates, or a goodput search")
    cli_args.add_run_args(sweep)
    cli_args.add_sweep_args(sweep)
    compare = commands.add_parser("compare", help="the same workload against several named endpoints")
    cli_args.add_run_args(compare, with_target=False)
    cli_args.add_sweep_args(compare)
    cli_args.add_compare_args(compare)
    for sub, command in ((serve, "serve"), (sweep, "sweep"), (compare, "compare")):
        # `func` and `handler`: the two names parent CLIs dispatch on (pdserve's own uses `handler`).
        sub.set_defaults(func=run_command, handler=run_command, bench_command=command, bench_parser=sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Validate the parsed flags (argparse errors on bad ones), then run the chosen command."""
    cli_args.validate(args, args.bench_parser)
    commands = {"serve": _serve, "sweep": _sweep, "compare": _compare}
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


def _workload(args: argparse.Namespace, tokenizer: HFTokenizer) -> list[BenchRequest]:
    """The requests of the chosen dataset, deterministic in --seed."""
    builder = PromptBuilder(tokenizer, PromptFormat(args.prompt_format))
    if args.dataset_name == "mooncake":
        records = read_mooncake_trace(args.dataset_path, limit=args.num_prompts)
        return mooncake_requests(builder, records, args.seed)
    if args.dataset_name in SHAPES:
        shape = SHAPES[args.dataset_name]
        return shape_requests(
            builder, shape, args.num_prompts, args.seed, args.length_scale, args.max_model_len
        )
    inputs = UniformLengths.from_range_ratio(args.random_input_len, args.random_range_ratio)
    outputs = UniformLengths.from_range_ratio(args.random_output_len, args.random_range_ratio)
    return synthetic_requests(builder, inputs, outputs, args.num_prompts, args.seed, args.max_model_len)


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
        percentiles=tuple(args.metric_percentiles),
        slo=SLOTargets.parse(args.goodput or []),
        disable_tqdm=args.disable_tqdm,
        label=label,
        dataset_name=args.dataset_name,
        tokenizer_id=tokenizer_id,
    )


async def _prepare(
    args: argparse.Namespace, base_url: str, label: str | None
) -> tuple[RunConfig, list[BenchRequest], HFTokenizer]:
    model = await _resolve_model(args, base_url)
    tokenizer = load_tokenizer(args.tokenizer or model, trust_remote_code=args.trust_remote_code)
    requests = _workload(args, tokenizer)
    return _run_config(args, base_url, model, label, tokenizer.name), requests, tokenizer


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
    config, requests, tokenizer = await _prepare(args, cli_args.base_url(args), args.label)
    result = await _run(config, requests, tokenizer)
    print(format_summary(result, args.percentile_metrics))
    _save_run(args, result)
    return 0


async def _rate_points(
    args: argparse.Namespace, config: RunConfig, requests: list[BenchRequest], tokenizer: HFTokenizer
) -> list[SweepPoint] | tuple[SweepPoint, ...]:
    """Sweep --request-rates, or run a goodput search when --search-goodput is set."""

    async def run_at(rate: float) -> BenchmarkResult:
        result = await _run(config.at_rate(rate), requests, tokenizer)
        attainment = result.metrics.attainment.all if result.metrics.attainment else 0.0
        print(f"[{config.label or config.backend}] rate {rate:.3f} req/s: SLO attainment {attainment:.1%}")
        _save_run(args, result, tag=f"{config.label or config.backend}-{rate:g}qps")
        return result

    if args.search_goodput:
        found = await search_goodput(run_at, _search_settings(args), args.num_gpus)
        return found.points
    return await sweep_rates(run_at, sorted(args.request_rates))


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
    config, requests, tokenizer = await _prepare(args, cli_args.base_url(args), args.label)
    points = await _rate_points(args, config, requests, tokenizer)
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
        config, requests, tokenizer = await _prepare(args, target.base_url, target.name)
        if args.search_goodput or args.request_rates:
            points = await _rate_points(args, config, requests, tokenizer)
            series[target.name] = points
            rows.append(_goodput_row(args, target, points))
        else:
            result = await _run(config, requests, tokenizer)
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


if __name__ == "__main__":
    sys.exit(main())
