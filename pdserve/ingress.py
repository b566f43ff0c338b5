"""An HTTP ingress replica: one of several frontends of a deployment, each a Ray actor.

Each replica (`Ingress`, the named actor `pdserve-ingress-<i>`, detached, restarted by Ray when
its process dies) runs the whole OpenAI frontend of `api/app.py` over its own `RayBackend`: its
own request ledger and request flow, and its own output stream from every engine (engines tell
frontends apart by subscriber, `engine_outputs.name_frontend`), so a replica's tokens go
straight from the engines to its clients and through no shared process. The replicas of a node
listen on the same api.host:api.port with SO_REUSEPORT: the kernel spreads connections over
them, and a replica that dies drops only its own connections. Every response names its
replica (`x-pdserve-ingress`).

The engines are the controller's (`controller.py`). A replica's `IngressControl` stands where
the actuator stands in one process: every `api.sync_interval_s` it sends the controller its
books, its signals and the engines it saw die, and applies the answer (`cluster.py`): engines
that joined, drain or left, and the other replicas' books for its router. Requests keep
streaming while the controller is away (restarting); the replica routes on its last view.

Lifecycle: the actor starts as it is created (or restarted): it names the frontend, syncs once
(the engines), loads the tokenizer, builds the app and serves in the background; `start()`
waits for that; `drain()` stops like `pdserve serve` on SIGTERM (running
requests may finish within api.shutdown_grace_s) and closes the engine streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

import ray

from pdserve.api.app import build_app
from pdserve.api.guard import AccessPolicy, RequestLimits
from pdserve.api.server import DrainingServer, load_tokenizer, uvicorn_config
from pdserve.config.loader import configure_logging
from pdserve.config.schema import PdserveConfig, PoolRole
from pdserve.engine.types import EngineInfo
from pdserve.errors import EngineStartError
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.ledger import RequestLedger
from pdserve.scheduler.types import PoolSignals
from pdserve.serving.backend import STATS_INTERVAL_S
from pdserve.serving.cluster import (
    ClusterView, EngineKey, IngressReport, apply_peers, books_of, ingress_name,
)
from pdserve.serving.engine_outputs import name_frontend
from pdserve.serving.metrics import ServingMetrics
from pdserve.serving.ray_backend import RayBackend
from pdserve.serving.replicas import EnginePool, Replica

logger = logging.getLogger(__name__)

INGRESS_HEADER = "x-pdserve-ingress"
# The first sync waits this long for the controller (it may still be starting engines).
_FIRST_SYNC_TIMEOUT_S = 600.0
# After a death, how long a pool counts as getting an engine before the view must say so.
_REPLACEMENT_SHOWS_S = 5.0
# A controller silent this long is reported (health, a warning per failed sync).
_CONTROLLER_SILENT_S = 5.0


class IngressControl:
    """An ingress replica's side of the controller (`RayBackend`'s `PoolControl`)."""

    def __init__(self, pools: dict[PoolRole, EnginePool], config: PdserveConfig,
                 model: ResolvedModel, ledger: RequestLedger, metrics: ServingMetrics,
                 info: EngineInfo, *, name: str, controller: Any, view: ClusterView) -> None:
        self._pools = pools
        self._config = config
        self._ledger = ledger
        self._metrics = metrics
        self._name = name
        self._controller = controller
        self._view = view
        self._dead: set[EngineKey] = set()  # to report at the next sync
        self._reported: dict[str, float] = {}  # pool -> when a death there was last reported
        self._task: asyncio.Task[None] | None = None
        self._last_answer = time.monotonic()
        self._closing: set[asyncio.Task[None]] = set()
        self._last_signals: dict[str, PoolSignals] = {}
        self._signals_at = -1e9

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sync_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def engine_died(self, replica: Replica, reason: str = "died") -> None:
        """Stop routing to it now; the controller replaces it (told at the next sync)."""
        record = self._ledger.engines.get(replica.pool.value, replica.replica_id)
        if record is not None:
            record.healthy = False
        self._dead.add((replica.pool.value, replica.replica_id))
        self._reported[replica.pool.value] = time.monotonic()

    def capacity_coming(self, pool: str) -> bool:
        """An engine of `pool` is starting, or one died moments ago: its replacement is on the
        way even if the controller's last view does not show it yet (a migration waits)."""
        recent = time.monotonic() - self._reported.get(pool, -1e9) < _REPLACEMENT_SHOWS_S
        return pool in self._view.capacity_coming or recent

    def health(self) -> dict[str, Any]:
        body = dict(self._view.health)
        silent = time.monotonic() - self._last_answer
        if silent > _CONTROLLER_SILENT_S:
            body["controller"] = f"unreachable for {silent:.0f} s (serving on its last view)"
        return body

    def publish_pool_sizes(self) -> None:
        for pool, counts in self._view.health.get("pools", {}).items():
            self._metrics.pool_replicas.labels(pool).set(counts.get("serving", 0))
            self._metrics.pool_replicas_changing.labels(pool, "starting").set(
                counts.get("starting", 0))

    async def sync_once(self) -> None:
        now = time.monotonic()
        report = IngressReport(self._name, books_of(self._ledger.engines, now),
                               self._signals(now), tuple(self._dead))
        view = await self._controller.sync.remote(report)
        self._dead -= set(report.dead)
        self._last_answer = time.monotonic()
        if view.controller != self._view.controller:
            logger.info("controller restarted (%s -> %s); re-attached", self._view.controller,
                        view.controller)
        self._view = view
        await apply_view(view, self._pools, self._ledger, self._config, self._closing)

    def _signals(self, now: float) -> dict[str, PoolSignals]:
        """This replica's autoscaling signals per pool, for the controller's autoscaler (none
        without autoscaling). Percentiles over the SLO window are not worth recomputing every
        sync: at most once per stats interval, as fresh as the engines' KV usage in them."""
        if not self._config.autoscale.enabled:
            return {}
        if now - self._signals_at >= STATS_INTERVAL_S:
            self._last_signals = {role.value: self._ledger.signals(role.value, now)
                                  for role in self._pools}
            self._signals_at = now
        return self._last_signals

    async def _sync_loop(self) -> None:
        interval = self._config.api.sync_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the controller may be restarting
                if time.monotonic() - self._last_answer > _CONTROLLER_SILENT_S:
                    logger.warning("controller did not answer the sync: %r", e)


async def apply_view(view: ClusterView, pools: dict[PoolRole, EnginePool], ledger: RequestLedger,
                     config: PdserveConfig, closing: set[asyncio.Task[None]]) -> None:
    """Make the replica's pools and ledger match the controller's engines: add the ones that
    joined (started), drain the draining, drop the gone (closing their output streams; legs
    on them fail over in the request flow), and take the other replicas' books."""
    engines = ledger.engines
    current = {e.key: e for e in view.engines}
    for role, pool in pools.items():
        for replica in list(pool.replicas):
            entry = current.get((role.value, replica.replica_id))
            if entry is None:
                pool.replicas.remove(replica)
                ledger.remove_engine(role.value, replica.replica_id)
                task = asyncio.get_running_loop().create_task(replica.outputs.aclose())
                closing.add(task)
                task.add_done_callback(closing.discard)
            elif entry.draining:
                engines.drain(role.value, replica.replica_id)
    for replica in await joined(view, pools, config.ray.namespace):
        pools.setdefault(replica.pool, EnginePool(replica.pool)).replicas.append(replica)
        assert replica.info is not None
        engines.add(replica.pool.value, replica.replica_id, replica.info.block_size,
                    replica.info.num_kv_blocks)
    apply_peers(engines, view.peers)


async def joined(view: ClusterView, pools: dict[PoolRole, EnginePool],
                 namespace: str) -> list[Replica]:
    """The view's started engines that `pools` lack, reached by their actor names."""
    known = {(r.pool.value, r.replica_id) for p in pools.values() for r in p.replicas}
    replicas = []
    for entry in view.engines:
        if entry.key in known or entry.info is None or entry.draining:
            continue
        try:
            actor = await asyncio.to_thread(ray.get_actor, entry.replica_id, namespace)
        except ValueError:
            continue  # gone since the view was made
        replicas.append(Replica(entry.replica_id, PoolRole(entry.pool), actor, entry.info))
    return replicas


class Ingress:
    """Ray actor (async): one HTTP ingress replica."""

    def __init__(self, config: PdserveConfig, model: ResolvedModel, index: int,
                 controller_name: str, access: AccessPolicy) -> None:
        configure_logging(config)
        self._config = config
        self._model = model
        self._name = ingress_name(index)
        self._controller_name = controller_name
        self._access = access
        self._backend: RayBackend | None = None
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None
        self._port = 0
        # Starts at once, also when Ray restarts the actor after its process died: the new
        # incarnation re-attaches to the engines and serves again with nobody asking.
        self._starting = asyncio.get_running_loop().create_task(self._start())

    async def start(self) -> dict[str, Any]:
        """Wait until it serves HTTP; returns where (and this process's pid)."""
        await asyncio.shield(self._starting)
        return await self.info()

    async def info(self) -> dict[str, Any]:
        return {"name": self._name, "pid": os.getpid(), "port": self._port,
                "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}

    async def drain(self) -> None:
        """Stop as `pdserve serve` stops on SIGTERM: no new connections, running requests may
        finish within api.shutdown_grace_s, then the engine streams close."""
        if self._server is not None:
            self._server.handle_exit(0, None)
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)
        if self._backend is not None:
            await self._backend.shutdown()

    async def _start(self) -> None:
        config = self._config
        name_frontend(self._name)
        controller = ray.get_actor(self._controller_name, config.ray.namespace)
        view = await _first_view(controller, self._name)
        pools = {role: EnginePool(role) for role in config.active_roles()}
        for replica in await joined(view, pools, config.ray.namespace):
            pools[replica.pool].replicas.append(replica)
        if not any(p.replicas for p in pools.values()):
            raise EngineStartError("the controller knows no started engine")

        def control(*args: Any) -> IngressControl:
            return IngressControl(*args, name=self._name, controller=controller, view=view)

        self._backend = backend = RayBackend(pools, config, self._model, ServingMetrics(),
                                             control=control, owns_engines=False)
        apply_peers(backend.ledger.engines, view.peers)
        backend.control.start()
        tokenizer = await asyncio.to_thread(load_tokenizer, self._model.path, config)
        app = build_app(backend, tokenizer, self._model.served_name,
                        config.api.max_queued_requests, config.api.default_max_tokens,
                        self._access,
                        RequestLimits(config.api.max_body_bytes, config.api.body_timeout_s),
                        config.api.tool_call_parser)
        sock = shared_socket(config.api.host, config.api.port)
        self._port = sock.getsockname()[1]
        self._server = DrainingServer(uvicorn_config(_NamedResponses(app, self._name), config), app)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve([sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises why it stopped
                raise EngineStartError(f"{self._name} stopped before it served")
            await asyncio.sleep(0.02)
        logger.info("%s serving on %s:%d", self._name, config.api.host, self._port)


async def _first_view(controller: Any, name: str) -> ClusterView:
    """The controller's engines, waiting for it to start them (or to restart)."""
    deadline = time.monotonic() + _FIRST_SYNC_TIMEOUT_S
    while True:
        try:
            return await controller.sync.remote(IngressReport(name, {}, {}))
        except Exception as e:  # noqa: BLE001 - restarting: try again until the deadline
            if time.monotonic() > deadline:
                raise EngineStartError(f"{name}: the controller did not answer: {e!r}") from e
            await asyncio.sleep(1.0)


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that the node's other replicas bind too (SO_REUSEPORT:
    the kernel spreads new connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _NamedResponses:
    """ASGI wrapper: every response carries the replica's name (`x-pdserve-ingress`)."""

    def __init__(self, app: Any, name: str) -> None:
        self._app = app
        self._header = (INGRESS_HEADER.encode(), name.encode())
        self.state = app.state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self._app(scope, receive, named)
