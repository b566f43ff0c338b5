"""The disaggregated request flow: prefill on one engine, decode on another.

For one request: the prefill engine runs the prompt with max_tokens=1 and keeps the prompt's KV
blocks; its first token goes to the client at once. The decode engine then gets prompt + first
token with the prefill side's transfer parameters; its KV connector pulls the blocks and it
continues from token 2 without recomputing the prompt. When the first token already ends the
request, nothing is left pinned: a stop (EOS or a stop string) makes the prefill engine's
connector free the blocks itself, and a request for one token is sent without asking the prefill
engine to keep its blocks at all.

Failures: a prefill engine that dies, or fails the request, is handled by the policy in
`kv.failure_policy`: `recompute` runs the whole request on the decode engine (it prefills
itself), `fail` ends the request with a clear error. Transfer failures inside the decode engine
follow the same policy in the connector.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from pdserve.engine.types import GenerateDelta, GenerateRequest
from pdserve.errors import EngineRequestError, EngineUnavailableError

logger = logging.getLogger(__name__)

# Streams one request from one engine (routing, abort-on-close and error mapping included).
EngineStream = Callable[[GenerateRequest], AsyncIterator[GenerateDelta]]


def prefill_request(request: GenerateRequest) -> GenerateRequest:
    """The prefill leg: one token; keep the blocks for a decode leg if one will follow."""
    sampling = dataclasses.replace(request.sampling, max_tokens=1)
    decode_follows = request.sampling.max_tokens > 1
    return dataclasses.replace(
        request, request_id=f"{request.request_id}-p", sampling=sampling,
        kv_transfer_params={"do_remote_decode": True} if decode_follows else None,
    )


def decode_request(request: GenerateRequest, first: GenerateDelta) -> GenerateRequest:
    """The decode leg: prompt + first token, the rest of the budget, and where the KV is."""
    params = {k: v for k, v in (first.kv_transfer_params or {}).items() if k != "do_remote_decode"}
    params["do_remote_prefill"] = True
    sampling = dataclasses.replace(request.sampling, max_tokens=request.sampling.max_tokens - 1)
    return dataclasses.replace(
        request, request_id=f"{request.request_id}-d",
        prompt_token_ids=request.prompt_token_ids + first.token_ids, sampling=sampling,
        kv_transfer_params=params,
    )


async def generate_disaggregated(
    request: GenerateRequest, prefill: EngineStream, decode: EngineStream, failure_policy: str,
) -> AsyncIterator[GenerateDelta]:
    first = await _run_prefill(request, prefill, failure_policy)
    if first is None:  # prefill failed and the policy says recompute: decode does it all
        async with aclosing(decode(request)) as deltas:
            async for delta in deltas:
                yield delta
        return
    # The first token can end the request: EOS or a stop string ("stop"), or a budget of one.
    ends_here = first.finish_reason == "stop" or request.sampling.max_tokens == 1
    yield _as_client_delta(request, first, finished=ends_here)
    if ends_here:
        return
    async with aclosing(decode(decode_request(request, first))) as deltas:
        async for delta in deltas:
            if delta.finish_reason == "error":
                # The connector's `fail` policy: the KV pull failed and nothing was recomputed.
                raise EngineRequestError(
                    f"KV transfer for {request.request_id} from its prefill engine failed "
                    "(kv.failure_policy is 'fail')")
            yield dataclasses.replace(
                delta, request_id=request.request_id,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=delta.num_output_tokens + 1,
            )


async def _run_prefill(request: GenerateRequest, prefill: EngineStream,
                       failure_policy: str) -> GenerateDelta | None:
    try:
        async with aclosing(prefill(prefill_request(request))) as stream:
            deltas = [d async for d in stream]
    except (EngineRequestError, EngineUnavailableError) as e:
        # A dead prefill engine, or none left in the pool: the decode engine can still serve.
        if failure_policy != "recompute":
            raise
        logger.warning("prefill of %s failed (%s); recomputing on the decode engine",
                       request.request_id, e)
        return None
    first = deltas[-1] if deltas else None
    if first is None or not first.token_ids or first.finish_reason == "abort":
        raise EngineRequestError(f"prefill of {request.request_id} produced no token")
    return first


def _as_client_delta(request: GenerateRequest, first: GenerateDelta, finished: bool) -> GenerateDelta:
    reason = (first.finish_reason or "length") if finished else None
    return dataclasses.replace(
        first, request_id=request.request_id, finish_reason=reason, kv_transfer_params=None,
        num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1,
    )
