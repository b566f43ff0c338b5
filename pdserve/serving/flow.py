"""A request's way through the engines, top to bottom, whichever backend reaches them.

`RequestFlow.admit` places a request with the request ledger (raising `OverloadedError` /
`EngineUnavailableError` before any response starts); `RequestFlow.run` streams it:

- a local placement (colocated, or a prompt prefilled on its decode engine) is one `FULL` leg;
- a remote one is a `PREFILL` leg on the prefill engine (max_tokens=1; the engine keeps the
  prompt's KV for the decode leg when more tokens follow), whose first token goes to the client
  at once, then a `DECODE` leg on the decode engine: prompt + first token, the rest of the
  budget, and where the KV is; its KV connector pulls the blocks and it continues from token 2;
- when the first token already ends the request (EOS, a stop string, a budget of one) there is
  no decode leg, and nothing stays pinned;
- a prefill engine that dies follows `kv.failure_policy`: `recompute` runs the request as a
  `FULL` leg on its decode engine, `fail` ends it with a clear error. A failed pull inside the
  decode engine follows the same policy in the connector. A leg the engine failed for the
  request's own sake (`EngineRequestError`, not `EngineDiedError`) is never run again elsewhere;
- a decode (or colocated) engine that dies mid-stream: the request migrates, up to
  `migration_limit` times, to another engine of its pool (waiting for a replacement while one
  is starting), which continues it from the prompt and the tokens the client already has;
  the client's stream goes on without a token missing or repeated. When no engine is left to
  continue it, it ends with `EngineDiedError`;
- a decode leg that never pulled its KV (the engine died, the client left) releases the prefill
  engine's pin at once rather than at the lease's end.

How a leg continues output the client already has: a migrated request's new engine replays it
as forced outputs (`replay_output_tokens`, one step each, as a colocated engine computed them),
and the flow drops the replayed part of the leg's deltas; the decode leg continues after token 1
as prompt (`decode_request` says how penalties, stop strings and seeds still come out as on one
engine). The leg requests and the delta rewrites live in `continuation.py`.

Every step is booked in the ledger (`leg_started`, `leg_output`, `leg_finished`,
`request_finished`) with this module's one clock, and the ledger's timing of the finished
request is what the metrics observe. A backend supplies `channels`: how to reach an engine
(`EngineChannel`: a Ray actor, an engine object in this process).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.types import GenerateDelta, GenerateRequest, Leg
from pdserve.errors import (
    EngineDiedError, EngineRequestError, EngineUnavailableError, OverloadedError,
    RequestDeadlineError,
)
from pdserve.scheduler.ledger import Admission, RequestLedger
from pdserve.scheduler.routing import Rejection
from pdserve.serving.continuation import (
    Replayed, Sent, StopStrings, continuation_request, decode_request, first_for_client,
    held_back, merged, prefill_request,
)
from pdserve.serving.metrics import ServingMetrics
from pdserve.serving.provenance import Provenance

logger = logging.getLogger(__name__)


class EngineChannel(Protocol):
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Submit one leg to the engine and stream its deltas until one is finished. Closing
        the iterator before that aborts the leg in the engine. Raises `EngineRequestError` when
        the engine fails the leg for the request's sake, `EngineDiedError` when it dies."""
        ...

    async def release_kv(self, kv_transfer_params: dict) -> None:
        """A prefill engine: end the pin of the request these parameters name (its decode leg
        will never pull it). Best effort: the lease frees it anyway."""
        ...

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        """A prefill engine: restart the lease of that pin (its decode leg still waits)."""
        ...


# (pool, replica id) -> the engine's channel; raises EngineUnavailableError for a gone engine.
ChannelLookup = Callable[[str, str], EngineChannel]
# pool -> whether an engine of it is starting (or about to be): a migration waits for it.
CapacityComing = Callable[[str], bool]

# How often a migration that found no engine looks again while a replacement starts.
_MIGRATION_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class FlowOptions:
    failure_policy: str = "recompute"  # kv.failure_policy
    migration_limit: int = 3  # serving.migration_limit
    migration_wait_s: float = 900.0  # longest a migration waits for an engine to start
    request_timeout_s: float | None = None  # api.request_timeout_s
    # kv.lease_s: a decode leg that waits for its engine renews its prefill pin every third of
    # it, so a backed-up decode pool does not let leases expire into recomputes. None: never.
    kv_lease_s: float | None = None


class RequestFlow:
    def __init__(self, ledger: RequestLedger, channels: ChannelLookup,
                 options: FlowOptions, metrics: ServingMetrics, serving_pool: str,
                 clock: Callable[[], float] = time.monotonic,
                 capacity_coming: CapacityComing = lambda pool: False) -> None:
        self._ledger = ledger
        self._channels = channels
        self._options = options
        self._metrics = metrics
        self._serving_pool = serving_pool
        self._clock = clock
        self._capacity_coming = capacity_coming

    def admit(self, request: GenerateRequest) -> Admission:
        admission = self._ledger.admit(request.request_id, request.prompt_token_ids,
                                       request.sampling.max_tokens, self._clock())
        if isinstance(admission, Rejection):
            if admission.reason == "no_engine":
                raise EngineUnavailableError(
                    f"no engine can take requests in pool {self._serving_pool!r}")
            raise OverloadedError(admission.retry_after_s, admission.reason,
                                  admission.predicted_ttft_s)
        placement = admission.placement
        logger.debug("placed %s: %s", request.request_id, placement)
        self._metrics.predicted_ttft.labels(admission.ttft_pool).observe(placement.predicted_ttft_s)
        self._metrics.predicted_tpot.labels(admission.decode_pool).observe(
            placement.predicted_tpot_s)
        return admission

    def stream(self, request: GenerateRequest, admission: Admission) -> AdmittedStream:
        """The admitted request's deltas; its books close exactly once, even if the stream is
        dropped before it starts."""
        return AdmittedStream(self, request, admission)

    async def run(self, request: GenerateRequest, admission: Admission,
                  provenance: Provenance | None = None) -> AsyncIterator[GenerateDelta]:
        state = _Running(admission, provenance or Provenance.placed(request.request_id,
                                                                    admission.placement))
        timeout = self._options.request_timeout_s
        state.deadline = None if timeout is None else admission.admitted_at + timeout
        output_tokens, reason, finished_at = 0, "error", None
        try:
            async with aclosing(self._legs(request, state)) as deltas:
                async for delta in deltas:
                    output_tokens = delta.num_output_tokens
                    if delta.finished:
                        reason, finished_at = delta.finish_reason, self._clock()
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):
            reason = "client_disconnect"
            raise
        except RequestDeadlineError:
            reason = "timeout"
            raise
        finally:
            self.finish(request, state.admission, finished_at, output_tokens, reason)
            state.provenance.log(reason)

    def finish(self, request: GenerateRequest, admission: Admission, now: float | None,
               output_tokens: int, reason: str) -> None:
        """Close the request's books (at `now`; None: this flow's clock now) and observe it."""
        now = self._clock() if now is None else now
        timing = self._ledger.request_finished(admission, now, output_tokens, reason)
        self._metrics.observe_request(self._serving_pool, timing.ttft_s, timing.tpot_s,
                                      timing.e2e_s, len(request.prompt_token_ids), output_tokens,
                                      reason)

    async def _legs(self, request: GenerateRequest,
                    state: _Running) -> AsyncIterator[GenerateDelta]:
        try:
            async with aclosing(self._continued(request, state)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            # A decode leg that never pulled (it failed, the client left between the legs, the
            # deadline passed): the prefill engine's pin goes now, not at the lease's end.
            self._release_prefill_kv(state)

    async def _continued(self, request: GenerateRequest,
                         state: _Running) -> AsyncIterator[GenerateDelta]:
        sent = Sent()  # what the client has
        first = stops = None
        if state.admission.first_leg is Leg.PREFILL:
            first = await self._prefill(request, state)
        if first is None:  # a local placement, or a failed prefill recomputed where it decodes
            state.provenance.prefill_failed = state.admission.first_leg is Leg.PREFILL
            leg, leg_request = Leg.FULL, request
        else:
            # The first token can end the request: EOS or a stop string ("stop"), or a budget
            # of one.
            ends_here = first.finish_reason == "stop" or request.sampling.max_tokens == 1
            state.provenance.first_token_only = ends_here
            if not ends_here:
                state.prefill_params = first.kv_transfer_params
                state.prefill_engine = state.admission.engine_of(Leg.PREFILL)
            out = first_for_client(request, first, finished=ends_here)
            if not ends_here:
                out = held_back(out, request.sampling)
            sent.add(out)
            yield out
            if ends_here:
                return
            leg, leg_request = Leg.DECODE, decode_request(request, first)
            if not leg_request.replay_output_tokens and request.sampling.stop:
                # Token 1 is prompt to the decode engine: the stop strings are checked here.
                stops = StopStrings(first.text, len(out.text), request.sampling)
        migrations = 0
        while True:
            replayed = Replayed(leg_request, sent)
            renewal = self._keep_pinned(state) if leg is Leg.DECODE else None
            try:
                async with aclosing(self._leg(leg, leg_request, state)) as deltas:
                    async for delta in deltas:
                        if leg is Leg.DECODE and delta.finish_reason == "error":
                            # The connector's `fail` policy: the KV pull failed, nothing was
                            # recomputed.
                            raise EngineRequestError(
                                f"KV transfer for {request.request_id} from its prefill engine "
                                "failed (kv.failure_policy is 'fail')")
                        if delta.kv_pull is not None:
                            state.provenance.pull = delta.kv_pull
                        if leg is Leg.DECODE and delta.token_ids:
                            state.pulled = True
                        out = replayed.new_part(delta)
                        if out is None:
                            continue
                        if leg is Leg.DECODE and stops is not None:
                            out = stops.feed(out)
                        sent.add(out)
                        yield out
                        if out.finished:
                            return  # a stop found here ends the leg early (closing aborts it)
                return
            except EngineDiedError as e:
                _stop(renewal)
                self._release_prefill_kv(state)
                if migrations >= self._options.migration_limit:
                    raise
                migrations += 1
                logger.warning("request %s: its engine %s died after %d tokens (%s); migrating",
                               request.request_id, state.admission.placement.decode,
                               len(sent.tokens), e)
                await self._migrate(request, state, sent)
                leg = Leg.FULL
                leg_request = continuation_request(request, sent, migrations)
            finally:
                _stop(renewal)

    async def _prefill(self, request: GenerateRequest, state: _Running) -> GenerateDelta | None:
        """The prefill leg's last delta (its first token), or None to recompute."""
        try:
            async with aclosing(self._leg(Leg.PREFILL, prefill_request(request),
                                          state)) as stream:
                deltas = [d async for d in stream]
        except (EngineDiedError, EngineUnavailableError) as e:
            # A dead prefill engine, or none left in the pool: the decode engine can still
            # serve. An error the request caused on its prefill engine is not retried.
            if self._options.failure_policy != "recompute":
                raise
            logger.warning("prefill of %s failed (%s); recomputing on the decode engine",
                           request.request_id, e)
            return None
        first = merged(deltas)
        if first is None or not first.token_ids or first.finish_reason == "abort":
            raise EngineRequestError(f"prefill of {request.request_id} produced no token")
        return first

    async def _leg(self, leg: Leg, request: GenerateRequest,
                   state: _Running) -> AsyncIterator[GenerateDelta]:
        """Stream one leg from its engine, booking it in the ledger."""
        admission = state.admission
        pool, replica_id = admission.engine_of(leg)
        try:
            if self._ledger.engines.get(pool, replica_id) is None:
                raise EngineUnavailableError(f"engine {replica_id} is gone")
            channel = self._channels(pool, replica_id)
        except EngineUnavailableError as e:  # it died (and was replaced) since the placement
            raise EngineDiedError(str(e)) from None
        ledger, reason = self._ledger, None
        ledger.leg_started(admission, leg, self._clock())
        try:
            async with aclosing(channel.stream(request)) as deltas:
                while True:
                    delta = await self._next(deltas, state, request)
                    if delta is None:
                        return
                    ledger.leg_output(admission, leg, self._clock(), len(delta.token_ids),
                                      delta.finished)
                    if delta.finished:
                        reason = delta.finish_reason
                    yield delta
                    if delta.finished:
                        return
        finally:
            ledger.leg_finished(admission, leg, self._clock(), reason)

    async def _next(self, deltas: AsyncIterator[GenerateDelta], state: _Running,
                    request: GenerateRequest) -> GenerateDelta | None:
        """The leg's next delta (None at its end), within the request's deadline."""
        if state.deadline is None:
            return await anext(deltas, None)
        left = state.deadline - self._clock()
        try:
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(anext(deltas, None), left)
        except TimeoutError:
            raise RequestDeadlineError(
                f"request {request.request_id} ran past its deadline "
                f"({self._options.request_timeout_s:g} s)") from None

    async def _migrate(self, request: GenerateRequest, state: _Running, sent: Sent) -> None:
        """Place the request's continuation on a live engine of its pool, waiting while one
        is starting; raise `EngineDiedError` when none can take it."""
        pool = state.admission.decode_pool
        waited_until = self._clock() + self._options.migration_wait_s
        if state.deadline is not None:
            waited_until = min(waited_until, state.deadline)
        prompt = len(request.prompt_token_ids) + len(sent.tokens)
        left = request.sampling.max_tokens - len(sent.tokens)
        while True:
            moved = self._ledger.migrate(state.admission, self._clock(), prompt, left)
            if isinstance(moved, Admission):
                state.admission = moved
                state.provenance.decode = moved.placement.decode
                state.provenance.migrations.append(moved.placement.decode)
                self._metrics.migrated.labels(pool).inc()
                logger.info("request %s continues on %s", request.request_id,
                            moved.placement.decode)
                return
            if not self._capacity_coming(pool) and moved.reason == "no_engine":
                raise EngineDiedError(f"no live engine in pool {pool!r} can continue request "
                                      f"{request.request_id}")
            if self._clock() >= waited_until:
                raise EngineDiedError(f"no engine in pool {pool!r} could take request "
                                      f"{request.request_id} in time to continue it")
            await asyncio.sleep(_MIGRATION_POLL_S)

    def _keep_pinned(self, state: _Running) -> asyncio.Task[None] | None:
        """While the decode leg has not pulled, renew its prefill pin's lease (a third of it
        at a time): the leg may wait behind a full decode batch for longer than the lease."""
        lease = self._options.kv_lease_s
        if lease is None or state.prefill_params is None or state.prefill_engine is None:
            return None
        return asyncio.get_running_loop().create_task(self._renew(state, lease / 3))

    async def _renew(self, state: _Running, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            params, engine = state.prefill_params, state.prefill_engine
            if state.pulled or params is None or engine is None:
                return
            try:
                await self._channels(*engine).renew_kv(params)
            except Exception as e:  # noqa: BLE001 - the lease may still hold; the pull decides
                logger.warning("could not renew a prefill engine's KV lease: %r", e)

    def _release_prefill_kv(self, state: _Running) -> None:
        """Free the prefill engine's pin of a decode leg that did not pull it, once, without
        waiting (the request may be unwinding from a cancellation)."""
        params, state.prefill_params = state.prefill_params, None
        if params is None or state.pulled or state.prefill_engine is None:
            return
        try:
            channel = self._channels(*state.prefill_engine)
        except EngineUnavailableError:
            return  # the engine is gone, and its KV with it
        task = asyncio.get_running_loop().create_task(channel.release_kv(params))
        _releases.add(task)
        task.add_done_callback(_released)


def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


# Releases in flight (a task nobody awaits must be referenced until it ends).
_releases: set[asyncio.Task[None]] = set()


def _released(task: asyncio.Task[None]) -> None:
    _releases.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("could not release a prefill engine's KV (its lease frees it): %r",
                       task.exception())


@dataclass(slots=True)
class _Running:
    """One request's state across its legs."""

    admission: Admission  # replaced when the request migrates
    provenance: Provenance
    deadline: float | None = None
    prefill_params: dict | None = None  # the prefill engine's transfer parameters
    prefill_engine: tuple[str, str] | None = None  # (pool, replica id) of the prefill leg
    pulled: bool = False  # the decode leg produced output: its KV pull is over


class AdmittedStream:
    """An async iterator over an admitted request that closes the request's books exactly once:
    through the flow when it ran, directly when it was closed or dropped before starting."""

    def __init__(self, flow: RequestFlow, request: GenerateRequest, admission: Admission) -> None:
        self._flow = flow
        self._request = request
        self._admission = admission
        self._stream: AsyncIterator[GenerateDelta] | None = None
        self._closed = False
        # Filled in as the request runs (headers, the log line).
        self.provenance = Provenance.placed(request.request_id, admission.placement)

    def __aiter__(self) -> AdmittedStream:
        return self

    @property
    def engines(self) -> dict[str, str]:
        """Where the request was placed: {'prefill': replica id (a remote prefill only),
        'decode': replica id} (response headers, for operators and tests)."""
        placement = self._admission.placement
        engines = {"decode": placement.decode}
        if placement.prefill is not None:
            engines["prefill"] = placement.prefill
        return engines

    async def __anext__(self) -> GenerateDelta:
        if self._stream is None:
            if self._closed:
                raise StopAsyncIteration
            self._stream = self._flow.run(self._request, self._admission, self.provenance)
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
        else:
            self._unstarted()

    def _unstarted(self) -> None:
        if not self._closed and self._stream is None:
            self._closed = True
            self._flow.finish(self._request, self._admission, None, 0, "client_disconnect")

    def __del__(self) -> None:
        self._unstarted()
