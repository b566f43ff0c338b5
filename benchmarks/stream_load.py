"""Keep N streaming completions in flight against an OpenAI endpoint and count what comes back.

For frontends, not engines: how many streamed tokens/s an endpoint relays at a fixed
concurrency, from several client processes so that the client is not the limit. Each process
runs `--concurrency / --processes` streams back to back (prompts of random token ids,
`ignore_eos`, so every stream is `--output-tokens` long) for `--warmup-s` + `--seconds`; only
the measured window counts: tokens that arrived in it, the TTFT of requests sent in it, and
which ingress replica served each (`x-pdserve-ingress`). Prints one JSON object.

    python benchmarks/stream_load.py --url http://127.0.0.1:8000 --model m \
        --concurrency 512 --processes 4 --seconds 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from collections import Counter

import aiohttp


async def _stream(session: aiohttp.ClientSession, args: argparse.Namespace, rng: random.Random,
                  window: tuple[float, float], out: dict) -> None:
    body = {"model": args.model,
            "prompt": [rng.randrange(100, args.vocab) for _ in range(args.prompt_tokens)],
            "max_tokens": args.output_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    sent = time.monotonic()
    first = None
    async with session.post(f"{args.url}/v1/completions", json=body) as response:
        if response.status != 200:
            out["errors"] += 1
            out["error"] = f"{response.status}: {(await response.read())[:200]!r}"
            return
        name = response.headers.get("x-pdserve-ingress", "in-process")
        tail = b""
        async for chunk in response.content.iter_any():
            now = time.monotonic()
            data = tail + chunk
            events = data.count(b"data: {")
            tail = data[-16:]
            if events and first is None:
                first = now
                if window[0] <= sent < window[1]:
                    out["ttft"].append(now - sent)
            if window[0] <= now < window[1]:
                out["tokens"] += events
    if window[0] <= sent < window[1]:
        out["ingress"][name] += 1
        out["completed"] += 1 if first is not None else 0


async def _worker(args: argparse.Namespace, seed: int, streams: int) -> dict:
    rng = random.Random(seed)
    start = time.monotonic()
    window = (start + args.warmup_s, start + args.warmup_s + args.seconds)
    out = {"tokens": 0, "ttft": [], "ingress": Counter(), "completed": 0, "errors": 0,
           "error": None}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def loop() -> None:
            while time.monotonic() < window[1]:
                try:
                    await _stream(session, args, rng, window, out)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    out["errors"] += 1
                    out["error"] = repr(e)
        await asyncio.gather(*(loop() for _ in range(streams)))
    out["ingress"] = dict(out["ingress"])
    return out


def _run(args: argparse.Namespace, seed: int, streams: int, queue) -> None:
    queue.put(asyncio.run(_worker(args, seed, streams)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids below this")
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    queue = multiprocessing.Queue()
    shares = [args.concurrency // args.processes + (i < args.concurrency % args.processes)
              for i in range(args.processes)]
    procs = [multiprocessing.Process(target=_run, args=(args, i, n, queue)) for i, n in enumerate(shares)]
    for proc in procs:
        proc.start()
    parts = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    ttft = sorted(t for part in parts for t in part["ttft"])
    ingress: Counter = Counter()
    for part in parts:
        ingress.update(part["ingress"])
    print(json.dumps({
        "concurrency": args.concurrency, "processes": args.processes, "seconds": args.seconds,
        "tokens_per_s": sum(part["tokens"] for part in parts) / args.seconds,
        "completed_per_s": sum(part["completed"] for part in parts) / args.seconds,
        "errors": sum(part["errors"] for part in parts),
        "error": next((part["error"] for part in parts if part["error"]), None),
        "ttft_ms_p50": 1000 * statistics.median(ttft) if ttft else None,
        "ttft_ms_p90": 1000 * ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
        "ingress": dict(ingress)}))


if __name__ == "__main__":
    main()
