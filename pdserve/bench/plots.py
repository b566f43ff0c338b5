"""PNG plots of benchmark results: latency CDFs of one run, SLO attainment vs request rate of sweeps.

Figures are built with `matplotlib.figure.Figure` and rendered by the Agg canvas directly, never through
pyplot: no GUI backend is needed on a headless benchmark host, and no global pyplot state leaks between
plots (or into an application that imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdserve.bench.runner import BenchmarkResult
from pdserve.bench.sweep import SweepPoint

_CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"))


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def _latencies_ms(result: BenchmarkResult, metric: str) -> np.ndarray:
    if metric == "tpot":
        return np.asarray(result.metrics.tpots_s, dtype=float) * 1000.0
    done = [o for o in result.outcomes if o.success]
    seconds = [o.ttft_s for o in done] if metric == "ttft" else [o.e2el_s for o in done]
    return np.asarray(seconds, dtype=float) * 1000.0


def plot_latency_cdfs(result: BenchmarkResult, path: str | Path, title: str | None = None) -> Path:
    """TTFT, TPOT and E2EL CDFs side by side, with the run's SLO targets drawn as vertical lines."""
    figure = Figure(figsize=(13, 3.8))
    targets = result.config.slo.as_dict()
    for axes, (metric, label) in zip(figure.subplots(1, 3), _CDF_METRICS, strict=True):
        values = np.sort(_latencies_ms(result, metric))
        if len(values):
            axes.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        if metric in targets:
            axes.axvline(
                targets[metric], color="tab:red", linestyle="--", label=f"SLO {targets[metric]:g} ms"
            )
            axes.legend(loc="lower right")
        axes.set_xlabel(f"{label} (ms)")
        axes.set_ylabel("fraction of requests")
        axes.set_ylim(0.0, 1.02)
        axes.grid(alpha=0.3)
    figure.suptitle(title or _default_title(result))
    return _save(figure, path)


def _default_title(result: BenchmarkResult) -> str:
    config = result.config
    return f"{config.label or config.backend} - {config.endpoint.model} - {len(result.requests)} requests"


def plot_attainment_vs_rate(
    series: Mapping[str, Sequence[SweepPoint]],
    path: str | Path,
    target_attainment: float = 0.9,
    num_gpus: Mapping[str, int] | None = None,
    title: str = "SLO attainment vs request rate",
) -> Path:
    """One line per named system: attainment (%) over offered rate, per GPU when `num_gpus` is given."""
    figure = Figure(figsize=(6.5, 4.2))
    axes = figure.subplots()
    for name, points in series.items():
        ordered = sorted(points, key=lambda p: p.request_rate)
        gpus = (num_gpus or {}).get(name, 1)
        rates = [p.request_rate / gpus for p in ordered]
        axes.plot(rates, [p.attainment * 100.0 for p in ordered], marker="o", label=name)
    axes.axhline(
        target_attainment * 100.0, color="gray", linestyle=":", label=f"{target_attainment:.0%} target"
    )
    axes.set_xlabel("request rate per GPU (req/s)" if num_gpus else "request rate (req/s)")
    axes.set_ylabel("requests meeting all SLOs (%)")
    axes.set_ylim(0.0, 102.0)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(title)
    return _save(figure, path)
