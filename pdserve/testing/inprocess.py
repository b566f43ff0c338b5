"""An `EngineBackend` over engine objects in this process: the HTTP layer without Ray.

Routing uses the same pure policy as `RayBackend`, so tests of the API exercise real routing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from pdserve.engine.protocol import Engine
from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest
from pdserve.errors import EngineUnavailableError
from pdserve.scheduler.routing import ReplicaLoad, pick_least_loaded


class InProcessBackend:
    def __init__(self, engines: Sequence[Engine], pool: str = "colocated") -> None:
        self._engines = list(engines)
        self._pool = pool
        self._info: EngineInfo | None = None
        self._infos: list[EngineInfo] = []
        self._in_flight: dict[int, int] = {i: 0 for i in range(len(self._engines))}

    async def start(self) -> None:
        self._infos = [await e.start() for e in self._engines]
        self._info = self._infos[0]

    def engine_infos(self) -> list[EngineInfo]:
        return list(self._infos)

    @property
    def info(self) -> EngineInfo:
        assert self._info is not None, "call start() first"
        return self._info

    @property
    def pools(self) -> tuple[str, ...]:
        return (self._pool,)

    @property
    def serving_pool(self) -> str:
        return self._pool

    def engine_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self._engines]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        loads = [ReplicaLoad(str(i), n) for i, n in self._in_flight.items()]
        chosen = pick_least_loaded(loads)
        if chosen is None:
            raise EngineUnavailableError("no engines")
        index = int(chosen)
        self._in_flight[index] += 1
        stream = self._engines[index].generate(request)
        try:
            async for delta in stream:
                yield delta
        finally:
            self._in_flight[index] -= 1
            await stream.aclose()  # closing early aborts the request in the engine

    async def refresh_stats(self) -> list[EngineStats]:
        return self.engine_stats()

    def healthy(self) -> bool:
        return True

    async def shutdown(self) -> None:
        for engine in self._engines:
            await engine.shutdown()
