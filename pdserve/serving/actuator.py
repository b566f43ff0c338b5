"""The actuator: keeps each pool at its size (supervision) and starts and drains engine actors
so each pool heads for its target size (scaling).

Supervision runs in every mode: an engine found dead (its actor or its vLLM engine core exited:
`engine_died`) or hung (legs in flight and no output for `serving.liveness_timeout_s`; the
supervision loop's check) is killed, taken out of the books, and replaced after a back-off that
doubles with each replacement in `serving.restart_window_s`. Its requests fail over to other
engines in the request flow (migration), which waits for the replacement when none is left.
Past `serving.restart_limit` replacements in the window a pool counts as crash-looping: no more
restarts, one error line, and `health()` says why. A replacement that does not start within
`engine.start_timeout_s` counts as a restart (`start_failed`) and is retried the same way.

Scaling: `PoolActuator.start()` also runs the scaling loop when autoscaling is on: every
`autoscale.interval_s` it asks the `Autoscaler` for decisions (the pure policy over the ledger's
signals) and applies them with `scale_to`. An added engine is registered with the ledger as
starting, placed and started in the background, then marked ready; a failed start is removed. A
drained engine takes no new requests and is stopped once the ledger says it is idle (nothing
running, placed, or waiting to be pulled from it) or the drain timeout passes. An engine found
dead is drained the same way, so the autoscaler replaces it. `stop()` cancels the loop and any
scaling in progress. Pool sizes and the ledger's model and SLO window go to the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from pdserve.autoscaler.controller import Autoscaler, SignalSource, scaling_policy_from_config
from pdserve.autoscaler.policy import PoolBounds, ScalingDecision
from pdserve.config.schema import PdserveConfig, PoolRole
from pdserve.engine.types import EngineInfo
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.ledger import RequestLedger
from pdserve.serving.backend import STATS_INTERVAL_S
from pdserve.serving.metrics import ServingMetrics
from pdserve.slo import SloTargets
from pdserve.serving.replicas import (
    EnginePool, Replica, actor_options, create_replica, kill_all, replica_index,
    request_resources, start_all,
)

logger = logging.getLogger(__name__)

# How often a starting engine that is not up yet is reported (it may wait for Ray to place it).
_SLOW_START_REPORT_S = 60.0


async def _report_slow_start(replica_id: str) -> None:
    """Log every minute that an engine is still starting: an engine Ray cannot place waits
    silently otherwise, until engine.start_timeout_s counts it as failed."""
    waited = 0.0
    while True:
        await asyncio.sleep(_SLOW_START_REPORT_S)
        waited += _SLOW_START_REPORT_S
        logger.warning("engine %s is still starting after %.0f s (is there room for it? `ray "
                       "status` shows pending demands; engine.start_timeout_s ends the wait)",
                       replica_id, waited)


class PoolActuator:
    def __init__(self, pools: dict[PoolRole, EnginePool], config: PdserveConfig,
                 model: ResolvedModel, ledger: RequestLedger, metrics: ServingMetrics,
                 info: EngineInfo) -> None:
        self._pools = pools
        self._config = config
        self._model = model
        self._ledger = ledger
        self._metrics = metrics
        self._info = info
        # Replica ids are never reused (a re-attached controller finds 'decode-0', 'decode-2').
        self._next_index = {role: 1 + max((replica_index(r.replica_id) for r in pool.replicas),
                                          default=-1)
                            for role, pool in pools.items()}
        self._loop_task: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        # Supervision: each pool's size to keep, its recent replacements, replacements waiting
        # out their back-off, and why a pool is no longer restarted (a crash loop).
        self._targets = {role: len(pool.replicas) for role, pool in pools.items()}
        self._restarts: dict[PoolRole, deque[float]] = {role: deque() for role in pools}
        self._pending = {role: 0 for role in pools}
        self._given_up: dict[PoolRole, str] = {}
        self._dead: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.autoscaler: Autoscaler | None = None
        # What the autoscaler reads each pool's signals from: this ledger's traffic, or (the
        # controller of several ingress replicas) every replica's, merged.
        self.signals: SignalSource = ledger
        if config.autoscale.enabled:
            self.autoscaler = Autoscaler(
                {role.value: PoolBounds(config.autoscale.bounds(role).min_replicas,
                                        config.autoscale.bounds(role).max_replicas)
                 for role in pools},
                SloTargets.from_config(config.slo), scaling_policy_from_config(config.autoscale),
                max_gpus=config.autoscale.max_gpus,
                # Budget units: each engine's GPUs, or one per engine on CPU.
                gpus_per_engine={role.value: max(1, int(actor_options(config, role, "")["num_gpus"]))
                                 for role in pools})

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.autoscaler is not None:
            self._loop_task = loop.create_task(self._scale_loop())
        self._supervisor = loop.create_task(self._supervise())
        self.publish_pool_sizes()

    async def stop(self) -> None:
        for task in (self._loop_task, self._supervisor):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- supervision ------------------------------------------------------------------------

    def engine_died(self, replica: Replica, reason: str = "died") -> None:
        """The engine is dead (`reason` 'died') or hung ('hung'): stop routing to it at once,
        kill it, and replace it."""
        record = self._ledger.engines.get(replica.pool.value, replica.replica_id)
        if replica.replica_id in self._dead or record is None:
            return
        self._dead.add(replica.replica_id)
        record.healthy = False
        # A draining engine was leaving anyway: nothing replaces it.
        replace = not record.draining
        logger.error("engine %s %s%s", replica.replica_id,
                     "died" if reason == "died" else f"is {reason}",
                     "; replacing it" if replace else " while draining")
        self._spawn(self._replace(replica, reason, replace))

    def capacity_coming(self, pool: str) -> bool:
        """Whether an engine of `pool` is starting or about to (a replacement in its back-off)."""
        role = PoolRole(pool)
        return self._pending.get(role, 0) > 0 or any(
            e.starting for e in self._ledger.engines.engines(pool))

    def health(self) -> dict[str, Any]:
        """'ready' (every pool at its size), 'degraded' (a pool below its size or crash-looping,
        requests still served) or 'down' (no engine serves the pool that produces tokens), with
        each pool's counts and the reason."""
        pools, problems, down = {}, [], False
        serving_pool = PoolRole.DECODE if PoolRole.DECODE in self._pools else PoolRole.COLOCATED
        now = time.monotonic()
        for role in self._pools:
            records = self._ledger.engines.engines(role.value)
            serving = sum(1 for e in records if e.accepting)
            starting = sum(1 for e in records if e.starting)
            target = self._targets[role]
            crash = self._given_up.get(role)
            pools[role.value] = {"serving": serving, "target": target, "starting": starting,
                                 "restarts_in_window": len(self._window(role, now)),
                                 "crash_loop": crash}
            if crash is not None:
                problems.append(f"pool {role.value!r} is not restarted: {crash}")
            elif serving < target:
                problems.append(f"pool {role.value!r} has {serving} of {target} engines serving"
                                f" ({starting} starting)")
            down |= serving == 0 and role is serving_pool
        status = "down" if down else "degraded" if problems else "ready"
        body: dict[str, Any] = {"status": status, "pools": pools}
        if problems:
            body["reason"] = "; ".join(problems)
        return body

    async def _supervise(self) -> None:
        """Every second: engines with legs in flight and no progress for the liveness timeout
        (or no stats answer for as long) are hung."""
        timeout = self._config.serving.liveness_timeout_s
        while True:
            await asyncio.sleep(1.0)
            try:
                now = time.monotonic()
                for role, pool in self._pools.items():
                    for replica in list(pool.replicas):
                        record = self._ledger.engines.get(role.value, replica.replica_id)
                        if record is None or not record.ready or not record.healthy:
                            continue
                        stalled = record.in_flight > 0 and now - record.last_progress > timeout
                        # Missed stats polls times their interval: how long it has been silent.
                        silent = record.stats_misses * STATS_INTERVAL_S > timeout
                        if stalled or silent:
                            self.engine_died(replica, "hung")
                self.publish_pool_sizes()
            except Exception:
                logger.exception("supervision step failed")

    async def _replace(self, replica: Replica, reason: str, replace: bool = True) -> None:
        role = replica.pool
        self._pending[role] += 1
        try:
            # Killing the actor ends its output stream: its requests fail over now.
            await self._retire(replica, graceful=False)
            if not replace:
                return
            self._metrics.engine_restarts.labels(role.value, reason).inc()
            while self._may_restart(role):
                await asyncio.sleep(self._backoff_s(role))
                if await self._add(role):
                    return
                self._metrics.engine_restarts.labels(role.value, "start_failed").inc()
        finally:
            self._pending[role] -= 1
            self.publish_pool_sizes()

    def _window(self, role: PoolRole, now: float) -> deque[float]:
        window = self._restarts[role]
        while window and window[0] < now - self._config.serving.restart_window_s:
            window.popleft()
        return window

    def _may_restart(self, role: PoolRole) -> bool:
        """Count one more restart of `role`'s pool, or give up on it (a crash loop)."""
        serving = self._config.serving
        window = self._window(role, time.monotonic())
        if len(window) >= serving.restart_limit:
            if role not in self._given_up:
                self._given_up[role] = (f"{len(window)} engine restarts within "
                                        f"{serving.restart_window_s:g} s (serving.restart_limit)")
                logger.error("pool %s is crash-looping: %s; not restarting its engines until "
                             "the service restarts", role.value, self._given_up[role])
            return False
        window.append(time.monotonic())
        return True

    def _backoff_s(self, role: PoolRole) -> float:
        serving = self._config.serving
        n = len(self._restarts[role])
        return min(serving.restart_backoff_s * 2 ** max(n - 1, 0), serving.restart_backoff_max_s)

    async def _scale_loop(self) -> None:
        assert self.autoscaler is not None
        interval = self._config.autoscale.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                for decision in self.autoscaler.evaluate(self.signals, time.monotonic()):
                    self._record(decision)
                    if decision.delta:
                        await self.scale_to(PoolRole(decision.pool), decision.target)
            except Exception:
                logger.exception("autoscaling step failed")

    def _record(self, decision: ScalingDecision) -> None:
        self._metrics.scaling_decisions.labels(decision.pool, decision.direction,
                                               decision.reason).inc()
        if decision.delta:
            logger.info("scaling %s %s: %d -> %d (%s: %s)", decision.pool, decision.direction,
                        decision.current, decision.target, decision.reason, decision.detail)

    async def scale_to(self, role: PoolRole, target: int) -> None:
        """Start or drain engines so that `role`'s pool heads for `target` serving engines.

        Adds run in the background (an engine takes up to minutes to start); a drain picks
        the engine with the least outstanding work, stops routing to it, and stops it once its
        requests are done and no decode engine still has to pull its KV.
        """
        engines = self._ledger.engines
        serving = [r for r in self._pools[role].replicas
                   if (rec := engines.get(role.value, r.replica_id)) is not None
                   and rec.healthy and not rec.draining]
        if self._config.autoscale.request_resources:
            wanted = {r: sum(1 for x in self._pools[r].replicas
                             if not self._draining(r, x.replica_id)) for r in self._pools}
            wanted[role] = target
            request_resources(self._config, wanted)
        self._targets[role] = target
        for _ in range(target - len(serving)):
            self._spawn(self._add(role))
        if target < len(serving):
            candidates = sorted(
                (r for r in serving if r.info is not None),
                key=lambda r: (not engines[role.value, r.replica_id].idle,
                               engines[role.value, r.replica_id].in_flight, r.replica_id))
            for replica in candidates[: len(serving) - target]:
                self._spawn(self._drain(replica))
        self.publish_pool_sizes()

    def _draining(self, role: PoolRole, replica_id: str) -> bool:
        record = self._ledger.engines.get(role.value, replica_id)
        return record is None or record.draining

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, role: PoolRole) -> bool:
        """Start one more engine of `role`; False when it did not start (it is gone again)."""
        index = self._next_index[role]
        self._next_index[role] += 1
        replica = create_replica(self._config, self._model, role, index)
        replica_id = replica.replica_id
        self._pools[role].replicas.append(replica)
        self._ledger.engines.add(role.value, replica_id, self._info.block_size,
                                 self._info.num_kv_blocks, ready=False)
        self.publish_pool_sizes()
        waiting = asyncio.get_running_loop().create_task(_report_slow_start(replica_id))
        try:
            replica.info = (await start_all([replica], self._config.engine.start_timeout_s))[0]
        except BaseException as e:
            logger.error("engine %s did not start: %r", replica_id, e)
            await self._retire(replica, graceful=False)
            if not isinstance(e, Exception):
                raise
            return False
        finally:
            waiting.cancel()
        self._ledger.engines.mark_ready(role.value, replica_id, replica.info.block_size,
                                        replica.info.num_kv_blocks)
        self._metrics.register_engines([replica.info])
        logger.info("engine %s is serving", replica_id)
        self.publish_pool_sizes()
        return True

    async def _drain(self, replica: Replica) -> None:
        role = replica.pool
        record = self._ledger.engines.drain(role.value, replica.replica_id)
        self.publish_pool_sizes()
        deadline = time.monotonic() + self._config.autoscale.drain_timeout_s
        while not record.idle:
            if replica.replica_id in self._dead:
                return  # it died while draining: `_replace` took it away
            if time.monotonic() > deadline:
                logger.warning("engine %s still busy after the drain timeout; stopping it",
                               replica.replica_id)
                break
            await asyncio.sleep(0.1)
        await self._retire(replica, graceful=True)
        logger.info("engine %s drained and stopped", replica.replica_id)

    async def _retire(self, replica: Replica, graceful: bool) -> None:
        """Take an engine out of its pool, the books and the metrics, then stop it (its
        `shutdown()` first when `graceful`: not for a dead, hung or unstarted one)."""
        role = replica.pool
        if replica in self._pools[role].replicas:
            self._pools[role].replicas.remove(replica)
        self._ledger.remove_engine(role.value, replica.replica_id)
        if replica.info is not None:
            self._metrics.forget_engine(replica.info)
        await kill_all([replica], graceful=graceful)
        self.publish_pool_sizes()

    def publish_pool_sizes(self) -> None:
        metrics, engines = self._metrics, self._ledger.engines
        for role in self._pools:
            records = engines.engines(role.value)
            metrics.pool_replicas.labels(role.value).set(
                sum(1 for e in records if e.ready and not e.draining))
            metrics.pool_replicas_changing.labels(role.value, "starting").set(
                sum(1 for e in records if not e.ready))
            metrics.pool_replicas_changing.labels(role.value, "draining").set(
                sum(1 for e in records if e.draining))
            metrics.observe_model(role.value, self._ledger.model(role.value))
        slo = self._ledger.slo
        if slo is not None:
            now = time.monotonic()
            for role in self._pools:
                summary = self._ledger.tracker.summary(role.value, now, slo.percentile,
                                                       slo.ttft_s, slo.tpot_s)
                metrics.observe_slo(role.value, summary)
