"""GPU proof (issues 9 and 7): per-GPU goodput of pdserve xPyD (NCCL KV pulls) against pdserve
colocated on the same GPUs and against plain vLLM engines behind round robin, on one host.

    benchmarks/gpu/proof.sh MODEL_DIR transfer disagg      # on the GPU host (bundle; see proof.sh)
    python benchmarks/gpu/proof.py run --model DIR --out DIR --arm colocated
    python benchmarks/gpu/proof.py run --model DIR --out DIR --arm 2P2D --rates 16 24 32
    python benchmarks/gpu/proof.py summarize --results DIR  # anywhere: table, plots, summary.json
    python benchmarks/gpu/proof.py merge a/colocated.json c/colocated.json --out DIR/colocated.json

Arms: `xPyD` (pdserve, x prefill + y decode engines, KV over NCCL; `xPyD-grpc` over gRPC),
`colocated-N` (pdserve, N colocated engines), `vllm-N` (N plain vLLM servers behind
pdserve.bench.rr_proxy); the two-GPU names of issue 9 stay: `disagg` = 1P1D, `colocated` = colocated-2,
`vllm` = vllm-2. An arm uses the first GPUs of CUDA_VISIBLE_DEVICES (or `--gpus`). With
PROOF_STEP_TRACE=DIR a pdserve arm's engines write their step traces to DIR/ARM-steps/.

`run` serves one arm with the same engine settings as every other arm (arms.ENGINE), sends the
same workload at each rate (random token-id prompts of ISL tokens, OSL output tokens with
ignore_eos, Poisson arrivals; `pdserve bench serve` as the client), and writes ARM.json: per
rate the bench summary, each request's TTFT and TPOT, and (pdserve arms) the KV pulls from
/metrics. `summarize` turns the arms' JSON into the goodput table: per target TPOT X, the highest
tested rate at which >= 90% of requests had TTFT <= 500 ms and TPOT <= X, divided by the arm's GPUs.
The arms, their commands and counters are pdserve.bench.arms; the table and merge
pdserve.bench.arm_summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.bench.arm_summary import merge, summarize  # noqa: E402
from pdserve.bench.arms import (  # noqa: E402
    ENGINE, ISL, OSL, RATES, TPOT_TARGETS_MS, TTFT_MS, ArmSpec, arm_spec, attainment, counters_line, delta,
    engine_counters, pdserve_args, per_request, proxy_command, pulls_from_log, serve_command, vllm_command,
)
from pdserve.testing.server import (  # noqa: E402
    RunningServer, free_port, spawn_process, start_process, wait_healthy)


@dataclass
class Arm:
    """A served arm: its endpoint, its processes (stopped in reverse) and how it was started."""

    name: str
    base_url: str
    processes: list[RunningServer]
    commands: list[str]
    pdserve: bool

    def stop(self) -> None:
        for process in reversed(self.processes):
            try:
                process.stop(timeout_s=90)
            except Exception as exc:  # noqa: BLE001 - stop the others anyway
                print(f"stopping {process.log_path.name} failed: {exc}", flush=True)


def start_arm(spec: ArmSpec, model: str, out: Path, mock: bool, gpus: list[str]) -> Arm:
    """Starts an arm on `gpus` (CUDA device ids) and returns once it answers /health."""
    name = spec.name
    if len(gpus) < spec.num_gpus and not mock:
        raise SystemExit(f"arm {name} needs {spec.num_gpus} GPUs, {len(gpus)} visible: {gpus}")
    if spec.kind in ("disagg", "colocated"):
        port = free_port()
        command, env = serve_command(spec, model, mock, gpus, port, os.environ.get("PROOF_STEP_TRACE"))
        server = start_process(command, port, out / f"{name}-server.log", 900, env)
        visible = ",".join(gpus[: spec.num_gpus])
        return Arm(name, server.base_url, [server], [f"CUDA_VISIBLE_DEVICES={visible} {shlex.join(command)}"],
                   pdserve=True)
    processes, commands, backends = [], [], []
    try:
        for gpu in gpus[: spec.engines] if not mock else map(str, range(spec.engines)):
            port = free_port()
            if mock:
                command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port),
                           *pdserve_args(model, True), "--mode", "colocated"]  # fmt: skip
            else:
                command = vllm_command(model, port)
            env = {"CUDA_VISIBLE_DEVICES": str(gpu)}
            processes.append(spawn_process(command, port, out / f"vllm{gpu}-server.log", env))
            commands.append(f"CUDA_VISIBLE_DEVICES={gpu} {shlex.join(command)}")
            backends.append(f"http://127.0.0.1:{port}")
        for server in processes:  # the engines start side by side, as a pdserve arm's do
            wait_healthy(server, 900)
        port = free_port()
        proxy = proxy_command(port, backends)
        processes.append(start_process(proxy, port, out / "proxy.log", 60))
        commands.append(shlex.join(proxy))
    except BaseException:
        for process in reversed(processes):
            process.stop()
        raise
    return Arm(name, f"http://127.0.0.1:{port}", processes, commands, pdserve=False)


def bench_command(arm: Arm, model: str, rate: float, prompts: int, result_dir: Path, seed: int) -> list[str]:
    return [
        sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", arm.base_url, "--model", "m",
        "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(ISL),
        "--random-output-len", str(OSL), "--random-range-ratio", "0", "--prompt-format", "token-ids",
        "--ignore-eos", "--num-prompts", str(prompts), "--request-rate", str(rate), "--burstiness", "1",
        "--seed", str(seed), "--goodput", f"ttft:{TTFT_MS:g}", f"tpot:{TPOT_TARGETS_MS[1]:g}",
        "--save-result", "--no-plots", "--disable-tqdm", "--label", arm.name,
        "--result-dir", str(result_dir), "--result-filename", f"rate-{rate:g}.json",
    ]  # fmt: skip


def kv_counters(arm: Arm) -> dict[str, float | None]:
    """A pdserve arm's KV transfer and engine first-output counters (arms.engine_counters); {}
    for plain vLLM."""
    if not arm.pdserve:
        return {}
    return engine_counters(httpx.get(f"{arm.base_url}/metrics", timeout=10).text)


SUMMARY_KEYS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput", "request_goodput",
    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "max_concurrent_requests",
)  # fmt: skip


def run_rate(arm: Arm, model: str, rate: float, args: argparse.Namespace, raw: Path) -> dict:
    prompts = max(args.min_prompts, round(rate * args.arrival_s))
    command = bench_command(arm, model, rate, prompts, raw, seed=int(rate * 1000))
    before = kv_counters(arm)
    started = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    result = json.loads((raw / f"rate-{rate:g}.json").read_text())
    requests = per_request(result)
    row = {
        "rate": rate,
        "num_prompts": prompts,
        "wall_s": wall,
        "command": shlex.join(command),
        "bench": {k: result.get(k) for k in SUMMARY_KEYS},
        "attainment": {f"{x:g}": attainment(requests, x) for x in TPOT_TARGETS_MS},
        "requests": requests,
    }
    if arm.pdserve:
        row["kv"] = delta(kv_counters(arm), before)
    return row


def warm_up(arm: Arm, model: str, raw: Path) -> None:
    """Unmeasured requests first: CUDA graphs, the NCCL pair, allocator pools all settle."""
    command = bench_command(arm, model, 8, 24, raw, seed=1)
    command[command.index("--result-filename") + 1] = "warmup.json"
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def host_facts() -> dict:
    facts: dict = {"host": platform.node(), "python": platform.python_version()}
    try:
        facts["gpus"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()  # fmt: skip
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        facts["topology"] = topo.stdout
    except (OSError, subprocess.CalledProcessError):
        facts["gpus"] = []
    for module in ("torch", "vllm", "ray"):
        try:
            facts[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - absent on a CPU test run
            facts[module] = None
    return facts


def run_arm(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{args.arm}-raw"
    raw.mkdir(exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    started = time.monotonic()
    spec = args.arm_spec
    gpus = args.gpus or [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    gpus = gpus or [str(i) for i in range(_gpu_count())]
    arm = start_arm(spec, args.model, out, args.mock, gpus)
    record = {
        "arm": args.arm, "label": spec.label, "engine": ENGINE, "isl": ISL, "osl": OSL,
        "ttft_ms": TTFT_MS, "tpot_targets_ms": TPOT_TARGETS_MS, "num_gpus": spec.num_gpus,
        "kind": spec.kind, "prefill": spec.prefill, "decode": spec.decode, "gpus": gpus[: spec.num_gpus],
        "start_s": time.monotonic() - started, "commands": arm.commands, "host": host_facts(),
        "arrival_s": args.arrival_s, "min_prompts": args.min_prompts, "rates": [], "skipped_rates": [],
    }  # fmt: skip
    print(f"{args.arm}: up in {record['start_s']:.0f} s at {arm.base_url}", flush=True)
    try:
        warm_up(arm, args.model, raw)
        rates = args.rates or RATES.get(args.arm)
        if not rates:
            raise SystemExit(f"arm {args.arm}: give --rates (total req/s)")
        for i, rate in enumerate(rates):
            prompts = max(args.min_prompts, round(rate * args.arrival_s))
            if time.monotonic() + prompts / rate + 20 > deadline:
                record["skipped_rates"] = rates[i:]
                print(f"{args.arm}: out of time budget, skipping rates {rates[i:]}", flush=True)
                break
            row = run_rate(arm, args.model, rate, args, raw)
            record["rates"].append(row)
            b = row["bench"]
            print(
                f"{args.arm} rate {rate:g}: {b['completed']} ok {b['failed']} failed, "
                f"{b['request_throughput']:.2f} req/s, TTFT p90 {b['p90_ttft_ms']:.0f} ms, "
                f"TPOT p90 {b['p90_tpot_ms']:.1f} ms, attainment "
                + " ".join(f"{k}ms={v:.2f}" for k, v in row["attainment"].items())
                + (f", {counters_line(row['kv'])}" if "kv" in row else ""),
                flush=True,
            )
            if max(row["attainment"].values()) < 0.5:  # past the knee for every target
                record["skipped_rates"] = rates[i + 1 :]
                break
    finally:
        (out / f"{args.arm}.json").write_text(json.dumps(record))
        arm.stop()
    record["pull_log_ms"] = pulls_from_log(out / f"{args.arm}-server.log")
    (out / f"{args.arm}.json").write_text(json.dumps(record))
    return 0


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch/CUDA: a CPU (mock) run
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve one arm and sweep its rates (GPU host)")
    run.add_argument("--arm", required=True, help="xPyD, colocated-N, vllm-N (or disagg/colocated/vllm)")
    run.add_argument("--gpus", type=lambda v: v.split(","), help="CUDA device ids, e.g. 0,1 (default: all)")
    run.add_argument("--model", required=True, help="config.json + tokenizer directory (dummy weights)")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--rates", type=float, nargs="+", help="total req/s (default: the arm's RATES)")
    run.add_argument("--arrival-s", type=float, default=12.0, help="seconds of arrivals per rate")
    run.add_argument("--min-prompts", type=int, default=80, help="requests per rate at least")
    run.add_argument("--budget-s", type=float, default=420.0, help="skip rates that would end later")
    run.add_argument("--mock", action="store_true", help="pdserve's mock engine (CPU test of the script)")
    summary = commands.add_parser("summarize", help="goodput table and plots from the arms' JSON")
    summary.add_argument("--results", type=Path, required=True)
    summary.add_argument("--no-plots", action="store_true")
    joined = commands.add_parser("merge", help="one arm's records from several starts into one")
    joined.add_argument("records", type=Path, nargs="+", help="ARM.json files of the same arm")
    joined.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "merge":
        return merge(args.records, args.out)
    if args.command == "run":
        try:
            args.arm_spec = arm_spec(args.arm)
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        return run_arm(args)
    return summarize(args.results, plots=not args.no_plots)


if __name__ == "__main__":
    sys.exit(main())
