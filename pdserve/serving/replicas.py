"""Engine replicas: the Ray actors of the engine pools, and how they are placed, started and stopped.

Lifecycle: `create_replica` places one `EngineActor` with its pool's Ray resources
(`actor_options`) and `create_pool` does so for every replica a pool starts with; `start_all`
awaits their `start()` in parallel; `kill_all` shuts each one down, kills its actor and closes its
output stream, each step in its own try block. `request_resources` asks the Ray autoscaler for
the nodes the wanted engines need.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from pdserve.config.schema import PdserveConfig, PoolRole
from pdserve.engine.actor import EngineActor, EngineSpec
from pdserve.engine.types import EngineInfo, EngineStats
from pdserve.errors import EngineStartError
from pdserve.models.embedded import ResolvedModel
from pdserve.serving.engine_outputs import EngineOutputs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Replica:
    replica_id: str
    pool: PoolRole
    actor: Any  # ray.actor.ActorHandle
    info: EngineInfo | None = None
    in_flight: int = 0
    stats: EngineStats | None = None
    healthy: bool = True
    draining: bool = False
    outputs: EngineOutputs = field(init=False)  # the actor's deltas, routed per request

    def __post_init__(self) -> None:
        self.outputs = EngineOutputs(self.replica_id, self.actor)


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
        num_gpus = config.tensor_parallel_size_of(role) if on_gpu else 0
    return {
        "name": replica_id,
        "namespace": config.ray.namespace,
        "num_cpus": pool.num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(pool.resources),
        # One actor serves many concurrent streams on its event loop.
        "max_concurrency": 4096,
    }


def with_cluster_token(config: PdserveConfig) -> PdserveConfig:
    """Fill in a random cluster token for KV peers when the config does not set one."""
    if config.kv.cluster_token:
        return config
    kv = config.kv.model_copy(update={"cluster_token": secrets.token_hex(16)})
    return config.model_copy(update={"kv": kv})


def create_replica(config: PdserveConfig, model: ResolvedModel, role: PoolRole,
                   index: int) -> Replica:
    """Place engine `index` of `role`'s pool as a Ray actor; it serves once `start_all` returns."""
    replica_id = f"{role.value}-{index}"
    spec = EngineSpec(replica_id, role.value, model.path, model.served_name,
                      config.for_pool(role))
    actor = ray.remote(EngineActor).options(
        **actor_options(config, role, replica_id)).remote(spec)
    return Replica(replica_id, role, actor)


def create_pool(config: PdserveConfig, model: ResolvedModel, role: PoolRole) -> EnginePool:
    """Place the engines `role`'s pool starts with."""
    return EnginePool(role, [create_replica(config, model, role, index)
                             for index in range(config.pools.for_role(role).replicas)])


async def start_all(replicas: list[Replica], timeout_s: float) -> list[EngineInfo]:
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


async def kill_all(replicas: list[Replica]) -> None:
    for replica in replicas:
        try:
            await asyncio.wait_for(replica.actor.shutdown.remote(), 30)
        except (Exception, GetTimeoutError) as e:  # noqa: BLE001 - each release on its own
            logger.warning("engine %s did not shut down cleanly: %r", replica.replica_id, e)
        try:
            ray.kill(replica.actor)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not kill engine actor %s: %r", replica.replica_id, e)
        try:
            await replica.outputs.aclose()
        except Exception as e:  # noqa: BLE001
            logger.warning("output stream of %s did not close: %r", replica.replica_id, e)


def request_resources(config: PdserveConfig, wanted: dict[PoolRole, int]) -> None:
    """Tell the Ray autoscaler the engines the pools want, so it brings up nodes for them.

    The request is the whole target (it replaces the previous one), so it shrinks again on a
    scale-down and idle nodes can go. Without an autoscaler (a fixed cluster) it is a no-op.
    """
    from ray.autoscaler.sdk import request_resources as ray_request_resources

    bundles = []
    for role, count in wanted.items():
        opts = actor_options(config, role, "")
        bundle = {"CPU": opts["num_cpus"], **opts["resources"]}
        if opts["num_gpus"]:
            bundle["GPU"] = opts["num_gpus"]
        bundles.extend({k: v for k, v in bundle.items() if v} for _ in range(count))
    try:
        ray_request_resources(bundles=[b for b in bundles if b])
    except Exception as e:  # noqa: BLE001 - scaling still proceeds on the nodes that exist
        logger.warning("could not request resources from the Ray autoscaler: %r", e)
