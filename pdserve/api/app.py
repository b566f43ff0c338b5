"""The OpenAI-compatible HTTP frontend (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET
/v1/models, POST /tokenize and POST /detokenize (vLLM's, `api/tokenization.py`), GET /health
(ready / degraded / down, per pool), GET /ready (for load balancers), GET /metrics. Every
error leaves as an OpenAI-style body with the right status; nothing a client sends can take the
server down. A client that goes away aborts its engine request: streams are cancelled by the
server when the connection drops, and non-streaming requests are watched for disconnects while
they run.

Every request first passes `api/guard.py` (API keys, body limit; /tokenize and /detokenize need
the key as /v1/... does). Lifecycle: `build_app()` wires a backend in; the app's lifespan runs
one background task that polls engine stats into the gauges, and cancels it on exit. The backend
itself is owned (and shut down) by whoever built it (`pdserve.service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.body import NOT_UNICODE, JsonBodyRoute
from pdserve.api.errors import OpenAIError, bad_request, internal, overloaded
from pdserve.api.guard import AccessPolicy, HttpGuard, RequestLimits
from pdserve.serving.metrics import ServingMetrics
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, FieldError
from pdserve.api.serving import OpenAIServing, PreparedRequest
from pdserve.api.tokenization import (
    DetokenizeRequest, Tokenization, TokenizeRequest,
)
from pdserve.serving.backend import STATS_INTERVAL_S, EngineBackend

logger = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


def build_app(backend: EngineBackend, tokenizer: Any, served_name: str,
              max_queued_requests: int = 1024, default_max_tokens: int | None = None,
              access: AccessPolicy | None = None,
              limits: RequestLimits | None = None,
              tool_call_parser: str | None = None) -> FastAPI:
    # The backend's metrics: its request flow observes each request as the ledger timed it.
    metrics = backend.metrics
    serving = OpenAIServing(backend, tokenizer, served_name, default_max_tokens,
                            tool_call_parser)
    tokenization = Tokenization(tokenizer, served_name, lambda: serving.max_model_len,
                                serving.tools)
    admission = _Admission(max_queued_requests)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.register_engines(backend.engine_infos())
        poller = asyncio.create_task(_poll_stats(backend, metrics))
        try:
            yield
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.router.route_class = JsonBodyRoute  # bodies parse with jiter (api/body.py)
    app.state.metrics = metrics
    _install_error_handlers(app, metrics)
    # Keys and the body limit are checked before routing and before any body is parsed.
    app.add_middleware(HttpGuard, policy=access or AccessPolicy(),
                       limits=limits or RequestLimits(),
                       on_refusal=lambda status: metrics.rejected.labels(str(status)).inc())

    async def admitted(prepare: Callable[[], Awaitable[PreparedRequest]],
                       request: Request) -> Response:
        release = admission.admit()
        try:
            prepared = await prepare()
            serving.start(prepared)  # placement: may refuse with 429 before any byte is sent
            await serving.validate(prepared)  # a refused grammar: 400 before any byte
        except BaseException:
            release()
            raise
        return await _respond(serving, prepared, request, release)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await admitted(lambda: serving.prepare_completion(body), request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await admitted(lambda: serving.prepare_chat(body), request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_name, "object": "model", "created": int(time.time()),
                "owned_by": "pdserve", "max_model_len": serving.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await tokenization.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        """Liveness and state: 200 'ready' or 'degraded' (with the reason), 503 'down'."""
        body = backend.health()
        return JSONResponse(body, status_code=503 if body["status"] == "down" else 200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness for a load balancer: 200 while requests are served and admitted, 503
        when down or shutting down."""
        body = backend.health()
        if getattr(app.state, "shutting_down", False):
            body = {**body, "status": "shutting_down"}
        ok = body["status"] in ("ready", "degraded")
        return JSONResponse({"status": body["status"]}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _Admission:
    """Bounded admission: past the limit, new requests get 429 instead of an unbounded queue."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._in_flight = 0

    def admit(self) -> Callable[[], None]:
        """Take a slot or raise 429; the returned callable gives it back (idempotent)."""
        if self._in_flight >= self._limit:
            raise overloaded(retry_after_s=1)
        self._in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight -= 1

        return release


async def _respond(serving: OpenAIServing, prepared: PreparedRequest, request: Request,
                   release: Callable[[], None]) -> Response:
    # Provenance headers (pdserve/serving/provenance.py): a stream's say where it was placed,
    # a whole response's also how its KV came and whether it migrated.
    if prepared.stream:
        return StreamingResponse(_released_after(serving.stream(prepared), release),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **prepared.headers()})
    try:
        response = await _complete_unless_disconnected(serving, prepared, request)
    finally:
        release()
    response.headers.update(prepared.headers())
    return response


async def _released_after(events: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    # Starlette cancels this stream when the client disconnects; the cancellation unwinds
    # into the backend, which aborts the engine request.
    try:
        async for event in events:
            yield event
    finally:
        release()
        await events.aclose()


async def _complete_unless_disconnected(serving: OpenAIServing, prepared: PreparedRequest,
                                        request: Request) -> Response:
    work = asyncio.ensure_future(serving.complete(prepared))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # client gone: unwinds into the backend, which aborts the request
        await asyncio.gather(watcher, return_exceptions=True)
    if work.cancelled():
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return JSONResponse(work.result())


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


async def _poll_stats(backend: EngineBackend, metrics: ServingMetrics) -> None:
    while True:
        try:
            metrics.update_engines(await backend.refresh_stats(), backend.pools)
        except Exception:
            logger.exception("engine stats poll failed")
        await asyncio.sleep(STATS_INTERVAL_S)


def _install_error_handlers(app: FastAPI, metrics: ServingMetrics) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        metrics.rejected.labels("400").inc()
        return _describe_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(str(exc.detail), exc.status_code, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # The traceback goes to the log under an id the client can quote; the body holds
        # nothing of the server's insides.
        error_id = uuid.uuid4().hex[:12]
        logger.exception("unhandled error %s while serving %s %s", error_id, request.method,
                         request.url.path)
        metrics.rejected.labels("500").inc()
        return internal(f"The server failed to handle the request (error id {error_id}).").response()


def _describe_validation(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        where = (first.get("ctx") or {}).get("error")  # the parser's words: what, at which line and column
        if where == NOT_UNICODE:
            return bad_request(NOT_UNICODE)
        return bad_request(f"The request body is not valid JSON: {where or first.get('msg')}")
    if first.get("type") == "model_attributes_type" or not loc and "dict" in first.get("msg", ""):
        return bad_request("The request body must be a JSON object.")
    param = ".".join(loc) or None
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a check across fields names the one to change
        param = ".".join([*loc, cause.param])
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = f"Missing required parameter: '{param}'."
    elif param:
        msg = f"Invalid value for '{param}': {msg}"
    return bad_request(msg, param)
