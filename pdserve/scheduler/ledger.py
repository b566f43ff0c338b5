"""The request ledger: the one set of books of what every engine has been given.

`RequestLedger` is the stateful shell around the pure policies (`routing.place`,
`routing.place_colocated`, and, through `signals`, `autoscaler.policy.decide`). The Ray backend,
the in-process backend and the simulator drive it with the same lifecycle events, each with
`now` passed in (wall time or virtual time; there is no clock inside):

    admission = ledger.admit(request_id, prompt_token_ids, max_tokens, now)   # or a Rejection
    ledger.leg_started(admission, Leg.PREFILL, now)     # a leg was sent to its engine
    ledger.leg_output(admission, Leg.PREFILL, now, n)   # each output of the leg (tokens in it)
    ledger.leg_finished(admission, Leg.PREFILL, now, finish_reason)
    ledger.leg_started(admission, Leg.DECODE, now) ... leg_finished(...)
    timing = ledger.request_finished(admission, now, output_tokens, finish_reason)

What each event books:
- `admit`: hashes the prompt once (the hashes ride in the `Admission`), routes it, and reserves
  its engines until `request_finished` (a decode engine chosen now may see the request only
  after a long prefill, and must not be drained meanwhile);
- a leg that prefills (`FULL`, `PREFILL`) queues its uncached prompt tokens on its engine until
  its first output, which also feeds the prefill fit and the prefix index; a `PREFILL` leg
  with a decode leg to follow pins its engine's KV until the decode leg's first output (the
  pull is done) or the request ends;
- a `FULL` leg decodes after its first output, a `DECODE` leg from its start; its first output
  is the KV pull (plus a step, on real engines), which feeds the transfer fit;
- the request's first token and its end give the client's TTFT and TPOT: the one timer behind
  both the SLO tracker and the Prometheus histograms (`RequestTiming`).

`decode_gap` feeds the decode fit with the time between a leg's outputs, and `observe_*` /
`resync` let the fluid simulator, which moves cohorts of requests between engine groups rather
than single requests, keep the same books. `signals(pool, now)` is what the autoscaler reads.
An optional `observer` sees every lifecycle event as a typed value (tests, tracing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.config.schema import PdserveConfig
from pdserve.engine.types import Leg
from pdserve.scheduler.perf_model import OnlineFit, PerfModel
from pdserve.scheduler.prefix import PrefixIndex, block_hashes
from pdserve.scheduler.registry import EngineRecord, EngineRegistry
from pdserve.scheduler.routing import (
    Placement, Rejection, RouteRequest, RoutingPolicy, place, place_colocated,
)
from pdserve.scheduler.slo import SloTracker
from pdserve.scheduler.types import COLOCATED, DECODE, PREFILL, PoolSignals
from pdserve.slo import SloTargets


@dataclass(frozen=True, slots=True)
class Admission:
    """A placed request: where its legs run, and what the ledger needs to book them."""

    request_id: str
    placement: Placement
    prompt_tokens: int
    max_tokens: int
    hashes: tuple[int, ...]  # the prompt's block hashes (empty without prefix awareness)
    admitted_at: float
    prefill_pool: str | None  # None: prefilled where it decodes
    decode_pool: str

    @property
    def first_leg(self) -> Leg:
        return Leg.FULL if self.placement.prefill is None else Leg.PREFILL

    @property
    def decode_follows_prefill(self) -> bool:
        """A remote prefill whose KV a decode leg will pull (a budget of one token needs none)."""
        return self.placement.prefill is not None and self.max_tokens > 1

    @property
    def ttft_pool(self) -> str:
        return self.prefill_pool or self.decode_pool

    def engine_of(self, leg: Leg) -> tuple[str, str]:
        """(pool, replica id) that runs `leg`; a FULL leg after a failed prefill runs where the
        request decodes."""
        if leg is Leg.PREFILL:
            assert self.prefill_pool is not None and self.placement.prefill is not None
            return self.prefill_pool, self.placement.prefill
        return self.decode_pool, self.placement.decode


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """The client's view of one request, from the ledger's one timer."""

    ttft_s: float | None  # None: no token came
    tpot_s: float | None  # None: fewer than two tokens
    e2e_s: float


# Lifecycle events as an observer sees them.
@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class LegStarted:
    request_id: str
    leg: Leg
    pool: str
    replica_id: str


@dataclass(frozen=True, slots=True)
class FirstOutput:
    request_id: str
    leg: Leg
    pool: str
    replica_id: str


@dataclass(frozen=True, slots=True)
class LegFinished:
    request_id: str
    leg: Leg
    pool: str
    replica_id: str
    finish_reason: str | None  # None: ended without finishing (failed, aborted, closed)


@dataclass(frozen=True, slots=True)
class Migrated:
    request_id: str
    pool: str
    replica_id: str  # the engine the request continues on


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: str
    finish_reason: str
    output_tokens: int


LedgerEvent = Admitted | LegStarted | FirstOutput | LegFinished | Migrated | RequestFinished


@dataclass(slots=True)
class _LegBooks:
    pool: str  # where the leg runs
    started: float
    tokens: int  # uncached prompt tokens queued (legs that prefill)
    work_ahead: int  # prompt tokens queued ahead at dispatch, plus its own
    open: bool = True  # until `leg_finished` (or the request's end) closes it
    prefilling: bool = False
    decoding: bool = False
    outputs: int = 0
    last_output: float = 0.0


@dataclass(slots=True)
class _RequestBooks:
    legs: dict[Leg, _LegBooks] = field(default_factory=dict)
    placed: list[tuple[str, str]] = field(default_factory=list)  # engines reserved for it
    pinned: bool = False
    first_token: float | None = None


@dataclass(slots=True)
class _Pool:
    name: str
    fit: OnlineFit
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


class RequestLedger:
    def __init__(self, pools: Sequence[str], seed: PerfModel | Mapping[str, PerfModel],
                 slo: SloTargets | None = None, policy: RoutingPolicy = RoutingPolicy(),
                 window_s: float = 30.0, prefix_aware: bool = True,
                 prefix_block_size: int = 16,
                 observer: Callable[[LedgerEvent], None] | None = None) -> None:
        """`seed`: one model for every pool, or one per pool name (pools on different
        hardware)."""
        seeds = seed if isinstance(seed, Mapping) else {name: seed for name in pools}
        self._pools = {name: _Pool(name, OnlineFit(seeds[name])) for name in pools}
        self.engines = EngineRegistry(list(pools))
        self.slo = slo
        self.policy = policy
        self.tracker = SloTracker(window_s)
        self._prefix = PrefixIndex(prefix_block_size, 1 << 16) if prefix_aware else None
        self._disaggregated = PREFILL in self._pools
        self._requests: dict[str, _RequestBooks] = {}
        self._observer = observer

    def model(self, pool: str) -> PerfModel:
        return self._pools[pool].model()

    def engine(self, pool: str, replica_id: str) -> EngineRecord:
        return self.engines[pool, replica_id]

    def remove_engine(self, pool: str, replica_id: str) -> None:
        """The engine is gone: forget it and what its prefix cache held."""
        self.engines.remove(pool, replica_id)
        if self._prefix is not None:
            self._prefix.forget(replica_id)

    # --- admission --------------------------------------------------------------------------

    def admit(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
              now: float, placement: Placement | None = None) -> Admission | Rejection:
        """Place a request and reserve its engines, or say why it cannot run now.
        `placement`: one decided elsewhere (a replayed trace, a scripted test), booked as is."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already admitted")
        hashes = tuple(self._hashes(prompt_token_ids))
        if placement is None:
            placement = self.place(len(prompt_token_ids), max_tokens, hashes)
        if isinstance(placement, Rejection):
            return placement
        prefill_pool, decode_pool = self._pools_of(placement)
        admission = Admission(request_id, placement, len(prompt_token_ids), max_tokens, hashes,
                              now, prefill_pool, decode_pool)
        books = self._requests[request_id] = _RequestBooks(placed=self._placed(admission))
        for pool, rid in books.placed:
            self.engines[pool, rid].reserved += 1
        self._emit(Admitted(request_id, placement))
        return admission

    def place(self, prompt_tokens: int, max_tokens: int,
              hashes: Sequence[int] = ()) -> Placement | Rejection:
        """Where a request of this shape would go now, booking nothing (`admit` books it; the
        fluid simulator books a whole cohort with `admit_cohort`)."""
        cached = {}
        if hashes and self._prefix is not None:
            for record in self.engines:
                hit = self._prefix.cached_tokens(record.replica_id, hashes)
                if hit:
                    cached[record.replica_id] = hit
        request = RouteRequest(prompt_tokens, max_tokens, cached)
        if self._disaggregated:
            return place(request, self.engines.loads(PREFILL), self.engines.loads(DECODE),
                         self.model(PREFILL), self.model(DECODE), self.slo, self.policy)
        return place_colocated(request, self.engines.loads(COLOCATED), self.model(COLOCATED),
                               self.slo, self.policy)

    # --- a request's legs -------------------------------------------------------------------

    def leg_started(self, admission: Admission, leg: Leg, now: float) -> None:
        """The leg was submitted to its engine."""
        pool, rid = admission.engine_of(leg)
        record = self.engines[pool, rid]
        books = self._requests[admission.request_id]
        if record.in_flight == 0:
            record.last_progress = now  # an idle engine's clock of progress starts now
        record.in_flight += 1
        if leg is Leg.DECODE:
            books.legs[leg] = _LegBooks(pool, now, 0, 0, decoding=True)
            record.num_decoding += 1
        else:
            cached = (self._prefix.cached_tokens(rid, admission.hashes)
                      if self._prefix is not None and admission.hashes else 0)
            tokens = max(admission.prompt_tokens - cached, 1)
            books.legs[leg] = _LegBooks(pool, now, tokens, record.queued_prefill_tokens + tokens,
                                        prefilling=True)
            record.queued_prefill_tokens += tokens
            record.num_prefilling += 1
            record.busy.start(now)
            self.tracker.record_arrival(pool, now, tokens)
            if leg is Leg.PREFILL and admission.decode_follows_prefill:
                # The prefill engine holds this request's KV until the decode engine has pulled
                # it: a draining prefill engine waits for it.
                record.pins += 1
                books.pinned = True
        self._emit(LegStarted(admission.request_id, leg, pool, rid))

    def leg_output(self, admission: Admission, leg: Leg, now: float, tokens: int,
                   finished: bool = False) -> None:
        """An output of the leg arrived, carrying `tokens` new tokens (0: none, e.g. a
        simulated pull's end)."""
        books = self._requests[admission.request_id]
        leg_books = books.legs[leg]
        pool, rid = admission.engine_of(leg)
        record = self.engines.get(pool, rid)
        if record is not None:
            record.last_progress = now
        if leg_books.outputs == 0:
            self._first_output(admission, leg, leg_books, pool, rid, now, finished)
        elif tokens:
            self.decode_gap(pool, rid, now - leg_books.last_output, tokens)
        leg_books.outputs += 1
        leg_books.last_output = now
        if tokens and books.first_token is None:
            books.first_token = now
            self.tracker.record_ttft(admission.ttft_pool, now, now - admission.admitted_at)

    def _first_output(self, admission: Admission, leg: Leg, leg_books: _LegBooks, pool: str,
                      rid: str, now: float, finished: bool) -> None:
        if leg_books.prefilling:
            self._prefill_done(pool, rid, leg_books, now, observe=True)
            if self._prefix is not None and admission.hashes:
                self._prefix.insert(rid, list(admission.hashes))
            if leg is Leg.FULL and not finished:
                leg_books.decoding = True
                self.engines[pool, rid].num_decoding += 1
        elif leg is Leg.DECODE:
            # A decode leg's first output comes after the KV pull (and, on an engine, a step).
            if DECODE in self._pools:
                self._pools[DECODE].fit.observe_transfer(admission.prompt_tokens,
                                                         now - leg_books.started)
            self._unpin(admission, self._requests[admission.request_id])
        self._emit(FirstOutput(admission.request_id, leg, pool, rid))

    def leg_finished(self, admission: Admission, leg: Leg, now: float,
                     finish_reason: str | None) -> None:
        """The leg ended: finished (`finish_reason` 'stop' / 'length' / ...) or not (None)."""
        self._close_leg(admission, self._requests[admission.request_id], leg, now, finish_reason)

    def request_finished(self, admission: Admission, now: float, output_tokens: int,
                         finish_reason: str) -> RequestTiming:
        """The request is over (`now`: its last output, as the client saw it): release what it
        held and time it."""
        books = self._requests.pop(admission.request_id)
        for leg in books.legs:  # legs their backend did not close
            self._close_leg(admission, books, leg, now, None)
        self._unpin(admission, books)
        self._release(books)
        ttft = tpot = None
        if books.first_token is not None:
            ttft = books.first_token - admission.admitted_at
            if output_tokens > 1:
                tpot = (now - books.first_token) / (output_tokens - 1)
                self.tracker.record_tpot(admission.decode_pool, now, tpot)
        self._emit(RequestFinished(admission.request_id, finish_reason, output_tokens))
        return RequestTiming(ttft, tpot, now - admission.admitted_at)

    def migrate(self, admission: Admission, now: float, prompt_tokens: int,
                max_tokens: int) -> Admission | Rejection:
        """The engine producing the request's tokens died (or hung): release what the request
        held (its legs, reservations, a pin not pulled yet) and place its continuation, a
        `FULL` leg of `prompt_tokens` (the prompt and the outputs so far, recomputed) and
        `max_tokens` more, on another engine of its decode pool. A `Rejection` (no engine takes it
        now) leaves the request holding nothing; `migrate` may be called again. The client's
        timing (TTFT, admission) carries over."""
        books = self._requests[admission.request_id]
        for leg in books.legs:
            self._close_leg(admission, books, leg, now, None)
        self._unpin(admission, books)
        self._release(books)
        pool, left = admission.decode_pool, admission.placement.decode
        loads = [load for load in self.engines.loads(pool) if load.replica_id != left]
        placement = place_colocated(RouteRequest(prompt_tokens, max_tokens, {}), loads,
                                    self.model(pool), None, self.policy)
        if isinstance(placement, Rejection):
            return placement
        placement = dataclasses.replace(placement, reason="migrated")
        moved = dataclasses.replace(admission, placement=placement, prompt_tokens=prompt_tokens,
                                    max_tokens=max_tokens, hashes=(), prefill_pool=None)
        books.legs = {}
        books.placed = [(pool, placement.decode)]
        self.engines[pool, placement.decode].reserved += 1
        self._emit(Migrated(admission.request_id, pool, placement.decode))
        return moved

    def _release(self, books: _RequestBooks) -> None:
        for pool, rid in books.placed:
            record = self.engines.get(pool, rid)
            if record is not None:
                record.reserved = max(0, record.reserved - 1)
        books.placed = []

    def _close_leg(self, admission: Admission, books: _RequestBooks, leg: Leg, now: float,
                   finish_reason: str | None) -> None:
        leg_books = books.legs[leg]
        if not leg_books.open:
            return
        leg_books.open = False
        pool, rid = admission.engine_of(leg)
        record = self.engines.get(pool, rid)
        if leg_books.prefilling:  # ended before its first output
            self._prefill_done(pool, rid, leg_books, now, observe=False)
        if leg_books.decoding and record is not None:
            record.num_decoding = max(0, record.num_decoding - 1)
        leg_books.decoding = False
        if record is not None:
            record.in_flight = max(0, record.in_flight - 1)
        if leg is Leg.PREFILL and finish_reason != "length":
            self._unpin(admission, books)  # failed, aborted or stopped: nothing to pull
        self._emit(LegFinished(admission.request_id, leg, pool, rid, finish_reason))

    def decode_gap(self, pool: str, replica_id: str, seconds: float, tokens: int) -> None:
        """`tokens` new tokens came `seconds` after the previous ones on this engine."""
        record = self.engines.get(pool, replica_id)
        # Only gaps of decode-only steps: a prefill running on the same engine (colocated,
        # chunked prefill, local prefill) stretches a step by its own cost, which would make
        # the decode line look steeper than it is.
        if (record is not None and tokens > 0 and record.num_decoding > 0
                and record.num_prefilling == 0):
            self._pools[pool].fit.observe_decode(record.num_decoding, seconds / tokens)

    def _prefill_done(self, pool: str, rid: str, leg_books: _LegBooks, now: float,
                      observe: bool) -> None:
        leg_books.prefilling = False
        record = self.engines.get(pool, rid)
        if record is not None:
            record.queued_prefill_tokens = max(0, record.queued_prefill_tokens - leg_books.tokens)
            record.num_prefilling = max(0, record.num_prefilling - 1)
            if record.num_prefilling == 0:
                record.busy.stop(now, self.tracker.window_s)
        if observe:
            self._pools[pool].fit.observe_prefill(leg_books.work_ahead, now - leg_books.started)

    def _unpin(self, admission: Admission, books: _RequestBooks) -> None:
        if books.pinned:
            books.pinned = False
            record = self.engines.get(*admission.engine_of(Leg.PREFILL))
            if record is not None:
                record.pins = max(0, record.pins - 1)

    def _pools_of(self, placement: Placement) -> tuple[str | None, str]:
        """(the pool that prefills remotely, None for a local prefill; the pool that decodes)."""
        if not self._disaggregated:
            return None, COLOCATED
        return (PREFILL if placement.prefill is not None else None), DECODE

    def _placed(self, admission: Admission) -> list[tuple[str, str]]:
        placed = [(admission.decode_pool, admission.placement.decode)]
        if admission.prefill_pool is not None:
            placed.append(admission.engine_of(Leg.PREFILL))
        return placed

    def _hashes(self, prompt_token_ids: Sequence[int]) -> list[int]:
        if self._prefix is None:
            return []
        return block_hashes(prompt_token_ids, self._prefix.block_size)

    def _emit(self, event: LedgerEvent) -> None:
        if self._observer is not None:
            self._observer(event)

    # --- the fluid simulator's cohorts ------------------------------------------------------

    def resync(self, pool: str, replica_id: str, *, queued_prefill_tokens: float | None = None,
               num_decoding: float | None = None, kv_usage: float | None = None) -> None:
        """Replace one engine's books by an authoritative count (None: keep): the fluid
        simulator's engine groups, which advance cohorts of requests, not single ones."""
        record = self.engines[pool, replica_id]
        if queued_prefill_tokens is not None:
            record.queued_prefill_tokens = queued_prefill_tokens
        if num_decoding is not None:
            record.num_decoding = num_decoding
        if kv_usage is not None:
            record.kv_usage = kv_usage

    def admit_cohort(self, placement: Placement, prefill_tokens: float, decode_requests: float,
                     kv_usage: float) -> None:
        """Book a routed cohort's totals on its engines at once (the fluid simulator): prompt
        tokens on the engine that prefills it, requests and KV on the one that decodes it."""
        prefill_pool, decode_pool = self._pools_of(placement)
        prefill = self.engines[prefill_pool or decode_pool, placement.prefill or placement.decode]
        prefill.queued_prefill_tokens += prefill_tokens
        decode = self.engines[decode_pool, placement.decode]
        decode.num_decoding += decode_requests
        decode.kv_usage += kv_usage

    def observe_arrival(self, pool: str, now: float, prompt_tokens: int) -> None:
        self.tracker.record_arrival(pool, now, prompt_tokens)

    def observe_ttft(self, pool: str, now: float, ttft_s: float) -> None:
        self.tracker.record_ttft(pool, now, ttft_s)

    def observe_tpot(self, pool: str, now: float, tpot_s: float) -> None:
        self.tracker.record_tpot(pool, now, tpot_s)

    # --- scaling signals --------------------------------------------------------------------

    def signals(self, pool: str, now: float) -> PoolSignals:
        """What the autoscaling policy sees of one pool (draining engines excluded)."""
        engines = [e for e in self.engines.engines(pool) if not e.draining and e.healthy]
        n = len(engines)
        starting = sum(not e.ready for e in engines)
        slo = self.slo
        pct = slo.percentile if slo else 90.0
        late = []
        if slo is not None:
            late = [now - leg.started for books in self._requests.values()
                    for leg in books.legs.values()
                    if leg.prefilling and leg.pool == pool
                    and now - leg.started > slo.ttft_s]
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


def ledger_from_config(config: PdserveConfig, pools: list[str], block_size: int,
                       observer: Callable[[LedgerEvent], None] | None = None) -> RequestLedger:
    """The ledger a backend starts with: routing policy, SLO targets and prefix awareness from
    the config, the performance model from `seed_model`."""
    policy = RoutingPolicy(local_prefill_max_tokens=config.scheduler.local_prefill_max_tokens,
                           admit_ttft_factor=config.scheduler.admit_ttft_factor,
                           overflow_ttft_share=config.scheduler.overflow_ttft_share)
    return RequestLedger(pools, seed_model(config), SloTargets.from_config(config.slo), policy,
                         config.scheduler.window_s, config.scheduler.prefix_aware,
                         max(block_size, 1), observer)


def seed_model(config: PdserveConfig) -> PerfModel:
    """The performance model to start from: a profile, the mock's settings, or a guess."""
    if config.scheduler.profile is not None:
        return PerfModel.load(config.scheduler.profile)
    if config.engine.kind == "mock":
        m = config.engine.mock
        return PerfModel(prefill_tokens_per_s=m.prefill_tokens_per_s, decode_step_s=m.decode_step_s,
                         decode_step_per_seq_s=m.decode_step_per_seq_s,
                         kv_bytes_per_token=m.kv_bytes_per_token,
                         transfer_bytes_per_s=m.transfer_bytes_per_s)
    # No profile: a deliberately modest guess; the online fit replaces it within a few dozen
    # requests.
    return PerfModel(prefill_tokens_per_s=2000.0, decode_step_s=0.02, decode_step_per_seq_s=1e-4,
                     prefill_overhead_s=0.01, transfer_bytes_per_s=1e9)
