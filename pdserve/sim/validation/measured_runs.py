"""A measured serving run replayed in the simulator, and the comparison of the two.

A `pdserve bench serve` result JSON carries each request's send time, lengths, TTFT, ITLs and
latency. `replay` turns it into the simulator's workload (its own arrival offsets and lengths, so the
simulation sees the measured run request for request); `compare` puts the simulated metrics beside
the measured ones with the relative error; `compare_seeds` compares the median over simulations that
differ only in their step noise's seed. Repeats of one rate can be scored as one pool of requests
(`measured_outcomes`, `pooled_metrics`). `benchmarks/research/sim_validate.py` drives these.
"""

from __future__ import annotations

import numpy as np

from pdserve.bench.client import RequestOutcome
from pdserve.bench.metrics import compute_metrics
from pdserve.slo import SloTargets
from pdserve.sim.runner import Topology
from pdserve.sim.workload import Workload

METRICS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "request_goodput",
           "output_throughput")


def replay(measured: dict) -> Workload:
    """The measured run's own requests: arrival offsets and lengths."""
    ok = [e in ("", None) for e in measured["errors"]]
    starts = np.array(measured["start_times"], float)
    order = np.argsort(starts, kind="stable")
    prompts = np.array(measured["input_lens"], np.int64)
    outputs = np.array([n if n else 1 for n in measured["output_lens"]], np.int64)
    if not all(ok):
        print(f"note: {ok.count(False)} failed request(s) replayed with their nominal lengths")
    return Workload(starts[order] - starts.min(), prompts[order], outputs[order], "replay")


def topology(arm: str) -> Topology:
    return Topology.colocated(1) if arm == "colocated" else Topology.disaggregated(1, 1)


def compare(sim: dict, measured: dict) -> dict:
    row = {}
    for key in METRICS:
        m, s = measured.get(key), sim.get(key)
        if m is None or s is None:
            continue
        row[key] = {"measured": m, "sim": s, "error_pct": (s - m) / m * 100 if m else None}
    return row


def compare_seeds(sims: list[dict], measured: dict) -> dict:
    """`compare` against the median over simulations that differ only in their step noise's seed,
    each metric's lowest and highest value kept as `sim_range`; one simulation: `compare`."""
    if len(sims) == 1:
        return compare(sims[0], measured)
    median = {key: float(np.median([s[key] for s in sims])) for key in METRICS
              if all(s.get(key) is not None for s in sims)}
    row = compare(median, measured)
    for key, cell in row.items():
        values = [s[key] for s in sims]
        cell["sim_range"] = [min(values), max(values)]
    return row


def measured_outcomes(measured: dict) -> list[RequestOutcome]:
    """A bench result JSON's requests as the harness's outcomes (what compute_metrics reads)."""
    return [RequestOutcome(success=error in ("", None), prompt_len=prompt, start_s=start,
                           ttft_s=ttft or 0.0, itls_s=tuple(itls or ()), e2el_s=latency or 0.0,
                           output_tokens=output, error=error or "")
            for prompt, output, start, ttft, itls, latency, error in zip(
                measured["input_lens"], measured["output_lens"], measured["start_times"],
                measured["ttfts"], measured["itls"], measured["latencies"], measured["errors"],
                strict=True)]


def pooled_metrics(outcomes: list[RequestOutcome], duration_s: float, slo: SloTargets) -> dict:
    """The harness's metrics over the requests of several runs of one rate: percentiles over all
    their requests; goodput and throughput over the sum of the runs' durations."""
    m = compute_metrics(outcomes, duration_s, (50.0, 90.0, 99.0), slo)
    return {"median_ttft_ms": m.ttft.median_ms, "p90_ttft_ms": m.ttft.percentile(90.0),
            "median_tpot_ms": m.tpot.median_ms, "p90_tpot_ms": m.tpot.percentile(90.0),
            "request_goodput": m.request_goodput, "output_throughput": m.output_throughput}
