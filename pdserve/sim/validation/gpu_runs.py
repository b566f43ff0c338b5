"""The GPU serving arms of `benchmarks/gpu/proof.py` held against the simulator: what to simulate,
and how the two are tabled.

An arm record (ARM.json) carries each rate's bench command line; `Arm.topology_flags` and
`workload_flags` turn it into the `pdserve sim run` flags of the same deployment and workload
(random 2048 in / 256 out, fixed lengths, Poisson at the same rate, the same number of requests and
the same seed: the simulator draws the harness's schedule for a seed). `median_result` is the median
over simulations that differ only in their step noise's seed; `goodput_table` and `markdown` put the
measured and the simulated side by side. `benchmarks/research/sim_validate_gpu.py` runs the
simulations.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from statistics import median

TPOT_TARGETS_MS = (10.0, 20.0)
TTFT_TARGET_MS = 500.0
ATTAINMENT_GOAL = 0.9  # goodput per GPU: highest tested rate with >= 90% attainment (proof.py)
# The frontend before commit c52f17d relayed ~5k streamed tokens/s at most (one Ray object per
# token): with `--frontend-tokens-per-s 5000` (the H100 runs of 2026-11-26-proof and -x4) an
# offered rate whose token stream reaches it is flagged, not modelled. The one-stream frontend
# showed no such limit up to 8k tokens/s (the H200 runs), so the default flags nothing.
LATENCY_KEYS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    path: Path
    record: dict

    @property
    def topology_flags(self) -> list[str]:
        """`pdserve sim run` topology flags for the arm's `pdserve serve` command line."""
        if self.record.get("kind") == "vllm":  # N plain vLLM engines behind round robin
            return ["--mode", "colocated", "--replicas", str(self.record["num_gpus"])]
        serve = shlex.split(self.record["commands"][0])
        if "disaggregated" in serve:
            return ["--prefill", _flag(serve, "--prefill"), "--decode", _flag(serve, "--decode")]
        return ["--mode", "colocated", "--replicas", _flag(serve, "--replicas", "1")]


def _flag(argv: list[str], name: str, default: str | None = None) -> str:
    if name in argv:
        return argv[argv.index(name) + 1]
    if default is None:
        raise ValueError(f"{name} missing from {' '.join(argv)}")
    return default


def workload_flags(row: dict, record: dict) -> list[str]:
    """The bench command's workload, in the harness flag names `pdserve sim run` shares."""
    bench = shlex.split(row["command"])
    seed = _flag(bench, "--seed")
    if float(_flag(bench, "--request-rate")) != float(row["rate"]):
        raise ValueError(f"rate {row['rate']} disagrees with its command")
    return ["--dataset-name", "random", "--random-input-len", str(record["isl"]),
            "--random-output-len", str(record["osl"]), "--random-range-ratio",
            _flag(bench, "--random-range-ratio", "0"), "--num-prompts", str(row["num_prompts"]),
            "--request-rate", str(row["rate"]), "--burstiness", _flag(bench, "--burstiness", "1"),
            "--seed", seed]


def median_result(results: list[dict]) -> dict:
    """The median over simulations that differ only in their step noise's seed, of what run_rate
    reads: the latency percentiles, the throughput, the attainment; the most failed."""
    out = {k: median([r[k] for r in results]) for k in (*LATENCY_KEYS, "request_throughput")}
    out["slo_attainment"] = {"all": median([r["slo_attainment"]["all"] for r in results])}
    out["failed"] = max(r["failed"] for r in results)
    return out


def error_pair(measured: float, sim: float) -> dict:
    error = (sim - measured) / measured * 100 if measured else None
    return {"measured": measured, "sim": sim, "error_pct": error}


def goodput_per_gpu(rows: list[dict], side: str, target: float) -> float:
    passing = [r["rate"] for r in rows
               if r["metrics"][f"attainment_{target:g}"][side] >= ATTAINMENT_GOAL]
    return max(passing, default=0.0) / rows[0]["gpus"]


def goodput_table(rows: list[dict]) -> dict:
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        out[arm] = {f"{t:g}": {"measured": goodput_per_gpu(mine, "measured", t),
                               "sim": goodput_per_gpu(mine, "sim", t)} for t in TPOT_TARGETS_MS}
    return out


def _cell(pair: dict, digits: str = ".0f") -> str:
    err = "" if pair["error_pct"] is None else f" ({pair['error_pct']:+.0f}%)"
    return f"{pair['measured']:{digits}} / {pair['sim']:{digits}}{err}"


def _attainment_cell(pair: dict) -> str:
    # Points, not percent: attainment near 0 makes a relative error meaningless.
    return f"{pair['measured']:.2f} / {pair['sim']:.2f} ({(pair['sim'] - pair['measured']) * 100:+.0f} pt)"


def markdown(rows: list[dict], goodput: dict, frontend_tokens_per_s: float = 0.0) -> str:
    lines = ["| arm | rate req/s (per GPU) | offered tok/s | done req/s meas / sim | TTFT p50 ms "
             "meas / sim | TTFT p90 | TPOT p50 ms | TPOT p90 | attainment @10 ms | attainment "
             "@20 ms |", "|" + "---|" * 10]
    for r in rows:
        m = r["metrics"]
        mark = " \u2020" if r["frontend_limited"] else ""
        lines.append(
            f"| {r['arm']} | {r['rate']:g} ({r['rate'] / r['gpus']:g}){mark} | "
            f"{r['offered_tokens_per_s']:.0f} | {_cell(m['request_throughput'], '.1f')} | "
            f"{_cell(m['median_ttft_ms'])} | {_cell(m['p90_ttft_ms'])} | "
            f"{_cell(m['median_tpot_ms'], '.1f')} | {_cell(m['p90_tpot_ms'], '.1f')} | "
            f"{_attainment_cell(m['attainment_10'])} | {_attainment_cell(m['attainment_20'])} |")
    if frontend_tokens_per_s:
        lines += ["", f"\u2020 offered token stream >= the frontend's {frontend_tokens_per_s:g} tokens/s "
                  "(not modelled)."]
    lines += ["", "| arm | goodput/GPU @10 ms meas / sim | goodput/GPU @20 ms meas / sim |",
              "|---|---|---|"]
    for arm, g in goodput.items():
        lines.append(f"| {arm} | {g['10']['measured']:g} / {g['10']['sim']:g} | "
                     f"{g['20']['measured']:g} / {g['20']['sim']:g} |")
    return "\n".join(lines)
