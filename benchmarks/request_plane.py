"""What the request plane takes off a first token: pdserve over the mock engine, its requests
and outputs through each engine actor's socket (`engine.request_plane: direct`) or through Ray
actor calls and a Ray stream (`ray`), one HTTP stream at a time.

Each repeat starts `pdserve serve --engine mock` (colocated, one engine whose prefill is nearly
free: the run measures the way in and out, not prefill) once per plane, alternating, and sends
`--requests` streaming completions one after another over one keep-alive connection for each
prompt length (token ids, so no tokenizer cost), `--max-tokens` tokens each. TTFT is the
client's: from the POST to the first SSE event. Prints the median TTFT per plane and length,
each repeat's, and the direct plane's saving (median over repeats of the per-repeat difference,
with its range). `--out FILE` saves the same as JSON.

    .venv/bin/python benchmarks/request_plane.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

PLANES = ("direct", "ray")


async def serial_ttfts(url: str, prompt_tokens: int, requests: int, max_tokens: int,
                       warmup: int = 20) -> list[float]:
    """TTFT in ms of `requests` streams sent one at a time (after `warmup` untimed ones)."""
    import aiohttp

    ttfts = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(warmup + requests):
            # Distinct first tokens: no prefix-cache reuse between requests (the mock ignores
            # it, the ledger's routing does not).
            prompt = [10 + i % 400] + [10 + j % 500 for j in range(1, prompt_tokens)]
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "temperature": 0}
            started, first = time.perf_counter(), None
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                async for chunk in response.content.iter_any():
                    if first is None and b"data: {" in chunk:
                        first = time.perf_counter() - started
            if first is None:
                raise RuntimeError("a stream without a token")
            if i >= warmup:
                ttfts.append(first * 1000)
    return ttfts


def serve(plane: str, model_dir: Path, work: Path, repeat: int, max_model_len: int = 4096):
    from pdserve.testing.server import free_port, start_process

    port = free_port()
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), "--engine", "mock",
               "--model", str(model_dir), "--served-model-name", "m", "--mode", "colocated",
               "--replicas", "1", "--set", f"engine.mock.max_model_len={max_model_len}",
               "--set", "engine.mock.num_kv_blocks=65536",
               "--set", "engine.mock.prefill_tokens_per_s=1e9",
               "--set", "engine.mock.decode_step_s=0.002",
               "--set", "engine.mock.decode_step_per_seq_s=0",
               "--set", f"engine.request_plane={plane}"]
    return start_process(command, port, work / f"pdserve-{plane}-{repeat}.log", start_timeout_s=300)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 2048])
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from pdserve.testing.tokenizer import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="request-plane-"))
    model_dir = save_tiny_model(work / "tiny-model")
    medians: dict[str, dict[int, list[float]]] = {plane: {n: [] for n in args.lengths}
                                                  for plane in PLANES}
    for repeat in range(args.repeats):
        for plane in PLANES if repeat % 2 == 0 else reversed(PLANES):
            server = serve(plane, model_dir, work, repeat, max(4096, max(args.lengths) + args.max_tokens))
            try:
                for n in args.lengths:
                    ttfts = asyncio.run(serial_ttfts(server.base_url, n, args.requests, args.max_tokens))
                    medians[plane][n].append(round(statistics.median(ttfts), 3))
                    print(f"repeat {repeat} {plane:6s} {n:5d} tokens: TTFT p50 "
                          f"{medians[plane][n][-1]:.3f} ms", flush=True)
            finally:
                server.stop()
    saving = {n: [round(r - d, 3) for r, d in zip(medians["ray"][n], medians["direct"][n])]
              for n in args.lengths}
    result = {"host": platform.node(), "cpus": __import__("os").cpu_count(),
              "requests": args.requests, "max_tokens": args.max_tokens,
              "ttft_ms_p50": medians, "saving_ms": saving,
              "saving_ms_median": {n: statistics.median(v) for n, v in saving.items()}}
    print("| prompt tokens | direct TTFT p50 ms | ray TTFT p50 ms | saving ms (median, range) |")
    print("|---|---|---|---|")
    for n in args.lengths:
        d, r, s = medians["direct"][n], medians["ray"][n], saving[n]
        print(f"| {n} | {statistics.median(d):.2f} ({min(d):.2f}-{max(d):.2f}) | "
              f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) | "
              f"{statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
