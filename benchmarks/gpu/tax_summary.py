"""The serving tax's summary (benchmarks/gpu/tax.sh): pdserve's TTFT minus plain vLLM's, request by
request on the same arrivals, and each arm's goodput per GPU, from the arms' JSON (proof.py's
ARM.json: per rate, each request's TTFT and TPOT).

    python3 benchmarks/gpu/tax_summary.py --runs RUN1 RUN2 [--first-token DIR] \
        [--proxy-cost proxy_cost.json] --out summary.json

Each RUN folder holds vllm-1.json and colocated-1.json of one `tax.sh a` call (the two arms side
by side, same arrivals); `--first-token` a folder with 1P1D.json (`tax.sh b`), set against the
last run's vllm-1.json. Per rate: the median over requests both arms completed of
`pdserve_ttft[i] - vllm_ttft[i]`, with its p10 and p90; per run the median over rates. The
headline `ttft_overhead_ms_p50` is the last run's, with every run's beside it. The vllm-1 arm
reaches `vllm serve` through pdserve.bench.rr_proxy (as every vllm-N arm of proof.py), so its
TTFTs carry the proxy's hop: `--proxy-cost` (benchmarks/gpu/proxy_cost.py's JSON, measured on
the same host) adds `ttft_overhead_ms_p50_vs_bare_vllm` = the overhead plus that hop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.bench.arms import TPOT_TARGETS_MS, TTFT_MS, attainment  # noqa: E402
from pdserve.bench.grid_summary import cells as grid_cells, request_deltas, runs_of  # noqa: E402


def paired(arm: dict, reference: dict) -> list[dict]:
    """Per common rate, the request-by-request TTFT differences (arm minus reference)."""
    theirs = {row["rate"]: row for row in reference["rates"]}
    rows = []
    for row in arm["rates"]:
        if row["rate"] not in theirs:
            continue
        diffs = sorted(request_deltas(row, theirs[row["rate"]]))
        if diffs:
            rows.append({"rate": row["rate"], "requests": len(diffs),
                         "median_ms": round(statistics.median(diffs), 3),
                         "p10_ms": round(diffs[len(diffs) // 10], 3),
                         "p90_ms": round(diffs[len(diffs) * 9 // 10], 3)})
    return rows


def every_target(record: dict) -> dict:
    """The record with each rate's attainment at every TPOT target, from its requests (these
    records stored 8, 10 and 20 ms only)."""
    ttft_ms = record.get("ttft_ms", TTFT_MS)
    rates = [{**row, "attainment": {f"{t:g}": attainment(row["requests"], t, ttft_ms) for t in TPOT_TARGETS_MS}}
             for row in record["rates"]]
    return {**record, "rates": rates, "tpot_targets_ms": list(TPOT_TARGETS_MS)}


def ratios(arm: dict, reference: dict, key: str) -> list[float]:
    theirs = {row["rate"]: row["bench"][key] for row in reference["rates"]}
    return [round(row["bench"][key] / theirs[row["rate"]], 3) for row in arm["rates"]
            if theirs.get(row["rate"])]


def summarize(runs: list[Path], first_token: Path | None, proxy_cost: Path | None = None) -> dict:
    overheads, tables, equal = [], {}, {}
    arms: dict[str, list[dict]] = {}
    for run in runs:
        vllm = json.loads((run / "vllm-1.json").read_text())
        pdserve = json.loads((run / "colocated-1.json").read_text())
        rows = paired(pdserve, vllm)
        overheads.append(statistics.median(r["median_ms"] for r in rows))
        tables[run.name] = rows
        equal[run.name] = {"output_throughput": ratios(pdserve, vllm, "output_throughput"),
                           "p90_tpot_ms": ratios(pdserve, vllm, "p90_tpot_ms")}
        arms.setdefault("vllm-1", []).append(vllm)
        arms.setdefault("colocated-1", []).append(pdserve)
    summary = {
        "ttft_overhead_ms_p50": round(overheads[-1], 3),
        "ttft_overhead_ms_p50_runs": [round(o, 3) for o in overheads],
        "ttft_overhead_by_rate": tables,
        "pdserve_over_vllm_ratios": equal,
    }
    if proxy_cost is not None:
        hop = json.loads(proxy_cost.read_text())["proxy_added_ms_median"]
        summary["vllm_arm_proxy_hop_ms"] = hop
        summary["ttft_overhead_ms_p50_vs_bare_vllm"] = round(overheads[-1] + hop, 3)
        summary["ttft_overhead_ms_p50_vs_bare_vllm_runs"] = [round(o + hop, 3) for o in overheads]
    if first_token is not None:
        one = json.loads((first_token / "1P1D.json").read_text())
        rows = paired(one, json.loads((runs[-1] / "vllm-1.json").read_text()))
        summary["first_token_1p1d_minus_vllm_ms_p50"] = round(
            statistics.median(r["median_ms"] for r in rows), 3)
        summary["first_token_1p1d_by_rate"] = rows
        arms["1P1D"] = [one]
    summary["cells"] = cells(arms)
    return summary


def cells(arms: dict[str, list[dict]]) -> list[dict]:
    """The grid's cells (pdserve.bench.grid_summary.cells: each arm's goodput per GPU over its
    runs, the best pdserve arm) of these records."""
    return grid_cells([run for name, records in arms.items() for i, record in enumerate(records)
                       for run in runs_of(every_target(record), f"{name}-{i}")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--first-token", type=Path)
    p.add_argument("--proxy-cost", type=Path, help="proxy_cost.py's JSON from the same host")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    summary = summarize(args.runs, args.first_token, args.proxy_cost)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"ttft_overhead_ms_p50 {summary['ttft_overhead_ms_p50']:+.2f} "
          f"(runs: {summary['ttft_overhead_ms_p50_runs']}); against vLLM without its proxy: "
          f"{summary.get('ttft_overhead_ms_p50_vs_bare_vllm_runs', 'not measured')}")
    for run, rows in summary["ttft_overhead_by_rate"].items():
        print(run, " ".join(f"{r['rate']:g}:{r['median_ms']:+.2f}" for r in rows))
    for cell in summary["cells"]:
        print(f"TPOT <= {cell['tpot_ms']:g} ms: " + ", ".join(
            f"{k} {'>= ' if v['lower_bound'] else ''}{v['value']:g}" for k, v in cell["goodput_per_gpu"].items()))


if __name__ == "__main__":
    main()
