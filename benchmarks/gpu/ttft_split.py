"""Where a TTFT goes, per workload and rate, from a results folder's arm records (proof.py's, with
the engine counters of probes run at or after commit 13b33e6):

    python3 benchmarks/gpu/ttft_split.py FOLDER [--json OUT]

Means over each probe's requests, in ms. A pdserve arm: the client's TTFT, the frontend's own
(`client - frontend`: HTTP, the body's parsing, the stream out), the engine actor's first output
(`frontend - actor`: routing and the request plane both ways), vLLM's own time to first token
inside the engine (`actor - vLLM`: the actor's and AsyncLLM's work before vLLM's input
processing and after its output processing), and vLLM's prefill (first scheduling to first
token). A vllm-N arm: the client's TTFT, vLLM's own time to first token and prefill (`client -
vLLM`: its HTTP, parsing, rendering and output path). The two arms' `client - vLLM` differ by
what each adds around the same engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.bench.arms import counter_mean_ms  # noqa: E402
from pdserve.bench.grid import WORKLOADS  # noqa: E402
from pdserve.bench.grid_summary import load_records  # noqa: E402


def split(row: dict, pool: str = "colocated") -> dict:
    """One probe's TTFT parts (ms); None where the record has no such counter."""
    ttfts = [t for t in row["requests"]["ttft_ms"] if t is not None]
    counters = row.get("kv") or {}
    own = f"_{pool}"  # a pdserve arm's counters are per pool; a vllm-N arm's are not
    out = {"rate": row["rate"], "requests": len(ttfts), "client": statistics.fmean(ttfts) if ttfts else None,
           "frontend": counter_mean_ms(counters, "frontend_ttft", own),
           "actor": counter_mean_ms(counters, "first_output", own),
           "vllm": counter_mean_ms(counters, "vllm_ttft", own) or counter_mean_ms(counters, "vllm_ttft"),
           "prefill": counter_mean_ms(counters, "prefill", own) or counter_mean_ms(counters, "prefill")}
    out["client_minus_vllm"] = out["client"] - out["vllm"] if out["vllm"] and out["client"] else None
    return out


def table(folder: Path) -> list[dict]:
    rows = []
    for _, record in load_records(folder):
        for sweep in record.get("sweeps", []):
            for row in sweep["rates"]:
                rows.append({"arm": record["arm"], "settings": record.get("settings", []),
                             "workload": sweep["workload"], **split(row)})
    order = list(WORKLOADS)
    return sorted(rows, key=lambda r: (order.index(r["workload"]), r["rate"], r["arm"]))


def markdown(rows: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    header = ("| workload | rate | arm | requests | client | frontend | actor first output | vLLM TTFT | "
              "vLLM prefill | client - vLLM TTFT |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['rate']:g} | {r['arm']} | {r['requests']} | {ms(r['client'])} | "
                     f"{ms(r['frontend'])} | {ms(r['actor'])} | {ms(r['vllm'])} | {ms(r['prefill'])} | "
                     f"{ms(r['client_minus_vllm'])} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = table(args.folder)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
