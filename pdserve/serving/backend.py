"""The frontend's view of the engines: route a request, stream its deltas back.

`EngineBackend` is what the HTTP layer talks to. `RayBackend` routes among engine actors;
`InProcessBackend` (pdserve.testing) wraps engine objects directly for tests without Ray.
Whichever backend, a request that stops being consumed before it finishes (client gone, error)
is aborted in its engine, so no engine keeps generating for nobody.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest


class EngineBackend(Protocol):
    @property
    def info(self) -> EngineInfo:
        """Facts shared by all engines (model, context length), from the first engine."""
        ...

    def engine_infos(self) -> list[EngineInfo]:
        """Static facts of every engine (replica id, pid, node)."""
        ...

    @property
    def pools(self) -> tuple[str, ...]:
        """Pool names, for metric labels."""
        ...

    @property
    def serving_pool(self) -> str:
        """The pool whose engines produce output tokens (metric label of TTFT/TPOT)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Route and stream one request. Raises EngineUnavailableError / EngineRequestError."""
        ...

    async def refresh_stats(self) -> list[EngineStats]:
        """Ask every engine for stats (bounded time); marks engines that fail as unhealthy."""
        ...

    def healthy(self) -> bool:
        """True when at least one engine of every pool answered its last stats call."""
        ...

    async def shutdown(self) -> None:
        ...
