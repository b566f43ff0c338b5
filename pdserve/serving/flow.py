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
- a prefill engine that dies or fails the leg follows `kv.failure_policy`: `recompute` runs the
  request as a `FULL` leg on its decode engine, `fail` ends it with a clear error. A failed pull
  inside the decode engine follows the same policy in the connector.

Every step is booked in the ledger (`leg_started`, `leg_output`, `leg_finished`,
`request_finished`) with this module's one clock, and the ledger's timing of the finished
request is what the metrics observe. A backend supplies `channels`: how to reach an engine
(`EngineChannel`: a Ray actor, an engine object in this process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Protocol

from pdserve.engine.types import GenerateDelta, GenerateRequest, Leg
from pdserve.errors import EngineRequestError, EngineUnavailableError, OverloadedError
from pdserve.scheduler.ledger import Admission, RequestLedger
from pdserve.scheduler.routing import Rejection
from pdserve.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class EngineChannel(Protocol):
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Submit one leg to the engine and stream its deltas until one is finished. Closing
        the iterator before that aborts the leg in the engine. Raises `EngineRequestError` when
        the engine fails the leg or dies (and reports a death to the registry)."""
        ...


# (pool, replica id) -> the engine's channel; raises EngineUnavailableError for a gone engine.
ChannelLookup = Callable[[str, str], EngineChannel]


class RequestFlow:
    def __init__(self, ledger: RequestLedger, channels: ChannelLookup, failure_policy: str,
                 metrics: ServingMetrics, serving_pool: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ledger = ledger
        self._channels = channels
        self._failure_policy = failure_policy
        self._metrics = metrics
        self._serving_pool = serving_pool
        self._clock = clock

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

    async def run(self, request: GenerateRequest,
                  admission: Admission) -> AsyncIterator[GenerateDelta]:
        output_tokens, reason, finished_at = 0, "error", None
        try:
            async with aclosing(self._legs(request, admission)) as deltas:
                async for delta in deltas:
                    output_tokens = delta.num_output_tokens
                    if delta.finished:
                        reason, finished_at = delta.finish_reason, self._clock()
                    yield delta
        except (asyncio.CancelledError, GeneratorExit):
            reason = "client_disconnect"
            raise
        finally:
            self.finish(request, admission, finished_at, output_tokens, reason)

    def finish(self, request: GenerateRequest, admission: Admission, now: float | None,
               output_tokens: int, reason: str) -> None:
        """Close the request's books (at `now`; None: this flow's clock now) and observe it."""
        now = self._clock() if now is None else now
        timing = self._ledger.request_finished(admission, now, output_tokens, reason)
        self._metrics.observe_request(self._serving_pool, timing.ttft_s, timing.tpot_s,
                                      timing.e2e_s, len(request.prompt_token_ids), output_tokens,
                                      reason)

    async def _legs(self, request: GenerateRequest,
                    admission: Admission) -> AsyncIterator[GenerateDelta]:
        first = None
        if admission.first_leg is Leg.PREFILL:
            first = await self._prefill(request, admission)
        if first is None:  # a local placement, or a failed prefill recomputed where it decodes
            async with aclosing(self._leg(Leg.FULL, request, admission)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        # The first token can end the request: EOS or a stop string ("stop"), or a budget of one.
        ends_here = first.finish_reason == "stop" or request.sampling.max_tokens == 1
        yield _first_for_client(request, first, finished=ends_here)
        if ends_here:
            return
        async with aclosing(self._leg(Leg.DECODE, decode_request(request, first),
                                      admission)) as deltas:
            async for delta in deltas:
                if delta.finish_reason == "error":
                    # The connector's `fail` policy: the KV pull failed and nothing was recomputed.
                    raise EngineRequestError(
                        f"KV transfer for {request.request_id} from its prefill engine failed "
                        "(kv.failure_policy is 'fail')")
                yield delta  # the client's id and counts already (GenerateRequest.prior_output_tokens)

    async def _prefill(self, request: GenerateRequest,
                       admission: Admission) -> GenerateDelta | None:
        """The prefill leg's last delta (its first token), or None to recompute."""
        try:
            async with aclosing(self._leg(Leg.PREFILL, prefill_request(request),
                                          admission)) as stream:
                deltas = [d async for d in stream]
        except (EngineRequestError, EngineUnavailableError) as e:
            # A dead prefill engine, or none left in the pool: the decode engine can still serve.
            if self._failure_policy != "recompute":
                raise
            logger.warning("prefill of %s failed (%s); recomputing on the decode engine",
                           request.request_id, e)
            return None
        first = deltas[-1] if deltas else None
        if first is None or not first.token_ids or first.finish_reason == "abort":
            raise EngineRequestError(f"prefill of {request.request_id} produced no token")
        return first

    async def _leg(self, leg: Leg, request: GenerateRequest,
                   admission: Admission) -> AsyncIterator[GenerateDelta]:
        """Stream one leg from its engine, booking it in the ledger."""
        channel = self._channels(*admission.engine_of(leg))
        ledger, reason = self._ledger, None
        ledger.leg_started(admission, leg, self._clock())
        try:
            async with aclosing(channel.stream(request)) as deltas:
                async for delta in deltas:
                    ledger.leg_output(admission, leg, self._clock(), len(delta.token_ids),
                                      delta.finished)
                    if delta.finished:
                        reason = delta.finish_reason
                    yield delta
                    if delta.finished:
                        return
        finally:
            ledger.leg_finished(admission, leg, self._clock(), reason)


class AdmittedStream:
    """An async iterator over an admitted request that closes the request's books exactly once:
    through the flow when it ran, directly when it was closed or dropped before starting."""

    def __init__(self, flow: RequestFlow, request: GenerateRequest, admission: Admission) -> None:
        self._flow = flow
        self._request = request
        self._admission = admission
        self._stream: AsyncIterator[GenerateDelta] | None = None
        self._closed = False

    def __aiter__(self) -> AdmittedStream:
        return self

    async def __anext__(self) -> GenerateDelta:
        if self._stream is None:
            if self._closed:
                raise StopAsyncIteration
            self._stream = self._flow.run(self._request, self._admission)
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


def prefill_request(request: GenerateRequest) -> GenerateRequest:
    """The prefill leg: one token; keep the blocks for a decode leg if one will follow."""
    sampling = dataclasses.replace(request.sampling, max_tokens=1)
    decode_follows = request.sampling.max_tokens > 1
    return dataclasses.replace(
        request, request_id=f"{request.request_id}-p", sampling=sampling, leg=Leg.PREFILL,
        kv_transfer_params={"do_remote_decode": True} if decode_follows else None,
    )


def decode_request(request: GenerateRequest, first: GenerateDelta) -> GenerateRequest:
    """The decode leg, under the client's request id (it runs on another engine than the
    prefill leg): prompt + first token (already the client's output), the rest of the budget,
    and the prefill engine connector's transfer parameters (where the KV is)."""
    params = {k: v for k, v in (first.kv_transfer_params or {}).items() if k != "do_remote_decode"}
    params["do_remote_prefill"] = True
    sampling = dataclasses.replace(request.sampling, max_tokens=request.sampling.max_tokens - 1)
    return dataclasses.replace(
        request, prompt_token_ids=request.prompt_token_ids + first.token_ids, sampling=sampling,
        leg=Leg.DECODE, prior_output_tokens=request.prior_output_tokens + len(first.token_ids),
        kv_transfer_params=params,
    )


def _first_for_client(request: GenerateRequest, first: GenerateDelta,
                      finished: bool) -> GenerateDelta:
    reason = (first.finish_reason or "length") if finished else None
    return dataclasses.replace(
        first, request_id=request.request_id, finish_reason=reason, kv_transfer_params=None,
        num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1,
    )
