"""What the plain-vLLM arms' round-robin proxy (pdserve.bench.rr_proxy) adds to a first token on
this host: a trivial SSE backend (its first event at once; a process of its own) reached
directly and through the proxy (`python -m pdserve.bench.rr_proxy`, as proof.py starts it),
alternating, one stream at a time over a keep-alive connection. The vllm-N arms of
proof.py and tax.sh put every plain `vllm serve` behind this proxy, so their TTFTs carry it.

    python3 benchmarks/gpu/proxy_cost.py [--requests 400] [--rounds 3] [--out FILE]

Needs aiohttp only (no GPU, no vLLM, no Ray).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aiohttp import ClientSession, TCPConnector, web  # noqa: E402



def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _completions(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"text":"x"}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    return response


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _ttfts(url: str, requests: int) -> list[float]:
    body = {"model": "m", "prompt": list(range(2048)), "max_tokens": 1, "stream": True}
    out = []
    async with ClientSession(connector=TCPConnector(limit=1)) as session:
        for i in range(requests + 20):
            started = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for chunk in response.content.iter_any():
                    if b"data: {" in chunk:
                        break
                first = time.perf_counter() - started
                await response.read()
            if i >= 20:
                out.append(first * 1000)
    return out


async def backend(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    await _serve(app, port)
    await asyncio.Event().wait()


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


async def main(requests: int, rounds: int) -> dict:
    backend_port, proxy_port = _port(), _port()
    processes = [
        subprocess.Popen([sys.executable, __file__, "--backend", str(backend_port)]),
        subprocess.Popen([sys.executable, "-m", "pdserve.bench.rr_proxy", "--port", str(proxy_port),
                          "--backend", f"http://127.0.0.1:{backend_port}"],
                         cwd=Path(__file__).resolve().parents[2])]
    for port in (backend_port, proxy_port):
        _wait_listening(port)
    medians: dict[str, list[float]] = {"direct": [], "proxy": []}
    try:
        for _ in range(rounds):
            for name, port in (("direct", backend_port), ("proxy", proxy_port)):
                ttfts = await _ttfts(f"http://127.0.0.1:{port}", requests)
                medians[name].append(round(statistics.median(ttfts), 4))
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
    added = [round(p - d, 4) for p, d in zip(medians["proxy"], medians["direct"])]
    return {"host": socket.gethostname(), "requests": requests, "ttft_ms_p50": medians,
            "proxy_added_ms": added, "proxy_added_ms_median": statistics.median(added)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--backend", type=int, help=argparse.SUPPRESS)  # run the backend on this port
    args = p.parse_args()
    if args.backend:
        asyncio.run(backend(args.backend))
    result = asyncio.run(main(args.requests, args.rounds))
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
