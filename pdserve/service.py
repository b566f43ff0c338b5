"""`pdserve serve`: bring a deployment up, serve HTTP until stopped, tear it down.

Order: resolve the model (converting the embedded one on first use), in local mode start the
reaper (`lifecycle.py`: the Ray session's processes die with the server, however it dies), start
a local Ray instance sized for the engines or join a cluster, launch the engine pools and wait
for every engine, load the tokenizer, then serve HTTP. On a cluster, or with api.replicas > 1,
the engines belong to the deployment instead and ingress replicas serve HTTP (`deployment.py`). The first SIGTERM or SIGINT drains
(`api/server.py`'s `DrainingServer`): running requests and streams may finish for up to api.shutdown_grace_s, the
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
import time
from collections.abc import Awaitable, Callable

import ray
import uvicorn
import uvloop

from pdserve.api.app import build_app
from pdserve.api.guard import AccessPolicy, RequestLimits
from pdserve.api.server import DrainingServer, load_tokenizer, uvicorn_config
from pdserve.config.loader import configure_logging, load_api_keys
from pdserve.serving.metrics import ServingMetrics
from pdserve.config.schema import PdserveConfig
from pdserve.deployment import serve_deployment
from pdserve.lifecycle import Reaper
from pdserve.models.embedded import ResolvedModel, resolve_model
from pdserve.serving.ray_backend import RayBackend

logger = logging.getLogger("pdserve")


def run_service(config: PdserveConfig) -> None:
    """Blocking entry point of `pdserve serve`, on a uvloop event loop."""
    configure_logging(config)
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
        if config.owned_by_deployment:
            # A controller owns the engines, ingress replicas serve HTTP (deployment.py).
            await serve_deployment(config, model, access, started, _engine_summary(config))
            return
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
    (pools.<role>.num_cpus each; with autoscaling, up to each pool's max_replicas) and every
    ingress replica (api.replica_num_cpus each), never fewer than the machine's cores. With
    Ray's default (the cores), `--prefill 1 --decode 2` on two cores waited forever for a third
    CPU. CPU engines still get disjoint core shares (`serving/replicas.py:local_core_split`)."""
    wanted = 0.0
    for role in config.active_roles():
        pool = config.pools.for_role(role)
        replicas = pool.replicas
        if config.autoscale.enabled:
            replicas = max(replicas, config.autoscale.bounds(role).max_replicas)
        wanted += replicas * pool.num_cpus
    if config.owned_by_deployment:  # the ingress replicas' share (the controller asks none)
        wanted += config.api.replicas * config.api.replica_num_cpus
    # round: 10 x 0.1 CPU is 1 CPU, not 2 (Ray counts resources in units of 1e-4)
    return max(os.cpu_count() or 1, math.ceil(round(wanted, 4)))


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
