"""The actuator: starts and drains engine actors so each pool heads for its target size.

Lifecycle: `PoolActuator.start()` runs the scaling loop when autoscaling is on: every
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
from typing import Any

from pdserve.autoscaler.controller import Autoscaler, scaling_policy_from_config
from pdserve.autoscaler.policy import PoolBounds, ScalingDecision
from pdserve.config.schema import PdserveConfig, PoolRole
from pdserve.engine.types import EngineInfo
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.ledger import RequestLedger
from pdserve.serving.metrics import ServingMetrics
from pdserve.slo import SloTargets
from pdserve.serving.replicas import (
    EnginePool, Replica, actor_options, create_replica, kill_all, request_resources, start_all,
)

logger = logging.getLogger(__name__)


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
        self._next_index = {role: len(pool.replicas) for role, pool in pools.items()}
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.autoscaler: Autoscaler | None = None
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
        if self.autoscaler is not None:
            self._loop_task = asyncio.get_running_loop().create_task(self._scale_loop())
        self.publish_pool_sizes()

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def engine_died(self, replica: Replica) -> None:
        """A dead actor: with autoscaling on, drain it so the autoscaler replaces it."""
        record = self._ledger.engines.get(replica.pool.value, replica.replica_id)
        if self.autoscaler is not None and record is not None and not record.draining:
            self._spawn(self._drain(replica))

    async def _scale_loop(self) -> None:
        assert self.autoscaler is not None
        interval = self._config.autoscale.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                for decision in self.autoscaler.evaluate(self._ledger, time.monotonic()):
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

    async def _add(self, role: PoolRole) -> None:
        index = self._next_index[role]
        self._next_index[role] += 1
        replica = create_replica(self._config, self._model, role, index)
        replica_id = replica.replica_id
        self._pools[role].replicas.append(replica)
        self._ledger.engines.add(role.value, replica_id, self._info.block_size,
                                 self._info.num_kv_blocks, ready=False)
        self.publish_pool_sizes()
        try:
            replica.info = (await start_all([replica], self._config.engine.start_timeout_s))[0]
        except BaseException as e:
            logger.error("engine %s did not start: %r", replica_id, e)
            self._pools[role].replicas.remove(replica)
            self._ledger.remove_engine(role.value, replica_id)
            await kill_all([replica])
            self.publish_pool_sizes()
            if not isinstance(e, Exception):
                raise
            return
        self._ledger.engines.mark_ready(role.value, replica_id, replica.info.block_size,
                                        replica.info.num_kv_blocks)
        logger.info("engine %s is serving", replica_id)
        self.publish_pool_sizes()

    async def _drain(self, replica: Replica) -> None:
        role = replica.pool
        record = self._ledger.engines.drain(role.value, replica.replica_id)
        self.publish_pool_sizes()
        deadline = time.monotonic() + self._config.autoscale.drain_timeout_s
        while not record.idle:
            if time.monotonic() > deadline:
                logger.warning("engine %s still busy after the drain timeout; stopping it",
                               replica.replica_id)
                break
            await asyncio.sleep(0.1)
        self._pools[role].replicas.remove(replica)
        self._ledger.remove_engine(role.value, replica.replica_id)
        await kill_all([replica])
        logger.info("engine %s drained and stopped", replica.replica_id)
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
