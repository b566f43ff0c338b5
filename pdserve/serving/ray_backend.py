"""The backend that serves requests over engine pools of Ray actors.

Lifecycle: `RayBackend.launch(config, model)` places one `EngineActor` per replica of every
active pool (`replicas.py`), awaits their `start()` in parallel, registers them with the request
ledger, and returns a backend ready to serve. Each request is admitted by the ledger and run by
the request flow (`flow.py`) over `RayEngineChannel`s: a leg is submitted to its actor and its
deltas come back through the actor's one multiplexed output stream (`engine_outputs.py`); a leg
whose consumer stops early is aborted in its engine. The pools' control keeps them at size and
scales them: in one process, the actuator (`actuator.py`, with the autoscaling loop when on);
in an ingress replica, the controller it syncs with (`ingress.py`), which also owns the
engines. `shutdown()` stops the control, then every engine this backend owns, each in its own
try block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from pdserve.config.schema import PdserveConfig, PoolRole, ServingMode
from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateFailure, GenerateRequest
from pdserve.errors import (
    EngineDiedError, EngineRejectedRequestError, EngineRequestError, EngineUnavailableError,
)
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.ledger import LedgerEvent, RequestLedger, ledger_from_config
from pdserve.serving.actuator import PoolActuator
from pdserve.engine.request_plane import PlaneEndpoint
from pdserve.serving.engine_outputs import PlaneAccess, StreamLost
from pdserve.serving.flow import AdmittedStream, FlowOptions, RequestFlow
from pdserve.serving.metrics import ServingMetrics
from pdserve.serving.replicas import (
    EnginePool, Replica, kill_all, launch_pools, with_cluster_token,
)

logger = logging.getLogger(__name__)

# A stats call slower than this means the engine is wedged or gone (a healthy one answers in ms).
_STATS_TIMEOUT_S = 5.0


class RayEngineChannel:
    """One engine actor as the request flow reaches it. A leg whose engine died (the actor or
    its engine core exited, or its output stream broke) raises `EngineDiedError` and the death
    goes to `on_death` (the supervisor); Ray's transient `ActorUnavailableError` fails the leg
    the same way but reports no death. `plane_token`: reach the actor through its request plane
    (engine.request_plane 'direct'); None: through Ray."""

    def __init__(self, replica: Replica, on_death: Callable[[Replica], None],
                 plane_token: str | None = None) -> None:
        self._replica = replica
        self._on_death = on_death
        endpoint = PlaneEndpoint.of(replica.info) if plane_token else None
        self._plane = PlaneAccess(endpoint, plane_token) if endpoint else None

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        replica = self._replica
        # Before submitting: no delta goes unrouted.
        replica.outputs.open(request.request_id, self._plane)
        finished = False
        try:
            await replica.outputs.submit(request)
            while True:
                delta = _delta_or_raise(replica, await replica.outputs.next(request.request_id))
                finished = delta.finished
                yield delta
                if finished:
                    return
        except ActorUnavailableError as e:
            raise EngineDiedError(f"engine {replica.replica_id} is unreachable: {e}") from e
        except RayActorError as e:
            self._on_death(replica)
            raise EngineDiedError(f"engine {replica.replica_id} died: {e}") from e
        except _EngineDead as e:
            self._on_death(replica)
            raise EngineDiedError(str(e)) from None
        except RayTaskError as e:
            raise EngineRequestError(f"engine {replica.replica_id} failed: {e.cause!r}") from e
        finally:
            replica.outputs.close(request.request_id)
            if not finished:
                _abort_quietly(replica, request.request_id)

    async def release_kv(self, kv_transfer_params: dict) -> None:
        await self._replica.actor.release_kv.remote(kv_transfer_params)

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        await self._replica.actor.renew_kv.remote(kv_transfer_params)


class PoolControl(Protocol):
    """What keeps the pools at size: the actuator in one process, the controller for an
    ingress replica."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def engine_died(self, replica: Replica, reason: str = "died") -> None: ...

    def capacity_coming(self, pool: str) -> bool: ...

    def health(self) -> dict[str, Any]: ...

    def publish_pool_sizes(self) -> None: ...


# (pools, config, model, ledger, metrics, first engine's info) -> the control
ControlFactory = Callable[..., PoolControl]


class RayBackend:
    """Serves requests over the engine pools through the request ledger; scales the pools."""

    def __init__(self, pools: dict[PoolRole, EnginePool], config: PdserveConfig,
                 model: ResolvedModel, metrics: ServingMetrics | None = None,
                 observer: Callable[[LedgerEvent], None] | None = None,
                 control: ControlFactory = PoolActuator, owns_engines: bool = True) -> None:
        self._pools = pools
        self._config = config
        self.metrics = metrics or ServingMetrics()
        disaggregated = config.mode is ServingMode.DISAGGREGATED
        self._serving_pool = PoolRole.DECODE if disaggregated else PoolRole.COLOCATED
        first = next(r for p in pools.values() for r in p.replicas)
        assert first.info is not None
        self._info = first.info
        self.ledger: RequestLedger = ledger_from_config(config, [r.value for r in pools],
                                                        first.info.block_size, observer)
        for pool in pools.values():
            for replica in pool.replicas:
                info = replica.info or self._info
                self.ledger.engines.add(replica.pool.value, replica.replica_id, info.block_size,
                                        info.num_kv_blocks)
        self.control: PoolControl = control(pools, config, model, self.ledger, self.metrics,
                                            self._info)
        self._owns_engines = owns_engines
        options = FlowOptions(config.kv.failure_policy, config.serving.migration_limit,
                              config.engine.start_timeout_s, config.api.request_timeout_s,
                              config.kv.lease_s)
        self._flow = RequestFlow(self.ledger, self._channel, options, self.metrics,
                                 self._serving_pool.value,
                                 capacity_coming=self.control.capacity_coming)

    @classmethod
    async def launch(cls, config: PdserveConfig, model: ResolvedModel,
                     metrics: ServingMetrics | None = None,
                     observer: Callable[[LedgerEvent], None] | None = None) -> RayBackend:
        config = with_cluster_token(config)
        pools = await launch_pools(config, model)
        backend = cls(pools, config, model, metrics, observer)
        backend.control.start()
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

    def generate(self, request: GenerateRequest) -> AdmittedStream:
        """Admit the request now (raising `OverloadedError` / `EngineUnavailableError` before
        any response starts), then stream it from its engines."""
        return self._flow.stream(request, self._flow.admit(request))

    def _channel(self, pool: str, replica_id: str) -> RayEngineChannel:
        for replica in self._pools[PoolRole(pool)].replicas:
            if replica.replica_id == replica_id:
                token = self._config.kv.cluster_token
                direct = self._config.engine.request_plane == "direct"
                return RayEngineChannel(replica, self.control.engine_died, token if direct else None)
        raise EngineUnavailableError(f"engine {replica_id} is gone")

    # --- stats ------------------------------------------------------------------------------

    async def refresh_stats(self) -> list[EngineStats]:
        replicas = [r for p in self._pools.values() for r in p.replicas if r.info is not None]
        results = await asyncio.gather(
            *(_fetch_stats(r) for r in replicas), return_exceptions=True
        )
        stats = []
        engines = self.ledger.engines
        for replica, result in zip(replicas, results, strict=True):
            pool, rid = replica.pool.value, replica.replica_id
            if isinstance(result, EngineStats) and result.dead:
                self.control.engine_died(replica)
                continue
            if isinstance(result, EngineStats):
                stats.append(result)
                engines.report(pool, rid, kv_usage=result.kv_cache_usage, healthy=True,
                               answering=True)
                continue
            engines.report(pool, rid, answering=False)
            # A dead actor (or engine core) is replaced; a slow answer (an overloaded host) or
            # Ray's transient unavailability is only counted: routing skips an engine that
            # keeps missing, the supervisor replaces one silent past the liveness timeout.
            if isinstance(result, RayActorError) and not isinstance(result, ActorUnavailableError):
                self.control.engine_died(replica)
            logger.warning("engine %s did not answer stats: %r", rid, result)
        self.control.publish_pool_sizes()
        return stats

    def health(self) -> dict:
        """ready / degraded / down, per pool (the control's)."""
        return self.control.health()

    def healthy(self) -> bool:
        return self.health()["status"] != "down"

    async def shutdown(self) -> None:
        await self.control.stop()
        replicas = [r for p in self._pools.values() for r in p.replicas]
        if self._owns_engines:
            await kill_all(replicas)
        else:  # an ingress replica: the engines are the controller's, only the streams are ours
            for replica in replicas:
                await replica.outputs.aclose()


async def _fetch_stats(replica: Replica) -> EngineStats:
    return await asyncio.wait_for(replica.actor.stats.remote(replica.outputs.subscriber),
                                  _STATS_TIMEOUT_S)


def _delta_or_raise(replica: Replica, output: GenerateDelta | GenerateFailure | StreamLost,
                    ) -> GenerateDelta:
    """A request's next output from its engine as a delta; anything else raises."""
    if isinstance(output, GenerateDelta):
        return output
    if isinstance(output, GenerateFailure):
        if output.engine_dead:
            raise _EngineDead(f"engine {replica.replica_id}'s engine core died: {output.error}")
        if output.rejected:
            raise EngineRejectedRequestError(output.error)
        if output.error:
            raise EngineRequestError(f"engine {replica.replica_id} failed: {output.error}")
        raise EngineRequestError(f"engine {replica.replica_id} ended a stream unfinished")
    if isinstance(output.error, RayActorError):
        raise output.error  # mapped (and a dead actor reported) by `RayEngineChannel.stream`
    # The actor's one output stream broke or ended (stopped, killed): every leg on it is lost.
    raise EngineDiedError(f"lost the output stream of engine {replica.replica_id}: "
                          f"{output.error!r}")


class _EngineDead(Exception):
    """The actor lives but its engine does not (vLLM's engine core exited)."""



def _abort_quietly(replica: Replica, request_id: str) -> None:
    """Abort a leg whose stream is already gone, without waiting (fire and forget)."""
    task = asyncio.get_running_loop().create_task(replica.outputs.abort(request_id))
    _aborts.add(task)
    task.add_done_callback(_aborted)


_aborts: set[asyncio.Task[None]] = set()  # held until done: the loop keeps weak references only


def _aborted(task: asyncio.Task[None]) -> None:
    _aborts.discard(task)
    if not task.cancelled() and task.exception() is not None:
        # an abort must never mask the original outcome
        logger.warning("an abort failed: %r", task.exception())
