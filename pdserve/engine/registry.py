"""Engine kinds: `engine.kind` in the config -> how an engine actor builds that engine.

Both kinds ship: "vllm" (`VllmEngine`, production) and "mock" (`MockEngine`, model-free, for
tests, benchmarks of everything above the engine, and the simulator's checks). Each entry takes
the actor's `EngineSpec` and returns an engine that has not started (no heavy work; the actor
awaits `start()`). Neither module imports vLLM at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.protocol import Engine
from pdserve.engine.spec import EngineSpec
from pdserve.engine.vllm_engine import VllmEngine

ENGINE_KINDS: Mapping[str, Callable[[EngineSpec], Engine]] = {
    "vllm": VllmEngine,
    "mock": MockEngine.from_spec,
}


def build_engine(spec: EngineSpec) -> Engine:
    """The engine of the configured kind; called once, in the engine actor's constructor."""
    return ENGINE_KINDS[spec.config.engine.kind](spec)
