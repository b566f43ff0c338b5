"""Engine pools of Ray actors, and the backend that routes requests among them.

Lifecycle: `RayBackend.launch(config, model)` creates one `EngineActor` per replica of every
active pool (placement from the pool's Ray resources), awaits their `start()` in parallel, and
returns a backend ready to serve. Each request is routed by the pure policy in
`pdserve.scheduler.routing`, streamed from its engine through a Ray streaming generator, and
aborted in the engine if its consumer stops early. In disaggregated mode each request runs as a
prefill leg and a decode leg (`disaggregated.py`) on engines of the two pools. `shutdown()` stops every engine, each in its
own try block, and kills the actors.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from pdserve.config.schema import PdserveConfig, PoolRole, ServingMode
from pdserve.engine.actor import EngineActor, EngineSpec
from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest
from pdserve.errors import EngineRequestError, EngineStartError, EngineUnavailableError
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.routing import ReplicaLoad, pick_least_loaded
from pdserve.serving.disaggregated import generate_disaggregated

logger = logging.getLogger(__name__)

# A stats call slower than this means the engine is wedged or gone (a healthy one answers in ms).
_STATS_TIMEOUT_S = 5.0


@dataclass(slots=True)
class Replica:
    replica_id: str
    pool: PoolRole
    actor: Any  # ray.actor.ActorHandle
    info: EngineInfo | None = None
    in_flight: int = 0
    stats: EngineStats | None = None
    healthy: bool = True


@dataclass(slots=True)
class EnginePool:
    role: PoolRole
    replicas: list[Replica] = field(default_factory=list)


def actor_options(config: PdserveConfig, role: PoolRole, replica_id: str) -> dict[str, Any]:
    """Ray placement of one engine actor, from its pool's config."""
    pool = config.pools.for_role(role)
    num_gpus = pool.num_gpus
    if num_gpus is None:
        on_gpu = config.engine.device == "cuda" or (
            config.engine.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        num_gpus = config.engine.tensor_parallel_size if on_gpu else 0
    return {
        "name": replica_id,
        "namespace": config.ray.namespace,
        "num_cpus": pool.num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(pool.resources),
        # One actor serves many concurrent streams on its event loop.
        "max_concurrency": 4096,
    }


class RayBackend:
    def __init__(self, pools: dict[PoolRole, EnginePool], config: PdserveConfig) -> None:
        self._pools = pools
        self._config = config
        self._disaggregated = config.mode is ServingMode.DISAGGREGATED
        self._serving_pool = PoolRole.DECODE if self._disaggregated else PoolRole.COLOCATED
        first = next(r for p in pools.values() for r in p.replicas)
        assert first.info is not None
        self._info = first.info

    @classmethod
    async def launch(cls, config: PdserveConfig, model: ResolvedModel) -> RayBackend:
        config = with_cluster_token(config)
        pools = {role: _create_pool(config, model, role) for role in config.active_roles()}
        replicas = [r for p in pools.values() for r in p.replicas]
        try:
            infos = await _start_all(replicas, config.engine.start_timeout_s)
        except BaseException:
            await _kill_all(replicas)
            raise
        for replica, info in zip(replicas, infos, strict=True):
            replica.info = info
        return cls(pools, config)

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

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        if not self._disaggregated:
            return self._stream(PoolRole.COLOCATED, request)
        return generate_disaggregated(
            request,
            prefill=lambda r: self._stream(PoolRole.PREFILL, r),
            decode=lambda r: self._stream(PoolRole.DECODE, r),
            failure_policy=self._config.kv.failure_policy,
        )

    async def _stream(self, role: PoolRole, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream one request from one engine of `role`'s pool; abort it there if unfinished."""
        replica = self._route(self._pools[role])
        replica.in_flight += 1
        finished = False
        try:
            stream = replica.actor.generate.options(num_returns="streaming").remote(request)
            async for ref in stream:
                delta: GenerateDelta = await ref
                finished = delta.finished
                yield delta
                if finished:
                    return
            raise EngineRequestError(f"engine {replica.replica_id} ended a stream unfinished")
        except RayActorError as e:
            replica.healthy = False
            raise EngineRequestError(f"engine {replica.replica_id} died: {e}") from e
        except RayTaskError as e:
            raise EngineRequestError(f"engine {replica.replica_id} failed: {e.cause!r}") from e
        finally:
            replica.in_flight -= 1
            if not finished:
                _abort_quietly(replica, request.request_id)

    async def refresh_stats(self) -> list[EngineStats]:
        replicas = [r for p in self._pools.values() for r in p.replicas]
        results = await asyncio.gather(
            *(_fetch_stats(r) for r in replicas), return_exceptions=True
        )
        stats = []
        for replica, result in zip(replicas, results, strict=True):
            replica.healthy = isinstance(result, EngineStats)
            if replica.healthy:
                replica.stats = result
                stats.append(result)
            else:
                logger.warning("engine %s did not answer stats: %r", replica.replica_id, result)
        return stats

    def healthy(self) -> bool:
        return all(any(r.healthy for r in p.replicas) for p in self._pools.values())

    async def shutdown(self) -> None:
        await _kill_all([r for p in self._pools.values() for r in p.replicas])

    def _route(self, pool: EnginePool) -> Replica:
        loads = [
            ReplicaLoad(
                replica_id=r.replica_id, in_flight=r.in_flight,
                num_waiting=r.stats.num_waiting if r.stats else 0,
                kv_cache_usage=r.stats.kv_cache_usage if r.stats else 0.0, healthy=r.healthy,
            )
            for r in pool.replicas
        ]
        chosen = pick_least_loaded(loads)
        if chosen is None:
            raise EngineUnavailableError(f"no healthy engine in pool {pool.role.value!r}")
        return next(r for r in pool.replicas if r.replica_id == chosen)


def with_cluster_token(config: PdserveConfig) -> PdserveConfig:
    """Fill in a random cluster token for KV peers when the config does not set one."""
    if config.kv.cluster_token:
        return config
    kv = config.kv.model_copy(update={"cluster_token": secrets.token_hex(16)})
    return config.model_copy(update={"kv": kv})


def _create_pool(config: PdserveConfig, model: ResolvedModel, role: PoolRole) -> EnginePool:
    pool = EnginePool(role)
    actor_cls = ray.remote(EngineActor)
    for index in range(config.pools.for_role(role).replicas):
        replica_id = f"{role.value}-{index}"
        spec = EngineSpec(replica_id, role.value, model.path, model.served_name, config)
        handle = actor_cls.options(**actor_options(config, role, replica_id)).remote(spec)
        pool.replicas.append(Replica(replica_id, role, handle))
    return pool


async def _start_all(replicas: list[Replica], timeout_s: float) -> list[EngineInfo]:
    calls = [r.actor.start.remote() for r in replicas]
    try:
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))
    except TimeoutError:
        raise EngineStartError(
            f"engines did not start within {timeout_s:.0f} s; check that the cluster has the "
            "resources the pools ask for (`ray status`) and the engine logs"
        ) from None
    except (RayActorError, RayTaskError) as e:
        raise EngineStartError(f"an engine failed to start: {e}") from e


async def _fetch_stats(replica: Replica) -> EngineStats:
    return await asyncio.wait_for(replica.actor.stats.remote(), _STATS_TIMEOUT_S)


def _abort_quietly(replica: Replica, request_id: str) -> None:
    try:
        replica.actor.abort.remote(request_id)  # fire and forget: the stream is already gone
    except Exception as e:  # noqa: BLE001 - an abort must never mask the original outcome
        logger.warning("abort of %s on %s failed: %r", request_id, replica.replica_id, e)


async def _kill_all(replicas: list[Replica]) -> None:
    for replica in replicas:
        try:
            await asyncio.wait_for(replica.actor.shutdown.remote(), 30)
        except (Exception, GetTimeoutError) as e:  # noqa: BLE001 - each release on its own
            logger.warning("engine %s did not shut down cleanly: %r", replica.replica_id, e)
        try:
            ray.kill(replica.actor)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not kill engine actor %s: %r", replica.replica_id, e)
