"""OpenAI-style errors for the HTTP layer.

Every failure a client can cause or see comes back as
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status, the shape the
official `openai` client parses into `BadRequestError`, `NotFoundError`, `RateLimitError`, ...
Streams that fail after their first byte yield the same object as an SSE event.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    """An error to return to the client, with its HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after_s:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param, code)


def unauthorized(message: str, code: str | None) -> OpenAIError:
    """401 as OpenAI answers a missing or wrong key (the key itself is never echoed)."""
    return OpenAIError(message, 401, "invalid_request_error", None, code,
                       headers={"WWW-Authenticate": "Bearer"})


def too_large(limit_bytes: int) -> OpenAIError:
    """413 before the body is parsed; the connection closes (the rest of the body is not read)."""
    return OpenAIError(f"The request body is larger than this server's limit of {limit_bytes} "
                       "bytes.", 413, "invalid_request_error", None, "request_too_large",
                       headers={"Connection": "close"})


def body_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(f"The request body did not arrive within {seconds:g} s.", 408,
                       "invalid_request_error", None, "request_timeout",
                       headers={"Connection": "close"})


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.", 404, "invalid_request_error", "model",
        "model_not_found",
    )


def overloaded(retry_after_s: int, detail: str | None = None) -> OpenAIError:
    message = "The server is at capacity; retry later."
    if detail:
        message = f"{message} ({detail})"
    return OpenAIError(
        message, 429, "rate_limit_exceeded", None,
        "rate_limit_exceeded", retry_after_s,
    )


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(message, 503, "service_unavailable", None, "service_unavailable")


def internal(message: str) -> OpenAIError:
    return OpenAIError(message, 500, "internal_error", None, "internal_error")
