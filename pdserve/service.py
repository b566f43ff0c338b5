"""`pdserve serve`: bring a deployment up, serve HTTP until stopped, tear it down.

Order: resolve the model (converting the embedded one on first use), start or join Ray, launch
the engine pools and wait for every engine, load the tokenizer, then serve HTTP. On exit (Ctrl-C,
SIGTERM, a failed start) everything started is released, each step in its own try block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import ray
import uvicorn
import uvloop

from pdserve.api.app import build_app
from pdserve.api.connections import ConnectionDeadlines, deadline_protocol
from pdserve.api.guard import AccessPolicy, RequestLimits
from pdserve.config.loader import load_api_keys
from pdserve.serving.metrics import ServingMetrics
from pdserve.config.schema import PdserveConfig, RayConfig
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
    init_ray(config.ray)
    backend = None
    try:
        logger.info("starting %s engine(s) for %s", _engine_summary(config), model.served_name)
        metrics = ServingMetrics()
        backend = await RayBackend.launch(config.without_api_secrets(), model, metrics)
        tokenizer = await asyncio.to_thread(load_tokenizer, model.path, config)
        app = build_app(backend, tokenizer, model.served_name, config.api.max_queued_requests,
                        config.api.default_max_tokens, access,
                        RequestLimits(config.api.max_body_bytes, config.api.body_timeout_s))
        server = uvicorn.Server(uvicorn_config(app, config))
        announcer = asyncio.create_task(_announce_when_ready(server, config, model, started))
        try:
            await server.serve()
        finally:
            announcer.cancel()
    finally:
        if backend is not None:
            try:
                await backend.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
        try:
            ray.shutdown()
        except Exception:
            logger.exception("ray shutdown failed")


def uvicorn_config(app: Any, config: PdserveConfig) -> uvicorn.Config:
    api = config.api
    deadlines = ConnectionDeadlines(api.header_timeout_s, api.write_timeout_s,
                                    api.max_header_bytes)
    return uvicorn.Config(
        app, host=api.host, port=api.port, log_level=api.log_level, loop="none",
        lifespan="on", timeout_graceful_shutdown=5, timeout_keep_alive=api.keep_alive_s,
        http=deadline_protocol(deadlines), limit_concurrency=api.max_connections,
        h11_max_incomplete_event_size=api.max_header_bytes,
        ssl_certfile=api.ssl_certfile, ssl_keyfile=api.ssl_keyfile)


def prepare_model(config: PdserveConfig) -> ResolvedModel:
    model = resolve_model(config.model.source, config.model.cache_dir)
    if config.model.served_name:
        model = dataclasses.replace(model, served_name=config.model.served_name)
    return model


def init_ray(settings: RayConfig) -> None:
    if ray.is_initialized():
        return
    if settings.address is None:
        # address="local": always a new instance, never a cluster some `ray start` on this
        # machine left in /tmp/ray/ray_current_cluster.
        ray.init(address="local", namespace=settings.namespace,
                 include_dashboard=settings.include_dashboard,
                 object_store_memory=settings.object_store_memory_bytes, log_to_driver=True)
    else:
        ray.init(address=settings.address, namespace=settings.namespace, log_to_driver=True)


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
