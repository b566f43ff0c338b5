"""The frontend's view of the engines: route a request, stream its deltas back.

`EngineBackend` is what the HTTP layer talks to. `RayBackend` reaches engine actors;
`InProcessBackend` (pdserve.testing) engine objects in this process, for tests without Ray. Both
admit and run requests with the same request ledger and request flow (`flow.py`), so a request
that stops being consumed before it finishes (client gone, error) is aborted in its engine, and
its metrics are observed once, as the ledger timed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest
from pdserve.serving.metrics import ServingMetrics

# How often the HTTP frontend calls `refresh_stats` (api/app.py): Prometheus scrapes every
# 10-15 s, routing wants fresher; the supervisor turns missed calls into silent seconds with it.
STATS_INTERVAL_S = 1.0


class EngineBackend(Protocol):
    metrics: ServingMetrics  # request latencies (observed by the flow) and engine gauges

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
        """Admit the request at once (raising OverloadedError / EngineUnavailableError before
        any response starts), then stream it; the stream raises EngineRequestError."""
        ...

    async def refresh_stats(self) -> list[EngineStats]:
        """Ask every engine for stats (bounded time); marks engines that fail as unhealthy."""
        ...

    def health(self) -> dict:
        """{"status": "ready" | "degraded" | "down", "pools": {...}, "reason": ...}: ready when
        every pool is at its size, degraded when one is below it (or no longer restarted) but
        requests are served, down when the pool that produces tokens has no engine."""
        ...

    def healthy(self) -> bool:
        """Requests can be served (health's status is not 'down')."""
        ...

    async def shutdown(self) -> None:
        ...
