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
    """What the client asked of the sampling, as vLLM's `SamplingParams` takes it (same names,
    same defaults). `vllm_engine._sampling_params` turns it into vLLM's object on the engine."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens (vLLM also takes -1)
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Per generated token: its logprob and this many alternatives (0: the token's alone; -1:
    # the whole vocabulary). None: no logprobs.
    logprobs: int | None = None
    # The same for every prompt token (vLLM's extension; the completions `echo` uses it).
    prompt_logprobs: int | None = None
    # A constraint on the output, as vLLM's `StructuredOutputsParams` fields: exactly one of
    # "json" (a JSON schema), "json_object", "regex", "choice", "grammar", "structural_tag",
    # plus its options ("disable_any_whitespace", "disable_additional_properties",
    # "whitespace_pattern"). Plain JSON values only.
    structured_output: dict[str, Any] | None = None

    @property
    def constrains_output_history(self) -> bool:
        """Whether what the engine may sample depends on the request's earlier outputs in a way
        that output moved into the prompt would not reproduce: a grammar's state, a multi-token
        bad word, a seeded generator (it advances once per sampled token), or presence and
        frequency penalties under a repetition penalty (vLLM applies the latter after logits
        processors, so `pdserve_prior`'s adjustment would come first and differ)."""
        return (self.structured_output is not None or bool(self.bad_words)
                or (self.seed is not None and self.temperature > 0)
                or (self.repetition_penalty != 1.0
                    and bool(self.presence_penalty or self.frequency_penalty)))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One candidate token at one position: its id, logprob (raw: before any penalty,
    temperature or constraint, as vLLM reports them), rank in the vocabulary, and text."""

    token_id: int
    logprob: float
    rank: int | None
    text: str


# One position's logprobs as vLLM orders them: the chosen token first, then the top
# alternatives by rank (the chosen one once if it is among them).
PositionLogprobs = tuple[TokenLogprob, ...]


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
class KVPull:
    """How a decode leg's KV came from its prefill engine, as the decode engine's connector
    measured it: bytes moved, seconds, and whether the pull failed (the connector then
    recomputed the prompt, or failed the request, per `kv.failure_policy`)."""

    nbytes: int
    seconds: float
    failed: bool = False


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
    # One entry per token of `token_ids` when the request asked for logprobs.
    logprobs: tuple[PositionLogprobs, ...] | None = None
    # The prompt's, once, on a leg's first delta (None for position 0, which has no logprob),
    # when the request asked for them.
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None
    # What ended the request when it stopped on a stop string or stop token: that string or
    # token id (vLLM's `stop_reason`); None for EOS, a length limit, or while running.
    stop_reason: int | str | None = None
    # A decode leg's KV pull, once, on a delta after it finished (None elsewhere).
    kv_pull: KVPull | None = None

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
    # vLLM's own timings of the requests that reached a first token or finished since the previous
    # stats call (vLLM engines; empty for the mock): its time to first token, from its input
    # processing to the first token's output processing (first_output_seconds minus it is the
    # engine actor's own work), and, per finished request, the time queued in its scheduler and
    # from its first scheduling to its first token (the prefill, or a decode leg's pull and step).
    vllm_ttft_seconds: tuple[float, ...] = ()
    queue_seconds: tuple[float, ...] = ()
    prefill_seconds: tuple[float, ...] = ()
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
    # The engine refused the request's input (a ValueError from vLLM's input validation);
    # `error` is then its message, meant for the client.
    rejected: bool = False
