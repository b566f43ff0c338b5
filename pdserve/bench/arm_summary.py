"""The GPU proof's goodput tables over a folder of arm records, and one arm's records merged.

`summarize` reads every arm record (`benchmarks/gpu/proof.py run`) in a folder. Every record's runs
go into pdserve.bench.grid_summary's cells (goodput per GPU per workload and target, with the spread
over runs, the best pdserve arm, the TTFT overhead over plain vLLM), printed and written to
summary.json with attainment.png. Issue 9's records (one workload, ISL 2048, TTFT <= 500 ms) also get
their table of old: per TPOT target, an arm's goodput is the highest tested total rate at which
>= 90% of requests had TTFT <= 500 ms and TPOT <= the target, divided by its GPUs; '>=' where the
arm's highest measured rate still passed (a lower bound); each disaggregated arm is compared with
each baseline (summary.json's `goodput_per_gpu`, `lower_bound`, `table_markdown`, `arms`, and
goodput.png, as before). `merge` joins one arm's issue-9 records from several starts (its rates
split over device calls) into one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pdserve.bench import grid_summary
from pdserve.bench.arms import (
    ATTAINMENT, ISL, LEGACY_NAMES, LEGACY_TPOT_TARGETS_MS, OSL, POOLS, TIMINGS, TTFT_MS, arm_spec,
    counter_mean_ms, first_output_ms,
)

TPOT_TARGETS_MS = LEGACY_TPOT_TARGETS_MS  # the targets issue 9's records scored


def goodput(record: dict, tpot_ms: float) -> float:
    """Highest tested total rate with attainment >= ATTAINMENT at this TPOT target (0 if none)."""
    passing = [row["rate"] for row in record["rates"] if row["attainment"][f"{tpot_ms:g}"] >= ATTAINMENT]
    return max(passing, default=0.0)


def unbounded(record: dict, tpot_ms: float) -> bool:
    """Whether the arm's goodput at this target is only a lower bound: its highest measured
    rate still passed (the arm was not pushed until it failed)."""
    top = max(record["rates"], key=lambda row: row["rate"])
    return top["attainment"][f"{tpot_ms:g}"] >= ATTAINMENT


def summarize(results: Path, plots: bool = True) -> int:
    """The tables of the arm records in `results`: printed, and written to summary.json (with
    attainment.png, and goodput.png for issue 9's records, with `plots`)."""
    summary: dict = {}
    arms = load_arms(results)
    if arms:
        summary.update(_legacy_summary(arms))
    runs = grid_summary.load_runs(results)
    if not runs:
        print(f"no arm record with a measured rate in {results}")
        return 1
    summary.update(grid_summary.grid_summary(runs))
    print(("MOCK ENGINES (a CPU test of the scripts, not a measurement)\n" if summary["mock"] else "")
          + "Per-GPU goodput (req/s per GPU: the highest probed rate at which >= 90% of requests met the "
          "TTFT and TPOT targets, below every failing rate, over the arm's GPUs)\n\n"
          + summary["cells_markdown"])
    overhead = summary["ttft_overhead_ms_p50"]
    if overhead is not None:
        pairs = ", ".join(f"{o['workload']} {o['pdserve']} - {o['vllm']}: {o['ms_p50']:+.1f} ms over "
                          f"{len(o['per_rate'])} rates" for o in summary["ttft_overhead"])
        print(f"\nTTFT overhead, pdserve colocated minus vLLM request by request (median of per-rate "
              f"medians): {overhead:+.1f} ms ({pairs})")
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    if plots:
        try:
            from pdserve.bench.plots import plot_attainment_grid  # matplotlib, only when plotting
        except ImportError as exc:  # a GPU host's bundle may lack it: `summarize` here plots later
            print(f"no plots ({exc})")
            return 0
        plot_attainment_grid(grid_summary.attainment_panels(runs), results / "attainment.png",
                             title="Attainment (TTFT and TPOT) against rate per GPU",
                             arms=sorted({run.arm for run in runs}, key=grid_summary.arm_order))
        if arms:
            plot(arms, results)
    return 0


def _legacy_summary(arms: dict[str, dict]) -> dict:
    """Issue 9's table over its records (one workload), printed; summary.json's keys of old."""
    table = {
        name: {f"{x:g}": goodput(record, x) / record["num_gpus"] for x in TPOT_TARGETS_MS}
        for name, record in arms.items()
    }
    bounds = {name: {f"{x:g}": unbounded(record, x) for x in TPOT_TARGETS_MS}
              for name, record in arms.items()}
    disagg = [a for a in arms if arm_spec(a).kind == "disagg"]
    baselines = [b for kind in ("colocated", "vllm") for b in arms if arm_spec(b).kind == kind]
    pairs = [(d, b) for d in disagg for b in baselines]
    header = [arms[a]["label"] for a in arms]
    header += [f"{LEGACY_NAMES.get(d, d)} / {LEGACY_NAMES.get(b, b)}" for d, b in pairs]
    lines = ["| TPOT target | " + " | ".join(header) + " |"]
    lines.append("|---" * (len(arms) + len(pairs) + 1) + "|")
    for x in TPOT_TARGETS_MS:
        key = f"{x:g}"
        cells = [(">= " if bounds[a][key] else "") + f"{table[a][key]:g}" for a in arms]
        cells += [_ratio(table, bounds, d, b, key) for d, b in pairs]
        lines.append(f"| <= {key} ms | " + " | ".join(cells) + " |")
    text = ("Issue 9's records: per-GPU goodput (req/s per GPU; TTFT <= 500 ms and TPOT <= target for >= 90% "
            "of requests; '>=': the arm's highest measured rate still passed)\n")
    print(text + "\n".join(lines) + "\n")
    summary = {"goodput_per_gpu": table, "lower_bound": bounds, "table_markdown": "\n".join(lines),
               "arms": {}}
    for name, record in arms.items():
        summary["arms"][name] = {
            "label": record["label"],
            "start_s": record["start_s"],
            "commands": record["commands"],
            "gpus": record["host"].get("gpus"),
            "skipped_rates": record["skipped_rates"],
            "rates": [_rate_row(row) for row in record["rates"]],
            "pulls": _pull_stats(record.get("pull_log_ms", [])),
        }
    return summary


def load_arms(results: Path) -> dict[str, dict]:
    """Every issue-9 arm record (ARM.json with its rates at the top and no `sweeps`: newer records
    of one workload mirror those keys) in a results folder, in a stable order: disaggregated arms
    by prefill share, then colocated, then vLLM."""
    arms = {}
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            issue9 = isinstance(record, dict) and "rates" in record and "sweeps" not in record
            spec = arm_spec(record["arm"]) if issue9 else None
        except (ValueError, KeyError, argparse.ArgumentTypeError):
            spec = None
        if spec is not None and path.stem == record["arm"]:
            if record["rates"]:
                arms[record["arm"]] = record
            else:  # started but never measured (e.g. out of its time budget)
                print(f"{record['arm']}: no rate measured ({path.name}); left out of the table")
    order = {"disagg": 0, "colocated": 1, "vllm": 2}
    return dict(sorted(arms.items(), key=lambda item: (
        order[arm_spec(item[0]).kind], -arm_spec(item[0]).prefill, arm_spec(item[0]).num_gpus)))


def _ratio(table: dict, bounds: dict, num: str, den: str, key: str) -> str:
    """num / den at one target; '>=' or '<=' where one side is only a lower bound, '?' where
    both are."""
    if num not in table or den not in table:
        return "n/a"
    num_open, den_open = bounds[num][key], bounds[den][key]
    if table[den][key] == 0:
        return "inf" if table[num][key] > 0 else "n/a (both 0)"
    ratio = f"{table[num][key] / table[den][key]:.2f}x"
    if num_open and den_open:
        return f"? ({ratio} at the rates measured)"
    return (">= " if num_open else "<= " if den_open else "") + ratio


def _rate_row(row: dict) -> dict:
    b = row["bench"]
    out = {
        "rate": row["rate"],
        "throughput": b["request_throughput"],
        "ttft_p50_p90_ms": [b["median_ttft_ms"], b["p90_ttft_ms"]],
        "tpot_p50_p90_ms": [b["median_tpot_ms"], b["p90_tpot_ms"]],
        "attainment": row["attainment"],
        "failed": b["failed"],
    }
    if row.get("kv") and row["kv"].get("pulls"):
        out["kv_pull_ms_mean"] = row["kv"]["seconds"] / row["kv"]["pulls"] * 1e3
    for pool in POOLS:
        if (mean_ms := first_output_ms(row.get("kv") or {}, pool)) is not None:
            out[f"engine_first_output_ms_mean_{pool}"] = mean_ms
    counters = row.get("kv") or {}
    for timing in TIMINGS:
        for suffix in ("", *(f"_{pool}" for pool in POOLS)):
            if (mean := counter_mean_ms(counters, timing, suffix)) is not None:
                out[f"{timing}_ms_mean{suffix}"] = mean
    return out


def _pull_stats(pulls: list[list[float]]) -> dict:
    """Pull times of full ISL-token prompts (the decode engine's log), in ms."""
    full = sorted(ms for blocks, mib, ms in pulls if mib >= ISL * 128 / 1024 * 0.99)
    if not full:
        return {"count": 0}
    pick = lambda q: full[min(len(full) - 1, int(q * len(full)))]  # noqa: E731
    return {"count": len(full), "p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99),
            "mean_ms": statistics.fmean(full)}  # fmt: skip


def plot(arms: dict, results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TPOT_TARGETS_MS) + 2, figsize=(5 * (len(TPOT_TARGETS_MS) + 2), 4))
    for name, record in arms.items():
        per_gpu = [row["rate"] / record["num_gpus"] for row in record["rates"]]
        label = record["label"]
        for ax, x in zip(axes, TPOT_TARGETS_MS, strict=False):
            ax.plot(per_gpu, [row["attainment"][f"{x:g}"] for row in record["rates"]], "o-", label=label)
            ax.set_title(f"TTFT <= {TTFT_MS:g} ms, TPOT <= {x:g} ms")
            ax.set_ylabel("share of requests meeting both")
        axes[-2].plot(per_gpu, [row["bench"]["p90_tpot_ms"] for row in record["rates"]], "o-", label=label)
        axes[-2].set_title("TPOT p90 (ms)")
        axes[-1].plot(per_gpu, [row["bench"]["p90_ttft_ms"] for row in record["rates"]], "o-", label=label)
        axes[-1].set_title("TTFT p90 (ms)")
        axes[-1].set_yscale("log")
    for ax in axes[: len(TPOT_TARGETS_MS)]:
        ax.axhline(ATTAINMENT, color="grey", linestyle=":")
        ax.set_ylim(0, 1.05)
    for ax in axes:
        ax.set_xlabel("request rate per GPU (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"ISL {ISL}, OSL {OSL}, Poisson arrivals; Llama-3.1-8B shape, dummy weights")
    fig.tight_layout()
    fig.savefig(results / "goodput.png", dpi=110)


def merge(paths: list[Path], out: Path) -> int:
    """One arm's records from several starts on the same host (e.g. its rates split over device
    calls) into one record: rates in order, each start's time and commands kept under `runs`.
    A rate measured by more than one start keeps the first record's row (in the order given);
    the others go to `repeats`."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    if any("sweeps" in r for r in records):
        raise SystemExit("records with sweeps (proof.py since issue 31) are one run each: join folders of "
                         "them with `merge --out DIR`, which keeps every run")
    names = {r["arm"] for r in records}
    if len(names) != 1:
        raise SystemExit(f"records of different arms: {sorted(names)}")
    kept: dict[float, dict] = {}
    repeats = []  # a rate measured again by a later start: kept aside, it shows run-to-run noise
    for path, record in zip(paths, records, strict=True):
        for row in record["rates"]:
            if row["rate"] in kept:
                repeats.append({"source": str(path), **row})
            else:
                kept[row["rate"]] = row
    rates = sorted(kept)
    rows = [kept[rate] for rate in rates]
    merged = {**records[0], "rates": rows, "repeats": repeats, "skipped_rates": records[-1]["skipped_rates"],
              "start_s": min(r["start_s"] for r in records),
              "pull_log_ms": [p for r in records for p in r.get("pull_log_ms", [])],
              "runs": [{"source": str(p), "start_s": r["start_s"], "commands": r["commands"],
                        "rates": [row["rate"] for row in r["rates"]], "skipped_rates": r["skipped_rates"]}
                       for p, r in zip(paths, records, strict=True)]}
    out.write_text(json.dumps(merged))
    print(f"{merged['arm']}: rates {rates} from {len(records)} starts"
          + (f" ({len(repeats)} repeated rates kept aside)" if repeats else "") + f" -> {out}")
    return 0
