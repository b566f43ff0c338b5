"""The global scheduler's state: what it knows about every engine, fed by the request path.

`GlobalScheduler` is the stateful shell around the pure policies (`routing.place`,
`routing.place_colocated`, `autoscaler.policy.decide`). It keeps, per engine, what the frontend
has sent and not yet seen come back (queued prefill tokens, decoding requests, KV pins still to
be pulled), the engines' reported KV usage, a prefix-cache index, one online-fitted performance
model per pool and the rolling SLO tracker. Time comes in as arguments (`now`), never from a
clock, so the Ray backend (wall time) and the simulator (virtual time) drive the same object.

Request accounting, per leg:
    ticket = sched.prefill_started(replica, tokens, now)   # a leg that prefills (any pool)
    sched.first_token(ticket, now)                          # its first token came back
    sched.decode_started(replica) ... sched.token_gap(replica, seconds, n) ... sched.decode_finished(replica)
    sched.pin(prefill_replica) ... sched.unpin(prefill_replica)  # KV waiting to be pulled
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.autoscaler.policy import PoolSignals
from pdserve.scheduler.perf_model import OnlineFit, PerfModel
from pdserve.scheduler.prefix import PrefixIndex, block_hashes
from pdserve.scheduler.routing import (
    EngineLoad, Placement, Rejection, RouteRequest, RoutingPolicy, SloTargets, place,
    place_colocated,
)
from pdserve.scheduler.slo import SloTracker

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"


@dataclass(slots=True)
class BusyLog:
    """When one engine had a prompt in prefill: the spans that ended within the last window
    and the open one. Its busy fraction is that engine's measured prefill utilization."""

    since: float | None = None  # start of the open span (a prompt is in prefill now)
    spans: deque[tuple[float, float]] = field(default_factory=deque)

    def start(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def stop(self, now: float, keep_s: float) -> None:
        if self.since is not None:
            self.spans.append((self.since, now))
            self.since = None
        while self.spans and self.spans[0][1] < now - keep_s:
            self.spans.popleft()

    def fraction(self, now: float, window_s: float) -> float:
        """Share of the last `window_s` seconds with a prompt in prefill (0..1)."""
        lo = now - window_s
        busy = sum(min(end, now) - max(start, lo) for start, end in self.spans if end > lo)
        if self.since is not None:
            busy += now - max(self.since, lo)
        return min(max(busy, 0.0) / window_s, 1.0)


@dataclass(slots=True)
class EngineState:
    replica_id: str
    pool: str
    block_size: int
    num_kv_blocks: int
    queued_prefill_tokens: int = 0
    num_prefilling: int = 0
    num_decoding: int = 0
    pins: int = 0  # prefilled requests whose KV a decode engine has not pulled yet
    reserved: int = 0  # requests placed here whose leg has not finished (may not have begun)
    kv_usage: float = 0.0
    healthy: bool = True
    ready: bool = True  # False while starting
    draining: bool = False
    busy: BusyLog = field(default_factory=BusyLog)  # prefill in flight (prefill_started..first_token)
    # `load()` and the fields it was built from: the router reads every engine on every
    # request, while a request changes the books of one or two (the fluid simulator routes ~30
    # cohorts a step over the same few engines). Callers change fields directly (the backend,
    # the simulators), so the cache is checked against the fields, not invalidated by setters.
    _load: EngineLoad | None = field(default=None, init=False, repr=False, compare=False)
    _load_key: tuple = field(default=(), init=False, repr=False, compare=False)

    @property
    def accepting(self) -> bool:
        return self.healthy and self.ready and not self.draining

    @property
    def idle(self) -> bool:
        return (self.num_prefilling == 0 and self.num_decoding == 0 and self.pins == 0
                and self.reserved == 0)

    def load(self) -> EngineLoad:
        key = (self.replica_id, self.queued_prefill_tokens, self.num_decoding, self.reserved,
               self.kv_usage, self.num_kv_blocks, self.block_size, self.healthy, self.ready,
               self.draining)
        if key == self._load_key:
            return self._load
        # Blocks the frontend has committed but the engine's last report may not show yet are
        # not tracked: the engine's usage lags by one stats interval at most.
        free = math.floor(self.num_kv_blocks * (1.0 - self.kv_usage))
        # Requests placed here but still prefilling elsewhere will join this engine's batch:
        # counting them keeps a burst of simultaneous placements from piling onto one engine.
        batch = max(self.num_decoding, self.reserved)
        self._load = EngineLoad(self.replica_id, self.queued_prefill_tokens, batch, free,
                                self.block_size, self.healthy, self.accepting)
        self._load_key = key
        return self._load


@dataclass(slots=True)
class PrefillTicket:
    replica_id: str
    pool: str
    tokens: int  # uncached prompt tokens this leg prefills
    work_ahead: int  # queued prefill tokens ahead of it at dispatch, plus its own
    started: float
    done: bool = False


@dataclass(slots=True)
class _Pool:
    name: str
    fit: OnlineFit
    engines: dict[str, EngineState] = field(default_factory=dict)
    # `fit.model()` and the observation counts it was built at: the model changes only when
    # the fit takes an observation, and rebuilding it costs as much as a routing decision.
    _model: PerfModel | None = None
    _model_counts: tuple[int, int, int] = (-1, -1, -1)

    def model(self) -> PerfModel:
        fit = self.fit
        counts = (fit.prefill.count, fit.decode.count, fit.transfer.count)
        if counts != self._model_counts:
            self._model = fit.model()
            self._model_counts = counts
        return self._model


class GlobalScheduler:
    def __init__(self, pools: Sequence[str], seed: PerfModel | Mapping[str, PerfModel],
                 slo: SloTargets | None = None, policy: RoutingPolicy = RoutingPolicy(),
                 window_s: float = 30.0, prefix_aware: bool = True,
                 prefix_block_size: int = 16) -> None:
        """`seed`: one model for every pool, or one per pool name (pools on different
        hardware)."""
        seeds = seed if isinstance(seed, Mapping) else {name: seed for name in pools}
        self._pools = {name: _Pool(name, OnlineFit(seeds[name])) for name in pools}
        self.slo = slo
        self.policy = policy
        self.tracker = SloTracker(window_s)
        self._prefix = PrefixIndex(prefix_block_size, 1 << 16) if prefix_aware else None
        self._disaggregated = PREFILL in self._pools
        self._open: dict[int, PrefillTicket] = {}  # prefill legs without a first token yet

    # --- engines --------------------------------------------------------------------------

    def add_engine(self, pool: str, replica_id: str, block_size: int, num_kv_blocks: int,
                   ready: bool = True) -> None:
        self._pools[pool].engines[replica_id] = EngineState(
            replica_id, pool, block_size, max(num_kv_blocks, 1), ready=ready)

    def mark_ready(self, pool: str, replica_id: str) -> None:
        """A starting engine has started: route to it from now on."""
        self._pools[pool].engines[replica_id].ready = True

    def drain(self, pool: str, replica_id: str) -> EngineState:
        """Stop routing to the engine; it may be removed once `idle` (requests it runs, requests
        placed on it, and KV that decode engines still have to pull from it are all done)."""
        state = self._pools[pool].engines[replica_id]
        state.draining = True
        return state

    def engine(self, pool: str, replica_id: str) -> EngineState:
        return self._pools[pool].engines[replica_id]

    def engines(self, pool: str) -> list[EngineState]:
        return list(self._pools[pool].engines.values())

    def remove_engine(self, pool: str, replica_id: str) -> None:
        self._pools[pool].engines.pop(replica_id, None)
        if self._prefix is not None:
            self._prefix.forget(replica_id)

    def update_engine(self, pool: str, replica_id: str, *, kv_usage: float | None = None,
                      healthy: bool | None = None) -> None:
        state = self._pools[pool].engines.get(replica_id)
        if state is None:
            return
        if kv_usage is not None:
            state.kv_usage = kv_usage
        if healthy is not None:
            state.healthy = healthy

    def model(self, pool: str) -> PerfModel:
        return self._pools[pool].model()

    # --- routing --------------------------------------------------------------------------

    def route(self, prompt_token_ids: Sequence[int], max_tokens: int) -> Placement | Rejection:
        hashes = self._hashes(prompt_token_ids)
        cached = {}
        if hashes:
            for pool in self._pools.values():
                for rid in pool.engines:
                    hit = self._prefix.cached_tokens(rid, hashes)
                    if hit:
                        cached[rid] = hit
        request = RouteRequest(len(prompt_token_ids), max_tokens, cached)
        if self._disaggregated:
            return place(request, self._loads(PREFILL), self._loads(DECODE), self.model(PREFILL),
                         self.model(DECODE), self.slo, self.policy)
        return place_colocated(request, self._loads(COLOCATED), self.model(COLOCATED), self.slo,
                               self.policy)

    def remember_prefix(self, replica_id: str, prompt_token_ids: Sequence[int]) -> None:
        """The engine now holds this prompt's blocks in its prefix cache."""
        hashes = self._hashes(prompt_token_ids)
        if hashes:
            self._prefix.insert(replica_id, hashes)

    def cached_tokens(self, replica_id: str, prompt_token_ids: Sequence[int]) -> int:
        hashes = self._hashes(prompt_token_ids)
        return self._prefix.cached_tokens(replica_id, hashes) if hashes else 0

    def _hashes(self, prompt_token_ids: Sequence[int]) -> list[bytes]:
        if self._prefix is None:
            return []
        return block_hashes(prompt_token_ids, self._prefix.block_size)

    def _loads(self, pool: str) -> list[EngineLoad]:
        return [e.load() for e in self._pools[pool].engines.values()]

    # --- request accounting ---------------------------------------------------------------

    def prefill_started(self, pool: str, replica_id: str, tokens: int, now: float) -> PrefillTicket:
        state = self._pools[pool].engines[replica_id]
        ticket = PrefillTicket(replica_id, pool, tokens, state.queued_prefill_tokens + tokens, now)
        state.queued_prefill_tokens += tokens
        state.num_prefilling += 1
        state.busy.start(now)
        self.tracker.record_arrival(pool, now, tokens)
        self._open[id(ticket)] = ticket
        return ticket

    def first_token(self, ticket: PrefillTicket, now: float, observe: bool = True) -> None:
        """The leg's prefill is over (first token out, or it ended); idempotent."""
        if ticket.done:
            return
        ticket.done = True
        self._open.pop(id(ticket), None)
        pool = self._pools[ticket.pool]
        state = pool.engines.get(ticket.replica_id)
        if state is not None:
            state.queued_prefill_tokens = max(0, state.queued_prefill_tokens - ticket.tokens)
            state.num_prefilling = max(0, state.num_prefilling - 1)
            if state.num_prefilling == 0:
                state.busy.stop(now, self.tracker.window_s)
        if observe:
            pool.fit.observe_prefill(ticket.work_ahead, now - ticket.started)

    def decode_started(self, pool: str, replica_id: str) -> None:
        state = self._pools[pool].engines.get(replica_id)
        if state is not None:
            state.num_decoding += 1

    def decode_finished(self, pool: str, replica_id: str) -> None:
        state = self._pools[pool].engines.get(replica_id)
        if state is not None:
            state.num_decoding = max(0, state.num_decoding - 1)

    def token_gap(self, pool: str, replica_id: str, seconds: float, tokens: int) -> None:
        """`tokens` new tokens arrived `seconds` after the previous ones on this engine."""
        state = self._pools[pool].engines.get(replica_id)
        # Only gaps of decode-only steps: a prefill running on the same engine (colocated,
        # chunked prefill, local prefill) stretches a step by its own cost, which would make
        # the decode line look steeper than it is.
        if (state is not None and tokens > 0 and state.num_decoding > 0
                and state.num_prefilling == 0):
            self._pools[pool].fit.observe_decode(state.num_decoding, seconds / tokens)

    def transfer_observed(self, tokens: int, seconds: float) -> None:
        if DECODE in self._pools:
            self._pools[DECODE].fit.observe_transfer(tokens, seconds)

    def reserve(self, placement: Placement) -> None:
        """Hold the placement's engines until `release`: a decode engine chosen now may see its
        request only after a long prefill, and must not be drained meanwhile."""
        for pool, rid in self._placed(placement):
            state = self._pools[pool].engines.get(rid)
            if state is not None:
                state.reserved += 1

    def release(self, placement: Placement) -> None:
        for pool, rid in self._placed(placement):
            state = self._pools[pool].engines.get(rid)
            if state is not None:
                state.reserved = max(0, state.reserved - 1)

    def _placed(self, placement: Placement) -> list[tuple[str, str]]:
        if not self._disaggregated:
            return [(COLOCATED, placement.decode)]
        placed = [(DECODE, placement.decode)]
        if placement.prefill is not None:
            placed.append((PREFILL, placement.prefill))
        return placed

    def pin(self, pool: str, replica_id: str) -> None:
        state = self._pools[pool].engines.get(replica_id)
        if state is not None:
            state.pins += 1

    def unpin(self, pool: str, replica_id: str) -> None:
        state = self._pools[pool].engines.get(replica_id)
        if state is not None:
            state.pins = max(0, state.pins - 1)

    def first_token_seen(self, pool: str, now: float, ttft_s: float) -> None:
        """A request's first token reached the frontend (its TTFT as the client sees it)."""
        self.tracker.record_ttft(pool, now, ttft_s)

    def request_finished(self, ttft_pool: str, tpot_pool: str, now: float,
                         ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.tracker.record_ttft(ttft_pool, now, ttft_s)
        if tpot_s is not None:
            self.tracker.record_tpot(tpot_pool, now, tpot_s)

    # --- scaling signals ------------------------------------------------------------------

    def signals(self, pool: str, now: float) -> PoolSignals:
        """What the autoscaling policy sees of one pool (draining engines excluded)."""
        engines = [e for e in self._pools[pool].engines.values() if not e.draining and e.healthy]
        n = len(engines)
        starting = sum(not e.ready for e in engines)
        slo = self.slo
        pct = slo.percentile if slo else 90.0
        late = []
        if slo is not None:
            late = [now - t.started for t in self._open.values()
                    if t.pool == pool and now - t.started > slo.ttft_s]
        summary = self.tracker.summary(pool, now, pct, slo.ttft_s if slo else None,
                                       slo.tpot_s if slo else None, late)
        model = self.model(pool)
        prefill_util = decode_util = kv = 0.0
        if n:
            # Two views of prefill load; the larger counts. The modelled one (arriving tokens
            # over the fitted rate) sees overload beyond 1; the measured one (share of the
            # window each engine had a prompt in prefill) cannot be fooled by the fit. The fit
            # relates TTFT to the tokens queued at dispatch, counting prompts already part-way
            # through a step as whole: under load its rate comes out above what the engine
            # sustains (4 x H100, 2026-11-27: fitted ~73k tok/s, sustained ~45k), so two
            # prefill engines at 26 req/s read 0.37 and the rebalance took one of them away.
            modelled = summary.prompt_tokens_per_s / (n * model.prefill_tokens_per_s)
            window = self.tracker.window_s
            measured = sum(e.busy.fraction(now, window) for e in engines) / n
            prefill_util = max(modelled, measured)
            kv = sum(e.kv_usage for e in engines) / n
            if slo is not None:
                max_batch = model.max_batch_for_tpot(slo.tpot_s)
                decoding = sum(e.num_decoding for e in engines) / n
                # A step floor above the target (max_batch 0) is no load that more engines
                # would relieve; the TPOT breach itself still shows it.
                decode_util = decoding / max_batch if max_batch else 0.0
        return PoolSignals(
            pool=pool, replicas=n, starting=starting, samples=summary.count,
            ttft_s=summary.ttft_p_s, tpot_s=summary.tpot_p_s,
            prefill_utilization=prefill_util, decode_utilization=decode_util, kv_usage=kv)
