"""Result files and printouts of a benchmark run: vllm-compatible JSON, per-request CSV, text summary.

The JSON uses `vllm bench serve`'s keys wherever the two overlap (header: date, backend, label, model_id,
tokenizer_id, num_prompts, request_rate, burstiness, max_concurrency; body: duration, completed, failed,
token totals, throughputs, request_goodput, per-request lists, and `{mean,median,std,pNN}_{metric}_ms`),
so scripts and plots written for vllm results read ours unchanged. Our additions sit under their own keys
(`slo_attainment`, `goodput_slos`, `dataset_name`, ...). File names follow vllm's pattern too:
`{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import (
    LATENCY_METRICS,
    BenchmarkMetrics,
    input_length,
    percentile_label,
    request_tpot_s,
)
from pdserve.bench.runner import BenchmarkResult, describe_rate

DEFAULT_PERCENTILE_METRICS = LATENCY_METRICS
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
CSV_COLUMNS = (
    "index",
    "arrival_s",
    "start_s",
    "queued_s",
    "success",
    "prompt_len",
    "server_prompt_tokens",
    "output_len",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "chunks",
    "mean_itl_ms",
    "max_itl_ms",
    "error",
)


def result_json(
    result: BenchmarkResult,
    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
    include_texts: bool = False,
) -> dict[str, Any]:
    """The run as a JSON-ready dict with vllm bench serve's keys (see the module docstring).

    Per-request lists (ttfts, itls, input_lens, ...) are always included: goodput and attainment can be
    recomputed from them offline. vllm keeps them only under --save-detailed; the generated texts, the
    one list that grows with output size, are likewise kept only when `include_texts` is set.
    """
    config, metrics = result.config, result.metrics
    header: dict[str, Any] = {
        "date": result.date,
        "endpoint_type": config.backend,
        "backend": config.backend,
        "label": config.label,
        "model_id": config.endpoint.model,
        "tokenizer_id": config.tokenizer_id,
        "num_prompts": len(result.requests),
        "request_rate": describe_rate(config.arrivals.request_rate),
        "burstiness": config.arrivals.burstiness,
        "max_concurrency": config.max_concurrency,
        "base_url": config.endpoint.base_url,
        "endpoint": config.endpoint.endpoint,
        "dataset_name": config.dataset_name,
        "arrivals": config.arrivals.distribution,
        "num_warmups": config.num_warmups,
        "seed": config.seed,
    }
    if config.arrival_seed is not None:
        header["arrival_seed"] = config.arrival_seed
    body = _body(result, metrics)
    if not include_texts:
        del body["generated_texts"]
    for metric in percentile_metrics:
        body.update(_metric_keys(metric, metrics))
    return {**header, **body}


def _body(result: BenchmarkResult, metrics: BenchmarkMetrics) -> dict[str, Any]:
    outcomes, slo = result.outcomes, result.config.slo
    return {
        "duration": result.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if slo else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "goodput_slos": slo.as_dict() if slo else None,
        "slo_attainment": metrics.attainment.as_dict() if metrics.attainment else None,
        "input_lens": [input_length(o) for o in outcomes],
        "output_lens": list(metrics.output_lens),
        "ttfts": [o.ttft_s for o in outcomes],
        "itls": [list(o.itls_s) for o in outcomes],
        "latencies": [o.e2el_s for o in outcomes],
        "start_times": [o.start_s - result.run_start_s for o in outcomes],
        "queue_times": [o.queued_s for o in outcomes],
        "generated_texts": [o.generated_text for o in outcomes],
        "errors": [o.error for o in outcomes],
    }


def _metric_keys(metric: str, metrics: BenchmarkMetrics) -> dict[str, float]:
    stats = metrics.stats(metric)
    keys = {
        f"mean_{metric}_ms": stats.mean_ms,
        f"median_{metric}_ms": stats.median_ms,
        f"std_{metric}_ms": stats.std_ms,
    }
    for p, value in stats.percentiles_ms:
        keys[f"p{percentile_label(p)}_{metric}_ms"] = value
    return keys


def default_result_filename(result: BenchmarkResult) -> str:
    """vllm's name: {label or backend}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json."""
    config = result.config
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    rate = config.arrivals.request_rate
    rate_text = "trace" if config.arrivals.use_trace_timestamps else ("inf" if math.isinf(rate) else rate)
    model = config.endpoint.model.rstrip("/").split("/")[-1]
    return f"{config.label or config.backend}-{rate_text}qps{concurrency}-{model}-{result.date}.json"


def save_json(payload: dict[str, Any], path: str | Path) -> Path:
    """Write a result dict as JSON (infinities as "inf", which JSON cannot hold), creating parents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        json.dump(json_safe(payload), out, indent=2)
        out.write("\n")
    return path


def json_safe(value: Any) -> Any:
    """The value with infinities as "inf"/"-inf" strings and tuples as lists (what save_json writes)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def save_csv(result: BenchmarkResult, path: str | Path) -> Path:
    """One row per request: arrival, queueing, lengths and latencies (ms), for spreadsheets and pandas."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS)
        for index, row in enumerate(_csv_rows(result)):
            writer.writerow([index, *row])
    return path


def _csv_rows(result: BenchmarkResult) -> list[list[Any]]:
    rows = []
    parts = zip(result.outcomes, result.metrics.output_lens, result.arrival_offsets_s, strict=True)
    for outcome, output_len, arrival in parts:
        tpot = request_tpot_s(outcome, output_len) if outcome.success else None
        itls = outcome.itls_s
        rows.append(
            [
                f"{arrival:.6f}",
                f"{outcome.start_s - result.run_start_s:.6f}",
                f"{outcome.queued_s:.6f}",
                int(outcome.success),
                outcome.prompt_len,
                "" if outcome.prompt_tokens is None else outcome.prompt_tokens,
                output_len,
                _ms(outcome.ttft_s if outcome.success else None),
                _ms(tpot),
                _ms(outcome.e2el_s if outcome.success else None),
                outcome.chunk_count,
                _ms(sum(itls) / len(itls) if itls else None),
                _ms(max(itls) if itls else None),
                outcome.error,
            ]
        )
    return rows


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000.0:.3f}"


def format_summary(
    result: BenchmarkResult, percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS
) -> str:
    """The result table as vllm bench serve prints it, plus an SLO attainment section."""
    config, metrics = result.config, result.metrics
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    rows: list[tuple[str, Any]] = [("Successful requests:", metrics.completed)]
    rows.append(("Failed requests:", metrics.failed))
    if config.max_concurrency is not None:
        rows.append(("Maximum request concurrency:", config.max_concurrency))
    if not math.isinf(config.arrivals.request_rate) and not config.arrivals.use_trace_timestamps:
        rows.append(("Request rate configured (RPS):", config.arrivals.request_rate))
    rows += [
        ("Benchmark duration (s):", result.duration_s),
        ("Total input tokens:", metrics.total_input),
        ("Total generated tokens:", metrics.total_output),
        ("Request throughput (req/s):", metrics.request_throughput),
    ]
    if config.slo:
        rows.append(("Request goodput (req/s):", metrics.request_goodput))
    rows += [
        ("Output token throughput (tok/s):", metrics.output_throughput),
        ("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        ("Peak concurrent requests:", metrics.max_concurrent_requests),
        ("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    lines += [_row(name, value) for name, value in rows]
    for metric in percentile_metrics:
        lines += _metric_lines(metric, metrics)
    if metrics.attainment is not None:
        lines.append("{:-^50}".format("SLO Attainment"))
        for name, target in config.slo.items():
            share = dict(metrics.attainment.per_slo)[name]
            lines.append(_row(f"{name.upper()} <= {target:g} ms (%):", share * 100.0))
        lines.append(_row("All targets met (%):", metrics.attainment.all * 100.0))
    lines.append("=" * 50)
    return "\n".join(lines)


def _metric_lines(metric: str, metrics: BenchmarkMetrics) -> list[str]:
    short, title = _HEADERS[metric]
    stats = metrics.stats(metric)
    lines = [f"{title:-^50}"]
    lines.append(_row(f"Mean {short} (ms):", stats.mean_ms))
    lines.append(_row(f"Median {short} (ms):", stats.median_ms))
    for p, value in stats.percentiles_ms:
        lines.append(_row(f"P{percentile_label(p)} {short} (ms):", value))
    return lines


def _row(name: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{name:<40} {value:<10.2f}"
    return f"{name:<40} {value!s:<10}"
