"""`pdserve serve`: bring a deployment up, serve HTTP until stopped, tear it down.

Order: resolve the model (converting the embedded one on first use), in local mode start the
reaper (`lifecycle.py`: the Ray session's processes die with the server, however it dies), start
a local Ray instance sized for the engines or join a cluster, launch the engine pools and wait
for every engine, load the tokenizer, then serve HTTP. The first SIGTERM or SIGINT drains
(`DrainingServer`): running requests and streams may finish for up to api.shutdown_grace_s, the
rest are cancelled. On exit (a signal, a failed start) everything started is released in reverse,
each step in its own try block: engines, Ray, the reaper; a drained stop exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType
from typing import Any

import ray
import uvicorn
import uvloop

from pdserve.api.app import build_app
from pdserve.api.connections import ConnectionDeadlines, deadline_protocol
from pdserve.api.guard import AccessPolicy, RequestLimits
from pdserve.config.loader import load_api_keys
from pdserve.serving.metrics import ServingMetrics
from pdserve.config.schema import PdserveConfig
from pdserve.lifecycle import Reaper
from pdserve.models.embedded import ResolvedModel, resolve_model
from pdserve.serving.ray_backend import RayBackend

logger = logging.getLogger("pdserve")


def run_service(config: PdserveConfig) -> None:
    """Blocking entry point of `pdserve serve`, on a uvloop event loop."""
    logging.basicConfig(level=config.api.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(config))


async def serve(config: PdserveConfig) -> None:
    started = time.perf_counter()
    access = AccessPolicy(load_api_keys(config.api), config.api.metrics_api_key)
    model = await asyncio.to_thread(prepare_model, config)
    # Released in reverse on every exit path: engines, then Ray, then the reaper.
    async with contextlib.AsyncExitStack() as releases:
        # Before Ray starts: the reaper records every process Ray starts for this server.
        reaper = Reaper.start() if config.ray.address is None else None
        if reaper is not None:
            releases.callback(_release, "reaper", reaper.close)
        releases.callback(_release, "ray", ray.shutdown)
        session_dir = init_ray(config)
        if reaper is not None and session_dir is not None:
            reaper.watch(session_dir)
        logger.info("starting %s engine(s) for %s", _engine_summary(config), model.served_name)
        backend = await RayBackend.launch(config.without_api_secrets(), model, ServingMetrics())
        releases.push_async_callback(_release_async, "engine", backend.shutdown)
        await _serve_http(config, backend, model, access, started)


async def _serve_http(config: PdserveConfig, backend: RayBackend, model: ResolvedModel,
                      access: AccessPolicy, started: float) -> None:
    tokenizer = await asyncio.to_thread(load_tokenizer, model.path, config)
    app = build_app(backend, tokenizer, model.served_name, config.api.max_queued_requests,
                    config.api.default_max_tokens, access,
                    RequestLimits(config.api.max_body_bytes, config.api.body_timeout_s),
                    config.api.tool_call_parser)
    server = DrainingServer(uvicorn_config(app, config), app)
    announcer = asyncio.create_task(_announce_when_ready(server, config, model, started))
    try:
        await server.serve()
    finally:
        announcer.cancel()


def _release(what: str, release: Callable[[], None]) -> None:
    try:
        release()
    except Exception:
        logger.exception("%s shutdown failed", what)


async def _release_async(what: str, release: Callable[[], Awaitable[None]]) -> None:
    try:
        await release()
    except Exception:
        logger.exception("%s shutdown failed", what)


# How long the requests cancelled at the grace's end get to abort their engine legs (an actor
# call each, milliseconds) before the engines go.
_CANCELLED_WAIT_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with pdserve's stop. The first SIGTERM or SIGINT drains: the app's
    `state.shutting_down` is set (readiness answers 503), uvicorn stops accepting connections,
    closes idle kept-alive ones, lets running requests and streams finish (closing each
    connection after its response) for up to `timeout_graceful_shutdown` (api.shutdown_grace_s),
    then cancels the rest, which aborts their engine requests. A second SIGINT stops waiting.
    Unlike uvicorn's own server it does not raise the signal again once it has stopped: `serve`
    then releases engines and Ray, and the process exits 0."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.shutting_down = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; whoever runs this thread stops it
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        logger.info("draining: %d request(s) in flight may finish within %g s "
                    "(api.shutdown_grace_s); new connections are refused",
                    len(self.server_state.tasks), self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
        # uvicorn cancels the requests that outlived the grace (after a second Ctrl-C it leaves
        # them running) and does not wait for them: here they abort their engine legs and close
        # their books while the engines still exist.
        running = list(self.server_state.tasks)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=_CANCELLED_WAIT_S)
        if self.force_exit:
            # uvicorn skips the app's shutdown then; its stats poller would go on calling the
            # engines after Ray is shut down, and Ray would start a new instance for the call.
            await self.lifespan.shutdown()


def uvicorn_config(app: Any, config: PdserveConfig) -> uvicorn.Config:
    api = config.api
    deadlines = ConnectionDeadlines(api.header_timeout_s, api.write_timeout_s,
                                    api.max_header_bytes)
    return uvicorn.Config(
        app, host=api.host, port=api.port, log_level=api.log_level, loop="none",
        lifespan="on", timeout_graceful_shutdown=api.shutdown_grace_s,
        timeout_keep_alive=api.keep_alive_s,
        http=deadline_protocol(deadlines), limit_concurrency=api.max_connections,
        h11_max_incomplete_event_size=api.max_header_bytes,
        ssl_certfile=api.ssl_certfile, ssl_keyfile=api.ssl_keyfile)


def prepare_model(config: PdserveConfig) -> ResolvedModel:
    model = resolve_model(config.model.source, config.model.cache_dir)
    if config.model.served_name:
        model = dataclasses.replace(model, served_name=config.model.served_name)
    return model


def init_ray(config: PdserveConfig) -> str | None:
    """Start a local Ray instance (ray.address None) sized for the engines, or join a cluster.
    Returns the local instance's session directory (its processes' logs live there)."""
    settings = config.ray
    if ray.is_initialized():
        return None
    if settings.address is not None:
        ray.init(address=settings.address, namespace=settings.namespace, log_to_driver=True)
        return None
    cpus, cores = local_ray_cpus(config), os.cpu_count() or 1
    if cpus > cores:
        logger.info("local Ray gets %d logical CPUs on %d cores for %s engine(s) "
                    "(pools.<role>.num_cpus each): the engines share cores", cpus, cores,
                    _engine_summary(config))
    # address="local": always a new instance, never a cluster some `ray start` on this
    # machine left in /tmp/ray/ray_current_cluster.
    context = ray.init(address="local", namespace=settings.namespace, num_cpus=cpus,
                       include_dashboard=settings.include_dashboard,
                       object_store_memory=settings.object_store_memory_bytes, log_to_driver=True)
    return context.address_info["session_dir"]


def local_ray_cpus(config: PdserveConfig) -> int:
    """Logical CPUs of a local Ray instance: what every engine the pools may run asks for
    (pools.<role>.num_cpus each; with autoscaling, up to each pool's max_replicas), never fewer
    than the machine's cores. With Ray's default (the cores), `--prefill 1 --decode 2` on two
    cores waited forever for a third CPU. CPU engines still get disjoint core shares
    (`serving/replicas.py:local_core_split`)."""
    wanted = 0.0
    for role in config.active_roles():
        pool = config.pools.for_role(role)
        replicas = pool.replicas
        if config.autoscale.enabled:
            replicas = max(replicas, config.autoscale.bounds(role).max_replicas)
        wanted += replicas * pool.num_cpus
    # round: 10 x 0.1 CPU is 1 CPU, not 2 (Ray counts resources in units of 1e-4)
    return max(os.cpu_count() or 1, math.ceil(round(wanted, 4)))


def load_tokenizer(path: str, config: PdserveConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)


def _engine_summary(config: PdserveConfig) -> str:
    parts = [f"{config.pools.for_role(r).replicas} {r.value}" for r in config.active_roles()]
    return " + ".join(parts) + f" {config.engine.kind}"


async def _announce_when_ready(server: uvicorn.Server, config: PdserveConfig,
                               model: ResolvedModel, started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.api.port
    scheme = "https" if config.api.ssl_certfile else "http"
    print(f"pdserve ready: {scheme}://{config.api.host}:{port}/v1 serving {model.served_name} "
          f"({_engine_summary(config)} engine(s), started in "
          f"{time.perf_counter() - started:.1f} s)", flush=True)
