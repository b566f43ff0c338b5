"""GPU proof (issues 9 and 7): per-GPU goodput of pdserve xPyD (NCCL KV pulls) against pdserve
colocated on the same GPUs and against plain vLLM engines behind round robin, on one host.

    benchmarks/gpu/proof.sh MODEL_DIR transfer disagg      # on the GPU host (bundle; see proof.sh)
    python benchmarks/gpu/proof.py run --model DIR --out DIR --arm colocated
    python benchmarks/gpu/proof.py run --model DIR --out DIR --arm 2P2D --rates 16 24 32
    python benchmarks/gpu/proof.py summarize --results DIR  # anywhere: table, plots, summary.json
    python benchmarks/gpu/proof.py merge a/colocated.json c/colocated.json --out DIR/colocated.json

Arms: `xPyD` (pdserve, x prefill + y decode engines, KV over NCCL; `xPyD-grpc` over gRPC),
`colocated-N` (pdserve, N colocated engines), `vllm-N` (N plain vLLM servers behind
`rr_proxy.py`); the two-GPU names of issue 9 stay: `disagg` = 1P1D, `colocated` = colocated-2,
`vllm` = vllm-2. An arm uses the first GPUs of CUDA_VISIBLE_DEVICES (or `--gpus`). With
PROOF_STEP_TRACE=DIR a pdserve arm's engines write their step traces to DIR/ARM-steps/.

`run` serves one arm with the same engine settings as every other arm (ENGINE below), sends the
same workload at each rate (random token-id prompts of ISL tokens, OSL output tokens with
ignore_eos, Poisson arrivals; `pdserve bench serve` as the client), and writes ARM.json: per
rate the bench summary, each request's TTFT and TPOT, and (pdserve arms) the KV pulls from
/metrics. `summarize` turns the arms' JSON into the goodput table: per target TPOT X, the highest
tested rate at which >= 90% of requests had TTFT <= 500 ms and TPOT <= X, divided by the arm's GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.testing.server import (  # noqa: E402
    RunningServer, free_port, metric_value, spawn_process, start_process, wait_healthy)

ISL, OSL = 2048, 256
TTFT_MS = 500.0
TPOT_TARGETS_MS = (8.0, 10.0, 20.0)
ATTAINMENT = 0.90
# One set of engine settings for every arm (recorded in each arm's JSON). 8192 batched tokens is
# vLLM's own default for its OpenAI server on these GPUs; CUDA graphs and chunked prefill on.
ENGINE = {
    "load_format": "dummy",
    "dtype": "bfloat16 (from config.json)",
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "gpu_memory_utilization": 0.9,
    "enforce_eager": False,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "seed": 0,
}
# Total request rates (req/s over the arm's GPUs) of issue 9's arms, bracketing each arm's knee from the H200
# calibration (one vLLM engine meets TPOT p90 8 ms near 4 req/s and saturates near 14; 1P1D is
# prefill-bound near 22) and a first colocated sweep on 2 x H200 (knees at 9-12, 12-16, 16-20).
RATES = {
    "disagg": [10, 14, 18, 22, 26],
    "colocated": [6, 9, 12, 16, 20],
    "vllm": [6, 9, 12, 16, 20],
}
ARMS = tuple(RATES)
LABELS = {
    "disagg": "pdserve 1P1D (NCCL)",
    "colocated": "pdserve colocated x2",
    "vllm": "2 x vLLM + round robin",
}
_LEGACY = {"disagg": "1P1D", "colocated": "colocated-2", "vllm": "vllm-2"}
_SPEC = re.compile(r"^(?:(\d+)P(\d+)D(?:-(grpc|nccl))?|(colocated|vllm)-(\d+))$")


@dataclass(frozen=True)
class ArmSpec:
    """What an arm name means: its kind and engine counts."""

    name: str
    kind: str  # "disagg" | "colocated" | "vllm"
    prefill: int = 0
    decode: int = 0
    engines: int = 0
    transport: str = "nccl"  # disaggregated arms: how the KV moves (`2P2D-grpc`)

    @property
    def num_gpus(self) -> int:
        return self.prefill + self.decode if self.kind == "disagg" else self.engines

    @property
    def label(self) -> str:
        if self.name in LABELS:
            return LABELS[self.name]
        if self.kind == "disagg":
            return f"pdserve {self.prefill}P{self.decode}D ({'NCCL' if self.transport == 'nccl' else 'gRPC'})"
        if self.kind == "colocated":
            return f"pdserve colocated x{self.engines}"
        return f"{self.engines} x vLLM + round robin"


def arm_spec(name: str) -> ArmSpec:
    """Parses an arm name (`2P2D`, `colocated-4`, `vllm-4`, or issue 9's `disagg`/...)."""
    match = _SPEC.match(_LEGACY.get(name, name))
    if match is None:
        raise argparse.ArgumentTypeError(
            f"arm {name!r}: expected xPyD (or xPyD-grpc), colocated-N, vllm-N, or one of {', '.join(_LEGACY)}")
    prefill, decode, transport, kind, engines = match.groups()
    if kind is None:
        spec = ArmSpec(name, "disagg", int(prefill), int(decode), transport=transport or "nccl")
    else:
        spec = ArmSpec(name, kind, engines=int(engines))
    if spec.num_gpus < 1 or (spec.kind == "disagg" and min(spec.prefill, spec.decode) < 1):
        raise argparse.ArgumentTypeError(f"arm {name!r}: needs at least one engine of each kind")
    return spec
_PULL_LOG = re.compile(r"pulled (\d+) blocks \(([\d.]+) MiB\) in ([\d.]+) ms")


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


def pdserve_args(model: str, mock: bool) -> list[str]:
    """`pdserve serve` flags for ENGINE (or the mock engine when testing the script on a CPU)."""
    if mock:
        return ["--model", model, "--engine", "mock", "--served-model-name", "m",
                "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--set", "engine.mock.max_model_len=4096",
                "--set", "engine.mock.prefill_tokens_per_s=40000", "--set", "engine.mock.decode_step_s=0.006",
                *(arg for pool in ("prefill", "decode", "colocated")
                  for arg in ("--set", f"pools.{pool}.num_cpus=0.1"))]
    return [
        "--model", model, "--served-model-name", "m", "--load-format", "dummy",
        "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
        "--set", f"engine.max_num_batched_tokens={ENGINE['max_num_batched_tokens']}",
        "--set", f"engine.gpu_memory_utilization={ENGINE['gpu_memory_utilization']}",
        "--set", "engine.enforce_eager=false", "--set", "engine.enable_prefix_caching=true",
        "--set", f"engine.seed={ENGINE['seed']}",
    ]  # fmt: skip


def vllm_command(model: str, port: int) -> list[str]:
    """A plain vLLM OpenAI server with ENGINE's settings (chunked prefill is vLLM v1's default)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", "m", "--load-format", "dummy", "--port", str(port),
        "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
        "--gpu-memory-utilization", str(ENGINE["gpu_memory_utilization"]),
        "--enable-prefix-caching", "--seed", str(ENGINE["seed"]),
    ]  # fmt: skip


def start_arm(spec: ArmSpec, model: str, out: Path, mock: bool, gpus: list[str]) -> Arm:
    """Starts an arm on `gpus` (CUDA device ids) and returns once it answers /health."""
    name = spec.name
    if len(gpus) < spec.num_gpus and not mock:
        raise SystemExit(f"arm {name} needs {spec.num_gpus} GPUs, {len(gpus)} visible: {gpus}")
    visible = ",".join(gpus[: spec.num_gpus])
    if spec.kind in ("disagg", "colocated"):
        mode = (
            ["--mode", "disaggregated", "--prefill", str(spec.prefill), "--decode", str(spec.decode),
             "--transport", spec.transport]
            if spec.kind == "disagg"
            else ["--mode", "colocated", "--replicas", str(spec.engines)]
        )  # fmt: skip
        args = [*pdserve_args(model, mock), *mode]
        if trace := os.environ.get("PROOF_STEP_TRACE"):  # every engine's steps, for the record
            args += ["--set", f"engine.step_trace_dir={trace}/{name}-steps"]
        port = free_port()
        command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), *args]
        env = {} if mock else {"CUDA_VISIBLE_DEVICES": visible}
        server = start_process(command, port, out / f"{name}-server.log", 900, env)
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
        proxy = [sys.executable, str(Path(__file__).with_name("rr_proxy.py")), "--port", str(port)]
        proxy += [arg for b in backends for arg in ("--backend", b)]
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


def per_request(result: dict) -> dict[str, list]:
    """TTFT and TPOT (ms) of each request, and whether it completed, from a bench result JSON."""
    ttft, tpot, ok = [], [], []
    for t, latency, n, error in zip(
        result["ttfts"], result["latencies"], result["output_lens"], result["errors"], strict=True
    ):
        good = not error and t is not None and latency is not None and n and n > 1
        ok.append(bool(good))
        ttft.append(t * 1e3 if good else None)
        tpot.append((latency - t) / (n - 1) * 1e3 if good else None)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "ok": ok}


def attainment(requests: dict[str, list], tpot_ms: float) -> float:
    """Share of all requests (failed ones count as misses) meeting TTFT and this TPOT target."""
    met = sum(
        1
        for ok, t, p in zip(requests["ok"], requests["ttft_ms"], requests["tpot_ms"], strict=True)
        if ok and t <= TTFT_MS and p <= tpot_ms
    )
    return met / max(1, len(requests["ok"]))


_FIRST_OUTPUT = "pdserve_engine_time_to_first_output_seconds"
_FIRST_OUTPUT_LE = ("0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.5")
_POOLS = ("prefill", "decode", "colocated")


def kv_counters(arm: Arm) -> dict[str, float | None]:
    """The KV transfer counters of a pdserve arm (None elsewhere), and per pool its engines'
    first-output histogram (count, sum, and the cumulative counts at a few bounds, `le0.1_prefill`):
    the engine's share of TTFT, per leg."""
    if not arm.pdserve:
        return {}
    text = httpx.get(f"{arm.base_url}/metrics", timeout=10).text
    names = {
        "pulls": "pdserve_kv_transfer_seconds_count",
        "seconds": "pdserve_kv_transfer_seconds_sum",
        "bytes": "pdserve_kv_transfer_bytes_total",
        "failures": "pdserve_kv_transfer_failures_total",
    }
    counters = {key: metric_sum(text, name) for key, name in names.items()}
    for pool in _POOLS:
        count = metric_value(text, f"{_FIRST_OUTPUT}_count", pool=pool)
        if count is None:
            continue
        counters[f"first_output_count_{pool}"] = count
        counters[f"first_output_sum_{pool}"] = metric_value(text, f"{_FIRST_OUTPUT}_sum", pool=pool)
        for le in _FIRST_OUTPUT_LE:
            counters[f"first_output_le{le}_{pool}"] = metric_value(text, f"{_FIRST_OUTPUT}_bucket", pool=pool, le=le)
    return counters


def _first_output_ms(counters: dict, pool: str) -> float | None:
    """The mean engine first output of a pool's requests in `counters`, in ms (None: none)."""
    count = counters.get(f"first_output_count_{pool}")
    return counters[f"first_output_sum_{pool}"] / count * 1e3 if count else None


def _counters_line(counters: dict) -> str:
    """KV pulls and each pool's engine first output, for the console."""
    parts = []
    if counters.get("pulls"):
        parts.append(f"{counters['pulls']:.0f} KV pulls, {counters['seconds'] / counters['pulls'] * 1e3:.1f} ms mean")
    for pool in _POOLS:
        if (mean_ms := _first_output_ms(counters, pool)) is not None:
            share = counters.get(f"first_output_le0.075_{pool}", 0) / counters[f"first_output_count_{pool}"]
            parts.append(f"{pool} engine first output {mean_ms:.0f} ms mean, {share:.0%} <= 75 ms")
    return "; ".join(parts) or "no engine counters"


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every series of a Prometheus sample (all label values), or None if absent."""
    values = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    return sum(values) if values else None


def delta(after: dict, before: dict) -> dict[str, float | None]:
    return {k: (after[k] - (before.get(k) or 0.0)) if after.get(k) is not None else None for k in after}


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
                + (f", {_counters_line(row['kv'])}" if "kv" in row else ""),
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


def pulls_from_log(log: Path) -> list[list[float]]:
    """[blocks, MiB, ms] of every pull the decode engine logged (pdserve arms)."""
    if not log.exists():
        return []
    return [[float(x) for x in m.groups()] for m in _PULL_LOG.finditer(log.read_text(errors="replace"))]


# ---- summary (runs anywhere) -----------------------------------------------------------------


def goodput(record: dict, tpot_ms: float) -> float:
    """Highest tested total rate with attainment >= ATTAINMENT at this TPOT target (0 if none)."""
    passing = [row["rate"] for row in record["rates"] if row["attainment"][f"{tpot_ms:g}"] >= ATTAINMENT]
    return max(passing, default=0.0)


def unbounded(record: dict, tpot_ms: float) -> bool:
    """Whether the arm's goodput at this target is only a lower bound: its highest measured
    rate still passed (the arm was not pushed until it failed)."""
    top = max(record["rates"], key=lambda row: row["rate"])
    return top["attainment"][f"{tpot_ms:g}"] >= ATTAINMENT


def summarize(args: argparse.Namespace) -> int:
    results: Path = args.results
    arms = load_arms(results)
    table = {
        name: {f"{x:g}": goodput(record, x) / record["num_gpus"] for x in TPOT_TARGETS_MS}
        for name, record in arms.items()
    }
    bounds = {name: {f"{x:g}": unbounded(record, x) for x in TPOT_TARGETS_MS} for name, record in arms.items()}
    disagg = [a for a in arms if arm_spec(a).kind == "disagg"]
    baselines = [b for kind in ("colocated", "vllm") for b in arms if arm_spec(b).kind == kind]
    pairs = [(d, b) for d in disagg for b in baselines]
    header = [arms[a]["label"] for a in arms] + [f"{_LEGACY.get(d, d)} / {_LEGACY.get(b, b)}" for d, b in pairs]
    lines = ["| TPOT target | " + " | ".join(header) + " |"]
    lines.append("|---" * (len(arms) + len(pairs) + 1) + "|")
    for x in TPOT_TARGETS_MS:
        key = f"{x:g}"
        cells = [(">= " if bounds[a][key] else "") + f"{table[a][key]:g}" for a in arms]
        cells += [_ratio(table, bounds, d, b, key) for d, b in pairs]
        lines.append(f"| <= {key} ms | " + " | ".join(cells) + " |")
    text = ("Per-GPU goodput (req/s per GPU; TTFT <= 500 ms and TPOT <= target for >= 90% of requests;"
            " '>=': the arm's highest measured rate still passed)\n")
    text += "\n".join(lines)
    print(text)
    summary = {"goodput_per_gpu": table, "lower_bound": bounds, "table_markdown": "\n".join(lines), "arms": {}}
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
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({a: s["rates"] for a, s in summary["arms"].items()}, indent=1))
    if not args.no_plots:
        plot(arms, results)
    return 0


def load_arms(results: Path) -> dict[str, dict]:
    """Every arm record (ARM.json written by `run`) in a results folder, in a stable order:
    disaggregated arms by prefill share, then colocated, then vLLM."""
    arms = {}
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            spec = arm_spec(record["arm"]) if isinstance(record, dict) and "rates" in record else None
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
    for pool in _POOLS:
        if (mean_ms := _first_output_ms(row.get("kv") or {}, pool)) is not None:
            out[f"engine_first_output_ms_mean_{pool}"] = mean_ms
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


def merge(args: argparse.Namespace) -> int:
    """One arm's records from several starts on the same host (e.g. its rates split over device
    calls) into one record: rates in order, each start's time and commands kept under `runs`.
    A rate measured by more than one start keeps the first record's row (in the order given);
    the others go to `repeats`."""
    records = [json.loads(Path(p).read_text()) for p in args.records]
    names = {r["arm"] for r in records}
    if len(names) != 1:
        raise SystemExit(f"records of different arms: {sorted(names)}")
    kept: dict[float, dict] = {}
    repeats = []  # a rate measured again by a later start: kept aside, it shows run-to-run noise
    for path, record in zip(args.records, records, strict=True):
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
                       for p, r in zip(args.records, records, strict=True)]}
    args.out.write_text(json.dumps(merged))
    print(f"{merged['arm']}: rates {rates} from {len(records)} starts"
          + (f" ({len(repeats)} repeated rates kept aside)" if repeats else "") + f" -> {args.out}")
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
        return merge(args)
    if args.command == "run":
        try:
            args.arm_spec = arm_spec(args.arm)
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        return run_arm(args)
    return summarize(args)


if __name__ == "__main__":
    sys.exit(main())
