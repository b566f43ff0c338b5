"""GPU proof (issues 9, 7 and 31): per-GPU goodput of pdserve xPyD against pdserve colocated on the
same GPUs and against plain vLLM engines behind round robin, on one host, workload by workload.

    benchmarks/gpu/grid.sh MODEL_DIR isl8k+isl16k:1P1D      # issue 31's grid on the GPU host
    benchmarks/gpu/proof.sh MODEL_DIR transfer disagg       # issue 9's parts (see proof.sh)
    python benchmarks/gpu/proof.py run --model DIR --out DIR --arm 1P1D --workloads isl8k isl16k
    python benchmarks/gpu/proof.py run --model DIR --out DIR --arm 2P2D --rates 16 24 32
    python benchmarks/gpu/proof.py summarize --results DIR  # anywhere: tables, plots, summary.json
    python benchmarks/gpu/proof.py merge --out DIR SESSION_DIR...   # runs of several sessions
    python benchmarks/gpu/proof.py merge a/colocated.json c/colocated.json --out DIR/colocated.json

Arms (pdserve.bench.arms): `xPyD` (pdserve, x prefill + y decode engines, KV over NCCL;
`xPyD-ipc` by CUDA IPC, `xPyD-grpc` over gRPC; `-adaptive[-Tms]` after either: `pdserve serve
--adaptive`, routing against TPOT T, default 10), `colocated-N` (pdserve, N colocated engines),
`vllm-N` (N plain vLLM servers, behind pdserve.bench.rr_proxy from two on; one is reached
directly); issue 9's names stay: `disagg` = 1P1D, `colocated` = colocated-2,
`vllm` = vllm-2. An arm uses the first GPUs of CUDA_VISIBLE_DEVICES (or `--gpus`). With
PROOF_STEP_TRACE=DIR a pdserve arm's engines write their step traces to DIR/ARM-steps/.

`run` starts one arm with the engine settings of every other arm (arms.ENGINE) and, for each
workload named (pdserve.bench.grid.WORKLOADS: isl2k, isl8k, isl16k, mooncake), sends it at one
rate after another (`pdserve bench serve`: token-id prompts, ignore_eos, Poisson arrivals seeded by
workload and rate, so every arm meets the same requests at a rate): the `--rates` given, or the
rates a bisection picks on the workload's rate lattice until each TPOT target's knee is bracketed
(grid.next_index), within the workload's share of `--budget-s`. It writes RECORD.json (default:
the arm's name) after every probe: per workload and rate the bench summary, each request's TTFT
and TPOT, the attainment at each TPOT target, and (pdserve arms) the engines' counters. Logs and
the bench's own files go to RECORD-raw/. `summarize` tables every record in a folder
(pdserve.bench.arm_summary, grid_summary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.bench.arm_summary import merge, summarize  # noqa: E402
from pdserve.bench.arms import (  # noqa: E402
    ENGINE, RATES, TPOT_TARGETS_MS, ArmSpec, arm_spec, attainment, counters_line, delta, engine_counters,
    pdserve_args, per_request, proxy_command, pulls_from_log, serve_command, vllm_command, vllm_counters,
)
from pdserve.bench.grid import (  # noqa: E402
    WORKLOADS, GridWorkload, RateLattice, assign_gpus, estimate_arm_s, next_index, parse_slice, prior_knees,
    probe_seconds,
)
from pdserve.bench.grid_summary import SCHEMA, load_records, merge_runs  # noqa: E402
from pdserve.testing.server import (  # noqa: E402
    RunningServer, free_port, spawn_process, start_process, wait_healthy)

TARGET_KEYS = tuple(f"{x:g}" for x in TPOT_TARGETS_MS)  # tightest first: the bisection's priority


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

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False


def start_arm(spec: ArmSpec, model: str, logs: Path, mock: bool, gpus: list[str], start_timeout_s: float,
              slo_ms: tuple[float, float] | None = None, settings: Sequence[str] = ()) -> Arm:
    """Starts an arm on `gpus` (CUDA device ids), its logs in `logs`; returns once it answers /health.
    An adaptive arm routes against `slo_ms` (TTFT, TPOT); a pdserve arm serves with `settings`
    (`pdserve serve --set KEY=VALUE`) too."""
    name = spec.name
    if len(gpus) < spec.num_gpus and not mock:
        raise SystemExit(f"arm {name} needs {spec.num_gpus} GPUs, {len(gpus)} visible: {gpus}")
    if spec.pdserve:
        port = free_port()
        trace = os.environ.get("PROOF_STEP_TRACE")
        command, env = serve_command(spec, model, mock, gpus, port, trace, slo_ms, settings)
        server = start_process(command, port, logs / "server.log", start_timeout_s, env)
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
            processes.append(spawn_process(command, port, logs / f"vllm{gpu}-server.log", env))
            commands.append(f"CUDA_VISIBLE_DEVICES={gpu} {shlex.join(command)}")
            backends.append(f"http://127.0.0.1:{port}")
        for server in processes:  # the engines start side by side, as a pdserve arm's do
            wait_healthy(server, start_timeout_s)
        if len(backends) == 1:  # one `vllm serve`, reached as its own clients would: no proxy hop
            return Arm(name, backends[0], processes, commands, pdserve=False)
        port = free_port()
        proxy = proxy_command(port, backends)
        processes.append(start_process(proxy, port, logs / "proxy.log", 60))
        commands.append(shlex.join(proxy))
    except BaseException:
        for process in reversed(processes):
            process.stop()
        raise
    return Arm(name, f"http://127.0.0.1:{port}", processes, commands, pdserve=False)


def bench_command(arm: Arm, model: str, workload: GridWorkload, rate: float, prompts: int, seed: int,
                  result_dir: Path, filename: str) -> list[str]:
    return [
        sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", arm.base_url, "--model", "m",
        "--tokenizer", model, *workload.bench_flags(), "--prompt-format", "token-ids",
        "--ignore-eos", "--num-prompts", str(prompts), "--request-rate", str(rate), "--burstiness", "1",
        "--seed", str(seed), "--goodput", f"ttft:{workload.ttft_ms:g}", f"tpot:{TPOT_TARGETS_MS[1]:g}",
        "--save-result", "--no-plots", "--disable-tqdm", "--label", arm.name,
        "--result-dir", str(result_dir), "--result-filename", filename,
    ]  # fmt: skip


def kv_counters(arm: Arm) -> dict[str, float | None]:
    """A pdserve arm's KV transfer and engine first-output counters (arms.engine_counters); for
    plain vLLM, its engines' own TTFT (arms.vllm_counters, summed over its servers; a mock vLLM
    arm, pdserve's mock servers, has none)."""
    if arm.pdserve:
        return engine_counters(httpx.get(f"{arm.base_url}/metrics", timeout=10).text)
    total: dict[str, float | None] = {}
    for server in arm.processes:
        if server.log_path.name == "proxy.log":
            continue
        for key, value in vllm_counters(httpx.get(f"{server.base_url}/metrics", timeout=10).text).items():
            total[key] = None if value is None else (total.get(key) or 0.0) + value
    return {} if all(v is None for v in total.values()) else total


SUMMARY_KEYS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput", "request_goodput",
    "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "max_concurrent_requests",
)  # fmt: skip


def run_probe(arm: Arm, model: str, workload: GridWorkload, rate: float, prompts: int, raw: Path) -> dict:
    """One rate of one workload: the bench run, and the row the record keeps of it."""
    seed = workload.seed(rate)
    filename = f"{workload.name}-rate-{rate:g}.json"
    command = bench_command(arm, model, workload, rate, prompts, seed, raw, filename)
    before = kv_counters(arm)
    started = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    result = json.loads((raw / filename).read_text())
    requests = per_request(result)
    row = {
        "rate": rate,
        "rate_per_gpu": None,  # set by the caller, who knows the arm's GPUs
        "num_prompts": prompts,
        "seed": seed,
        "wall_s": wall,
        "command": shlex.join(command),
        "bench": {k: result.get(k) for k in SUMMARY_KEYS},
        "attainment": {key: attainment(requests, float(key), workload.ttft_ms) for key in TARGET_KEYS},
        "requests": requests,
    }
    if after := kv_counters(arm):
        row["kv"] = delta(after, before)
    return row


def warm_up(arm: Arm, model: str, raw: Path) -> None:
    """Unmeasured requests first (issue 9's: 24 prompts of 2048 tokens at 8 req/s, seed 1): CUDA
    graphs, the KV pair, allocator pools all settle."""
    command = bench_command(arm, model, WORKLOADS["isl2k"], 8, 24, 1, raw, "warmup.json")
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
    facts["frontend_cpu_ms"] = frontend_cpu_ms()
    return facts


def frontend_cpu_ms(tokens: int = 16384, repeats: int = 20) -> dict[str, float]:
    """How fast this host's CPU does the frontend's per-token steps for one prompt of `tokens` token
    ids (ms, best of `repeats`): parsing its body, hashing its blocks, packing it for the engine.
    Set beside another host's (the CI host: 0.32, 0.18, 0.16) it says how much of a TTFT difference
    that grows with the prompt is the host's speed."""
    import timeit

    import msgpack

    from pdserve.api.body import parse_json
    from pdserve.scheduler.prefix import block_hashes

    ids = [(i * 7919) % 32000 for i in range(tokens)]
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
    steps = {"parse_json": lambda: parse_json(body), "block_hashes": lambda: block_hashes(ids, 16),
             "msgpack_pack": lambda: msgpack.packb(ids)}
    return {name: round(min(timeit.repeat(step, number=1, repeat=repeats)) * 1e3, 4)
            for name, step in steps.items()}


def _next_rate(sweep: dict, lattice: RateLattice, fixed: list[float] | None,
               prior: dict[str, int] | None = None) -> tuple[float, int | None] | None:
    """The sweep's next rate (and lattice index): the next of `fixed`, or the bisection's (sought
    first at the `prior` knees, grid.next_index)."""
    rows = sweep["rates"]
    if fixed is not None:
        if rows and max(rows[-1]["attainment"].values()) < 0.5:  # past the knee for every target
            return None
        return (fixed[len(rows)], None) if len(rows) < len(fixed) else None
    index = next_index({row["index"]: row["attainment"] for row in rows}, TARGET_KEYS, lattice, prior)
    return None if index is None else (lattice.rate(index), index)


def sweep_workload(arm: Arm, spec: ArmSpec, args: argparse.Namespace, workload: GridWorkload, sweep: dict,
                   share_end: float, save: Callable[[], None]) -> bool:
    """Probes one workload until its knees are bracketed, its rates or probes run out, or the next
    probe would end after `share_end`; False if the arm stopped serving meanwhile."""
    lattice = RateLattice(workload.rate_unit * spec.num_gpus, args.steps_per_octave)
    fixed = list(rates_for(args.rates, workload.name) or RATES.get(args.arm) or []) or None
    sweep.update(method="rates" if fixed else "bisection",
                 lattice={"unit": lattice.unit, "steps_per_octave": lattice.steps_per_octave})
    prior = prior_knees(earlier_sweeps(args.prior, spec, workload.name), TARGET_KEYS, lattice)
    if prior and not fixed:
        sweep["prior_knees"] = prior
    raw = args.out / f"{args.record}-raw"
    while (step := _next_rate(sweep, lattice, fixed, prior)) is not None:
        rate, index = step
        prompts = workload.num_prompts(rate, args.arrival_s, args.min_prompts)
        max_probes = None if fixed else args.max_probes  # a list of rates given is run whole
        left_s = share_end - time.monotonic()
        reason = _stop_reason(workload, rate, prompts, len(sweep["rates"]), max_probes, left_s)
        if reason:
            sweep["stopped"] = f"before rate {rate:g}: {reason}"
            if fixed:
                sweep["skipped_rates"] = fixed[len(sweep["rates"]):]
            print(f"{spec.name} {workload.name}: stopped {sweep['stopped']}", flush=True)
            return True
        try:
            row = run_probe(arm, args.model, workload, rate, prompts, raw)
        except subprocess.CalledProcessError as exc:
            sweep["stopped"] = f"rate {rate:g}: the bench client failed ({exc.returncode})"
            print(f"{spec.name} {workload.name}: {sweep['stopped']}", flush=True)
            return arm.healthy()
        row.update(index=index, rate_per_gpu=rate / spec.num_gpus)
        sweep["rates"].append(row)
        save()
        print(_probe_line(spec.name, workload.name, row), flush=True)
        if not row["bench"]["completed"] and not arm.healthy():
            sweep["stopped"] = f"rate {rate:g}: the arm stopped serving"
            return False
    return True


def rates_for(given: list[tuple[str | None, list[float]]] | None, workload: str) -> list[float]:
    """The `--rates` of one workload: its own (`isl8k=0.75,1.5`), else those given for all."""
    given = given or []
    return next((rates for name, rates in given if name == workload), None) or \
        [rate for name, rates in given if name is None for rate in rates]


def _rates_arg(text: str) -> tuple[str | None, list[float]]:
    name, _, rates = text.rpartition("=")
    if name and name not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    try:
        return name or None, [float(rate) for rate in rates.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates {rates!r}: numbers separated by commas") from None


def earlier_sweeps(folders: list[Path] | None, spec: ArmSpec, workload: str) -> list[dict]:
    """The sweeps of `workload` in the records of this arm (by canonical name) in `folders`."""
    return [sweep for folder in folders or [] for _, record in load_records(folder)
            if arm_spec(record["arm"]).canonical == spec.canonical
            for sweep in record.get("sweeps", []) if sweep["workload"] == workload]


def _stop_reason(workload: GridWorkload, rate: float, prompts: int, probes: int, max_probes: int | None,
                 left_s: float) -> str | None:
    """Why the next probe is not run (None: it is)."""
    if max_probes is not None and probes >= max_probes:
        return f"{probes} probes (--max-probes)"
    needed = probe_seconds(workload, rate, prompts)
    if needed > left_s:
        return f"it needs ~{needed:.0f} s, {left_s:.0f} s of the workload's share left"
    return None


def _probe_line(arm: str, workload: str, row: dict) -> str:
    b = row["bench"]
    line = (f"{arm} {workload} rate {row['rate']:g} ({row['rate_per_gpu']:.3g}/GPU): {b['completed']} ok "
            f"{b['failed']} failed in {row['wall_s']:.0f} s, {b['request_throughput']:.2f} req/s, TTFT p90 "
            f"{b['p90_ttft_ms']:.0f} ms, TPOT p90 {b['p90_tpot_ms']:.1f} ms, attainment "
            + " ".join(f"{k}ms={v:.2f}" for k, v in row["attainment"].items()))
    return line + (f", {counters_line(row['kv'])}" if "kv" in row else "")


def new_record(args: argparse.Namespace, spec: ArmSpec, gpus: list[str]) -> dict:
    started = datetime.now(UTC)
    return {
        "schema": SCHEMA, "run_id": f"{started:%Y%m%dT%H%M%SZ}-{args.record}-{secrets.token_hex(3)}",
        "arm": args.arm, "canonical": spec.canonical, "label": spec.label, "kind": spec.kind,
        "prefill": spec.prefill, "decode": spec.decode, "engines": spec.engines, "transport": spec.transport,
        "num_gpus": spec.num_gpus, "gpus": gpus[: spec.num_gpus], "engine": ENGINE, "mock": args.mock,
        "started_utc": started.isoformat(timespec="seconds"), "budget_s": args.budget_s,
        "arrival_s": args.arrival_s, "min_prompts": args.min_prompts, "max_probes": args.max_probes,
        "steps_per_octave": args.steps_per_octave, "host": host_facts(), "sweeps": [], "pull_log_ms": [],
    }  # fmt: skip


def with_issue9_keys(record: dict) -> dict:
    """A record of one workload also carries issue 9's top-level keys (`rates`, `isl`, `osl`,
    `ttft_ms`, `tpot_targets_ms`, `skipped_rates`), so the readers of those records
    (benchmarks/gpu/tax.sh, research/sim_validate_gpu.py) read it unchanged."""
    if len(record["sweeps"]) != 1:
        return record
    sweep = record["sweeps"][0]
    spec = sweep["spec"]
    lengths = {"isl": spec["input_len"], "osl": spec["output_len"]} if spec["dataset"] == "random" else {}
    return {**record, **lengths, "ttft_ms": sweep["ttft_ms"], "tpot_targets_ms": sweep["tpot_targets_ms"],
            "rates": sweep["rates"], "skipped_rates": sweep.get("skipped_rates", [])}


def run_arm(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + args.budget_s
    out: Path = args.out
    raw = out / f"{args.record}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    spec = args.arm_spec
    gpus = args.gpus or [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    gpus = gpus or [str(i) for i in range(_gpu_count())]
    record = new_record(args, spec, gpus)
    path = out / f"{args.record}.json"
    save = lambda: path.write_text(json.dumps(with_issue9_keys(record)))  # noqa: E731
    # An adaptive arm routes against one pair of targets for its whole start: its first workload's
    # TTFT and the TPOT its name gives (`1P1D-adaptive-20ms`; 10 ms by default).
    if spec.adaptive:
        record["slo_ms"] = [WORKLOADS[args.workloads[0]].ttft_ms, spec.route_tpot_ms]
    if args.set:
        record["settings"] = args.set  # a variant of the arm: the record says how it was served
    arm = start_arm(spec, args.model, raw, args.mock, gpus, max(60.0, deadline - time.monotonic()),
                    record.get("slo_ms"), args.set or ())
    record.update(start_s=time.monotonic() - started, commands=arm.commands)
    print(f"{args.record}: {spec.name} up in {record['start_s']:.0f} s at {arm.base_url}", flush=True)
    try:
        warm_up(arm, args.model, raw)
        for i, name in enumerate(args.workloads):
            workload = WORKLOADS[name]
            # Each workload left gets an equal share of the time left; what one leaves, the next gets.
            share_end = time.monotonic() + (deadline - time.monotonic()) / (len(args.workloads) - i)
            sweep = {"workload": name, "ttft_ms": workload.ttft_ms, "tpot_targets_ms": list(TPOT_TARGETS_MS),
                     "spec": workload.as_dict(), "rates": []}
            record["sweeps"].append(sweep)
            if not sweep_workload(arm, spec, args, workload, sweep, share_end, save):
                break
    finally:
        save()
        arm.stop()
    record["pull_log_ms"] = pulls_from_log(raw / "server.log")
    record["wall_s"] = time.monotonic() - started
    save()
    return 0


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch/CUDA: a CPU (mock) run
        return 0


def plan(args: argparse.Namespace) -> int:
    """grid.sh's plan: per group of a slice, a line `GROUP<TAB>WORKLOADS<TAB>ARM=GPUS ...` on stdout
    (every slice checked before anything starts: a typo costs no device time), the expected
    seconds on stderr."""
    try:
        slices = [(text, parse_slice(text)) for text in args.slices]
        lines, total = [], 0.0
        for text, groups in slices:
            slice_s = 0.0
            for group in groups:
                gpus = assign_gpus(group.arms, args.gpus)
                group_s = max(estimate_arm_s(group.workloads, arm_spec(arm).num_gpus, args.start_s)
                              for arm in group.arms)
                slice_s += group_s
                arms = " ".join(f"{arm}={','.join(ids)}" for arm, ids in zip(group.arms, gpus, strict=True))
                lines.append(f"GROUP\t{' '.join(group.workloads)}\t{arms}")
            print(f"# {text}: ~{slice_s:.0f} s expected (arm start {args.start_s:g} s each)", file=sys.stderr)
            total += slice_s
    except ValueError as exc:
        print(f"grid: {exc}", file=sys.stderr)
        return 2
    print(f"# all: ~{total:.0f} s", file=sys.stderr)
    print("\n".join(lines))
    return 0


def _workload_name(text: str) -> str:
    if text not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"workload {text!r}: one of {', '.join(WORKLOADS)}")
    return text


def _add_run(commands) -> None:
    run = commands.add_parser("run", help="serve one arm, sweep its rates workload by workload (GPU host)")
    run.add_argument("--arm", required=True, help="xPyD[-ipc|-grpc][-adaptive[-Tms]], colocated-N, vllm-N "
                     "(or disagg/colocated/vllm)")
    run.add_argument("--workloads", type=_workload_name, nargs="+", default=["isl2k"],
                     help=f"in order, each sweep against the one started arm ({', '.join(WORKLOADS)})")
    run.add_argument("--record", help="the record's name, RECORD.json (default: the arm's name)")
    run.add_argument("--gpus", type=lambda v: v.split(","), help="CUDA device ids, e.g. 0,1 (default: all)")
    run.add_argument("--model", required=True, help="config.json + tokenizer directory (dummy weights)")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--rates", type=_rates_arg, nargs="+",
                     help="total req/s, each workload, or one workload's: isl8k=0.75,1.5 (default: a "
                          "bisection; issue 9's names: their RATES)")
    run.add_argument("--steps-per-octave", type=int, default=4, help="the bisection's rate lattice")
    run.add_argument("--max-probes", type=int, default=8, help="rates per workload at most")
    run.add_argument("--prior", type=Path, nargs="+",
                     help="folders of earlier records: the bisection seeks each knee first where "
                          "this arm's earlier runs placed it (grid.prior_knees)")
    run.add_argument("--arrival-s", type=float, help="seconds of arrivals per rate (default: the workload's)")
    run.add_argument("--min-prompts", type=int, help="requests per rate at least (default: the workload's)")
    run.add_argument("--budget-s", type=float, default=420.0,
                     help="seconds from now for the start and every probe; a probe that would end "
                          "later is not started")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="a pdserve arm's `pdserve serve --set`, after the arm's own (a variant)")
    run.add_argument("--mock", action="store_true", help="pdserve's mock engine (CPU test of the script)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands)
    summary = commands.add_parser("summarize", help="goodput tables and plots from the arms' records")
    summary.add_argument("--results", type=Path, required=True)
    summary.add_argument("--no-plots", action="store_true")
    planned = commands.add_parser("plan", help="grid.sh's slices checked, split into groups, timed")
    planned.add_argument("slices", nargs="+", help="WORKLOAD[+WORKLOAD]:ARM[,ARM][/ARM] (grid.parse_slice)")
    planned.add_argument("--gpus", type=lambda v: v.split(","), default=["0", "1"], help="CUDA device ids")
    planned.add_argument("--start-s", type=float, default=170.0, help="an arm's expected start")
    joined = commands.add_parser(
        "merge", help="runs of several folders (sessions) into one folder (--out DIR); or, with "
                      "--out FILE.json, one issue-9 arm's records from several starts into one")
    joined.add_argument("records", type=Path, nargs="+", help="results folders or arm records")
    joined.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "plan":
        return plan(args)
    if args.command == "merge":
        if args.out.suffix == ".json":
            return merge(args.records, args.out)
        return merge_runs(args.records, args.out)
    if args.command == "run":
        try:
            args.arm_spec = arm_spec(args.arm)
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
        args.record = args.record or args.arm
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        return run_arm(args)
    return summarize(args.results, plots=not args.no_plots)


if __name__ == "__main__":
    sys.exit(main())
