"""An `EngineBackend` over engine objects in this process: the HTTP layer without Ray.

Requests go through the production request ledger and request flow, exactly as with
`RayBackend`; only the way to an engine differs (a method call instead of an actor). One pool of
engines that do both phases (colocated).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

from pdserve.engine.protocol import Engine
from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest
from pdserve.errors import EngineUnavailableError
from pdserve.scheduler.ledger import LedgerEvent, RequestLedger
from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.types import COLOCATED
from pdserve.serving.flow import AdmittedStream, FlowOptions, RequestFlow
from pdserve.serving.metrics import ServingMetrics


class InProcessChannel:
    """One engine object as the request flow reaches it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        # Closing the engine's stream early aborts the request in the engine.
        async with aclosing(self._engine.generate(request)) as deltas:
            async for delta in deltas:
                yield delta

    async def release_kv(self, kv_transfer_params: dict) -> None:
        await self._engine.release_kv(kv_transfer_params)

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        await self._engine.renew_kv(kv_transfer_params)


class InProcessBackend:
    def __init__(self, engines: Sequence[Engine], metrics: ServingMetrics | None = None,
                 observer: Callable[[LedgerEvent], None] | None = None) -> None:
        self._engines = list(engines)
        self.metrics = metrics or ServingMetrics()
        self._observer = observer
        self._infos: list[EngineInfo] = []
        self._by_id: dict[str, Engine] = {}
        self.ledger: RequestLedger | None = None
        self._flow: RequestFlow | None = None

    async def start(self) -> None:
        self._infos = [await e.start() for e in self._engines]
        self._by_id = {info.replica_id: e for info, e in zip(self._infos, self._engines, strict=True)}
        # No performance model to seed from: a neutral one, refitted from what requests show.
        self.ledger = RequestLedger([COLOCATED], PerfModel(prefill_tokens_per_s=1e4,
                                                           decode_step_s=0.01),
                                    prefix_block_size=max(self._infos[0].block_size, 1),
                                    observer=self._observer)
        for info in self._infos:
            self.ledger.engines.add(COLOCATED, info.replica_id, info.block_size,
                                    info.num_kv_blocks or 1 << 20)
        self._flow = RequestFlow(self.ledger, self._channel, FlowOptions(), self.metrics, COLOCATED)

    def engine_infos(self) -> list[EngineInfo]:
        return list(self._infos)

    @property
    def info(self) -> EngineInfo:
        assert self._infos, "call start() first"
        return self._infos[0]

    @property
    def pools(self) -> tuple[str, ...]:
        return (COLOCATED,)

    @property
    def serving_pool(self) -> str:
        return COLOCATED

    def engine_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self._engines]

    def generate(self, request: GenerateRequest) -> AdmittedStream:
        assert self._flow is not None, "call start() first"
        return self._flow.stream(request, self._flow.admit(request))

    def _channel(self, pool: str, replica_id: str) -> InProcessChannel:
        engine = self._by_id.get(replica_id)
        if engine is None:
            raise EngineUnavailableError(f"engine {replica_id} is gone")
        return InProcessChannel(engine)

    async def refresh_stats(self) -> list[EngineStats]:
        stats = self.engine_stats()
        if self.ledger is not None:
            for s in stats:
                self.ledger.engines.report(COLOCATED, s.replica_id, kv_usage=s.kv_cache_usage)
        return stats

    def health(self) -> dict:
        return {"status": "ready", "pools": {COLOCATED: {"serving": len(self._engines),
                                                        "target": len(self._engines)}}}

    def healthy(self) -> bool:
        return True

    async def shutdown(self) -> None:
        for engine in self._engines:
            await engine.shutdown()
