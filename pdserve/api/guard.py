"""The HTTP guard: what every request passes before the app reads a byte of its body.

A pure ASGI middleware in front of the FastAPI app. It runs per request, before routing and
body parsing, so a client without a key cannot make the server parse anything:

- `/v1/...` needs `Authorization: Bearer <key>` when API keys are configured;
- `/metrics` needs its own key when one is configured; `/health` and `/ready` are always open;
- a body over `RequestLimits.max_body_bytes` gets 413: at once when its Content-Length says
  so, else as soon as the bytes read pass the limit (chunked uploads); a body not received
  within `RequestLimits.body_timeout_s` of its head gets 408. The guard reads the body (the app
  would read it whole anyway) and hands it on.

Refusals leave as OpenAI-style bodies (401 with `WWW-Authenticate: Bearer`, 408 and 413 closing
the connection); keys are never logged nor echoed. `AccessPolicy.check` is the decision, a
function of plain values.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.errors import OpenAIError, body_timeout, too_large, unauthorized

logger = logging.getLogger(__name__)

_MISSING_KEY = ("You didn't provide an API key. Send it in an Authorization header: "
                "'Authorization: Bearer YOUR_KEY'.")
_WRONG_KEY = "Incorrect API key provided."


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """Who may call what. No API key: the API is open (as without a guard)."""

    api_keys: tuple[str, ...] = ()
    metrics_api_key: str | None = None

    def check(self, path: str, authorization: bytes | None) -> OpenAIError | None:
        """None if a request for `path` with this Authorization header may go on, else the
        refusal to send."""
        if path == "/v1" or path.startswith("/v1/") or path in _KEYED_ROOT_PATHS:
            keys = self.api_keys
        elif path == "/metrics":
            keys = (self.metrics_api_key,) if self.metrics_api_key else ()
        else:
            return None
        if not keys:
            return None
        token = _bearer_token(authorization)
        if token is None:
            return unauthorized(_MISSING_KEY, None)
        if not _matches_any(token, keys):
            return unauthorized(_WRONG_KEY, "invalid_api_key")
        return None


# Routes outside /v1/ that need the API key as /v1/... does (vLLM leaves them open).
_KEYED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize"})


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may cost the server before the app sees it."""

    # 8 MiB: a full 128k-token context as text is ~0.5 MiB, as a JSON token-id list ~1 MiB.
    max_body_bytes: int = 8 * 1024**2
    body_timeout_s: float = 60.0


class HttpGuard:
    """ASGI middleware applying an `AccessPolicy` and `RequestLimits` to every HTTP request."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy, limits: RequestLimits,
                 on_refusal: Callable[[int], None] | None = None) -> None:
        self._app = app
        self._policy = policy
        self._limits = limits
        self._on_refusal = on_refusal or (lambda status: None)  # counts refusals by status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        refusal = self._policy.check(scope["path"], _header(scope, b"authorization"))
        if refusal is not None:
            # Who and what, never the key the client sent.
            logger.info("refused %s %s from %s: %s", scope["method"], scope["path"],
                        _client(scope), refusal.code or "missing_api_key")
            self._on_refusal(refusal.status)
            await refusal.response()(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if isinstance(body, OpenAIError):
            logger.info("refused %s %s from %s: %s", scope["method"], scope["path"],
                        _client(scope), body.code)
            self._on_refusal(body.status)
            await body.response()(scope, receive, send)
            return
        if body is None:
            return  # the client left while sending; nobody to answer
        await self._app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | OpenAIError | None:
        limit = self._limits.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return too_large(limit)
        try:
            async with asyncio.timeout(self._limits.body_timeout_s):
                return await self._read_within_limit(receive, limit)
        except TimeoutError:
            return body_timeout(self._limits.body_timeout_s)

    @staticmethod
    async def _read_within_limit(receive: Receive, limit: int) -> bytes | OpenAIError | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then whatever the server says next
    (a disconnect)."""
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _bearer_token(authorization: bytes | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


def _matches_any(token: bytes, keys: tuple[str, ...]) -> bool:
    # Every key is compared, each in constant time: how long the check takes says nothing
    # about which key (nor how much of one) the token matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key.encode())
    return matched


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"
