"""Configuration: one validated tree (`schema`), loaded from YAML plus overrides (`loader`)."""

from pdserve.config.loader import (
    config_json_schema, configure_logging, load_api_keys, load_config, parse_set_options,
)
from pdserve.config.schema import (
    ApiConfig,
    EngineConfig,
    ModelConfig,
    PdserveConfig,
    PoolConfig,
    PoolRole,
    PoolsConfig,
    RayConfig,
    ServingMode,
)

__all__ = [
    "ApiConfig", "EngineConfig", "ModelConfig", "PdserveConfig", "PoolConfig", "PoolRole",
    "PoolsConfig", "RayConfig", "ServingMode", "config_json_schema", "configure_logging",
    "load_api_keys", "load_config", "parse_set_options",
]
