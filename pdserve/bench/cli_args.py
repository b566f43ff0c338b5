"""Flags of `pdserve bench` and their validation, kept apart from the commands that use them.

Names and defaults of flags shared with `vllm bench serve` are vllm's. Type functions reject malformed
values at parse time; `validate` checks what depends on several flags (a trace needs a path, token-id
prompts need /v1/completions, a sweep needs SLO targets) and reports through `parser.error`, so every
mistake surfaces as a normal argparse usage error before any request is sent.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from typing import Any

from pdserve.bench.metrics import LATENCY_METRICS
from pdserve.slo import SloTargets
from pdserve.bench.sweep import NamedTarget
from pdserve.bench.tune import Deployment, deployments_for_budget
from pdserve.bench.workloads import SHAPES, PromptFormat

DATASETS = ("random", *SHAPES, "mooncake")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    """A float > 0; "inf" is allowed (request rate and burstiness use it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _range_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _metric_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown metric(s) {unknown or text!r}; choose from {','.join(LATENCY_METRICS)}"
        )
    return names


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 < p <= 100.0 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_run_args(parser: argparse.ArgumentParser, with_target: bool = True) -> None:
    """Endpoint, workload, traffic and output flags of one run."""
    _add_endpoint_args(parser, with_target)
    _add_workload_args(parser)
    _add_traffic_args(parser)
    _add_output_args(parser)


def _add_endpoint_args(parser: argparse.ArgumentParser, with_target: bool) -> None:
    group = parser.add_argument_group("endpoint")
    if with_target:
        group.add_argument("--base-url", default=None, help="server base URL; default http://HOST:PORT")
        group.add_argument("--host", default="127.0.0.1")
        group.add_argument("--port", type=_positive_int, default=8000)
    group.add_argument(
        "--endpoint", default="/v1/completions", help="/v1/completions (default) or /v1/chat/completions"
    )
    group.add_argument("--model", default=None, help="model name; default: the server's first model")
    group.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    group.add_argument("--temperature", type=float, default=None, help="default: the server's")
    group.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="generate exactly the requested output lengths (default on)",
    )
    group.add_argument(
        "--extra-body", type=_json_object, default=None, help="JSON object merged into every request body"
    )


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random lengths, a synthetic shape (chat, code, summarization) or a Mooncake trace",
    )
    group.add_argument("--dataset-path", default=None, help="Mooncake JSONL trace (mooncake only)")
    group.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory or cached hub id, loaded offline (default: --model's own; the "
        "embedded checkpoint for the embedded model's name; else the path the server reports)",
    )
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument(
        "--prompt-format",
        choices=[f.value for f in PromptFormat],
        default="text",
        help="send text (the server tokenizes) or token ids (/v1/completions only)",
    )
    group.add_argument("--num-prompts", type=_positive_int, default=1000)
    group.add_argument("--random-input-len", type=_positive_int, default=1024)
    group.add_argument("--random-output-len", type=_positive_int, default=128)
    group.add_argument(
        "--random-range-ratio", type=_range_ratio, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]"
    )
    group.add_argument(
        "--length-scale",
        type=_positive_float,
        default=1.0,
        help="multiply chat/code/summarization lengths (small models, CPU runs)",
    )
    group.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="cut prompts so prompt + output fits this context",
    )
    group.add_argument(
        "--trace-speedup",
        type=_positive_float,
        default=1.0,
        help="replay trace timestamps this many times faster",
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--arrival-seed",
        type=int,
        default=None,
        help="draw the arrival schedule from this seed instead of --seed: the same arrivals with "
        "other prompts, so a repeat meets the same load without hitting the prefix cache",
    )


def _add_traffic_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("traffic")
    group.add_argument(
        "--request-rate",
        type=_positive_float,
        default=math.inf,
        help="requests/s (default inf: all at once; mooncake: trace timestamps)",
    )
    group.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier",
    )
    group.add_argument("--max-concurrency", type=_positive_int, default=None)
    group.add_argument(
        "--num-warmups", type=_non_negative_int, default=0, help="unmeasured requests sent before the run"
    )


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics and results")
    group.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLO targets, e.g. ttft:200 tpot:50 (keys ttft, tpot, e2el)",
    )
    group.add_argument(
        "--percentile-metrics",
        type=_metric_names,
        default=LATENCY_METRICS,
        help="comma-separated, from ttft,tpot,itl,e2el (default all)",
    )
    group.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=(90.0, 99.0),
        help='comma-separated percentiles (default "90,99")',
    )
    group.add_argument("--save-result", action="store_true", help="write JSON, CSV and PNG results")
    group.add_argument(
        "--save-detailed", action="store_true", help="also keep every generated text in the result JSON"
    )
    group.add_argument("--result-dir", default=None)
    group.add_argument("--result-filename", default=None)
    group.add_argument("--label", default=None, help="result label (default: the backend name)")
    group.add_argument("--no-plots", action="store_true", help="skip PNG plots when saving")
    group.add_argument("--disable-tqdm", action="store_true")


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweep and goodput search")
    group.add_argument(
        "--request-rates",
        type=_positive_float,
        nargs="+",
        default=None,
        metavar="RATE",
        help="rates to sweep (req/s)",
    )
    group.add_argument(
        "--search-goodput", action="store_true", help="search the highest rate meeting --target-attainment"
    )
    _add_search_args(group)
    group.add_argument(
        "--num-gpus",
        type=_positive_int,
        default=1,
        help="GPUs behind the endpoint, for per-GPU rates (sweep; compare reads gpus= from --target)",
    )


def _add_search_args(group: argparse._ArgumentGroup) -> None:
    """Goodput search settings (sweep.GoodputSearch), shared by sweep, compare and tune."""
    group.add_argument("--target-attainment", type=_fraction, default=0.9)
    group.add_argument("--search-start-rate", type=_positive_float, default=1.0)
    group.add_argument("--search-max-rate", type=_positive_float, default=1024.0)
    group.add_argument("--search-growth", type=_positive_float, default=2.0)
    group.add_argument(
        "--search-tolerance",
        type=_positive_float,
        default=0.05,
        help="stop when the pass/fail bracket is within this fraction",
    )
    group.add_argument("--search-max-probes", type=_positive_int, default=12)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="NAME=URL[,gpus=N]",
        help="an endpoint to compare; repeat; the first is the baseline",
    )


def _knob_value(text: str) -> int | None:
    """A knob value for the tuner's grids: a positive integer, or "default" (the engine's own)."""
    return None if text == "default" else _positive_int(text)


def _serve_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r}: {exc}") from None


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    """What `pdserve bench tune` searches and how it starts each candidate service."""
    group = parser.add_argument_group("tuning (each candidate is a `pdserve serve` the tuner starts)")
    group.add_argument(
        "--num-engines",
        type=_positive_int,
        default=None,
        help="engine (GPU) budget N: try colocated:N and every xPyD with x + y = N",
    )
    group.add_argument(
        "--deployments",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="deployments to try instead of all of --num-engines: xPyD (e.g. 3P1D) or colocated[:N]",
    )
    group.add_argument(
        "--num-seqs-list",
        type=_knob_value,
        nargs="+",
        default=[None],
        metavar="N|default",
        help="max_num_seqs values to try (as auto_tune's NUM_SEQS_LIST; default: the engine's)",
    )
    group.add_argument(
        "--num-batched-tokens-list",
        type=_knob_value,
        nargs="+",
        default=[None],
        metavar="N|default",
        help="max_num_batched_tokens values to try (as auto_tune's NUM_BATCHED_TOKENS_LIST)",
    )
    group.add_argument(
        "--serve-args",
        type=_serve_args,
        action="append",
        default=[],
        metavar="ARGS",
        help='extra `pdserve serve` flags for every candidate, one quoted string, e.g. "--engine mock"',
    )
    group.add_argument(
        "--num-cpus-per-engine",
        type=float,
        default=None,
        help="Ray CPUs each engine reserves in every pool (below 1 to fit N engines on a small host)",
    )
    group.add_argument(
        "--gpus-per-engine",
        type=_positive_int,
        default=1,
        help="GPUs each engine uses, for per-GPU goodput (set tensor parallelism itself in --serve-args)",
    )
    group.add_argument(
        "--prune-drop",
        type=_fraction,
        default=0.1,
        help="stop a max_num_seqs series once goodput falls this fraction below its best",
    )
    group.add_argument("--no-prune", action="store_true", help="evaluate every candidate")
    group.add_argument(
        "--resume", action="store_true", help="reuse the trials in --result-dir's tune.json (same settings)"
    )
    group.add_argument(
        "--start-timeout", type=_positive_float, default=900.0, help="seconds a service may take to start"
    )
    group.add_argument(
        "--start-retries",
        type=_non_negative_int,
        default=1,
        help="restarts of a service that failed to start",
    )
    _add_search_args(group)


# `pdserve serve` flags the tuner sets itself for every candidate.
_TUNER_OWNED_SERVE_FLAGS = ("--port", "--mode", "--replicas", "--prefill", "--decode", "--max-num-seqs")


def _validate_tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not args.goodput:
        parser.error("tune ranks by goodput: add --goodput ttft:MS tpot:MS")
    if args.num_engines is None and not args.deployments:
        parser.error("tune needs --num-engines N or --deployments SPEC...")
    try:
        args.deployment_list = deployments_of(args)
    except ValueError as exc:
        parser.error(f"--deployments: {exc}")
    passed = [flag for chunk in args.serve_args for flag in chunk]
    owned = sorted({flag.split("=")[0] for flag in passed} & set(_TUNER_OWNED_SERVE_FLAGS))
    if owned:
        parser.error(f"--serve-args must not set {', '.join(owned)}: the tuner sets them per candidate")
    settings = [flag.split("=")[0] for flag in passed if flag.startswith("engine.max_num")]
    if settings:
        parser.error(f"--serve-args must not set {', '.join(settings)}: use --num-seqs-list / "
                     "--num-batched-tokens-list")
    if args.search_start_rate > args.search_max_rate:
        parser.error("--search-start-rate must not exceed --search-max-rate")
    if args.search_growth <= 1.0:
        parser.error("--search-growth must be > 1")
    if args.num_cpus_per_engine is not None and args.num_cpus_per_engine < 0:
        parser.error("--num-cpus-per-engine must be >= 0")


def deployments_of(args: argparse.Namespace) -> list[Deployment]:
    """--deployments parsed (colocated without :N means --num-engines), or all splits of --num-engines."""
    if args.deployments:
        return [Deployment.parse(spec, args.num_engines) for spec in args.deployments]
    return deployments_for_budget(args.num_engines)


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Cross-flag checks; each failure is a `parser.error` naming the flags involved."""
    try:
        SloTargets.parse(args.goodput or [])
    except ValueError as exc:
        parser.error(f"--goodput: {exc}")
    if args.dataset_name == "mooncake" and not args.dataset_path:
        parser.error("--dataset-name mooncake needs --dataset-path TRACE.jsonl")
    if args.dataset_name != "mooncake" and args.dataset_path:
        parser.error(f"--dataset-path is only used with --dataset-name mooncake, not {args.dataset_name}")
    is_chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if args.prompt_format == PromptFormat.TOKEN_IDS.value and is_chat:
        parser.error("--prompt-format token-ids needs --endpoint /v1/completions")
    if args.bench_command in ("sweep", "compare"):
        _validate_rates(args, parser)
    if args.bench_command == "compare":
        _validate_targets(args, parser)
    if args.bench_command == "tune":
        _validate_tune(args, parser)


def _validate_rates(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.request_rates and args.search_goodput:
        parser.error("use either --request-rates or --search-goodput, not both")
    if args.request_rates and any(math.isinf(rate) for rate in args.request_rates):
        parser.error("--request-rates must be finite")
    sweeping = args.request_rates or args.search_goodput
    if args.bench_command == "sweep" and not sweeping:
        parser.error("sweep needs --request-rates RATE... or --search-goodput")
    if sweeping and not args.goodput:
        parser.error("SLO attainment needs targets: add --goodput ttft:MS tpot:MS")
    if args.search_goodput and args.search_start_rate > args.search_max_rate:
        parser.error("--search-start-rate must not exceed --search-max-rate")
    if args.search_goodput and args.search_growth <= 1.0:
        parser.error("--search-growth must be > 1")


def _validate_targets(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if len(args.target) < 2:
        parser.error("compare needs at least two --target NAME=URL entries")
    try:
        names = [NamedTarget.parse(spec).name for spec in args.target]
    except ValueError as exc:
        parser.error(f"--target: {exc}")
    if len(set(names)) != len(names):
        parser.error("--target names must be unique")


def slo_serve_args(args: argparse.Namespace, serve_args: list[str]) -> list[str]:
    """An adaptive deployment routes against the SLO: the goodput targets, unless --serve-args
    gave the service its own."""
    slo = SloTargets.parse(args.goodput)
    return [arg for flag, ms in (("--ttft-ms", slo.ttft_ms), ("--tpot-ms", slo.tpot_ms))
            if flag not in serve_args and ms is not None for arg in (flag, f"{ms:g}")]


def passthrough_serve_args(args: argparse.Namespace) -> list[str]:
    extra = [flag for chunk in args.serve_args for flag in chunk]
    if args.num_cpus_per_engine is not None:
        for pool in ("colocated", "prefill", "decode"):
            extra += ["--set", f"pools.{pool}.num_cpus={args.num_cpus_per_engine:g}"]
    return extra
