"""A round-robin HTTP proxy in front of several OpenAI-compatible servers (the plain-vLLM arm).

    python -m pdserve.bench.rr_proxy --port 8000 \
        --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101

Each POST goes to the next backend in turn; GETs (/health, /v1/models, /metrics) go to the first,
except /health, which is 200 only when every backend answers 200. Responses stream through
chunk by chunk as they arrive (SSE token streams keep their timing). No retries, no rewriting:
it is the simplest load balancer two plain `vllm serve` engines would sit behind.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import aiohttp
from aiohttp import web

# Request headers not to forward (hop-by-hop, or recomputed by the client session).
_DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class RoundRobinProxy:
    """Forwards requests to `backends` in turn; one aiohttp session for all of them."""

    def __init__(self, backends: list[str]):
        if not backends:
            raise ValueError("at least one backend is needed")
        self.backends = [b.rstrip("/") for b in backends]
        self._next = itertools.cycle(range(len(self.backends)))
        self._session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def pick(self, request: web.Request) -> str:
        """The backend for a request: the next in turn for POSTs, the first otherwise."""
        if request.method == "POST":
            return self.backends[next(self._next)]
        return self.backends[0]

    async def health(self, _request: web.Request) -> web.Response:
        assert self._session is not None
        try:
            answers = await asyncio.gather(*(self._session.get(f"{b}/health") for b in self.backends))
        except aiohttp.ClientError:
            return web.Response(status=503)
        codes = [a.status for a in answers]
        for answer in answers:
            answer.release()
        return web.Response(status=200 if all(c == 200 for c in codes) else 503)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        target = self.pick(request) + request.rel_url.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        body = await request.read()
        async with self._session.request(request.method, target, headers=headers, data=body) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _DROP and key.lower() != "content-encoding":
                    response.headers[key] = value
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def make_app(backends: list[str]) -> web.Application:
    proxy = RoundRobinProxy(backends)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_get("/health", proxy.health)
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True, help="base URL; repeat per backend")
    args = parser.parse_args()
    web.run_app(make_app(args.backend), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
