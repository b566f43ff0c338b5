"""Values that cross the boundary between the frontend and engine actors.

They travel through Ray (inside the cluster), so they are small frozen dataclasses of plain
values: never a vLLM object, never a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Leg(Enum):
    """What one engine does for a request."""

    FULL = "full"  # prefill and decode here (colocated, a local prefill, a recompute)
    PREFILL = "prefill"  # the first token only; the KV stays for a decode leg to pull
    DECODE = "decode"  # pull the prompt's KV from the prefill engine, decode from token 2


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request for one engine: already tokenized and validated by the frontend."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    leg: Leg = Leg.FULL
    # The last tokens of the prompt that the client already has as output (a decode leg: the
    # first token, from the prefill leg). Deltas count them as output, not prompt, so a leg's
    # deltas go to the client as they are.
    prior_output_tokens: int = 0
    # Outputs the client already has that the engine must produce again, forced, as its first
    # outputs (a decode leg after a prefill leg, a migrated request), so that what depends on
    # them (presence/frequency penalties, a seeded generator, a stop string across them)
    # continues exactly as on one engine. The engine's deltas include them; the request flow
    # drops them. The prompt then holds the client's prompt only (prior_output_tokens 0).
    replay_output_tokens: tuple[int, ...] = ()
    # Opaque to the engine adapter; consumed by pdserve's KV connector (disaggregated mode).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def client_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) - self.prior_output_tokens


@dataclass(frozen=True, slots=True)
class GenerateDelta:
    """What an engine produced since its previous delta for one request."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A point-in-time view of one engine, for metrics and routing."""

    replica_id: str
    pool: str
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    num_aborted_total: int = 0
    num_finished_total: int = 0
    # KV transfers this engine pulled (decode side), by its connector's transport.
    kv_transport: str = ""
    kv_transfer_bytes_total: int = 0
    kv_transfer_failures_total: int = 0
    kv_transfer_seconds: tuple[float, ...] = ()  # durations finished since the previous stats call
    # Seconds from a request's arrival at the engine's actor to its first output, for requests
    # that produced one since the previous stats call (set by EngineActor, not by engines).
    first_output_seconds: tuple[float, ...] = ()
    # The engine can serve nothing more (set by EngineActor from `Engine.dead`).
    dead: bool = False


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Static facts an engine reports once started."""

    replica_id: str
    pool: str
    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int = 0
    pid: int = 0  # the actor's process, for operators (and failure-injection tests)
    node_ip: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GenerateFailure:
    """A request's engine stream ended without a finished delta: the engine raised `error`, or
    (error "") its stream just stopped. Travels on the actor's output stream in place of the
    request's last delta; the frontend fails that request alone."""

    request_id: str
    error: str = ""
    # The engine itself is dead (vLLM's engine core exited): every request on it fails, and
    # another engine may run them; False: this request alone failed.
    engine_dead: bool = False
