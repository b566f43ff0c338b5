"""Start the CPU service, record its engine profile with `pdserve.sim.profile`, stop it.

    .venv/bin/python benchmarks/research/sim_profile_cpu.py --arm colocated --out benchmarks/results/sim/cpu-profile \
        --bench-rates 0.5 1 2
    .venv/bin/python benchmarks/research/sim_profile_cpu.py --arm disaggregated --out benchmarks/results/sim/cpu-profile \
        --bench-rates 0.5 1 2

With --bench-rates, the same service is then measured with benchmarks/cpu_compare.py's
workload (random 256 in / 32 out, Poisson, 2 warm-ups, goodput TTFT 2000 ms and TPOT 250 ms;
--num-prompts per rate, 16 in the comparison) at each rate, so profile and benchmark see the
same machine load: the shared box's load changes by the minute, and the simulator can only
predict the engine it was fed. The k-th rate uses seed k: with one seed for all (before
2026-11-26 session 4), every later rate found half of each prompt in the prefix cache.
--bench-repeats R measures every rate R times (rates in order, then again): repeat r sends
prompts of seed k + 100 r (no repeat finds another's prompts in the prefix cache) on the arrival
schedule of seed k (`--arrival-seed`), so the repeats of a rate meet the same load and differ only
by the machine's noise. Until 2026-11-27 (session 13) the arrivals came from seed k + 100 r too:
those repeats were different workloads, and their spread is not the machine's noise alone.

The arms start exactly like benchmarks/cpu_compare.py starts them (same flags), so the profile
describes the engines that the recorded comparison measured. The start time (launch to /health)
is measured here and stored as the profile's startup_s.

With --step-trace the service writes its engine step traces to OUT/steps-ARM
(`engine.step_trace_dir`) and the profile gains `step_fit`, the step model fitted to them
(pdserve.sim.calibration.step_fit), which the simulator then uses.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.models import ensure_embedded_model  # noqa: E402
from pdserve.sim import profile  # noqa: E402
from pdserve.sim.validation.cpu_service import (  # noqa: E402
    ARMS, NUM_KV_BLOCKS, engine_batched_tokens,
)
from pdserve.testing.server import start_server  # noqa: E402


def bench(base_url: str, model_dir: Path, arm: str, rate: float, out: Path,
          num_prompts: int = 16, seed: int = 0, suffix: str = "", arrival_seed: int | None = None) -> None:
    """benchmarks/cpu_compare.py's run_bench, same flags; `suffix` tells repeats apart."""
    cmd = [sys.executable, "-m", "pdserve.bench.cli", "serve", "--base-url", base_url,
           "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(model_dir),
           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32",
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--num-warmups", "2",
           "--seed", str(seed), *(["--arrival-seed", str(arrival_seed)] if arrival_seed is not None else []),
           "--goodput", "ttft:2000", "tpot:250", "--save-result", "--result-dir", str(out),
           "--result-filename", f"{arm}-bench-rate{rate:g}{suffix}.json", "--label", arm,
           "--disable-tqdm"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", choices=sorted(ARMS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bench-rates", type=float, nargs="*", default=[])
    parser.add_argument("--num-prompts", type=int, default=16, help="benchmark prompts per rate")
    parser.add_argument("--bench-repeats", type=int, default=1,
                        help="measure every rate this many times (files -r1, -r2, ...): the same "
                        "arrivals (seed k) with prompts of seed k + 100 x repeat, so no repeat finds "
                        "another's prompts in the prefix cache and the spread between repeats is this "
                        "machine's own noise")
    parser.add_argument("--step-trace", action="store_true",
                        help="record engine step traces and fit the profile's step model to them")
    parser.add_argument("--start-timeout-s", type=float, default=1200)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_embedded_model()
    started = time.monotonic()
    trace_dir = args.out / f"steps-{args.arm}"
    flags = [*ARMS[args.arm], *(["--set", f"engine.step_trace_dir={trace_dir}"]
                                 if args.step_trace else [])]
    server = start_server(flags, args.out / f"{args.arm}-serve.log", args.start_timeout_s)
    startup = time.monotonic() - started
    try:
        log = (args.out / f"{args.arm}-serve.log").read_text(errors="replace")
        blocks = re.findall(r"num_gpu_blocks[^0-9]*(\d+)|GPU KV cache size: ([\d,]+) tokens", log)
        batched = engine_batched_tokens(log)
        print(f"service up in {startup:.1f} s; KV lines in log: {blocks[:2]}; "
              f"max_num_batched_tokens {batched}", flush=True)
        argv = ["--base-url", server.base_url, "--model-dir", str(model_dir),
                "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", "128",
                "--max-num-batched-tokens", str(batched),
                "--startup-s", f"{startup:.1f}", "--context-len", "256", "--note",
                f"pdserve serve {' '.join(ARMS[args.arm])} on the 2-core CPU box",
                "--out", str(args.out / f"{args.arm}.json"),
                *(["--step-trace", str(trace_dir)] if args.step_trace else [])]
        code = profile.main(argv)
        for repeat in range(args.bench_repeats):
            suffix = f"-r{repeat + 1}" if args.bench_repeats > 1 else ""
            for k, rate in enumerate(args.bench_rates):
                bench(server.base_url, model_dir, args.arm, rate, args.out, args.num_prompts,
                      seed=k + 100 * repeat, suffix=suffix, arrival_seed=k)
        return code
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
