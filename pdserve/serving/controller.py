"""The controller: the one actor of a deployment that owns its engines.

With several ingress replicas, or on a cluster (`PdserveConfig.owned_by_deployment`), `pdserve
serve` starts one `Controller` (the named actor `pdserve-controller`, detached, restarted by Ray
when it dies). It launches the engine pools as detached actors, keeps them at size (supervision:
the actuator replaces dead and hung engines) and scales them (the autoscaler runs here, and only
here: one leader, and a restarted controller is the same leader again). It serves no request:
the ingress replicas (`ingress.py`) do, each with its own ledger, and `sync` with it every
`api.sync_interval_s` (`cluster.py`: each replica's books in, the engines and the other
replicas' books out).

Lifecycle: `start()` (called by the driver; a restarted controller starts by itself) attaches to
the engines that already run under their names in the namespace, or launches the pools when
there are none; it returns the engines' infos. A controller that Ray restarted after a crash
therefore re-attaches to the running engines without restarting any, and rebuilds its books from
the replicas' next reports (their books are the truth; it keeps no other state). `stop()` is the
deployment's end: it drains and removes the ingress replicas, stops every engine, then removes
the controller itself, all from here, so that it completes whatever happens to the process that
asked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from typing import Any

import ray

from pdserve.config.loader import configure_logging
from pdserve.config.schema import PdserveConfig, PoolRole
from pdserve.engine.types import EngineInfo
from pdserve.errors import EngineStartError
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.types import PoolSignals
from pdserve.serving.backend import STATS_INTERVAL_S
from pdserve.serving.cluster import (
    INGRESS_PREFIX, REPORT_STALE_S, ClusterView, EngineEntry, IngressReport, apply_totals,
    merge_signals, peers, total,
)
from pdserve.serving.engine_outputs import name_frontend
from pdserve.serving.metrics import ServingMetrics
from pdserve.serving.ray_backend import RayBackend
from pdserve.serving.replicas import EnginePool, Replica, kill_all, launch_pools

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "pdserve-controller"
_ENGINE_NAME = re.compile(r"^(prefill|decode|colocated)-(\d+)$")
# How long a found engine may take to answer `start()` before it counts as gone.
_ATTACH_TIMEOUT_S = 30.0


class Controller:
    """Ray actor (async). Owns the engines; merges the ingress replicas' books and signals."""

    def __init__(self, config: PdserveConfig, model: ResolvedModel) -> None:
        configure_logging(config)
        self._config = config  # carries the cluster token: replacements must share it
        self._model = model
        self._incarnation = uuid.uuid4().hex[:12]
        # The controller reads no engine outputs; named '' it polls engine stats without
        # taking the samples the frontends count (first outputs, KV pull times).
        name_frontend("")
        self._backend: RayBackend | None = None
        self._starting: asyncio.Task[RayBackend] | None = None
        self._stats: asyncio.Task[None] | None = None
        self._reports: dict[str, tuple[float, IngressReport]] = {}
        # Starts at once, also when Ray restarts it: a restarted controller re-attaches.
        asyncio.get_running_loop().create_task(self._quiet_start())

    async def start(self) -> list[EngineInfo]:
        """Attach to the running engines or launch the pools; returns the engines' infos."""
        backend = await self._ready()
        return backend.engine_infos()

    async def sync(self, report: IngressReport) -> ClusterView:
        """One ingress replica's books and signals in; the engines and the others' books out."""
        backend = await self._ready()
        now = time.monotonic()
        self._reports[report.name] = (now, report)
        for pool, replica_id in report.dead:
            replica = _find(backend, pool, replica_id)
            if replica is not None:
                backend.control.engine_died(replica)
        totals = total(r.books for r in self._fresh(now))
        apply_totals(backend.ledger.engines, totals, now)
        coming = frozenset(role.value for role in self._roles()
                           if backend.control.capacity_coming(role.value))
        return ClusterView(self._incarnation, self._entries(backend), peers(totals, report.books),
                           backend.health(), coming)

    async def info(self) -> dict[str, Any]:
        """For operators and tests: the controller's process and incarnation, the engines."""
        backend = await self._ready()
        return {"pid": os.getpid(), "incarnation": self._incarnation,
                "engines": backend.engine_infos(), "replicas_reporting": sorted(
                    r.name for r in self._fresh(time.monotonic()))}

    async def stop(self) -> None:
        """The deployment's end, run here so that it completes even if the caller dies: drain
        every ingress replica (running requests may finish within api.shutdown_grace_s) and
        remove it, stop the engines, then remove this actor (no restart)."""
        names = await asyncio.to_thread(ray.util.list_named_actors)
        replicas = []
        for name in sorted(n for n in names if n.startswith(INGRESS_PREFIX)):
            try:
                replicas.append(await asyncio.to_thread(ray.get_actor, name,
                                                        self._config.ray.namespace))
            except ValueError:
                continue
        timeout = self._config.api.shutdown_grace_s + _ATTACH_TIMEOUT_S
        drains = await asyncio.gather(
            *(asyncio.wait_for(r.drain.remote(), timeout) for r in replicas),
            return_exceptions=True)
        for replica, result in zip(replicas, drains, strict=True):
            if isinstance(result, BaseException):
                logger.warning("an ingress replica did not drain cleanly: %r", result)
            ray.kill(replica, no_restart=True)
        await self.shutdown()
        me = ray.get_runtime_context().current_actor
        asyncio.get_running_loop().call_later(0.2, lambda: ray.kill(me, no_restart=True))

    async def shutdown(self) -> None:
        """Stop supervision and scaling, then every engine."""
        if self._stats is not None:
            self._stats.cancel()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self._backend is not None:
            await self._backend.shutdown()
            self._backend = None

    # --- start and attach -------------------------------------------------------------------

    async def _quiet_start(self) -> None:
        try:
            await self._ready()
        except Exception:
            logger.exception("controller did not start")

    async def _ready(self) -> RayBackend:
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> RayBackend:
        config = self._config
        pools = await self._attach()
        if pools:
            logger.info("controller %s re-attached to %d running engine(s): %s",
                        self._incarnation, sum(len(p.replicas) for p in pools.values()),
                        ", ".join(r.replica_id for p in pools.values() for r in p.replicas))
            for role in self._roles():
                pools.setdefault(role, EnginePool(role))
        else:
            pools = await self._launch()
        backend = RayBackend(pools, config, self._model, ServingMetrics())
        self._backend = backend
        backend.control.signals = _MergedSignals(self)  # the actuator's autoscaler
        backend.control.start()
        # A pool that lost engines while no controller ran heads back to its size.
        for role, pool in pools.items():
            missing = config.pools.for_role(role).replicas - len(pool.replicas)
            if missing > 0 and not config.autoscale.enabled:
                logger.warning("pool %s has %d of %d engines: starting %d", role.value,
                               len(pool.replicas), config.pools.for_role(role).replicas, missing)
                await backend.control.scale_to(role, config.pools.for_role(role).replicas)
        self._stats = asyncio.get_running_loop().create_task(self._poll_stats(backend))
        return backend

    async def _attach(self) -> dict[PoolRole, EnginePool]:
        """The engines of this deployment that already run (named actors in the namespace)."""
        names = await asyncio.to_thread(ray.util.list_named_actors)
        roles = {role.value: role for role in self._roles()}
        found: list[Replica] = []
        for name in sorted(names):
            match = _ENGINE_NAME.match(name)
            if match is None or match.group(1) not in roles:
                continue
            try:
                actor = await asyncio.to_thread(ray.get_actor, name, self._config.ray.namespace)
            except ValueError:
                continue  # gone since it was listed
            found.append(Replica(name, roles[match.group(1)], actor))
        if not found:
            return {}
        answers = await asyncio.gather(
            *(asyncio.wait_for(r.actor.start.remote(), _ATTACH_TIMEOUT_S) for r in found),
            return_exceptions=True)
        pools: dict[PoolRole, EnginePool] = {}
        for replica, answer in zip(found, answers, strict=True):
            if isinstance(answer, EngineInfo):
                replica.info = answer
                pools.setdefault(replica.pool, EnginePool(replica.pool)).replicas.append(replica)
            else:
                logger.warning("engine %s did not answer (%r): stopping it", replica.replica_id,
                               answer)
                await kill_all([replica], graceful=False)
        return pools

    async def _launch(self) -> dict[PoolRole, EnginePool]:
        pools = await launch_pools(self._config, self._model)
        if not any(p.replicas for p in pools.values()):
            raise EngineStartError("no engine to start: every pool has 0 replicas")
        return pools

    def _roles(self) -> list[PoolRole]:
        return list(self._config.active_roles())

    # --- books ------------------------------------------------------------------------------

    def _fresh(self, now: float) -> list[IngressReport]:
        for name, (at, _) in list(self._reports.items()):
            if now - at > REPORT_STALE_S:
                logger.warning("ingress replica %s stopped reporting; its books no longer count",
                               name)
                del self._reports[name]
        return [report for _, report in self._reports.values()]

    def _entries(self, backend: RayBackend) -> tuple[EngineEntry, ...]:
        entries = []
        for role in self._roles():
            for replica in backend.replicas(role):
                record = backend.ledger.engines.get(role.value, replica.replica_id)
                if record is None:
                    continue
                ready = record.ready and replica.info is not None
                entries.append(EngineEntry(role.value, replica.replica_id,
                                           replica.info if ready else None,
                                           draining=record.draining or not record.healthy))
        return tuple(entries)

    async def _poll_stats(self, backend: RayBackend) -> None:
        """Engine stats every second: deaths and silent engines for the supervisor, KV usage
        for the autoscaler (the replicas poll their own for routing)."""
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            try:
                await backend.refresh_stats()
            except Exception:
                logger.exception("stats poll failed")


class _MergedSignals:
    """The autoscaler's view of a pool: every fresh replica's signals, merged
    (`cluster.merge_signals`), with the controller's engine counts."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def signals(self, pool: str, now: float) -> PoolSignals:
        controller = self._controller
        assert controller._backend is not None
        own = controller._backend.ledger.signals(pool, now)  # engine counts
        parts = [r.signals[pool] for r in controller._fresh(now) if pool in r.signals]
        return merge_signals(pool, parts, own.replicas, own.starting)


def _find(backend: RayBackend, pool: str, replica_id: str) -> Replica | None:
    return next((r for r in backend.replicas(PoolRole(pool)) if r.replica_id == replica_id),
                None)
