"""Simulator vs measured GPU serving runs (issue 8: "the GPU runs are compared the same way").

For every measured arm and rate (a `benchmarks/gpu/proof.py` arm JSON: per rate the bench
summary, the attainment at TTFT <= 500 ms and TPOT <= 8/10/20 ms, and the bench command line),
runs `pdserve sim run` (per-request DES mode) with an engine profile (`--profile`), the arm's
topology (colocated N or xPyD; a plain-vLLM arm of N engines as colocated N) and the same workload: random 2048 in / 256 out, fixed
lengths, Poisson at the same rate, the same number of requests and the same seed (the simulator
draws the harness's schedule for a seed, so the arrival times are the measured run's). Each rate
is simulated once per TPOT target (`--goodput ttft:500 tpot:T`); the runs are deterministic, so
only the attainment differs between them. With `--noise-seeds K`, K times per target with the
profile's step noise on (seeds 0..K-1), and the medians compared.

Writes `validation.json` (every number, every command) and `table.md` (measured / predicted and
the error) to `--out`. Nothing is fitted to the measurements: the profile is used as recorded.

    .venv/bin/python benchmarks/research/sim_validate_gpu.py --frontend-tokens-per-s 5000 \\
        --profile benchmarks/results/gpu/2026-11-26-x4/profile.json \\
        --arm colocated-4=benchmarks/results/gpu/2026-11-26-x4/colocated-4.json \\
        --arm 2P2D=benchmarks/results/gpu/2026-11-26-x4/2P2D.json \\
        --arm 1P3D=benchmarks/results/gpu/2026-11-26-x4/1P3D.json \\
        --arm 1P1D=benchmarks/results/gpu/2026-11-26-proof/disagg.json \\
        --arm colocated-2=benchmarks/results/gpu/2026-11-26-proof/colocated.json \\
        --out benchmarks/results/sim/2026-11-26-gpu-validation
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
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


def simulate(command: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        subprocess.run([*command, "--save-result", str(out)], check=True, cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def run_rate(arm: Arm, row: dict, profile: Path, frontend_tokens_per_s: float = 0.0,
             noise_seeds: int = 0) -> dict:
    base = [sys.executable, "-m", "pdserve.sim.cli", "run", "--profile", str(profile),
            *arm.topology_flags, *workload_flags(row, arm.record)]
    sims, commands = {}, []
    for target in TPOT_TARGETS_MS:
        command = base + ["--goodput", f"ttft:{TTFT_TARGET_MS:g}", f"tpot:{target:g}"]
        seeded = [command + ["--step-noise", str(seed)] for seed in range(noise_seeds)] or [command]
        commands += [" ".join(shlex.quote(c) for c in c_[1:]) for c_ in seeded]
        runs = [simulate(c_) for c_ in seeded]
        sims[target] = median_result(runs) if noise_seeds else runs[0]
    sim = sims[TPOT_TARGETS_MS[0]]
    bench = row["bench"]
    metrics = {k: _pair(bench[k], sim[k]) for k in LATENCY_KEYS}
    metrics["request_throughput"] = _pair(bench["request_throughput"], sim["request_throughput"])
    for target in TPOT_TARGETS_MS:
        metrics[f"attainment_{target:g}"] = _pair(row["attainment"][f"{target:g}"],
                                                  sims[target]["slo_attainment"]["all"])
    offered_tokens = float(row["rate"]) * arm.record["osl"]
    return {"arm": arm.name, "rate": float(row["rate"]), "num_prompts": row["num_prompts"],
            "gpus": arm.record["num_gpus"], "offered_tokens_per_s": offered_tokens,
            "frontend_limited": 0 < frontend_tokens_per_s <= offered_tokens,
            "metrics": metrics, "commands": ["pdserve sim" + c.split("pdserve.sim.cli", 1)[1]
                                             for c in commands],
            "simulated_failed": sim["failed"]}


def median_result(results: list[dict]) -> dict:
    """The median over simulations that differ only in their step noise's seed, of what run_rate
    reads: the latency percentiles, the throughput, the attainment; the most failed."""
    out = {k: median([r[k] for r in results]) for k in (*LATENCY_KEYS, "request_throughput")}
    out["slo_attainment"] = {"all": median([r["slo_attainment"]["all"] for r in results])}
    out["failed"] = max(r["failed"] for r in results)
    return out


def _pair(measured: float, sim: float) -> dict:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--arm", action="append", required=True, metavar="NAME=ARM.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frontend-tokens-per-s", type=float, default=0.0,
                        help="flag rates whose token stream reaches this frontend limit (0: none)")
    parser.add_argument("--noise-seeds", type=int, default=0, metavar="K",
                        help="simulate each rate K times with the profile's step noise on "
                        "(`pdserve sim run --step-noise 0..K-1`) and compare the medians")
    args = parser.parse_args()
    arms = []
    for spec in args.arm:
        name, path = spec.split("=", 1)
        arms.append(Arm(name, Path(path), json.loads(Path(path).read_text())))
    rows = []
    for arm in arms:
        for row in arm.record["rates"]:
            rows.append(run_rate(arm, row, args.profile, args.frontend_tokens_per_s,
                                 args.noise_seeds))
            print(f"{arm.name} @ {row['rate']:g}: " + ", ".join(
                f"{k} {v['measured']:.3g}/{v['sim']:.3g}" for k, v in rows[-1]["metrics"].items()),
                flush=True)
    goodput = goodput_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, goodput, args.frontend_tokens_per_s)
    (args.out / "validation.json").write_text(json.dumps({
        "command": " ".join(shlex.quote(a) for a in sys.argv), "profile": str(args.profile),
        "arms": {a.name: str(a.path) for a in arms}, "rows": rows, "goodput_per_gpu": goodput,
        "frontend_tokens_per_s": args.frontend_tokens_per_s}, indent=1))
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
