"""The grid's results over any number of arm records: goodput per GPU cell by cell with its spread
over runs, the best pdserve arm of each cell, and pdserve's TTFT overhead over plain vLLM request by
request.

A *run* is one arm's sweep of one workload from one start of that arm (`benchmarks/gpu/proof.py run`
writes one record per start, holding a sweep per workload; issue 9's records, one workload and no
`sweeps`, read as `isl2k` runs). `load_runs` reads a folder's records; `merge_runs` copies the runs of
several folders (sessions) into one, once each. A *cell* is (workload, TTFT target, TPOT target):
`cells` gives, per arm, the goodput per GPU of each of its runs (the highest probed rate at which
>= 90% of requests met both targets, below every failing rate, over the arm's GPUs) as a median with
min/max over runs, and the best pdserve arm by that median. `ttft_overheads` pairs each pdserve
colocated-N run with each vllm-N run of the same workload, rate, seed and request count, and takes
per rate the median of pdserve's TTFT minus vLLM's over the requests both completed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.arms import (
    ENGINE, LEGACY_TPOT_TARGETS_MS, PDSERVE_KINDS, TTFT_MS, ArmSpec, arm_spec,
)
from pdserve.bench.grid import WORKLOADS, bracket, passes

SCHEMA = 2  # records with a sweep per workload (proof.py since issue 31); 1: issue 9's
LEGACY_WORKLOAD = "isl2k"
_KIND_ORDER = {"disagg": 0, "colocated": 1, "vllm": 2}


@dataclass(frozen=True, slots=True)
class Run:
    """One arm's sweep of one workload from one start of the arm."""

    run_id: str
    arm: str  # canonical (ArmSpec.canonical): records of several sessions join under it
    workload: str
    ttft_ms: float
    tpot_targets: tuple[str, ...]  # the attainment keys its rows carry ("8", "10", ...)
    num_gpus: int
    rows: tuple[dict, ...]  # proof.py's rate rows, by rate
    engine: dict
    source: str
    mock: bool = False

    @property
    def spec(self) -> ArmSpec:
        return arm_spec(self.arm)


def run_id_of(record: dict, source: str) -> str:
    """A record's run id: its own (schema 2), else one derived from what identifies its start."""
    if record.get("run_id"):
        return record["run_id"]
    key = json.dumps([record["arm"], record.get("start_s"), record.get("commands")], sort_keys=True)
    return f"legacy-{record['arm']}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def runs_of(record: dict, source: str) -> list[Run]:
    """The runs of one arm record (either schema)."""
    spec = arm_spec(record["arm"])
    run_id = run_id_of(record, source)
    if "sweeps" in record:
        sweeps = record["sweeps"]
    else:  # issue 9: one workload, its rates at the top
        sweeps = [{"workload": LEGACY_WORKLOAD, "ttft_ms": record.get("ttft_ms", TTFT_MS),
                   "tpot_targets_ms": record.get("tpot_targets_ms", LEGACY_TPOT_TARGETS_MS),
                   "rates": record["rates"]}]
    return [Run(f"{run_id}/{sweep['workload']}", spec.canonical, sweep["workload"], float(sweep["ttft_ms"]),
                tuple(f"{x:g}" for x in sweep["tpot_targets_ms"]), record["num_gpus"],
                tuple(sorted(sweep["rates"], key=lambda row: row["rate"])), record.get("engine") or {},
                source, bool(record.get("mock")))
            for sweep in sweeps if sweep["rates"]]


def is_arm_record(record: object, path: Path) -> bool:
    """Whether a JSON file is an arm record this module reads: any name for schema 2 (records carry
    their run id); issue 9's only under the arm's own name (its folders also keep the parts a
    merged ARM.json was joined from, e.g. colocated-4-i.json)."""
    if not isinstance(record, dict) or "arm" not in record:
        return False
    try:
        arm_spec(record["arm"])
    except argparse.ArgumentTypeError:
        return False
    if record.get("schema") == SCHEMA and "sweeps" in record:
        return True
    return "rates" in record and path.stem == record["arm"]


def load_records(folder: Path) -> list[tuple[Path, dict]]:
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if is_arm_record(record, path):
            records.append((path, record))
    return records


def load_runs(folder: Path) -> list[Run]:
    """Every run of the arm records in a folder, each once (by run id)."""
    runs: dict[str, Run] = {}
    for path, record in load_records(folder):
        for run in runs_of(record, str(path)):
            runs.setdefault(run.run_id, run)
    return sort_runs(runs.values())


def sort_runs(runs: Iterable[Run]) -> list[Run]:
    """Workloads in the grid's order (isl2k, isl8k, isl16k, mooncake; others after), then arms."""
    order = {name: i for i, name in enumerate(WORKLOADS)}
    return sorted(runs, key=lambda run: (order.get(run.workload, len(order)), run.workload,
                                         *arm_order(run.arm), run.run_id))


def arm_order(arm: str) -> tuple:
    """Disaggregated arms (by prefill share), adaptive, colocated, then plain vLLM; by GPUs."""
    spec = arm_spec(arm)
    return (_KIND_ORDER[spec.kind], -spec.prefill, spec.num_gpus, arm)


# --- goodput per cell -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Knee:
    """One run's knee at one target, per GPU: goodput (the bracket's lower end; 0 if even the
    lowest rate failed) and the first failing rate (None: never failed, a lower bound)."""

    goodput: float
    failed: float | None

    @property
    def lower_bound(self) -> bool:
        return self.failed is None


def knee(run: Run, target: str) -> Knee:
    knee_rates = bracket({row["rate"]: passes(row["attainment"][target]) for row in run.rows})
    per_gpu = lambda rate: None if rate is None else rate / run.num_gpus  # noqa: E731
    return Knee(per_gpu(knee_rates.passed) or 0.0, per_gpu(knee_rates.failed))


def spread(values: Sequence[float]) -> dict:
    return {"value": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def arm_cell(runs: Sequence[Run], target: str) -> dict:
    """One arm's goodput per GPU in one cell over its runs: median, min, max, runs; each run's
    bracket [goodput, first failing rate) per GPU."""
    knees = [knee(run, target) for run in runs]
    return {**spread([k.goodput for k in knees]), "lower_bound": any(k.lower_bound for k in knees),
            "brackets": [[k.goodput, k.failed] for k in knees], "run_ids": [run.run_id for run in runs]}


def cells(runs: Sequence[Run]) -> list[dict]:
    """One entry per (workload, TTFT target, TPOT target) measured: goodput per GPU of every arm
    measured there and of the best pdserve arm (named), each with its spread over runs."""
    out = []
    for workload, ttft_ms in dict.fromkeys((run.workload, run.ttft_ms) for run in runs):
        mine = [run for run in runs if (run.workload, run.ttft_ms) == (workload, ttft_ms)]
        targets = sorted({t for run in mine for t in run.tpot_targets}, key=float)
        for target in targets:
            by_arm: dict[str, list[Run]] = {}
            for run in mine:
                if target in run.tpot_targets:
                    by_arm.setdefault(run.arm, []).append(run)
            goodput = {arm: arm_cell(arm_runs, target)
                       for arm, arm_runs in sorted(by_arm.items(), key=lambda item: arm_order(item[0]))}
            cell = {"workload": workload, "ttft_ms": ttft_ms, "tpot_ms": float(target),
                    "goodput_per_gpu": goodput}
            best = pdserve_best(goodput)
            if best is not None:
                goodput["pdserve_best"] = best
                others = {arm: entry for arm, entry in goodput.items() if arm not in ("pdserve_best", best["arm"])}
                cell["pdserve_best_vs"] = {arm: _ratio(best["value"], entry["value"]) for arm, entry in others.items()}
                bounds = {arm: _bound(best, entry) for arm, entry in others.items()}
                if any(bounds.values()):
                    cell["pdserve_best_vs_bound"] = {arm: b for arm, b in bounds.items() if b}
            engines = {json.dumps(run.engine, sort_keys=True)
                       for arm_runs in by_arm.values() for run in arm_runs}
            if len(engines) > 1:
                cell["engine_settings_differ"] = True
            out.append(cell)
    return out


def pdserve_best(goodput: dict[str, dict]) -> dict | None:
    """The pdserve arm with the highest median goodput per GPU (the first in arm order on a tie)."""
    candidates = [(arm, entry) for arm, entry in goodput.items()
                  if arm != "pdserve_best" and arm_spec(arm).kind in PDSERVE_KINDS]
    if not candidates:
        return None
    arm, entry = max(candidates, key=lambda item: item[1]["value"])  # max keeps the first of equals
    # A pdserve arm that never failed may lie above the best found: the best is then a lower bound.
    lower_bound = any(other["lower_bound"] for _, other in candidates)
    return {"arm": arm, **{k: entry[k] for k in ("value", "min", "max", "runs")}, "lower_bound": lower_bound}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _bound(best: dict, other: dict) -> str | None:
    """What the best arm's ratio to `other` is, where either goodput is a lower bound: `at_least`
    (the best's is), `at_most` (the other's is), `unknown` (both); None where both are measured."""
    return {(True, True): "unknown", (True, False): "at_least", (False, True): "at_most"}.get(
        (best["lower_bound"], other["lower_bound"]))


# --- TTFT overhead, request by request ----------------------------------------------------------


def request_deltas(pdserve_row: dict, vllm_row: dict) -> list[float]:
    """pdserve's TTFT minus vLLM's, request by request, over the requests both completed; [] when
    the two rows did not send the same requests (seed, count) or lack per-request times."""
    sent = lambda row: (row.get("seed"), row.get("num_prompts"))  # noqa: E731
    if sent(pdserve_row) != sent(vllm_row):
        return []
    mine, theirs = pdserve_row.get("requests") or {}, vllm_row.get("requests") or {}
    if not mine.get("ttft_ms") or len(mine["ttft_ms"]) != len(theirs.get("ttft_ms") or ()):
        return []
    pairs = zip(mine["ttft_ms"], theirs["ttft_ms"], mine["ok"], theirs["ok"], strict=True)
    return [a - b for a, b, ok_a, ok_b in pairs if ok_a and ok_b]


def ttft_overheads(runs: Sequence[Run]) -> list[dict]:
    """Per workload and GPU count with both colocated-N and vllm-N runs: per rate, the median of
    request-by-request TTFT differences pooled over every (pdserve run, vLLM run) pair that
    measured it; and the median of those over rates."""
    out = []
    for workload in dict.fromkeys(run.workload for run in runs):
        mine = [run for run in runs if run.workload == workload]
        for gpus in sorted({run.num_gpus for run in mine}):
            ours = [run for run in mine if run.arm == f"colocated-{gpus}"]
            theirs = [run for run in mine if run.arm == f"vllm-{gpus}"]
            per_rate = _overhead_per_rate(ours, theirs)
            if per_rate:
                out.append({"workload": workload, "gpus": gpus, "pdserve": f"colocated-{gpus}",
                            "vllm": f"vllm-{gpus}",
                            "ms_p50": statistics.median(r["ms_p50"] for r in per_rate), "per_rate": per_rate})
    return out


def _overhead_per_rate(ours: Sequence[Run], theirs: Sequence[Run]) -> list[dict]:
    per_rate = []
    rates = sorted({row["rate"] for run in ours for row in run.rows})
    for rate in rates:
        deltas, pairs = [], 0
        for our_row in (row for run in ours for row in run.rows if row["rate"] == rate):
            for their_row in (row for run in theirs for row in run.rows if row["rate"] == rate):
                paired = request_deltas(our_row, their_row)
                pairs += bool(paired)
                deltas += paired
        if deltas:
            per_rate.append({"rate": rate, "ms_p50": statistics.median(deltas), "requests": len(deltas),
                             "pairs": pairs})
    return per_rate


def overhead_p50(overheads: Sequence[dict]) -> float | None:
    """The median over every (workload, GPU count, rate) of the per-rate medians."""
    values = [entry["ms_p50"] for pair in overheads for entry in pair["per_rate"]]
    return statistics.median(values) if values else None


# --- tables, summary, merge ---------------------------------------------------------------------


def _fmt(entry: dict) -> str:
    text = f"{entry['value']:.3g}"
    if entry["runs"] > 1:
        same = entry["min"] == entry["max"]
        text += (" " if same else f" [{entry['min']:.3g}-{entry['max']:.3g}] ") + f"x{entry['runs']}"
    return (">= " if entry["lower_bound"] else "") + text


_BOUND_PREFIX = {None: "", "at_least": ">= ", "at_most": "<= ", "unknown": "? "}


def markdown(cell_list: Sequence[dict]) -> str:
    """Per workload: a row per TPOT target, a column per arm, then the best pdserve arm and its
    ratio to each colocated and plain-vLLM arm (median goodput per GPU; [min-max] xN over N runs,
    the range left out where they agree; '>=': a run still passed at its highest rate; a ratio's
    '>=' / '<=' / '?': one or both of its goodputs is such a lower bound)."""
    blocks = []
    for workload, ttft_ms in dict.fromkeys((c["workload"], c["ttft_ms"]) for c in cell_list):
        mine = [c for c in cell_list if (c["workload"], c["ttft_ms"]) == (workload, ttft_ms)]
        arms = sorted({a for c in mine for a in c["goodput_per_gpu"] if a != "pdserve_best"}, key=arm_order)
        baselines = [a for a in arms if arm_spec(a).kind in ("vllm", "colocated")]
        header = ["TPOT", *arms, "best pdserve", *(f"best / {b}" for b in baselines)]
        lines = [f"{workload} (TTFT <= {ttft_ms:g} ms): goodput per GPU, req/s",
                 "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        for cell in mine:
            goodput = cell["goodput_per_gpu"]
            row = [f"<= {cell['tpot_ms']:g} ms", *(_fmt(goodput[a]) if a in goodput else "-" for a in arms)]
            best = goodput.get("pdserve_best")
            row.append(f"{best['arm']} {_fmt(best)}" if best else "-")
            for b in baselines:
                ratio = 1.0 if best and best["arm"] == b else cell.get("pdserve_best_vs", {}).get(b)
                prefix = _BOUND_PREFIX[cell.get("pdserve_best_vs_bound", {}).get(b)]
                row.append("-" if ratio is None else f"{prefix}{ratio:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def attainment_panels(runs: Sequence[Run]) -> dict[tuple[str, str], list[tuple[str, list, list]]]:
    """plots.plot_attainment_grid's input: per (workload, TPOT target), in order, a line per run:
    attainment over rate per GPU."""
    targets = sorted({t for run in runs for t in run.tpot_targets}, key=float)
    panels: dict[tuple[str, str], list[tuple[str, list, list]]] = {}
    for workload, ttft_ms in dict.fromkeys((run.workload, run.ttft_ms) for run in runs):
        for target in targets:
            lines = [(run.arm, [row["rate"] / run.num_gpus for row in run.rows],
                      [row["attainment"][target] for row in run.rows])
                     for run in runs if (run.workload, run.ttft_ms) == (workload, ttft_ms)
                     and target in run.tpot_targets]
            if lines:
                panels[(f"{workload} TTFT<={ttft_ms:g}", f"TPOT<={target} ms")] = lines
    return panels


def run_summary(run: Run) -> dict:
    def rate_row(row: dict) -> dict:
        bench = row["bench"]
        return {"rate": row["rate"], "attainment": row["attainment"],
                "ttft_p50_p90_ms": [bench.get("median_ttft_ms"), bench.get("p90_ttft_ms")],
                "tpot_p50_p90_ms": [bench.get("median_tpot_ms"), bench.get("p90_tpot_ms")],
                "failed": bench.get("failed")}

    return {"run_id": run.run_id, "arm": run.arm, "workload": run.workload, "gpus": run.num_gpus,
            "source": run.source, "mock": run.mock, "rates": [rate_row(row) for row in run.rows]}


def grid_summary(runs: Sequence[Run]) -> dict:
    """summary.json's grid part: cells, the TTFT overhead, the workloads and runs behind them."""
    cell_list = cells(runs)
    overheads = ttft_overheads(runs)
    workloads = {run.workload: WORKLOADS[run.workload].as_dict() for run in runs if run.workload in WORKLOADS}
    return {"cells": cell_list, "cells_markdown": markdown(cell_list),
            "ttft_overhead_ms_p50": overhead_p50(overheads), "ttft_overhead": overheads,
            "workloads": workloads, "engine_now": ENGINE, "mock": any(run.mock for run in runs),
            "runs": [run_summary(run) for run in runs]}


def upgraded(record: dict, source: str) -> dict:
    """A record in schema 2 (issue 9's: its rates as one `isl2k` sweep), with its run id."""
    if record.get("schema") == SCHEMA:
        return record
    sweep = {"workload": LEGACY_WORKLOAD, "ttft_ms": record.get("ttft_ms", TTFT_MS),
             "tpot_targets_ms": record.get("tpot_targets_ms", list(LEGACY_TPOT_TARGETS_MS)),
             "rates": record["rates"], "method": "rates"}
    rest = {k: v for k, v in record.items() if k not in ("rates", "isl", "osl", "ttft_ms", "tpot_targets_ms")}
    return {**rest, "schema": SCHEMA, "run_id": run_id_of(record, source), "sweeps": [sweep],
            "upgraded_from": source}


def merge_runs(sources: Sequence[Path], out: Path) -> int:
    """Copies the arm records of several folders (or record files) into `out`, each start once
    (by run id; issue 9's records upgraded to schema 2), so `summarize` on `out` tables every run
    with its spread."""
    out.mkdir(parents=True, exist_ok=True)
    present = {record.get("run_id") for _, record in load_records(out)}
    added = 0
    for source in sources:
        found = load_records(source) if source.is_dir() else [(source, json.loads(source.read_text()))]
        for path, record in found:
            record = upgraded(record, str(path))
            if record["run_id"] in present:
                continue
            present.add(record["run_id"])
            name = f"{arm_spec(record['arm']).canonical}.{record['run_id'].replace('/', '_')}.json"
            (out / name).write_text(json.dumps(record))
            added += 1
    print(f"{added} records added to {out} ({len(present)} there now)")
    return 0
