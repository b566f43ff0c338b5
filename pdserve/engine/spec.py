"""What an engine actor is given to build its engine: a small frozen value sent through Ray once,
when the driver creates the actor."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.schema import PdserveConfig


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything an engine actor needs to build its engine."""

    replica_id: str
    pool: str
    model_path: str
    served_name: str
    config: PdserveConfig
