"""Engine replicas: the Ray actors of the engine pools, and how they are placed, started and stopped.

Lifecycle: `create_replica` places one `EngineActor` with its pool's Ray resources
(`actor_options`) and `create_pool` does so for every replica a pool starts with (CPU engines
of a local Ray instance each get their own cores: `local_core_split`); `start_all`
awaits their `start()` in parallel (`launch_pools`: all of it for every pool); `kill_all`
shuts each one down, kills its actor and closes its output stream, each step in its own try
block. `request_resources` asks the Ray autoscaler for
the nodes the wanted engines need.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from pdserve.config.schema import PdserveConfig, PoolRole
from pdserve.engine.actor import EngineActor, EngineSpec
from pdserve.engine.types import EngineInfo
from pdserve.errors import EngineStartError
from pdserve.models.embedded import ResolvedModel
from pdserve.serving.engine_outputs import EngineOutputs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Replica:
    """One engine actor and the frontend's end of its output stream. What the engine is doing
    (health, readiness, draining, work in flight) lives in the ledger's engine registry."""

    replica_id: str
    pool: PoolRole
    actor: Any  # ray.actor.ActorHandle
    info: EngineInfo | None = None  # set once started
    outputs: EngineOutputs = field(init=False)  # the actor's deltas, routed per request

    def __post_init__(self) -> None:
        self.outputs = EngineOutputs(self.replica_id, self.actor)


@dataclass(slots=True)
class EnginePool:
    role: PoolRole
    replicas: list[Replica] = field(default_factory=list)


def _on_gpu(config: PdserveConfig) -> bool:
    return config.engine.device == "cuda" or (
        config.engine.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
    )


def actor_options(config: PdserveConfig, role: PoolRole, replica_id: str) -> dict[str, Any]:
    """Ray placement of one engine actor, from its pool's config."""
    pool = config.pools.for_role(role)
    num_gpus = pool.num_gpus
    if num_gpus is None:
        num_gpus = config.tensor_parallel_size_of(role) if _on_gpu(config) else 0
    return {
        "name": replica_id,
        "namespace": config.ray.namespace,
        "num_cpus": pool.num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(pool.resources),
        # One actor serves many concurrent streams on its event loop.
        "max_concurrency": 4096,
        # The controller's engines (`controller.py`) outlive any frontend, and the controller.
        **({"lifetime": "detached"} if config.owned_by_deployment else {}),
    }


def with_cluster_token(config: PdserveConfig) -> PdserveConfig:
    """Fill in a random cluster token for KV peers when the config does not set one."""
    if config.kv.cluster_token:
        return config
    kv = config.kv.model_copy(update={"cluster_token": secrets.token_hex(16)})
    return config.model_copy(update={"kv": kv})


def replica_id_of(role: PoolRole, index: int) -> str:
    """The id (and Ray actor name) of engine `index` of `role`'s pool: 'prefill-0'."""
    return f"{role.value}-{index}"


def replica_index(replica_id: str) -> int:
    """'prefill-3' -> 3."""
    return int(replica_id.rsplit("-", 1)[1])


def split_cores(cores: Sequence[int], replica_ids: Sequence[str]) -> dict[str, str]:
    """Disjoint, contiguous shares of `cores` for the engines, in order (the first ones get one
    more when the count does not divide), as core lists vLLM reads ('0-3', '4,6'); nothing when
    fewer than two engines or fewer cores than engines."""
    if len(replica_ids) < 2 or len(cores) < len(replica_ids):
        return {}
    share, extra = divmod(len(cores), len(replica_ids))
    shares, start = {}, 0
    for i, replica_id in enumerate(replica_ids):
        size = share + (i < extra)
        shares[replica_id] = core_list(cores[start:start + size])
        start += size
    return shares


def core_list(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def local_core_split(config: PdserveConfig) -> dict[str, str]:
    """replica id -> its cores, for the engines the pools start with, when they are vLLM CPU
    engines that all run on this machine (a local Ray instance) and nobody chose cores. Two
    engines bound to the same cores slowed each other 3x (1P1D on 2 cores: TPOT p50 602 vs
    197 ms pinned, benchmarks/results/sim/cpu-profile-5)."""
    engine = config.engine
    chosen = engine.cpu_threads is not None or any(
        config.pools.for_role(role).cpu_threads is not None for role in config.active_roles())
    if (not engine.split_cpu_cores or chosen or engine.kind != "vllm" or config.ray.address is not None
            or _on_gpu(config)):
        return {}
    replica_ids = [replica_id_of(role, i) for role in config.active_roles()
                   for i in range(config.pools.for_role(role).replicas)]
    shares = split_cores(sorted(os.sched_getaffinity(0)), replica_ids)
    if shares:
        logger.info("CPU engines on this machine get their own cores: %s (engine.split_cpu_cores)",
                    ", ".join(f"{r} {c}" for r, c in shares.items()))
    return shares


def create_replica(config: PdserveConfig, model: ResolvedModel, role: PoolRole,
                   index: int, cpu_threads: str | None = None) -> Replica:
    """Place engine `index` of `role`'s pool as a Ray actor; it serves once `start_all` returns.
    `cpu_threads`: the cores this engine binds to, over its config's (a CPU engine)."""
    replica_id = replica_id_of(role, index)
    engine_config = config.for_pool(role)
    if cpu_threads is not None:
        engine_config = engine_config.model_copy(update={
            "engine": engine_config.engine.model_copy(update={"cpu_threads": cpu_threads})})
    spec = EngineSpec(replica_id, role.value, model.path, model.served_name, engine_config)
    actor = ray.remote(EngineActor).options(
        **actor_options(config, role, replica_id)).remote(spec)
    return Replica(replica_id, role, actor)


def create_pool(config: PdserveConfig, model: ResolvedModel, role: PoolRole,
                cores: Mapping[str, str] | None = None) -> EnginePool:
    """Place the engines `role`'s pool starts with (`cores`: replica id -> cores to bind)."""
    cores = cores or {}
    return EnginePool(role, [create_replica(config, model, role, index, cores.get(replica_id_of(role, index)))
                             for index in range(config.pools.for_role(role).replicas)])


async def launch_pools(config: PdserveConfig, model: ResolvedModel) -> dict[PoolRole, EnginePool]:
    """Place and start the engines every active pool starts with (asking the Ray autoscaler
    for their nodes first when it should); on any failure, stop the ones that started."""
    roles = config.active_roles()
    if config.autoscale.enabled and config.autoscale.request_resources:
        request_resources(config, {r: config.pools.for_role(r).replicas for r in roles})
    cores = local_core_split(config)
    pools = {role: create_pool(config, model, role, cores) for role in roles}
    replicas = [r for p in pools.values() for r in p.replicas]
    try:
        infos = await start_all(replicas, config.engine.start_timeout_s)
    except BaseException:
        await kill_all(replicas)
        raise
    for replica, info in zip(replicas, infos, strict=True):
        replica.info = info
    return pools


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


async def kill_all(replicas: list[Replica], graceful: bool = True) -> None:
    """Stop each engine: its `shutdown()` first when `graceful` (not for a dead or hung one,
    which would only make this wait), then kill its actor and close its output stream."""
    for replica in replicas:
        try:
            if graceful:
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
