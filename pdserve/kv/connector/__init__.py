"""pdserve's vLLM KV connector: disaggregated prefill/decode over pdserve's KV transports.

Give an engine `AsyncEngineArgs(kv_transfer_config=vllm_kv_transfer_config(role, transport,
cluster_token, ...))`; vLLM then loads `PdserveConnector` from this package. Modules:

| module | |
|---|---|
| `connector` | `PdserveConnector`, the thin KVConnectorBase_V1 facade vLLM instantiates |
| `scheduler_side` | scheduler side: what to pin, pull and release (pure state machine) |
| `worker_side` | worker side: transport endpoints, pins, pulls, completion reports |
| `pulls` | a decode rank's pulls of one request across the prefill TP ranks |
| `step_window` | when a decode worker may wait for its pulls inside a step at no cost |
| `stats` | the connector's transfer stats as vLLM aggregates and logs them |
| `metadata` | typed values crossing boundaries: kv_transfer_params, per-step plans |
| `layout` | vLLM KV tensors -> transport regions and compatibility spec |
| `config` | extra-config validation and `kv_transfer_config()` |
| `compat` | every difference between the supported vLLM versions |

Importing this package does not import vLLM; `PdserveConnector` is loaded on first access.
"""

from __future__ import annotations

from typing import Any

from pdserve.kv.connector.config import (
    CONNECTOR_NAME,
    ConnectorConfig,
    kv_transfer_config,
    vllm_kv_transfer_config,
)

__all__ = [
    "CONNECTOR_NAME",
    "ConnectorConfig",
    "PdserveConnector",
    "kv_transfer_config",
    "vllm_kv_transfer_config",
]


def __getattr__(name: str) -> Any:
    if name == "PdserveConnector":
        from pdserve.kv.connector.connector import PdserveConnector

        return PdserveConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
