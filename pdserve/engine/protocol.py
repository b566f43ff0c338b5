"""The engine contract that engine actors host.

An engine runs inside one Ray actor (see `actor.py`) and serves many requests concurrently on
that actor's event loop. Implementations: `vllm_engine.VllmEngine` and `mock_engine.MockEngine`
(model-free: tests, benchmarks, simulation). The actor builds the one its config names
(`engine.kind`, registry.py), so tests run the mock without touching serving code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.engine.types import EngineInfo, EngineStats, GenerateDelta, GenerateRequest


class Engine(Protocol):
    async def start(self) -> EngineInfo:
        """Called once by the actor before any request; may take minutes (model load)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas for one request until a delta with finish_reason set.

        Closing the iterator early (consumer gone) must abort the request in the engine.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a running request; its stream ends with finish_reason 'abort'. Idempotent."""
        ...

    def stats(self) -> EngineStats:
        """Cheap, non-blocking snapshot; called every second or so by the frontend."""
        ...

    @property
    def dead(self) -> bool:
        """The engine can serve nothing more (vLLM: its engine core exited); the frontend
        replaces it and moves its requests."""
        ...

    async def release_kv(self, kv_transfer_params: dict) -> None:
        """A prefill engine: end the pin of the request these transfer parameters (from its
        prefill leg) name, whose decode leg will never pull. Best effort, idempotent."""
        ...

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        """A prefill engine: restart the lease of that pin (its decode leg still waits for its
        engine). Best effort."""
        ...

    async def shutdown(self) -> None:
        """Release the engine (subprocesses, memory). Called once, last."""
        ...
