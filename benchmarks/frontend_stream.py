"""How many streamed tokens per second one pdserve frontend process can relay.

Starts `pdserve serve --engine mock` (colocated; decode steps of `--decode-step-ms`, prefill
nearly free, so the engines are never the limit), keeps `--concurrency` streaming completions
of `--output-tokens` tokens in flight from one asyncio client for `--seconds` after a warm-up,
and prints and saves: streamed tokens/s, completed requests/s, and the CPU% (of one core) of the
frontend process (HTTP + Ray driver), the engine actors and this client over the measured window.
A frontend near 100% while the engines idle means the frontend is the bottleneck.

    .venv/bin/python benchmarks/frontend_stream.py --label before \
        --out benchmarks/results/frontend/2026-11-26
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil

from pdserve.testing import tiny_tokenizer
from pdserve.testing.processes import cpu_seconds
from pdserve.testing.server import RunningServer, start_server


@dataclass
class Window:
    """What the client saw during the measured window."""

    tokens: int = 0
    completed: int = 0
    errors: int = 0


def serve_args(model_dir: Path, replicas: int, decode_step_ms: float) -> list[str]:
    return ["--engine", "mock", "--model", str(model_dir), "--served-model-name", "m",
            "--mode", "colocated", "--replicas", str(replicas), "--max-num-seqs", "1024",
            "--set", "pools.colocated.num_cpus=0.1",
            "--set", "engine.mock.max_model_len=4096",
            # 1M tokens of KV per engine: ~450 requests of 2k+256 fit, so KV never rejects.
            "--set", "engine.mock.num_kv_blocks=65536",
            # Prefill of a 2k prompt takes 2 ms: the run measures streaming, not prefill.
            "--set", "engine.mock.prefill_tokens_per_s=1000000",
            "--set", f"engine.mock.decode_step_s={decode_step_ms / 1000}",
            "--set", "engine.mock.decode_step_per_seq_s=0"]


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict, window: Window,
                     counting: asyncio.Event) -> None:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            window.errors += counting.is_set()
            await response.read()
            await asyncio.sleep(0.05)  # a rejected request (429) must not spin the client
            return
        async for line in response.content:
            if line.startswith(b"data: {") and counting.is_set():
                window.tokens += 1  # the mock emits one token per delta
    window.completed += counting.is_set()


async def drive(base_url: str, concurrency: int, body: dict, warmup_s: float, seconds: float,
                pids: dict[str, list[int]]) -> dict:
    window, counting, stop = Window(), asyncio.Event(), asyncio.Event()
    url = f"{base_url}/v1/completions"

    async def worker(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                await one_stream(session, url, body, window, counting)
            except aiohttp.ClientError:
                window.errors += counting.is_set()

    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        before = cpu_seconds(pids)
        counting.set()
        started = time.monotonic()
        await asyncio.sleep(seconds)
        counting.clear()
        elapsed = time.monotonic() - started
        after = cpu_seconds(pids)
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
    cpu = {name: round(100 * (after[name] - before[name]) / elapsed, 1) for name in pids}
    # CPU time per streamed token: unlike tokens/s, it holds on a host shared with other work.
    per_token = {name: round(1000 * (after[name] - before[name]) / max(window.tokens, 1), 3)
                 for name in pids}
    return {"elapsed_s": round(elapsed, 2), **asdict(window), "cpu_ms_per_token": per_token,
            "tokens_per_s": round(window.tokens / elapsed, 1),
            "requests_per_s": round(window.completed / elapsed, 2),
            "cpu_percent": cpu}


def engine_pids(server: RunningServer) -> list[int]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return [int(line.split('pid="')[1].split('"')[0]) for line in text.splitlines()
            if line.startswith("pdserve_engine_info{")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/frontend/2026-11-26"))
    p.add_argument("--label", required=True, help="names the JSON file (e.g. before, after)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[100, 200])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--decode-step-ms", type=float, default=5.0)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()

    load_before = os.getloadavg()  # the host may be shared: say how busy it was
    work = Path(tempfile.mkdtemp(prefix="frontend-stream-"))
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(work / "model")
    (work / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    body = {"model": "m", "prompt": [5 + i % 500 for i in range(args.prompt_tokens)], "stream": True,
            "max_tokens": args.output_tokens, "ignore_eos": True}
    server = start_server(serve_args(work / "model", args.replicas, args.decode_step_ms),
                          work / "pdserve.log", start_timeout_s=300)
    runs = []
    try:
        pids = {"frontend": [server.process.pid], "engines": engine_pids(server),
                "client": [os.getpid()]}
        for concurrency in args.concurrency:
            run = asyncio.run(drive(server.base_url, concurrency, body, args.warmup_s,
                                    args.seconds, pids))
            run["concurrency"] = concurrency
            # With engines at full speed every stream would get one token per decode step.
            run["engine_bound_tokens_per_s"] = round(concurrency * 1000 / args.decode_step_ms)
            runs.append(run)
            print(f"{args.label} c={concurrency}: {run['tokens_per_s']:.0f} tok/s "
                  f"(engine-bound {run['engine_bound_tokens_per_s']}), "
                  f"{run['requests_per_s']:.1f} req/s, errors {run['errors']}, "
                  f"CPU% frontend {run['cpu_percent']['frontend']} "
                  f"({run['cpu_ms_per_token']['frontend']} ms/token), "
                  f"engines {run['cpu_percent']['engines']}, client {run['cpu_percent']['client']}",
                  flush=True)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"label": args.label, "args": {k: str(v) if isinstance(v, Path) else v
                                            for k, v in vars(args).items()},
              "host": {"cpus": psutil.cpu_count(), "python": platform.python_version(),
                       "load_avg_before": load_before,
                       "load_avg_after": os.getloadavg()},
              "runs": runs}
    path = args.out / f"{args.label}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
