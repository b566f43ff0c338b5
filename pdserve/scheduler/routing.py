"""Routing policy: which engines serve a request, or whether to refuse it.

Pure functions of plain values (no Ray, no clocks, no I/O): the frontend's scheduler, the unit
tests and the simulator (pdserve.sim) call the very same code.

Disaggregated placement (`place`):
- prefill engine: the lowest predicted TTFT = (prompt tokens already queued there + this
  prompt's tokens not in its prefix cache) / its prefill rate. The client's first token is the
  prefill engine's, so the KV pull to the decode engine delays token 2, not the first: it is
  spread over the request's tokens in the predicted TPOT, as a local prefill's stall is;
- decode engine: enough free KV blocks for the whole request, then the shortest predicted decode
  step (batch size against the TPOT target), ties to the most free blocks;
- conditional disaggregation: the prompt is prefilled on the decode engine itself when few of
  its tokens are uncached there (at most `local_prefill_max_tokens`, a setting or, when None,
  what that engine prefills within one TPOT of stall) and that predicts a TTFT no worse than the
  remote path;
- adaptive disaggregation (`overflow_ttft_share`): when the prefill pool falls behind (the best
  remote prefill predicts a TTFT above that share of the target), a decode engine prefills a
  prompt of any length itself, if that predicts a lower TTFT and keeps its predicted TPOT, with
  every prompt queued there, within the target. The decode engines then take both roles, as
  colocated engines do, exactly while the prefill pool cannot meet the TTFT target alone and
  the TPOT target leaves room: 1P1D's prefill-bound knee moves toward colocated's, and below it
  nothing changes;
- admission: when even the best placement predicts a TTFT beyond `admit_ttft_factor` x the
  target, or no decode engine has room for the request's KV, the answer is a `Rejection` with a
  retry hint (the frontend turns it into a 429). A request whose engine has nothing queued
  ahead of it is always admitted, whatever the model predicts: admission sheds queues, and
  the model is refitted only from requests that run. Refusing on a model that overestimates
  an idle engine would starve the model of the very observations that correct it, and refuse
  everything for good (4 x H100, 2026-11-27: after a burst, 180 s of 429s at 6 req/s on
  idle engines).

Colocated placement (`place_colocated`) picks by the same TTFT prediction, then decode headroom.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.scheduler.perf_model import PerfModel
from pdserve.slo import SloTargets


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the scheduler knows about one engine when a request arrives."""

    replica_id: str
    queued_prefill_tokens: int = 0  # prompt tokens sent here whose first token is not back
    num_decoding: int = 0  # requests past their first token on this engine
    kv_free_blocks: int = 1 << 30
    block_size: int = 16
    healthy: bool = True
    accepting: bool = True  # False while starting or draining


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_tokens: int
    max_tokens: int
    # Prompt tokens already in each engine's prefix cache (replica id -> tokens); missing = 0.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)

    def uncached(self, replica_id: str) -> int:
        return max(self.prompt_tokens - self.cached_tokens.get(replica_id, 0), 1)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    # Local prefill on the decode engine: None = decide from the model (what the decode engine
    # prefills within `local_stall_tpots` x the TPOT target), 0 = never, N = up to N tokens.
    local_prefill_max_tokens: int | None = None
    local_stall_tpots: float = 1.0
    # Refuse a request whose best predicted TTFT exceeds this multiple of the target.
    admit_ttft_factor: float = 4.0
    # Adaptive disaggregation: decode engines also prefill once the best remote prefill predicts
    # a TTFT above this share of the target (needs an SLO); None: never beyond the limit above.
    overflow_ttft_share: float | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    decode: str  # the engine that produces tokens 2.. (colocated: the only engine)
    prefill: str | None  # None: prefilled on the decode engine (local or colocated)
    predicted_ttft_s: float
    predicted_tpot_s: float
    reason: str  # "remote", "local_short_prompt", "local_cached", "overflow", "colocated"
    # Prompt tokens queued ahead of this request on the engine that prefills it (admission
    # never refuses a request that would start at once).
    queued_ahead_tokens: int = 0

    @property
    def local(self) -> bool:
        return self.prefill is None


@dataclass(frozen=True, slots=True)
class Rejection:
    retry_after_s: float
    reason: str  # "ttft_slo", "kv_capacity", "no_engine"
    predicted_ttft_s: float = math.inf


def predicted_ttft(load: EngineLoad, request: RouteRequest, model: PerfModel) -> float:
    """Prefill queue ahead plus this prompt's uncached tokens, at the engine's prefill rate."""
    return model.prefill_s(load.queued_prefill_tokens + request.uncached(load.replica_id))


def predicted_tpot(load: EngineLoad, model: PerfModel) -> float:
    """Decode step time once this request joins the engine's batch."""
    return model.decode_step_time(load.num_decoding + 1)


def blocks_needed(request: RouteRequest, block_size: int) -> int:
    return -(-(request.prompt_tokens + request.max_tokens) // block_size)


def local_prefill_limit(policy: RoutingPolicy, decode_model: PerfModel,
                        slo: SloTargets | None) -> int:
    """Most uncached prompt tokens the decode engine may prefill itself."""
    if policy.local_prefill_max_tokens is not None:
        return policy.local_prefill_max_tokens
    if slo is None:
        return 0
    budget = slo.tpot_s * policy.local_stall_tpots - decode_model.prefill_overhead_s
    return max(0, int(budget * decode_model.prefill_tokens_per_s))


def place(
    request: RouteRequest,
    prefill: Sequence[EngineLoad],
    decode: Sequence[EngineLoad],
    prefill_model: PerfModel,
    decode_model: PerfModel,
    slo: SloTargets | None = None,
    policy: RoutingPolicy = RoutingPolicy(),
) -> Placement | Rejection:
    """Disaggregated placement of one request (see the module docstring)."""
    roomy = _roomy(request, decode, decode_model)
    if isinstance(roomy, Rejection):
        return roomy
    # Ties (e.g. a flat decode cost) go to the smaller batch, then to more free KV.
    best_decode = min(roomy, key=lambda d: (predicted_tpot(d, decode_model), d.num_decoding,
                                            -d.kv_free_blocks, d.replica_id))
    tpot = predicted_tpot(best_decode, decode_model)

    options: list[Placement] = []
    # A prefill engine holds each prompt's KV until its decode engine has pulled it: one whose
    # cache is taken by prompts waiting to be pulled (its reported usage counts them) gets no
    # more, and the decode engine prefills instead.
    prompt_blocks = RouteRequest(request.prompt_tokens, 0)
    prefillers = [p for p in prefill if p.healthy and p.accepting
                  and p.kv_free_blocks >= blocks_needed(prompt_blocks, p.block_size)]
    if prefillers:
        best_prefill = min(prefillers, key=lambda p: (
            predicted_ttft(p, request, prefill_model), p.queued_prefill_tokens, p.replica_id))
        # The pull delays token 2 once: spread over this request's tokens, like a local stall.
        pull = decode_model.transfer_s(request.prompt_tokens)
        options.append(Placement(
            best_decode.replica_id, best_prefill.replica_id,
            predicted_ttft(best_prefill, request, prefill_model),
            tpot + pull / max(request.max_tokens, 1), "remote",
            best_prefill.queued_prefill_tokens))
    limit = local_prefill_limit(policy, decode_model, slo)
    local = [d for d in roomy if request.uncached(d.replica_id) <= limit]
    if _overflowing(options, policy, slo):
        assert slo is not None
        local += [d for d in roomy if d not in local
                  and overflow_tpot(d, request, decode_model) <= slo.tpot_s]
    if local:
        best_local = min(local, key=lambda d: (predicted_ttft(d, request, decode_model),
                                               predicted_tpot(d, decode_model), d.num_decoding,
                                               d.replica_id))
        cached = request.cached_tokens.get(best_local.replica_id, 0)
        reason = "local_cached" if cached > request.prompt_tokens // 2 else "local_short_prompt"
        if request.uncached(best_local.replica_id) > limit:
            reason = "overflow"
        ttft = predicted_ttft(best_local, request, decode_model)
        # The local prefill stalls the decode batch once: spread over this request's tokens.
        stall = decode_model.prefill_s(request.uncached(best_local.replica_id))
        options.append(Placement(
            best_local.replica_id, None, ttft,
            predicted_tpot(best_local, decode_model) + stall / max(request.max_tokens, 1), reason,
            best_local.queued_prefill_tokens))
    if not options:
        # No prefill engine: the decode engines prefill everything themselves.
        best = min(roomy, key=lambda d: (predicted_ttft(d, request, decode_model), d.replica_id))
        options.append(Placement(best.replica_id, None, predicted_ttft(best, request, decode_model),
                                 predicted_tpot(best, decode_model), "no_prefill_engine",
                                 best.queued_prefill_tokens))
    chosen = min(options, key=lambda o: (o.predicted_ttft_s, o.prefill is None))
    return _admit(chosen, slo, policy)


def overflow_tpot(load: EngineLoad, request: RouteRequest, model: PerfModel) -> float:
    """A decode engine's predicted TPOT if it also prefills this prompt: its decode step with
    this request in the batch, plus every prompt queued there and this one, spread over this
    request's tokens (each prefill stalls the whole batch once)."""
    stall = model.prefill_s(load.queued_prefill_tokens + request.uncached(load.replica_id))
    return predicted_tpot(load, model) + stall / max(request.max_tokens, 1)


def _overflowing(options: Sequence[Placement], policy: RoutingPolicy,
                 slo: SloTargets | None) -> bool:
    """Whether the prefill pool is behind: no remote option, or the best one predicts a TTFT
    above `overflow_ttft_share` of the target."""
    if policy.overflow_ttft_share is None or slo is None:
        return False
    return not options or options[0].predicted_ttft_s > slo.ttft_s * policy.overflow_ttft_share


def place_colocated(
    request: RouteRequest,
    engines: Sequence[EngineLoad],
    model: PerfModel,
    slo: SloTargets | None = None,
    policy: RoutingPolicy = RoutingPolicy(),
) -> Placement | Rejection:
    """Colocated placement: lowest predicted TTFT, then decode headroom."""
    roomy = _roomy(request, engines, model)
    if isinstance(roomy, Rejection):
        return roomy
    # The ranking tuples themselves: the winner's carries its predictions (replica ids are
    # unique, so no two tuples tie).
    ttft, tpot, _, _, replica_id, queued = min(
        (predicted_ttft(e, request, model), predicted_tpot(e, model), e.num_decoding,
         -e.kv_free_blocks, e.replica_id, e.queued_prefill_tokens) for e in roomy)
    return _admit(Placement(replica_id, None, ttft, tpot, "colocated", queued), slo, policy)


def _roomy(request: RouteRequest, engines: Sequence[EngineLoad],
           model: PerfModel) -> list[EngineLoad] | Rejection:
    """The engines that take requests and have KV room for this one, or why there are none."""
    ready = [e for e in engines if e.healthy and e.accepting]
    if not ready:
        return Rejection(1.0, "no_engine")
    roomy = [e for e in ready if e.kv_free_blocks >= blocks_needed(request, e.block_size)]
    if not roomy:
        # Blocks free up as running requests finish: about one request's decode time.
        return Rejection(_retry_after(model.decode_step_time(1) * request.max_tokens),
                         "kv_capacity")
    return roomy


def _admit(chosen: Placement, slo: SloTargets | None, policy: RoutingPolicy) -> Placement | Rejection:
    if (slo is None or chosen.queued_ahead_tokens <= 0
            or chosen.predicted_ttft_s <= slo.ttft_s * policy.admit_ttft_factor):
        return chosen
    # Retry once the queue ahead has drained to what the target allows.
    wait = chosen.predicted_ttft_s - slo.ttft_s * policy.admit_ttft_factor
    return Rejection(_retry_after(wait), "ttft_slo", chosen.predicted_ttft_s)


def _retry_after(seconds: float) -> float:
    return min(max(seconds, 1.0), 60.0)


