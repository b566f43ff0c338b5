"""A simulated run in the benchmark harness's terms: outcomes, metrics, JSON, plots.

Small runs (`SimConfig.keep_requests`) become the harness's own `RequestOutcome`s and go through
`pdserve.bench.metrics.compute_metrics` and `pdserve.bench.report.result_json`: the same metric
names, JSON keys (`median_ttft_ms`, `p99_tpot_ms`, `request_goodput`, `slo_attainment`, ...) and
rules (TPOT = (E2EL - TTFT) / (output - 1), failed requests meet no SLO) as a measured run. Large
runs keep only per-request latencies in numpy arrays (`LatencyRecorder`), summarised with the
harness's `LatencyStats` and the same goodput/attainment rules, under the same keys.

The `simulation` section adds what only a simulation knows: topology, GPU-hours, every scaling
decision with its reason, pool sizes over time, rejections, events and wall time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.client import EndpointConfig, RequestOutcome
from pdserve.bench.metrics import LatencyStats, compute_metrics, percentile_label
from pdserve.slo import SloTargets
from pdserve.bench.report import result_json
from pdserve.bench.runner import BenchmarkResult, RunConfig
from pdserve.bench.workloads import BenchRequest
from pdserve.sim.engine import SimRequest
from pdserve.sim.runner import SimConfig, SimRun


def request_outcome(req: SimRequest, response: Callable[[int], float]) -> RequestOutcome:
    """One simulated request as the benchmark client would have recorded it (`response`: the
    response path for a prompt's tokens, `EngineProfile.response_of`)."""
    if req.error:
        return RequestOutcome(success=False, prompt_len=req.prompt, start_s=req.arrival,
                              error=req.error)
    response_s = response(req.prompt)
    first = req.first_token + response_s
    itls: tuple[float, ...] = ()
    steps = req.step_engine.step_ends if req.step_engine is not None else None
    if req.output > 1 and steps is not None:
        # Tokens 2.. came out at the ends of steps join+1 .. join+output-1 (1-based).
        times = [req.first_token, *steps[req.join_step: req.join_step + req.output - 1]]
        itls = tuple(float(b - a) for a, b in zip(times, times[1:]))
    return RequestOutcome(
        success=True, prompt_len=req.prompt, start_s=req.arrival, ttft_s=first - req.arrival,
        itls_s=itls, e2el_s=req.finish + response_s - req.arrival, output_tokens=req.output,
        prompt_tokens=req.prompt, chunk_count=req.output)


def bench_result(run: SimRun, slo: SloTargets | None = None,
                 percentiles: Sequence[float] = (50.0, 90.0, 99.0), label: str = "sim",
                 dataset_name: str = "sim", request_rate: float = math.inf,
                 burstiness: float = 1.0) -> BenchmarkResult:
    """The run as a harness `BenchmarkResult` (needs `keep_requests`)."""
    outcomes = [request_outcome(r, run.config.profile.response_of) for r in run.requests]
    duration = max(run.end_s - (float(run.workload.arrivals[0]) if len(run.workload) else 0.0),
                   1e-9)
    slo = slo or SloTargets()
    metrics = compute_metrics(outcomes, duration, tuple(percentiles), slo)
    config = RunConfig(
        endpoint=EndpointConfig(base_url=f"sim://{run.config.topology.name}",
                                model=run.config.profile.name),
        arrivals=ArrivalSpec(request_rate=request_rate, burstiness=burstiness),
        percentiles=tuple(percentiles), slo=slo, label=label, dataset_name=dataset_name,
        disable_tqdm=True)
    requests = tuple(BenchRequest(prompt="", prompt_len=r.prompt, output_len=r.output)
                     for r in run.requests)
    return BenchmarkResult(config=config, requests=requests, outcomes=tuple(outcomes),
                           arrival_offsets_s=tuple(r.arrival for r in run.requests),
                           duration_s=duration, metrics=metrics, date="simulated",
                           run_start_s=float(run.workload.arrivals[0]) if len(run.workload) else 0.0)


class LatencyRecorder:
    """Per-request TTFT / TPOT / E2EL in arrays, filled by `Simulation.on_request_done`."""

    def __init__(self, count: int, response: Callable[[int], float]) -> None:
        self.ttft = np.full(count, np.nan)
        self.tpot = np.full(count, np.nan)
        self.e2el = np.full(count, np.nan)
        self.prompt = np.zeros(count, np.int64)
        self.output = np.zeros(count, np.int64)
        self._response = response  # EngineProfile.response_of

    def __call__(self, req: SimRequest) -> None:
        i = req.index
        self.prompt[i] = req.prompt
        if req.error:
            return
        self.output[i] = req.output
        response_s = self._response(req.prompt)
        self.ttft[i] = req.first_token + response_s - req.arrival
        self.e2el[i] = req.finish + response_s - req.arrival
        if req.output > 1:
            self.tpot[i] = (req.finish - req.first_token) / (req.output - 1)

    def summary(self, duration_s: float, slo: SloTargets | None,
                percentiles: Sequence[float]) -> dict[str, Any]:
        """The harness's keys for what a large run keeps (no ITLs, no per-request lists)."""
        ok = ~np.isnan(self.ttft)
        out: dict[str, Any] = {
            "duration": duration_s, "completed": int(ok.sum()), "failed": int((~ok).sum()),
            "total_input_tokens": int(self.prompt[ok].sum()),
            "total_output_tokens": int(self.output[ok].sum()),
            "request_throughput": float(ok.sum() / duration_s),
            "output_throughput": float(self.output[ok].sum() / duration_s),
        }
        values = {"ttft": self.ttft[ok], "tpot": self.tpot[ok & ~np.isnan(self.tpot)],
                  "e2el": self.e2el[ok]}
        for metric, data in values.items():
            stats = LatencyStats.of(data.tolist(), tuple(percentiles))
            out[f"mean_{metric}_ms"] = stats.mean_ms
            out[f"median_{metric}_ms"] = stats.median_ms
            out[f"std_{metric}_ms"] = stats.std_ms
            for p, v in stats.percentiles_ms:
                out[f"p{percentile_label(p)}_{metric}_ms"] = v
        if slo:
            tpot0 = np.where(np.isnan(self.tpot), 0.0, self.tpot)  # one-token requests meet TPOT
            observed = {"ttft": self.ttft, "tpot": tpot0, "e2el": self.e2el}
            verdicts = {name: ok & (target / 1000.0 >= np.nan_to_num(observed[name], nan=np.inf))
                        for name, target in slo.items()}
            every = np.logical_and.reduce(list(verdicts.values()))
            total = max(len(self.ttft), 1)
            out["request_goodput"] = float(every.sum() / duration_s)
            out["goodput_slos"] = slo.as_dict()
            out["slo_attainment"] = {**{k: float(v.sum() / total) for k, v in verdicts.items()},
                                     "all": float(every.sum() / total)}
        return out


def config_section(cfg: SimConfig) -> dict[str, Any]:
    """What was simulated: topology, bounds, profile, SLO (both simulators' `simulation`)."""
    return {
        "topology": cfg.topology.name,
        "pools_initial": dict(cfg.topology.pools),
        "bounds": ({p: [b.min_replicas, b.max_replicas] for p, b in cfg.topology.bounds.items()}
                   if cfg.topology.bounds else None),
        "profile": cfg.profile.name,
        "slo_targets_s": ({"ttft": cfg.slo.ttft_s, "tpot": cfg.slo.tpot_s,
                           "percentile": cfg.slo.percentile} if cfg.slo else None),
    }


def simulation_section(run: SimRun) -> dict[str, Any]:
    cfg = run.config
    n = len(run.workload)
    return {
        **config_section(cfg),
        "simulated_s": run.end_s,
        "gpu_hours": run.gpu_hours(),
        "gpu_hours_by_pool": run.gpu_hours_by_pool(),
        "engines_started": len(run.engines),
        "rejected": run.rejected,
        "scaling_decisions": [
            {"t_s": t, "pool": d.pool, "from": d.current, "to": d.target, "reason": d.reason,
             "detail": d.detail} for t, d in run.decisions],
        "pool_sizes": [
            {"t_s": s.t, "pool": s.pool, "ready": s.ready, "starting": s.starting,
             "draining": s.draining, "kv_usage": round(s.kv_usage, 4), "busy": round(s.busy, 4)}
            for s in run.samples],
        "wall_s": run.wall_s,
        "events": run.events,
        "simulated_requests_per_wall_s": n / run.wall_s if run.wall_s > 0 else None,
    }


def run_json(run: SimRun, slo: SloTargets | None = None,
             percentiles: Sequence[float] = (50.0, 90.0, 99.0), per_request: bool = False,
             recorder: LatencyRecorder | None = None, **labels: Any) -> dict[str, Any]:
    """Harness-keyed JSON of a run plus its `simulation` section."""
    if recorder is not None:
        duration = max(run.end_s - float(run.workload.arrivals[0]), 1e-9) if len(run.workload) else 1e-9
        body = {"label": labels.get("label", "sim"), "num_prompts": len(run.workload),
                **recorder.summary(duration, slo, percentiles)}
    else:
        body = result_json(bench_result(run, slo, percentiles, **labels))
        if not per_request:
            for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                        "queue_times", "errors"):
                body.pop(key, None)
    body["simulation"] = simulation_section(run)
    return body


def plot_pool_sizes(run: SimRun, path: str | Path, title: str = "") -> Path:
    """Engines per pool over time (ready / starting), scaling decisions marked with reasons."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    pools = sorted({s.pool for s in run.samples})
    for pool in pools:
        pts = [s for s in run.samples if s.pool == pool]
        t = np.array([s.t for s in pts]) / 3600
        ax.step(t, [s.ready + s.starting + s.draining for s in pts], where="post",
                label=f"{pool} (provisioned)")
        ax.step(t, [s.ready for s in pts], where="post", linestyle=":", label=f"{pool} (ready)")
    for t, d in run.decisions:
        ax.axvline(t / 3600, color="green" if d.delta > 0 else "red", alpha=0.08, linewidth=0.8)
    ax.set_xlabel("hours")
    ax.set_ylabel("engines")
    ax.set_title(title or f"{run.config.topology.name}: pool sizes")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
