"""The Ray actor that hosts one engine.

Lifecycle: the driver creates the actor (cheap), then awaits `start()`, which builds the engine
off the actor's event loop (a vLLM engine takes 20-75 s to start) and returns its `EngineInfo`.
Requests stream through `generate()` (a Ray streaming generator, one `GenerateDelta` per item);
`abort()` ends a request early; `stats()` is polled by the frontend; `shutdown()` runs last.
The engine class is chosen from the config (`engine.kind`), so tests inject the mock engine
without touching serving code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.config.schema import PdserveConfig
from pdserve.engine.protocol import Engine
from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything an engine actor needs to build its engine."""

    replica_id: str
    pool: str
    model_path: str
    served_name: str
    config: PdserveConfig


def build_engine(spec: EngineSpec) -> Engine:
    """Instantiate the configured engine class (no heavy work; `start()` does that)."""
    if spec.config.engine.kind == "mock":
        from pdserve.testing.mock_engine import MockEngine

        return MockEngine(spec.replica_id, spec.pool, spec.served_name, spec.config.engine.mock)
    from pdserve.engine.vllm_engine import VllmEngine

    return VllmEngine(spec)


class EngineActor:
    """Hosts one engine; all methods run on the actor's event loop (an async actor)."""

    def __init__(self, spec: EngineSpec) -> None:
        logging.basicConfig(level=spec.config.api.log_level.upper())
        self._spec = spec
        self._engine: Engine = build_engine(spec)
        self._info: EngineInfo | None = None

    async def start(self) -> EngineInfo:
        """Build the engine; called once by the driver, may take minutes."""
        if self._info is None:
            logger.info("starting engine %s (pid %d)", self._spec.replica_id, os.getpid())
            info = await self._engine.start()
            self._info = dataclasses.replace(info, pid=os.getpid(), node_ip=_node_ip())
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream one request's deltas; call with `.options(num_returns="streaming")`."""
        async for delta in self._engine.generate(request):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def stats(self) -> EngineStats:
        return self._engine.stats()

    async def shutdown(self) -> None:
        await self._engine.shutdown()

    async def ping(self) -> str:
        return self._spec.replica_id


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - informational only
        return ""
