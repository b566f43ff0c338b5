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
the error; pdserve.sim.validation.gpu_runs) to `--out`. Nothing is fitted to the measurements:
the profile is used as recorded.

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
from pathlib import Path

from pdserve.sim.validation.gpu_runs import (
    LATENCY_KEYS, TPOT_TARGETS_MS, TTFT_TARGET_MS, Arm, error_pair, goodput_table, markdown,
    median_result, workload_flags,
)

ROOT = Path(__file__).resolve().parents[2]


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
    metrics = {k: error_pair(bench[k], sim[k]) for k in LATENCY_KEYS}
    metrics["request_throughput"] = error_pair(bench["request_throughput"], sim["request_throughput"])
    for target in TPOT_TARGETS_MS:
        metrics[f"attainment_{target:g}"] = error_pair(row["attainment"][f"{target:g}"],
                                                  sims[target]["slo_attainment"]["all"])
    offered_tokens = float(row["rate"]) * arm.record["osl"]
    return {"arm": arm.name, "rate": float(row["rate"]), "num_prompts": row["num_prompts"],
            "gpus": arm.record["num_gpus"], "offered_tokens_per_s": offered_tokens,
            "frontend_limited": 0 < frontend_tokens_per_s <= offered_tokens,
            "metrics": metrics, "commands": ["pdserve sim" + c.split("pdserve.sim.cli", 1)[1]
                                             for c in commands],
            "simulated_failed": sim["failed"]}


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
