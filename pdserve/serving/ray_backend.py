"""The backend that routes requests over the engine pools on Ray, and scales the pools.

Lifecycle: `RayBackend.launch(config, model)` places one `EngineActor` per replica of every
active pool (`replicas.py`), awaits their `start()` in parallel, and returns a backend ready to
serve, with the global scheduler built from the config (`scheduling.py`). Each request is routed
by the pure policy in `pdserve.scheduler.routing`, submitted to its engine, streamed back through
the engine's one multiplexed output stream (`engine_outputs.py`), and aborted in the engine if its
consumer stops early. In disaggregated mode each request runs as a prefill leg and a decode leg
(`disaggregated.py`) on engines of the two pools. With autoscaling on, a background loop asks
the autoscaler for decisions and starts or drains engines to meet them. `shutdown()` cancels that
loop and any scaling in progress, then stops every engine, each in its own try block, and kills
the actors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from pdserve.api.metrics import ServingMetrics
from pdserve.autoscaler.controller import Autoscaler, scaling_policy_from_config
from pdserve.autoscaler.policy import PoolBounds, ScalingDecision
from pdserve.config.schema import PdserveConfig, PoolRole, ServingMode
from pdserve.engine.types import (
    EngineInfo, EngineStats, GenerateDelta, GenerateFailure, GenerateRequest,
)
from pdserve.errors import EngineRequestError, EngineUnavailableError, OverloadedError
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.routing import Placement, Rejection
from pdserve.serving.disaggregated import generate_disaggregated
from pdserve.serving.engine_outputs import StreamLost
from pdserve.serving.replicas import (
    EnginePool, Replica, actor_options, create_pool, create_replica, kill_all, local_core_split,
    request_resources, start_all, with_cluster_token,
)
from pdserve.serving.scheduling import build_scheduler

logger = logging.getLogger(__name__)

# A stats call slower than this means the engine is wedged or gone (a healthy one answers in ms).
_STATS_TIMEOUT_S = 5.0


class RayBackend:
    """Routes requests over the engine pools with the global scheduler; scales the pools."""

    def __init__(self, pools: dict[PoolRole, EnginePool], config: PdserveConfig,
                 model: ResolvedModel, metrics: ServingMetrics | None = None) -> None:
        self._pools = pools
        self._config = config
        self._model = model
        self._metrics = metrics
        self._disaggregated = config.mode is ServingMode.DISAGGREGATED
        self._serving_pool = PoolRole.DECODE if self._disaggregated else PoolRole.COLOCATED
        first = next(r for p in pools.values() for r in p.replicas)
        assert first.info is not None
        self._info = first.info
        self._next_index = {role: len(pool.replicas) for role, pool in pools.items()}
        self.scheduler = build_scheduler(config, [r.value for r in pools], first.info)
        for pool in pools.values():
            for replica in pool.replicas:
                self._register(replica)
        self.autoscaler: Autoscaler | None = None
        self._scaler_task: asyncio.Task[None] | None = None
        self._scaling_tasks: set[asyncio.Task[None]] = set()
        if config.autoscale.enabled:
            slo = config.slo
            self.autoscaler = Autoscaler(
                {role.value: PoolBounds(config.autoscale.bounds(role).min_replicas,
                                        config.autoscale.bounds(role).max_replicas)
                 for role in pools},
                slo.ttft_ms / 1000, slo.tpot_ms / 1000,
                scaling_policy_from_config(config.autoscale),
                max_gpus=config.autoscale.max_gpus,
                # Budget units: each engine's GPUs, or one per engine on CPU.
                gpus_per_engine={role.value: max(1, int(actor_options(config, role, "")["num_gpus"]))
                                 for role in pools})

    @classmethod
    async def launch(cls, config: PdserveConfig, model: ResolvedModel,
                     metrics: ServingMetrics | None = None) -> RayBackend:
        config = with_cluster_token(config)
        if config.autoscale.enabled and config.autoscale.request_resources:
            request_resources(config, {r: config.pools.for_role(r).replicas
                                       for r in config.active_roles()})
        cores = local_core_split(config)
        pools = {role: create_pool(config, model, role, cores) for role in config.active_roles()}
        replicas = [r for p in pools.values() for r in p.replicas]
        try:
            infos = await start_all(replicas, config.engine.start_timeout_s)
        except BaseException:
            await kill_all(replicas)
            raise
        for replica, info in zip(replicas, infos, strict=True):
            replica.info = info
        backend = cls(pools, config, model, metrics)
        if backend.autoscaler is not None:
            backend._scaler_task = asyncio.get_running_loop().create_task(backend._scale_loop())
        backend._publish_pool_sizes()
        return backend

    @property
    def info(self) -> EngineInfo:
        return self._info

    def engine_infos(self) -> list[EngineInfo]:
        return [r.info for p in self._pools.values() for r in p.replicas if r.info is not None]

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(role.value for role in self._pools)

    @property
    def serving_pool(self) -> str:
        return self._serving_pool.value

    def replicas(self, role: PoolRole) -> list[Replica]:
        return list(self._pools[role].replicas)

    # --- request path -----------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Place the request now (raising `OverloadedError` / `EngineUnavailableError` before
        any response starts), then stream it from the chosen engines."""
        placement = self.scheduler.route(request.prompt_token_ids, request.sampling.max_tokens)
        if isinstance(placement, Rejection):
            if placement.reason == "no_engine":
                raise EngineUnavailableError(f"no engine can take requests in pool "
                                             f"{self._serving_pool.value!r}")
            raise OverloadedError(placement.retry_after_s, placement.reason,
                                  placement.predicted_ttft_s)
        logger.debug("placed %s: %s", request.request_id, placement)
        self.scheduler.reserve(placement)
        return _Reserved(self._generate(request, placement),
                         lambda: self.scheduler.release(placement))

    async def _generate(self, request: GenerateRequest,
                        placement: Placement) -> AsyncIterator[GenerateDelta]:
        decode = self._replica(self._serving_pool, placement.decode)
        prefill = (self._replica(PoolRole.PREFILL, placement.prefill)
                   if placement.prefill is not None else None)
        ttft_pool = prefill.pool.value if prefill is not None else decode.pool.value
        if self._metrics is not None:
            self._metrics.predicted_ttft.labels(ttft_pool).observe(placement.predicted_ttft_s)
            self._metrics.predicted_tpot.labels(decode.pool.value).observe(
                placement.predicted_tpot_s)
        if prefill is None:
            deltas = self._stream(decode, request, "full")
        else:
            deltas = self._disaggregated_stream(request, prefill, decode)
        started = time.monotonic()
        first = last = None
        tokens = 0
        try:
            async with aclosing(deltas) as stream:
                async for delta in stream:
                    if delta.token_ids:
                        last = time.monotonic()
                        if first is None:
                            first = last
                            self.scheduler.first_token_seen(ttft_pool, first, first - started)
                        tokens += len(delta.token_ids)
                    yield delta
        finally:
            now = time.monotonic()
            tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
            self.scheduler.request_finished(ttft_pool, decode.pool.value, now, None, tpot)

    async def _disaggregated_stream(self, request: GenerateRequest, prefill: Replica,
                                    decode: Replica) -> AsyncIterator[GenerateDelta]:
        # The prefill engine holds this request's KV until the decode engine has pulled it:
        # the scheduler counts it as a pin, so a draining prefill engine waits for it.
        pinned = request.sampling.max_tokens > 1
        if pinned:
            self.scheduler.pin(prefill.pool.value, prefill.replica_id)

        def release() -> None:
            nonlocal pinned
            if pinned:
                pinned = False
                self.scheduler.unpin(prefill.pool.value, prefill.replica_id)

        async def prefill_leg(r: GenerateRequest) -> AsyncIterator[GenerateDelta]:
            last = None
            try:
                async for last in self._stream(prefill, r, "prefill"):
                    yield last
            finally:
                if last is None or last.finish_reason != "length":
                    release()  # failed, aborted or stopped: there is nothing to pull

        async def decode_leg(r: GenerateRequest) -> AsyncIterator[GenerateDelta]:
            kind = "decode" if _remote_prefill(r) else "full"
            async for delta in self._stream(decode, r, kind):
                release()  # the decode engine has pulled the KV (or recomputed the prompt)
                yield delta

        try:
            async with aclosing(generate_disaggregated(
                    request, prefill=prefill_leg, decode=decode_leg,
                    failure_policy=self._config.kv.failure_policy)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            release()

    async def _stream(self, replica: Replica, request: GenerateRequest,
                      kind: str) -> AsyncIterator[GenerateDelta]:
        """Stream one leg from one engine; keep the scheduler's books; abort if unfinished.

        kind: "full" (prefill + decode on this engine), "prefill" (first token only),
        "decode" (a decode leg whose KV is pulled from a prefill engine).
        """
        replica.outputs.open(request.request_id)  # before submitting: no delta goes unrouted
        sched, pool = self.scheduler, replica.pool.value
        ticket = None
        decoding = False
        if kind in ("full", "prefill"):
            uncached = max(len(request.prompt_token_ids)
                           - sched.cached_tokens(replica.replica_id, request.prompt_token_ids), 1)
            ticket = sched.prefill_started(pool, replica.replica_id, uncached, time.monotonic())
        else:
            sched.decode_started(pool, replica.replica_id)
            decoding = True
        started = previous = time.monotonic()
        first_delta = True
        replica.in_flight += 1
        finished = False
        try:
            await replica.actor.submit.remote(request)
            while True:
                delta = _delta_or_raise(replica, await replica.outputs.next(request.request_id))
                now = time.monotonic()
                if ticket is not None and not ticket.done:
                    sched.first_token(ticket, now)
                    sched.remember_prefix(replica.replica_id, request.prompt_token_ids)
                    if kind == "full" and not delta.finished:
                        sched.decode_started(pool, replica.replica_id)
                        decoding = True
                elif kind == "decode" and first_delta:
                    # A decode leg's first token comes after the pull and one step.
                    sched.transfer_observed(len(request.prompt_token_ids), now - started)
                elif delta.token_ids:
                    sched.token_gap(pool, replica.replica_id, now - previous, len(delta.token_ids))
                previous, first_delta = now, False
                finished = delta.finished
                yield delta
                if finished:
                    return
        except RayActorError as e:
            replica.healthy = False
            sched.update_engine(pool, replica.replica_id, healthy=False)
            raise EngineRequestError(f"engine {replica.replica_id} died: {e}") from e
        except RayTaskError as e:
            raise EngineRequestError(f"engine {replica.replica_id} failed: {e.cause!r}") from e
        finally:
            replica.outputs.close(request.request_id)
            replica.in_flight -= 1
            if ticket is not None:
                sched.first_token(ticket, time.monotonic(), observe=False)
            if decoding:
                sched.decode_finished(pool, replica.replica_id)
            if not finished:
                _abort_quietly(replica, request.request_id)

    def _replica(self, role: PoolRole, replica_id: str) -> Replica:
        for replica in self._pools[role].replicas:
            if replica.replica_id == replica_id:
                return replica
        raise EngineUnavailableError(f"engine {replica_id} is gone")

    def _register(self, replica: Replica, ready: bool = True) -> None:
        info = replica.info
        self.scheduler.add_engine(
            replica.pool.value, replica.replica_id,
            info.block_size if info else self._info.block_size,
            info.num_kv_blocks if info else self._info.num_kv_blocks, ready=ready)

    # --- stats ------------------------------------------------------------------------------

    async def refresh_stats(self) -> list[EngineStats]:
        replicas = [r for p in self._pools.values() for r in p.replicas if r.info is not None]
        results = await asyncio.gather(
            *(_fetch_stats(r) for r in replicas), return_exceptions=True
        )
        stats = []
        for replica, result in zip(replicas, results, strict=True):
            replica.healthy = isinstance(result, EngineStats)
            if replica.healthy:
                replica.stats = result
                stats.append(result)
                self.scheduler.update_engine(replica.pool.value, replica.replica_id,
                                             kv_usage=result.kv_cache_usage, healthy=True)
            else:
                # A dead actor takes no more requests; a slow answer (an overloaded host) is
                # reported but the engine stays routable: its requests still complete.
                if isinstance(result, RayActorError):
                    self.scheduler.update_engine(replica.pool.value, replica.replica_id,
                                                 healthy=False)
                    if self.autoscaler is not None and not replica.draining:
                        # The pool's signals no longer count it; the autoscaler replaces it.
                        self._spawn(self._drain_replica(replica))
                logger.warning("engine %s did not answer stats: %r", replica.replica_id, result)
        self._publish_pool_sizes()
        return stats

    def healthy(self) -> bool:
        return all(any(r.healthy and r.info is not None for r in p.replicas)
                   for p in self._pools.values())

    async def shutdown(self) -> None:
        if self._scaler_task is not None:
            self._scaler_task.cancel()
            await asyncio.gather(self._scaler_task, return_exceptions=True)
        for task in list(self._scaling_tasks):
            task.cancel()
        await asyncio.gather(*self._scaling_tasks, return_exceptions=True)
        await kill_all([r for p in self._pools.values() for r in p.replicas])

    # --- scaling (the actuator) -------------------------------------------------------------

    async def _scale_loop(self) -> None:
        assert self.autoscaler is not None
        interval = self._config.autoscale.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                for decision in self.autoscaler.evaluate(self.scheduler, time.monotonic()):
                    self._record_decision(decision)
                    if decision.delta:
                        await self.scale_to(PoolRole(decision.pool), decision.target)
            except Exception:
                logger.exception("autoscaling step failed")

    def _record_decision(self, decision: ScalingDecision) -> None:
        if self._metrics is not None:
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
        pool = self._pools[role]
        serving = [r for r in pool.replicas if not r.draining
                   and self.scheduler.engine(role.value, r.replica_id).healthy]
        if self._config.autoscale.request_resources:
            wanted = {r: len([x for x in self._pools[r].replicas if not x.draining])
                      for r in self._pools}
            wanted[role] = target
            request_resources(self._config, wanted)
        for _ in range(target - len(serving)):
            self._spawn(self._add_replica(role))
        if target < len(serving):
            candidates = sorted(
                (r for r in serving if r.info is not None),
                key=lambda r: (not self.scheduler.engine(role.value, r.replica_id).idle,
                               r.in_flight, r.replica_id))
            for replica in candidates[: len(serving) - target]:
                self._spawn(self._drain_replica(replica))
        self._publish_pool_sizes()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._scaling_tasks.add(task)
        task.add_done_callback(self._scaling_tasks.discard)

    async def _add_replica(self, role: PoolRole) -> None:
        index = self._next_index[role]
        self._next_index[role] += 1
        replica = create_replica(self._config, self._model, role, index)
        replica_id = replica.replica_id
        self._pools[role].replicas.append(replica)
        self._register(replica, ready=False)
        self._publish_pool_sizes()
        try:
            replica.info = (await start_all([replica], self._config.engine.start_timeout_s))[0]
        except BaseException as e:
            logger.error("engine %s did not start: %r", replica_id, e)
            self._pools[role].replicas.remove(replica)
            self.scheduler.remove_engine(role.value, replica_id)
            await kill_all([replica])
            self._publish_pool_sizes()
            if not isinstance(e, Exception):
                raise
            return
        state = self.scheduler.engine(role.value, replica_id)
        state.block_size = replica.info.block_size
        state.num_kv_blocks = max(replica.info.num_kv_blocks, 1)
        self.scheduler.mark_ready(role.value, replica_id)
        logger.info("engine %s is serving", replica_id)
        self._publish_pool_sizes()

    async def _drain_replica(self, replica: Replica) -> None:
        role, sched = replica.pool, self.scheduler
        replica.draining = True
        state = sched.drain(role.value, replica.replica_id)
        self._publish_pool_sizes()
        deadline = time.monotonic() + self._config.autoscale.drain_timeout_s
        while replica.in_flight or not state.idle:
            if time.monotonic() > deadline:
                logger.warning("engine %s still busy after the drain timeout; stopping it",
                               replica.replica_id)
                break
            await asyncio.sleep(0.1)
        self._pools[role].replicas.remove(replica)
        sched.remove_engine(role.value, replica.replica_id)
        await kill_all([replica])
        logger.info("engine %s drained and stopped", replica.replica_id)
        self._publish_pool_sizes()

    def _publish_pool_sizes(self) -> None:
        if self._metrics is None:
            return
        for role, pool in self._pools.items():
            ready = sum(1 for r in pool.replicas if r.info is not None and not r.draining)
            starting = sum(1 for r in pool.replicas if r.info is None)
            draining = sum(1 for r in pool.replicas if r.draining)
            self._metrics.pool_replicas.labels(role.value).set(ready)
            self._metrics.pool_replicas_changing.labels(role.value, "starting").set(starting)
            self._metrics.pool_replicas_changing.labels(role.value, "draining").set(draining)
        for role in self._pools:
            self._metrics.observe_model(role.value, self.scheduler.model(role.value))
        if self.scheduler.slo is not None:
            now = time.monotonic()
            for role in self._pools:
                summary = self.scheduler.tracker.summary(
                    role.value, now, self.scheduler.slo.percentile, self.scheduler.slo.ttft_s,
                    self.scheduler.slo.tpot_s)
                self._metrics.observe_slo(role.value, summary)


class _Reserved:
    """An async iterator over a placed request that releases the placement's reservation
    exactly once: when the stream ends, when it is closed, or when it is dropped unstarted."""

    def __init__(self, stream: AsyncIterator[GenerateDelta], release: Any) -> None:
        self._stream = stream
        self._release = release

    def __aiter__(self) -> _Reserved:
        return self

    async def __anext__(self) -> GenerateDelta:
        try:
            return await self._stream.__anext__()
        except BaseException:
            self._done()
            raise

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._done()

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        self._done()


def _remote_prefill(request: GenerateRequest) -> bool:
    return bool((request.kv_transfer_params or {}).get("do_remote_prefill"))


async def _fetch_stats(replica: Replica) -> EngineStats:
    return await asyncio.wait_for(replica.actor.stats.remote(), _STATS_TIMEOUT_S)


def _delta_or_raise(replica: Replica, output: GenerateDelta | GenerateFailure | StreamLost,
                    ) -> GenerateDelta:
    """A request's next output from its engine as a delta; anything else raises."""
    if isinstance(output, GenerateDelta):
        return output
    if isinstance(output, GenerateFailure):
        if output.error:
            raise EngineRequestError(f"engine {replica.replica_id} failed: {output.error}")
        raise EngineRequestError(f"engine {replica.replica_id} ended a stream unfinished")
    if isinstance(output.error, (RayActorError, RayTaskError)):
        raise output.error  # mapped (and a dead actor marked unhealthy) by `_stream`
    raise EngineRequestError(f"lost the output stream of engine {replica.replica_id}: "
                             f"{output.error!r}")


def _abort_quietly(replica: Replica, request_id: str) -> None:
    try:
        replica.actor.abort.remote(request_id)  # fire and forget: the stream is already gone
    except Exception as e:  # noqa: BLE001 - an abort must never mask the original outcome
        logger.warning("abort of %s on %s failed: %r", request_id, replica.replica_id, e)

