"""Streamed tokens/s, TTFT overhead and CPU per token at 1, 2 and 4 HTTP ingress replicas.

Each arm starts `pdserve serve --engine mock` (colocated, two mock engines, decode steps of
`--decode-step-ms`, prefill nearly free: 256 streams could get 4x what this host relays) and
runs three phases, each with a client process of its own (`client` subcommand, CPU measured):

- low load: `--lowload-requests` streams one at a time over one keep-alive connection: TTFT.
  In-process vs one replica is what the replica architecture adds to TTFT.
- moderate: `--moderate-concurrency` streams, below what the host relays: TTFT without backlog.
- saturated: `--concurrency` streams: tokens/s, req/s, which replica served each response
  (`x-pdserve-ingress`), CPU seconds per 1000 tokens of each group of processes (frontend,
  engines, controller, driver, Ray's own, client), read from /proc at the window's edges.

TTFT overhead = client TTFT p50 minus the engines' mean time to their first output over the
phase (`pdserve_engine_time_to_first_output_seconds` from every frontend's /metrics: from the
request's arrival at the engine actor to the engine's first output). The rest is HTTP, the
frontend (parse, route, Ray calls), the output stream back and the client.

Arms: `in-process` (`replicas` 0 in scaling.json: api.replicas 1 and no cluster, the frontend
runs in the pdserve process) and `1`, `2`, `4` (a controller and N ingress actors on a Ray head
this script starts for the arm: one replica without a cluster is the in-process path).

    .venv/bin/python benchmarks/frontend_scaling.py --repeats 3 \
        --out benchmarks/results/frontend/2026-11-29-scaling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

from pdserve.testing.processes import cpu_seconds, kill_processes, process_tree, stop_tree

ARMS = ("in-process", "1", "2", "4")
INGRESS_HEADER = "x-pdserve-ingress"
IN_PROCESS = "in-process"  # the name a response without the ingress header counts under
_EVENT = b"data: {"  # one SSE event; the mock engine streams one token per event
_ENGINE_FIRST = "pdserve_engine_time_to_first_output_seconds"
_SERVER_TTFT = "pdserve_time_to_first_token_seconds"


# ---------------------------------------------------------------- pure helpers (unit tested)
def count_events(tail: bytes, chunk: bytes) -> tuple[int, bytes]:
    """SSE data events in `chunk`, given the `tail` the previous chunk left (an event may
    straddle two chunks). Returns (events, the tail to pass with the next chunk)."""
    data = tail + chunk
    return data.count(_EVENT), data[-(len(_EVENT) - 1):]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the nearest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def histogram_totals(metrics_text: str, name: str) -> tuple[float, float]:
    """(sum, count) of the Prometheus histogram `name` over all its label sets."""
    total, count = 0.0, 0.0
    for line in metrics_text.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rpartition(" ")[2])
        elif line.startswith(f"{name}_count"):
            count += float(line.rpartition(" ")[2])
    return total, count


def mean_ms_between(before: dict[str, tuple[float, float]],
                    after: dict[str, tuple[float, float]]) -> tuple[float | None, int]:
    """Mean (ms) and number of the samples a histogram gained between two scrapes of every
    frontend ({frontend: (sum, count)}); frontends missing from either scrape are left out."""
    total = count = 0.0
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (None, None))
        if s0 is None:
            continue
        total += s1 - s0
        count += c1 - c0
    return (1000 * total / count if count > 0 else None), int(count)


def classify(cmdline: list[str], pid: int, server_pid: int, in_process: bool) -> str:
    """Which group a process of an arm's tree counts under for CPU."""
    title = cmdline[0] if cmdline else ""
    if pid == server_pid:
        return "frontend" if in_process else "driver"  # deployment: `pdserve serve` only waits
    if title.startswith("ray::Ingress"):
        return "frontend"
    if title.startswith("ray::EngineActor"):
        return "engines"
    if title.startswith("ray::Controller"):
        return "controller"
    return "ray_system"  # gcs, raylet, agents, idle workers


def summarize(rows: list[dict], fields: tuple[str, ...]) -> list[dict]:
    """Per arm: the median of each field over the repeats, and its (min, max) spread."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        entry = {"arm": arm, "replicas": mine[0]["replicas"], "repeats": len(mine)}
        for field in fields:
            values = [r[field] for r in mine if r.get(field) is not None]
            if values:
                entry[field] = round(statistics.median(values), 3)
                entry[f"{field}_range"] = [round(min(values), 3), round(max(values), 3)]
        out.append(entry)
    return out


# ---------------------------------------------------------------- client (its own process)

async def scrape_frontends(base_url: str, frontends: int) -> dict[str, tuple[float, float]]:
    """{frontend: (sum, count)} of the engine first-output and server TTFT histograms, from
    every frontend: new connections until each replica answered once (the kernel picks)."""
    import aiohttp

    seen: dict[str, str] = {}
    for _ in range(40 * frontends):
        async with aiohttp.ClientSession() as session:  # a new connection: maybe another replica
            async with session.get(f"{base_url}/metrics") as response:
                seen[response.headers.get(INGRESS_HEADER, IN_PROCESS)] = await response.text()
        if len(seen) >= frontends:
            break
    return {f"{name}/{metric}": histogram_totals(text, metric)
            for name, text in seen.items() for metric in (_ENGINE_FIRST, _SERVER_TTFT)}


def _split(scrape: dict[str, tuple[float, float]], metric: str) -> dict[str, tuple[float, float]]:
    return {k: v for k, v in scrape.items() if k.endswith(f"/{metric}")}


def _server_side(before: dict, after: dict) -> dict:
    engine_ms, engine_n = mean_ms_between(_split(before, _ENGINE_FIRST), _split(after, _ENGINE_FIRST))
    server_ms, _ = mean_ms_between(_split(before, _SERVER_TTFT), _split(after, _SERVER_TTFT))
    return {"engine_first_output_ms_mean": engine_ms and round(engine_ms, 3),
            "engine_first_output_samples": engine_n,
            "server_ttft_ms_mean": server_ms and round(server_ms, 3)}


async def lowload(base_url: str, body: dict, requests: int, warmup: int, frontends: int) -> dict:
    """`requests` streams one at a time over one keep-alive connection."""
    import aiohttp

    url, ttfts, errors = f"{base_url}/v1/completions", [], 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(warmup):
            await _stream(session, url, body)
        await asyncio.sleep(1.5)  # the warm-up's engine samples reach /metrics first
        before = await scrape_frontends(base_url, frontends)
        for _ in range(requests):
            ttft, _, _, status = await _stream(session, url, body)
            if ttft is None or status != 200:
                errors += 1
            else:
                ttfts.append(ttft * 1000)
        await asyncio.sleep(1.5)  # the frontends poll engine stats every second
        after = await scrape_frontends(base_url, frontends)
    return {"requests": requests, "errors": errors, **_ttft_fields(ttfts),
            **_server_side(before, after)}


def _ttft_fields(ttfts_ms: list[float]) -> dict:
    return {f"ttft_ms_p{q}": round(percentile(ttfts_ms, q), 3) if ttfts_ms else None
            for q in (50, 90, 99)}


class _Window:
    """What the load phase's client saw while counting."""

    def __init__(self) -> None:
        self.counting = False
        self.tokens = self.completed = self.errors = 0
        self.ttfts_ms: list[float] = []
        self.replicas: Counter[str] = Counter()


async def _stream(session, url: str, body: dict,
                  window: _Window | None = None) -> tuple[float | None, int, str, int]:
    """One streaming completion: (TTFT s or None, events, replica, HTTP status). Its events
    count into `window.tokens` as they arrive while the window counts."""
    started = time.perf_counter()
    ttft, events, tail = None, 0, b""
    async with session.post(url, json=body) as response:
        replica = response.headers.get(INGRESS_HEADER, IN_PROCESS)
        if response.status != 200:
            await response.read()
            return None, 0, replica, response.status
        async for chunk in response.content.iter_any():
            n, tail = count_events(tail, chunk)
            if n and ttft is None:
                ttft = time.perf_counter() - started
            events += n
            if window is not None and window.counting:
                window.tokens += n
    return ttft, events, replica, 200


async def _load_worker(session, url: str, body: dict, window: _Window, stop: asyncio.Event,
                       seed: int, delay_s: float) -> None:
    """Streams back to back. Output lengths vary (0.5-1.5x max_tokens, seeded) and the first
    start is delayed by `delay_s`: equal lengths kept every stream in lockstep, all 256
    finishing and restarting at once, which measured a burst rather than a steady load."""
    import aiohttp
    import random

    rng = random.Random(seed)
    await asyncio.sleep(delay_s)
    while not stop.is_set():
        counted = window.counting  # its TTFT counts if it started in the window
        sized = {**body, "max_tokens": rng.randint(body["max_tokens"] // 2,
                                                   body["max_tokens"] * 3 // 2)}
        try:
            ttft, _, replica, status = await _stream(session, url, sized, window)
        except aiohttp.ClientError:
            window.errors += window.counting
            continue
        if status != 200:
            window.errors += window.counting
            await asyncio.sleep(0.05)  # a rejected request (429) must not spin the client
            continue
        if window.counting:
            window.completed += 1
            window.replicas[replica] += 1
        if counted and ttft is not None:
            window.ttfts_ms.append(ttft * 1000)


async def load(base_url: str, body: dict, concurrency: int, warmup_s: float, seconds: float,
               groups: dict[str, list[int]], frontends: int) -> dict:
    import aiohttp

    window, stop = _Window(), asyncio.Event()
    groups = {**groups, "client": [os.getpid()]}
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        url = f"{base_url}/v1/completions"
        workers = [asyncio.create_task(_load_worker(session, url, body, window, stop, seed=i,
                                                    delay_s=warmup_s / 2 * i / concurrency))
                   for i in range(concurrency)]
        await asyncio.sleep(warmup_s)
        before = await scrape_frontends(base_url, frontends)
        cpu_before, host_before = cpu_seconds(groups), _host_busy_s()
        window.counting, started = True, time.monotonic()
        await asyncio.sleep(seconds)
        window.counting, elapsed = False, time.monotonic() - started
        cpu_after, host_after = cpu_seconds(groups), _host_busy_s()
        after = await scrape_frontends(base_url, frontends)
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
    tokens = max(window.tokens, 1)
    cpu = {g: cpu_after[g] - cpu_before[g] for g in groups}
    return {"elapsed_s": round(elapsed, 2), "tokens": window.tokens,
            "completed": window.completed, "errors": window.errors,
            "tokens_per_s": round(window.tokens / elapsed, 1),
            "requests_per_s": round(window.completed / elapsed, 2),
            **_ttft_fields(window.ttfts_ms), "ttft_samples": len(window.ttfts_ms),
            **_server_side(before, after),
            "cpu_s_per_1k_tokens": {g: round(1000 * s / tokens, 4) for g, s in cpu.items()},
            "cpu_percent": {g: round(100 * s / elapsed, 1) for g, s in cpu.items()},
            "host_busy_percent": round(100 * (host_after - host_before) / elapsed, 1),
            # The host is shared: CPU that none of the arm's processes nor the client used.
            "others_percent": round(100 * (host_after - host_before - sum(cpu.values()))
                                    / elapsed, 1),
            "responses_by_replica": dict(sorted(window.replicas.items()))}


def _host_busy_s() -> float:
    """CPU seconds this whole host spent busy (all processes, all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="frontend_scaling.py client")
    p.add_argument("phase", choices=["lowload", "load"])
    p.add_argument("--spec", required=True, help="JSON: url, body, groups and the phase's knobs")
    spec = json.loads(p.parse_args(argv).spec)
    import uvloop

    if spec["phase"] == "lowload":
        coro = lowload(spec["url"], spec["body"], spec["requests"], spec["warmup"],
                       spec["frontends"])
    else:
        coro = load(spec["url"], spec["body"], spec["concurrency"], spec["warmup_s"],
                    spec["seconds"], spec["groups"], spec["frontends"])
    print(json.dumps(uvloop.run(coro)))
    return 0


# ---------------------------------------------------------------- arms (the parent process)

def serve_args(model_dir: Path, args: argparse.Namespace) -> list[str]:
    return ["--engine", "mock", "--model", str(model_dir), "--served-model-name", "m",
            "--mode", "colocated", "--replicas", str(args.engines), "--max-num-seqs", "1024",
            "--set", "pools.colocated.num_cpus=0.1",
            "--set", "engine.mock.max_model_len=4096",
            # 1M tokens of KV per engine: KV never rejects at these concurrencies.
            "--set", "engine.mock.num_kv_blocks=65536",
            # A 1k prompt prefills in 1 ms: the run measures the frontends, not prefill.
            "--set", f"engine.mock.prefill_tokens_per_s={args.prefill_tokens_per_s}",
            "--set", f"engine.mock.decode_step_s={args.decode_step_ms / 1000}",
            "--set", "engine.mock.decode_step_per_seq_s=0"]


class RayHead:
    """A Ray head on this machine for one deployment arm (`ray start --head --block`, so every
    process of it descends from the one we started and goes with it)."""

    def __init__(self, log_path: Path) -> None:
        from pdserve.testing.server import free_port

        self.port = free_port()
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             f"--port={self.port}", "--num-cpus=2", "--include-dashboard=false",
             "--disable-usage-stats", "--object-store-memory=200000000"],
            stdout=self._log, stderr=subprocess.STDOUT, env=_ray_env())
        self.address = f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.process.returncode}")
            if any("raylet" in " ".join(c.cmdline()[:1]) for c in process_tree(self.process.pid)):
                time.sleep(3)  # the raylet registers with the GCS a moment after it starts
                return
            time.sleep(0.5)
        raise RuntimeError("the Ray head did not start")

    def stop(self) -> None:
        stop_tree(self.process.pid)
        self._log.close()
        # `ray start` recorded this cluster as the machine's default for ray.init(); forget it.
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip().endswith(f":{self.port}"):
            current.unlink()


def _ray_env() -> dict[str, str]:
    # Token auth, as every pdserve cluster runs (the server joins with the same mode).
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def process_groups(roots: list[int], server_pid: int, in_process: bool) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {"frontend": [], "engines": [], "controller": [],
                                    "driver": [], "ray_system": []}
    for root in roots:
        for p in process_tree(root):
            try:
                cmdline = p.cmdline()
            except psutil.Error:
                continue
            groups[classify(cmdline, p.pid, server_pid, in_process)].append(p.pid)
    return groups


def run_client(phase: str, spec: dict, nice: int, timeout_s: float) -> dict:
    """Run one phase's client in its own process (niced by `nice`) and return its JSON."""
    done = subprocess.run(
        [sys.executable, __file__, "client", phase, "--spec", json.dumps({**spec, "phase": phase})],
        capture_output=True, text=True, timeout=timeout_s,
        preexec_fn=(lambda: os.nice(nice)) if nice else None)
    if done.returncode != 0:
        raise RuntimeError(f"{phase} client failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_arm(arm: str, repeat: int, args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    """Start the arm's service (and Ray head), run both phases, take everything down."""
    from pdserve.testing.server import free_port, start_process

    replicas = 0 if arm == IN_PROCESS else int(arm)
    waited_s = wait_for_quiet(args.quiet_wait_s)
    load_avg = os.getloadavg()
    head = RayHead(work / f"ray-{arm}-{repeat}.log") if replicas else None
    server = None
    tree: list[psutil.Process] = []
    try:
        extra = []
        if head is not None:
            head.wait_ready()
            extra = ["--ray-address", head.address, "--ingress-replicas", str(replicas)]
        port = free_port()
        command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port),
                   *serve_args(model_dir, args), *extra]
        server = start_process(command, port, work / f"pdserve-{arm}-{repeat}.log",
                               start_timeout_s=300, env=_ray_env() if head else None)
        roots = [server.process.pid, *([head.process.pid] if head else [])]
        tree = [p for r in roots for p in process_tree(r)]
        common = {"url": server.base_url, "body": _body(args, args.lowload_tokens),
                  "frontends": max(replicas, 1)}
        low = run_client("lowload", {**common, "requests": args.lowload_requests,
                                     "warmup": 10}, args.client_nice, 300)
        groups = process_groups(roots, server.process.pid, in_process=not replicas)
        loads = {}
        for phase, concurrency, seconds in (("moderate", args.moderate_concurrency,
                                             args.moderate_seconds),
                                            ("saturated", args.concurrency, args.seconds)):
            loads[phase] = run_client("load", {
                **common, "body": _body(args, args.output_tokens), "concurrency": concurrency,
                "warmup_s": args.warmup_s, "seconds": seconds, "groups": groups},
                args.client_nice, args.warmup_s + seconds + 300)
    finally:
        if server is not None:
            server.stop()
        if head is not None:
            head.stop()
        kill_processes(p for p in tree if p.is_running())  # same pid and start time only
    return {**row_of(arm, replicas, repeat, low, loads, load_avg),
            "waited_for_quiet_s": waited_s}


def wait_for_quiet(max_wait_s: float, busy_below_percent: float = 25.0) -> float:
    """Wait until the (shared) host is nearly idle, at most `max_wait_s`; returns the wait.
    Busy: the share of all cores used over 3 s, by anyone."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait_s:
        if psutil.cpu_percent(interval=3) < busy_below_percent:
            break
    return round(time.monotonic() - started, 1)


def _body(args: argparse.Namespace, max_tokens: int) -> dict:
    return {"model": "m", "prompt": [5 + i % 500 for i in range(args.prompt_tokens)],
            "stream": True, "max_tokens": max_tokens, "ignore_eos": True}


def row_of(arm: str, replicas: int, repeat: int, low: dict, loads: dict[str, dict],
           load_avg: tuple[float, ...]) -> dict:
    """One arm's repeat as a row of scaling.json. TTFT overhead: client TTFT p50 minus the
    engines' mean first-output time over the same phase; `ttft_overhead_ms_p50` is the
    moderate load's (below what the host relays, so no token backlog is in it)."""
    def overhead(phase: dict) -> float | None:
        engine, p50 = phase["engine_first_output_ms_mean"], phase["ttft_ms_p50"]
        return None if engine is None or p50 is None else round(p50 - engine, 3)

    moderate, saturated = loads["moderate"], loads["saturated"]
    cpu = saturated["cpu_s_per_1k_tokens"]
    return {"arm": arm, "replicas": replicas, "repeat": repeat,
            "tokens_per_s": saturated["tokens_per_s"],
            "requests_per_s": saturated["requests_per_s"],
            "ttft_overhead_ms_p50": overhead(moderate),
            "moderate_tokens_per_s": moderate["tokens_per_s"],
            "moderate_ttft_ms_p50": moderate["ttft_ms_p50"],
            "moderate_ttft_ms_p90": moderate["ttft_ms_p90"],
            "moderate_engine_first_output_ms_mean": moderate["engine_first_output_ms_mean"],
            "saturated_ttft_ms_p50": saturated["ttft_ms_p50"],
            "saturated_ttft_ms_p90": saturated["ttft_ms_p90"],
            "saturated_engine_first_output_ms_mean": saturated["engine_first_output_ms_mean"],
            "saturated_ttft_overhead_ms_p50": overhead(saturated),
            "lowload_ttft_ms_p50": low["ttft_ms_p50"], "lowload_ttft_ms_p90": low["ttft_ms_p90"],
            "lowload_ttft_ms_p99": low["ttft_ms_p99"],
            "lowload_engine_first_output_ms_mean": low["engine_first_output_ms_mean"],
            "lowload_ttft_overhead_ms_p50": overhead(low),
            # Engine samples behind each overhead (few in deployment mode: see the README).
            "engine_samples": {"lowload": low["engine_first_output_samples"],
                               "moderate": moderate["engine_first_output_samples"],
                               "saturated": saturated["engine_first_output_samples"]},
            **{f"{group}_cpu_s_per_1k_tokens": cpu[group] for group in CPU_GROUPS},
            # The host is shared (others_percent): what its cores would relay were they all
            # this arm's and its client's, the run being CPU-bound (host ~200% busy).
            "cpu_bound_tokens_per_s": round(
                1000 * psutil.cpu_count() / sum(cpu[group] for group in CPU_GROUPS), 1),
            "host_busy_percent": saturated["host_busy_percent"],
            "others_percent": saturated["others_percent"],
            "moderate_others_percent": moderate["others_percent"],
            "load_avg_1m_before": round(load_avg[0], 2),
            "responses_by_replica": saturated["responses_by_replica"],
            "lowload": low, "moderate": moderate, "saturated": saturated}


CPU_GROUPS = ("frontend", "engines", "controller", "driver", "ray_system", "client")
SUMMARY_FIELDS = (
    "tokens_per_s", "cpu_bound_tokens_per_s", "requests_per_s", "ttft_overhead_ms_p50",
    "moderate_tokens_per_s",
    "moderate_ttft_ms_p50", "moderate_ttft_ms_p90", "moderate_engine_first_output_ms_mean",
    "saturated_ttft_ms_p50", "saturated_ttft_ms_p90", "saturated_engine_first_output_ms_mean",
    "saturated_ttft_overhead_ms_p50", "lowload_ttft_ms_p50", "lowload_ttft_ms_p90",
    "lowload_engine_first_output_ms_mean", "lowload_ttft_overhead_ms_p50",
    *(f"{group}_cpu_s_per_1k_tokens" for group in CPU_GROUPS), "host_busy_percent",
    "others_percent", "moderate_others_percent")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/frontend/scaling"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--repeats", type=int, default=2, help="each arm's runs, interleaved")
    p.add_argument("--engines", type=int, default=2, help="colocated mock engines")
    p.add_argument("--concurrency", type=int, default=256,
                   help="streams of the saturated phase (engines could give 51k tokens/s)")
    p.add_argument("--moderate-concurrency", type=int, default=24,
                   help="streams of the moderate phase (engines give at most 4.8k tokens/s)")
    p.add_argument("--moderate-seconds", type=float, default=10.0)
    p.add_argument("--decode-step-ms", type=float, default=5.0)
    p.add_argument("--prefill-tokens-per-s", type=float, default=1e6)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--lowload-requests", type=int, default=200)
    p.add_argument("--lowload-tokens", type=int, default=8, help="max_tokens at low load")
    p.add_argument("--quiet-wait-s", type=float, default=60.0,
                   help="before each arm, wait up to this long for the host to be idle")
    p.add_argument("--client-nice", type=int, default=0, help="niceness of the client processes")
    return p.parse_args(argv)


def _code() -> dict:
    """The commit run, and which files under pdserve/ differed from it at the start."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "pdserve_changed": git("status", "--porcelain", "pdserve").splitlines()}


def _host() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
                 platform.processor())
    return {"cpus": psutil.cpu_count(), "cpu_model": model, "machine": platform.machine(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version()}


def main(argv: list[str]) -> int:
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    args = parse_args(argv)
    from pdserve.testing.tokenizer import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="frontend-scaling-"))
    model_dir = save_tiny_model(work / "tiny-model")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    code = _code()
    rows = []
    for repeat in range(args.repeats):
        for arm in args.arms:  # interleaved: a drifting host load hits every arm alike
            row = run_arm(arm, repeat, args, model_dir, work)
            rows.append(row)
            print(f"{arm:>10} #{repeat}: {row['tokens_per_s']:.0f} tok/s, "
                  f"{row['requests_per_s']:.1f} req/s, TTFT p50 ms: low load "
                  f"{row['lowload_ttft_ms_p50']} (overhead {row['lowload_ttft_overhead_ms_p50']}), "
                  f"moderate {row['moderate_ttft_ms_p50']} (overhead "
                  f"{row['ttft_overhead_ms_p50']}), saturated {row['saturated_ttft_ms_p50']}; "
                  f"CPU s/1k tok frontend {row['frontend_cpu_s_per_1k_tokens']} engines "
                  f"{row['engines_cpu_s_per_1k_tokens']} client "
                  f"{row['client_cpu_s_per_1k_tokens']}, host {row['host_busy_percent']}% (others "
                  f"{row['others_percent']}%), "
                  f"by replica {row['responses_by_replica']}", flush=True)
    table = summarize(rows, SUMMARY_FIELDS)
    for entry in table:
        entry["runs"] = [r for r in rows if r["arm"] == entry["arm"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(table, indent=1) + "\n")
    (args.out / "run.json").write_text(json.dumps(
        {"started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "code": code, "host": _host(), "args": {k: str(v) if isinstance(v, Path) else v
                                   for k, v in vars(args).items()}}, indent=1) + "\n")
    print(f"wrote {args.out / 'scaling.json'} and run.json; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
