"""Colocated vs disaggregated pdserve vs plain `vllm serve`, on this machine's CPU.

Each arm is started alone (so arms never compete for cores), measured with the same
`pdserve bench serve` workload at each request rate, and stopped. Results (vllm-bench-compatible
JSON, per-request CSV, latency CDF plots) go under --out; the side-by-side table is printed and
saved as table.md, and attainment.png plots TTFT / TPOT / both-SLO attainment vs rate for every arm.
With --resume, arms whose JSON is already in --out are not rerun (all saved: only the table and
the plot are regenerated).

    .venv/bin/python benchmarks/cpu_compare.py --out benchmarks/results/cpu/<date> \\
        --arms colocated disaggregated vllm --request-rates 0.5 1 2 --num-prompts 24

On a 2-core host every engine shares the same two cores, so this run measures pdserve's
overheads (routing, the prefill->decode hand-off, the KV pull) on equal hardware; it cannot show
the interference relief disaggregation brings on separate GPUs. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.models import ensure_embedded_model
from pdserve.testing.server import RunningServer, free_port, start_process, start_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PDSERVE_ARMS = {
    "colocated": ["--mode", "colocated", "--replicas", "1"],
    "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                      "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5"],
}


def start_vllm(model_dir: Path, log_path: Path) -> RunningServer:
    """Plain vLLM's own OpenAI server with the engine settings pdserve uses on CPU."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--kv-cache-memory-bytes", str(1024**3), "--seed", "0"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
    return start_process(command, port, log_path, 600, env)


def run_bench(server: RunningServer, arm: str, rate: float, args: argparse.Namespace,
              tokenizer: Path, out: Path, seed: int) -> dict:
    """One rate against a running arm. Every rate of an arm gets its own prompts (`seed`): the
    rates run against the same server, whose prefix cache would hold the previous rate's
    prompts."""
    name = f"{arm}-rate{rate:g}.json"
    cmd = [sys.executable, "-m", "pdserve.bench.cli", "serve", "--base-url", server.base_url,
           "--model", MODEL, "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
           "--num-warmups", "2", "--seed", str(seed), "--goodput", f"ttft:{args.ttft_ms}",
           f"tpot:{args.tpot_ms}", "--save-result", "--result-dir", str(out),
           "--result-filename", name, "--label", arm, "--disable-tqdm"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / name).read_text())


def table(results: dict[str, dict[float, dict]], args: argparse.Namespace) -> str:
    lines = [
        f"random {args.input_len} in / {args.output_len} out, {args.num_prompts} prompts per "
        f"point, SLO TTFT <= {args.ttft_ms} ms and TPOT <= {args.tpot_ms} ms",
        "",
        "| arm | rate req/s | done | p50 TTFT ms | p90 TTFT ms | p50 TPOT ms | p90 TPOT ms "
        "| out tok/s | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, points in results.items():
        for rate, r in sorted(points.items()):
            lines.append(
                f"| {arm} | {rate:g} | {r['completed']}/{r['completed'] + r['failed']} "
                f"| {r['median_ttft_ms']:.0f} | {r.get('p90_ttft_ms', float('nan')):.0f} "
                f"| {r['median_tpot_ms']:.0f} | {r.get('p90_tpot_ms', float('nan')):.0f} "
                f"| {r['output_throughput']:.1f} | {r.get('request_goodput', 0):.2f} |")
    return "\n".join(lines)


def plot_attainment(results: dict[str, dict[float, dict]], args: argparse.Namespace) -> Path:
    """TTFT, TPOT and both-SLO attainment vs rate, one line per arm, from the saved result JSON."""
    from pdserve.bench.plots import plot_slo_attainment_panels

    runs = {arm: [(rate, r["slo_attainment"]) for rate, r in sorted(points.items())]
            for arm, points in results.items()}
    title = (f"SLO attainment vs request rate (TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms; "
             f"every arm on the same {os.cpu_count()} CPU cores)")
    return plot_slo_attainment_panels(runs, args.out / "attainment.png", title=title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", nargs="+", default=["colocated", "disaggregated", "vllm"],
                        choices=["colocated", "disaggregated", "vllm"])
    parser.add_argument("--request-rates", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ttft-ms", type=float, default=2000)
    parser.add_argument("--tpot-ms", type=float, default=250)
    parser.add_argument("--transport", default="grpc", choices=["grpc", "nccl"])
    parser.add_argument("--resume", action="store_true",
                        help="reuse an arm's saved JSON results in --out instead of rerunning it")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_embedded_model()
    results: dict[str, dict[float, dict]] = {}
    for arm in args.arms:
        saved = [args.out / f"{arm}-rate{rate:g}.json" for rate in args.request_rates]
        if args.resume and all(p.exists() for p in saved):
            results[arm] = {rate: json.loads(p.read_text())
                            for rate, p in zip(args.request_rates, saved, strict=True)}
            continue
        log = args.out / f"{arm}.log"
        started = time.perf_counter()
        if arm == "vllm":
            server = start_vllm(model_dir, log)
        else:
            server = start_server(["--model", "embedded", "--transport", args.transport,
                                   *PDSERVE_ARMS[arm]], log)
        print(f"{arm}: healthy after {time.perf_counter() - started:.1f} s", flush=True)
        try:
            results[arm] = {rate: run_bench(server, arm, rate, args, model_dir, args.out, seed)
                            for seed, rate in enumerate(args.request_rates)}
        finally:
            server.stop()
    text = table(results, args)
    machine = (f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
               f"Python {platform.python_version()}")
    (args.out / "table.md").write_text(f"{machine}\n\n{text}\n\ncommand: {' '.join(sys.argv)}\n")
    print(text)
    print(f"Saved {plot_attainment(results, args)}")


if __name__ == "__main__":
    main()
