"""`pdserve serve` for a deployment: a controller, its engines and N ingress replicas.

Used when the engines belong to the deployment (`PdserveConfig.owned_by_deployment`: a cluster,
or api.replicas > 1). The pdserve process then serves nothing itself: it starts (or finds, by
name) the controller (`serving/controller.py`), which launches the engines, then the ingress
replicas (`ingress.py`), each a detached actor that Ray restarts when its process dies, prints
the ready line and waits. SIGINT or SIGTERM, during the start or after it, takes the deployment
down, from inside the controller (`Controller.stop`): every replica drains (running requests may finish within
api.shutdown_grace_s), then the engines stop, then the actors go.

If this process dies instead (SIGKILL, a lost SSH session), the deployment keeps serving: the
actors are detached. Running `pdserve serve` again with the same namespace attaches to it
(nothing restarts) and owns it from then on. In local mode (no ray.address) the Ray instance is
this process's own, so its end still takes everything with it (`service.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.api.guard import AccessPolicy
from pdserve.config.schema import PdserveConfig
from pdserve.errors import EngineStartError
from pdserve.models.embedded import ResolvedModel
from pdserve.serving.controller import CONTROLLER_NAME, Controller
from pdserve.ingress import Ingress
from pdserve.serving.cluster import ingress_name
from pdserve.serving.replicas import with_cluster_token

logger = logging.getLogger("pdserve")

# How long each replica's drain, then the controller's shutdown, may take at the end.
_STOP_TIMEOUT_S = 120.0
# How long the ingress replicas may take to be placed and serve (a tokenizer load each).
_REPLICA_START_TIMEOUT_S = 300.0


async def serve_deployment(config: PdserveConfig, model: ResolvedModel, access: AccessPolicy,
                           started: float, summary: str) -> None:
    """Start or attach to the deployment, print the ready line, stop it on SIGINT/SIGTERM. A
    signal during the start stops the deployment once the start ends (the controller's start
    and stop do not overlap), as one after it would: replicas already serving drain."""
    config = with_cluster_token(config)  # engines started later (replacements) share it
    if config.api.port == 0:
        config = _with_port(config, free_port(config.api.host))
    controller = _controller(config, model)
    replicas: list[Any] = []
    with _signals() as stop:  # from here on, not Ray's handlers (which abort the process)
        try:
            infos = await _start(config, model, access, controller, replicas)
        except BaseException:
            logger.error("the deployment did not start; removing what started")
            await stop_deployment(config, replicas, controller)
            raise
        if not stop.is_set():
            scheme = "https" if config.api.ssl_certfile else "http"
            nodes = {info["node_id"] for info in infos}
            print(f"pdserve ready: {scheme}://{config.api.host}:{config.api.port}/v1 serving "
                  f"{model.served_name} ({summary} engine(s), {len(replicas)} ingress replica(s) "
                  f"on {len(nodes)} node(s), started in {time.perf_counter() - started:.1f} s)",
                  flush=True)
            await stop.wait()
    logger.info("stopping the deployment: draining %d ingress replica(s)", len(replicas))
    await stop_deployment(config, replicas, controller)


async def _start(config: PdserveConfig, model: ResolvedModel, access: AccessPolicy, controller: Any,
                 replicas: list[Any]) -> list[dict]:
    """The controller (its engines), then the ingress replicas, each added to `replicas` as it is
    created (for whoever stops them); their start infos."""
    await controller.start.remote()
    nodes = alive_nodes()
    replicas.extend(_ingress(config, model, i, access, nodes[i % len(nodes)])
                    for i in range(config.api.replicas))
    try:
        return await asyncio.wait_for(asyncio.gather(*(r.start.remote() for r in replicas)),
                                      _REPLICA_START_TIMEOUT_S)
    except TimeoutError:
        raise EngineStartError(
            f"the ingress replicas did not start within {_REPLICA_START_TIMEOUT_S:.0f} s: "
            "is there room for them (api.replica_num_cpus each; `ray status`)?") from None


async def stop_deployment(config: PdserveConfig, replicas: list[Any], controller: Any) -> None:
    """The controller drains every replica, stops the engines and removes the actors
    (`Controller.stop`: it finishes even if this process is killed meanwhile, as `ray job
    stop` does after 3 s); whatever is left after that is removed from here."""
    try:
        await asyncio.wait_for(controller.stop.remote(),
                               config.api.shutdown_grace_s + _STOP_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the actors go anyway
        logger.warning("the controller did not stop the deployment cleanly: %r", e)
    for actor in (*replicas, controller):
        _kill(actor)


def _controller(config: PdserveConfig, model: ResolvedModel) -> Any:
    """The deployment's controller: the running one (attach) or a new one."""
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=config.ray.namespace, get_if_exists=True,
        lifetime="detached", max_restarts=-1, num_cpus=0, max_concurrency=1024,
    ).remote(config.without_api_secrets(), model)


def _ingress(config: PdserveConfig, model: ResolvedModel, index: int,
             access: AccessPolicy, node_id: str) -> Any:
    # Replica 0 runs on this process's node, where api.host is meant (pinned: a client's way in,
    # an SSH forward say, leads there); replica i > 0 goes to node i mod nodes (soft: elsewhere
    # if that node is gone or full), so replicas spread over the nodes as Ray Serve's per-node
    # proxies do. The replica authenticates clients, so it gets the API keys (as actor
    # arguments, which anyone who may run code on the cluster can read: Ray's token auth
    # guards them).
    return ray.remote(Ingress).options(
        name=ingress_name(index), namespace=config.ray.namespace, get_if_exists=True,
        lifetime="detached", max_restarts=-1, num_cpus=config.api.replica_num_cpus,
        max_concurrency=64,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=index > 0),
    ).remote(config, model, index, CONTROLLER_NAME, access)


def alive_nodes() -> list[str]:
    """The cluster's live nodes' ids: this process's node first, then the others by address."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    ordered = sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"],
                                           n["NodeID"]))
    logger.info("ingress replicas go to the nodes in this order: %s",
                ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in ordered))
    return [n["NodeID"] for n in ordered]


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # noqa: BLE001
        logger.warning("could not remove actor: %r", e)


def free_port(host: str) -> int:
    """A port free on this host now (every replica then binds it: api.port 0 must not give
    each replica, or a restarted one, a port of its own)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _with_port(config: PdserveConfig, port: int) -> PdserveConfig:
    return config.model_copy(update={"api": config.api.model_copy(update={"port": port})})


@contextlib.contextmanager
def _signals() -> Iterator[asyncio.Event]:
    """An event SIGINT or SIGTERM sets, while in the block."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
