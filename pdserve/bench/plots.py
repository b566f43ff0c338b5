"""PNG plots of benchmark results: latency CDFs of one run, SLO attainment vs request rate of sweeps
(and of the GPU grid's arms, workload by workload and TPOT target by target).

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
    curves = {name: [(p.request_rate, p.attainment) for p in points] for name, points in series.items()}
    return plot_attainment_curves(curves, path, target_attainment, num_gpus, title)


def plot_attainment_curves(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    target_attainment: float = 0.9,
    num_gpus: Mapping[str, int] | None = None,
    title: str = "SLO attainment vs request rate",
) -> Path:
    """Like `plot_attainment_vs_rate`, from plain (rate, attainment fraction) pairs (saved results)."""
    figure = Figure(figsize=(6.5, 4.2))
    _draw_attainment(figure.subplots(), curves, target_attainment, num_gpus, "requests meeting all SLOs (%)")
    figure.axes[0].set_title(title)
    return _save(figure, path)


# Panels of `plot_slo_attainment_panels`: key of the result JSON's slo_attainment dict, and its title.
_ATTAINMENT_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("all", "TTFT and TPOT"))


def plot_slo_attainment_panels(
    runs: Mapping[str, Sequence[tuple[float, Mapping[str, float]]]],
    path: str | Path,
    target_attainment: float = 0.9,
    num_gpus: Mapping[str, int] | None = None,
    title: str = "SLO attainment vs request rate",
) -> Path:
    """Three panels (TTFT, TPOT, both) of attainment vs rate, one line per system.

    `runs` maps a system to (request rate, the run's `slo_attainment` dict) pairs, as saved in every
    result JSON, so recorded runs are re-plotted without rerunning them.
    """
    figure = Figure(figsize=(15, 4.2))
    for axes, (key, label) in zip(figure.subplots(1, 3), _ATTAINMENT_PANELS, strict=True):
        curves = {
            name: [(rate, shares[key]) for rate, shares in points if key in shares]
            for name, points in runs.items()
        }
        _draw_attainment(axes, curves, target_attainment, num_gpus, f"requests meeting {label} SLO (%)")
        axes.set_title(label)
    figure.suptitle(title)
    return _save(figure, path)


def _draw_attainment(
    axes,
    curves: Mapping[str, Sequence[tuple[float, float]]],
    target_attainment: float,
    num_gpus: Mapping[str, int] | None,
    ylabel: str,
) -> None:
    for name, points in curves.items():
        ordered = sorted(points)
        gpus = (num_gpus or {}).get(name, 1)
        axes.plot([r / gpus for r, _ in ordered], [a * 100.0 for _, a in ordered], marker="o", label=name)
    axes.axhline(
        target_attainment * 100.0, color="gray", linestyle=":", label=f"{target_attainment:.0%} target"
    )
    axes.set_xlabel("request rate per GPU (req/s)" if num_gpus else "request rate (req/s)")
    axes.set_ylabel(ylabel)
    axes.set_ylim(0.0, 102.0)
    axes.grid(alpha=0.3)
    axes.legend()


def plot_attainment_grid(
    panels: Mapping[tuple[str, str], Sequence[tuple[str, Sequence[float], Sequence[float]]]],
    path: str | Path,
    target_attainment: float = 0.9,
    title: str = "",
    arms: Sequence[str] = (),
) -> Path:
    """The GPU grid's attainment curves: a row of panels per workload, a column per TPOT target.

    `panels` maps (workload title, TPOT target title) to its lines: (arm, rates per GPU,
    attainment fractions). Lines of one arm share a colour in every panel (several runs of an arm:
    several lines of its colour, labelled once), in the order of `arms` (default: as they come),
    so the panels read alike. Small on purpose (72 dpi, a palette): results folders keep it.
    """
    rows = list(dict.fromkeys(workload for workload, _ in panels))
    columns = list(dict.fromkeys(target for _, target in panels))
    figure = Figure(figsize=(3.0 * len(columns), 2.4 * len(rows) + 0.5))
    grid = np.atleast_2d(figure.subplots(len(rows), len(columns), squeeze=False))
    arms = list(dict.fromkeys([*arms, *(arm for lines in panels.values() for arm, _, _ in lines)]))
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    for axes in grid.flat:  # a workload without some target's lines leaves that panel out
        axes.set_visible(False)
    for (workload, target), lines in panels.items():
        axes = grid[rows.index(workload), columns.index(target)]
        axes.set_visible(True)
        for arm, rates, shares in lines:
            ordered = sorted(zip(rates, shares, strict=True))
            axes.plot([r for r, _ in ordered], [a * 100.0 for _, a in ordered], marker="o", markersize=3,
                      color=colours[arm], linewidth=1)
        axes.axhline(target_attainment * 100.0, color="gray", linestyle=":", linewidth=1)
        axes.set_ylim(0.0, 102.0)
        axes.set_title(f"{workload}, {target}", fontsize=8)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
    for axes in grid[-1]:
        axes.set_xlabel("req/s per GPU", fontsize=7)
    for axes in grid[:, 0]:
        axes.set_ylabel("% meeting both", fontsize=7)
    height = figure.get_figheight()  # inches: the title and legend get a fixed band at the top
    handles = [figure.axes[0].plot([], [], color=colours[arm], marker="o", markersize=3)[0] for arm in arms]
    figure.legend(handles, arms, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.18 / height),
                  ncol=min(len(arms), 6), fontsize=7, frameon=False)
    if title:
        figure.suptitle(title, fontsize=8, y=1 - 0.02 / height)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=72)
    _to_palette(path)
    return path


def _to_palette(path: Path, colours: int = 256) -> None:
    """Re-encode a PNG with an adaptive palette: a line plot needs few colours, and the file shrinks
    ~3x (a recorded results folder keeps its plots)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colours)
    small.save(path, optimize=True)


def plot_goodput_ranking(
    bars: Sequence[tuple[str, str, float]], path: str | Path, title: str = "Max goodput per GPU"
) -> Path:
    """Horizontal bars, best at the top: (candidate label, group e.g. deployment, goodput req/s per GPU).

    Bars of one group share a colour, so the pool split and the engine knobs read apart.
    """
    figure = Figure(figsize=(8, 0.35 * len(bars) + 1.5))
    axes = figure.subplots()
    groups = list(dict.fromkeys(group for _, group, _ in bars))
    colours = {group: f"C{i % 10}" for i, group in enumerate(groups)}
    ordered = list(reversed(bars))  # barh draws bottom-up
    axes.barh(
        range(len(ordered)), [v for _, _, v in ordered], color=[colours[g] for _, g, _ in ordered]
    )
    axes.set_yticks(range(len(ordered)), [label for label, _, _ in ordered])
    axes.set_xlabel("max goodput per GPU (req/s)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_title(title)
    return _save(figure, path)


# Background of the chaos plot's health strip, by /health status; other statuses are grey.
_HEALTH_COLOURS = {"ready": "tab:green", "degraded": "tab:orange", "down": "tab:red"}


def plot_chaos(report: Mapping, path: str | Path, title: str = "Chaos soak") -> Path:
    """Two panels: requests completed / failed / hung per time bucket, and engines serving per pool
    over a band of the /health status (both as polled, at each change); kills as vertical lines.

    `report` is `chaos.json` as `chaos_report.build_report` writes it, so a saved run re-plots.
    """
    buckets = report["timeline"]
    width = buckets[1]["t"] - buckets[0]["t"] if len(buckets) > 1 else 5.0
    starts = np.asarray([b["t"] for b in buckets], dtype=float)
    figure = Figure(figsize=(11, 6.5))
    requests, engines = figure.subplots(2, 1, sharex=True)
    bottom = np.zeros(len(buckets))
    for key, colour in (("completed", "tab:blue"), ("failed", "tab:red"), ("hung", "black")):
        counts = np.asarray([b[key] for b in buckets], dtype=float)
        requests.bar(starts, counts, width=width * 0.9, bottom=bottom, align="edge", color=colour, label=key)
        bottom += counts
    requests.set_ylabel(f"requests ended per {width:g} s")
    _draw_serving(engines, report["health_changes"], starts[-1] + width)
    for axes in (requests, engines):
        for kill in report["kills"]:
            axes.axvline(kill["t"], color="tab:purple", linestyle="--", linewidth=1)
        axes.axvline(report["duration_s"], color="gray", linestyle=":", linewidth=1)
        axes.grid(alpha=0.3)
    for t, text in [(k["t"], f"kill {k['replica']}") for k in report["kills"]] + [
            (report["duration_s"], "load ends")]:
        requests.annotate(text, (t, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                          ha="right", fontsize=8, color="tab:purple" if text != "load ends" else "gray",
                          bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})
    requests.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(title)
    return _save(figure, path)


def _draw_serving(axes, changes: Sequence[Mapping], end_s: float) -> None:
    """Engines serving per pool as steps, and the /health status as a band along the bottom."""
    times = [c["t"] for c in changes]
    for pool in sorted({pool for c in changes for pool in c["serving"]}):
        counts = [c["serving"].get(pool, np.nan) for c in changes]
        axes.step([*times, end_s], [*counts, counts[-1]], where="post", label=pool, linewidth=2)
    seen: set[str] = set()
    for change, until in zip(changes, [*times[1:], end_s], strict=False):  # no polls: nothing
        status = change["status"]
        axes.axvspan(change["t"], until, ymin=0.0, ymax=0.04, alpha=0.8, linewidth=0,
                     color=_HEALTH_COLOURS.get(status, "tab:gray"), label=None if status in seen else status)
        seen.add(status)
    axes.set_ylabel("engines serving (band: /health)")
    axes.set_xlabel("time since the soak began (s)")
    axes.set_ylim(bottom=-0.3)
    if changes:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="pool / health")
