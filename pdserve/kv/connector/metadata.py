"""Typed values that cross the connector's boundaries.

- `RemotePrefill`: the `kv_transfer_params` a prefill engine returns with its first token and
  a decode engine receives with the request (JSON through the frontend; checked field by field
  on the way in, since it came over the network).
- `StepPlan` and its parts: what the scheduler side tells the worker side each engine step
  (vLLM carries it inside `SchedulerOutput`; pickled between vLLM's own processes when TP > 1).
- `WorkerEndpoint`: where a worker's KV source listens, reported once at engine start.

Everything here is frozen, small and free of vLLM and torch objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.kv.transport.handshake import WIRE_VERSION

__all__ = [
    "KVPin",
    "KVPull",
    "RemotePrefill",
    "RemoteRelease",
    "StepPlan",
    "WorkerEndpoint",
    "is_remote_decode",
    "is_remote_prefill",
    "prompt_blocks",
]


def is_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request: its blocks are kept for a decode engine to pull."""
    return bool(params) and bool(params.get("do_remote_decode"))


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """A decode request: its prompt's KV waits on a prefill engine."""
    return bool(params) and bool(params.get("do_remote_prefill"))


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a prompt's KV lives: the prefill engine's answer, and the decode request's input.

    `remote_block_ids[i]` holds prompt tokens [i*B, (i+1)*B) of the first `num_prompt_tokens`
    (B = block size, equal on both sides: the transport handshake checks it).
    `remote_tp_addresses` is set only for TP > 1: entry r is prefill TP rank r's source. Which of
    them a decode rank pulls from depends on both TP sizes (`transport.heads.sources_for`).
    """

    remote_engine_id: str
    remote_request_id: str
    remote_address: str
    remote_block_ids: tuple[int, ...]
    num_prompt_tokens: int
    transport: str
    wire_version: int = WIRE_VERSION
    remote_tp_addresses: tuple[str, ...] = ()

    def to_params(self) -> dict[str, Any]:
        """The JSON-able kv_transfer_params a decode request carries."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_address": self.remote_address,
            "remote_block_ids": list(self.remote_block_ids),
            "num_prompt_tokens": self.num_prompt_tokens,
            "transport": self.transport,
            "wire_version": self.wire_version,
        }
        if self.remote_tp_addresses:
            params["remote_tp_addresses"] = list(self.remote_tp_addresses)
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Parses and checks a decode request's kv_transfer_params; ValueError names the bad key.

        Called by the scheduler side once per decode request; never trusts types it was sent.
        """
        text = {
            k: _require(params, k, str)
            for k in ("remote_engine_id", "remote_request_id", "remote_address", "transport")
        }
        blocks = _require(params, "remote_block_ids", list)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
            raise ValueError("kv_transfer_params.remote_block_ids must be non-negative integers")
        num_tokens = _require(params, "num_prompt_tokens", int)
        if num_tokens < 1:
            raise ValueError(f"kv_transfer_params.num_prompt_tokens must be >= 1, got {num_tokens}")
        version = params.get("wire_version", WIRE_VERSION)
        if version != WIRE_VERSION:
            raise ValueError(f"kv_transfer_params.wire_version {version!r} is not {WIRE_VERSION}")
        tp_addresses = params.get("remote_tp_addresses") or []
        if not isinstance(tp_addresses, list) or not all(isinstance(a, str) for a in tp_addresses):
            raise ValueError("kv_transfer_params.remote_tp_addresses must be a list of strings")
        return cls(
            **text,
            remote_block_ids=tuple(blocks),
            num_prompt_tokens=num_tokens,
            remote_tp_addresses=tuple(tp_addresses),
        )

    @property
    def source_addresses(self) -> tuple[str, ...]:
        """Each prefill TP rank's source address, by rank (one entry at TP 1)."""
        return self.remote_tp_addresses or (self.remote_address,)


def _require(params: Mapping[str, Any], key: str, kind: type) -> Any:
    value = params.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        # ValueError, not TypeError: from_params reports every malformed input the same way.
        raise ValueError(  # noqa: TRY004
            f"kv_transfer_params.{key} must be a {kind.__name__}, got {type(value).__name__}"
        )
    return value


@dataclass(frozen=True, slots=True)
class KVPin:
    """Prefill side: keep `block_ids` of `request_id` readable for a decode engine."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVPull:
    """Decode side: pull remote blocks `src_block_ids[i]` into local `dst_block_ids[i]`."""

    request_id: str
    remote: RemotePrefill
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemoteRelease:
    """Decode side: tell a prefill engine that a request's blocks will not be pulled."""

    remote: RemotePrefill


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the worker side does this step, in this order: drop, pin, confirm, pull, release.

    - `drops`: prefill requests whose pins end without a report (aborted, or nothing to send).
    - `pins`: prefill requests whose prompt finishes computing in this step's forward; pinned
      now so the blocks are servable before the first token leaves the engine.
    - `confirms`: prefill requests vLLM now waits on (request_finished returned True); the
      worker reports each in get_finished()'s sending set once its pin ends.
    - `pulls`, `releases`: decode-side transfers to start, and remote pins to give up.
    """

    drops: tuple[str, ...] = ()
    pins: tuple[KVPin, ...] = ()
    confirms: tuple[KVPin, ...] = ()
    pulls: tuple[KVPull, ...] = ()
    releases: tuple[RemoteRelease, ...] = ()
    num_scheduled_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """No work for the worker side (the common decode-step case)."""
        return not (self.drops or self.pins or self.confirms or self.pulls or self.releases)


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """A worker's KV source address, collected by vLLM at engine start (handshake metadata)."""

    tp_rank: int
    address: str | None
    transport: str
    engine_id: str


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks holding `num_tokens` tokens (the last one possibly partial)."""
    return -(-num_tokens // block_size)
