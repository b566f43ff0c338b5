"""Per-connection deadlines uvicorn does not have, on its HTTP protocol.

uvicorn (0.30 to 0.54) gives an idle keep-alive connection `timeout_keep_alive`, but nothing
bounds a client that opens a connection and sends half a request head (slowloris), nor one
that stops reading a response: its writes wait on the transport's flow control for ever and
the request keeps its admission slot; with httptools nothing bounds a request head's size
either. `deadline_protocol` subclasses uvicorn's HTTP protocol (httptools where installed, else
h11: the class `http="auto"` picks) with two timers and a size bound:

- head: armed when a connection opens, and when the first bytes of a further request arrive on
  a kept-alive one; disarmed once the head is parsed (uvicorn then starts a request cycle).
  On expiry the client gets a 408 and the connection closes. A head still unparsed after
  `max_head_bytes` gets a 431 and the connection closes.
- bytes that are not HTTP get uvicorn's 400, with an OpenAI-style body.
- write: armed when the transport pauses writing (its buffer passed the high-water mark because
  the client stopped reading); disarmed when it resumes. On expiry the connection is aborted,
  which the app sees as a disconnect: a stream is cancelled, its engine request aborted and its
  admission slot released.

Reading the body is bounded in `api/guard.py` (the app is reading it by then).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from pdserve.api.errors import OpenAIError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionDeadlines:
    """The bounds each connection's protocol enforces (from `api.*` in the config)."""

    head_timeout_s: float
    write_timeout_s: float
    # 64 KiB: common servers and proxies refuse heads past 8-16 KiB (h11's own bound is 16 KiB);
    # room for long cookies or tracing headers a gateway adds.
    max_head_bytes: int = 64 * 1024


def _raw_error(status_line: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response, for answers the protocol gives before any app runs."""
    body = json.dumps(OpenAIError(message, int(status_line.split()[0]), "invalid_request_error",
                                  None, code).body()).encode()
    head = (f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


def deadline_protocol(deadlines: ConnectionDeadlines) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the head and write deadlines (pass as `http=`)."""
    timeout_response = _raw_error(
        "408 Request Timeout",
        f"The request head did not arrive within {deadlines.head_timeout_s:g} s.", "request_timeout")
    too_large_response = _raw_error(
        "431 Request Header Fields Too Large",
        f"The request head is larger than this server's limit of {deadlines.max_head_bytes} bytes.",
        "request_header_fields_too_large")

    class DeadlineHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            self._head_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            self._cycle_before_head: Any = None
            self._head_bytes = 0
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()  # a further request on a kept-alive connection begins
            super().data_received(data)
            if self._head_timer is None:
                return
            if self.cycle is not self._cycle_before_head:
                self._cancel_head_timer()  # the head is parsed: a new request cycle began
                return
            self._head_bytes += len(data)
            if self._head_bytes > deadlines.max_head_bytes and not self.transport.is_closing():
                self._cancel_head_timer()
                logger.info("closing the connection from %s: request head over %d bytes",
                            _peer(self.client), deadlines.max_head_bytes)
                self.transport.write(too_large_response)
                self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(deadlines.write_timeout_s,
                                                         self._on_write_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to bytes it cannot parse as HTTP: an OpenAI-style body like every
            # other refusal, instead of its text/plain one.
            self._cancel_head_timer()
            self.transport.write(_raw_error("400 Bad Request", msg, "invalid_http_request"))
            self.transport.close()

        def _arm_head_timer(self) -> None:
            self._cycle_before_head = self.cycle
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(deadlines.head_timeout_s, self._on_head_late)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _on_head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            logger.info("closing the connection from %s: no request head within %g s",
                        _peer(self.client), deadlines.head_timeout_s)
            self.transport.write(timeout_response)
            self.transport.close()

        def _on_write_stalled(self) -> None:
            self._write_timer = None
            if self.transport.is_closing():
                return
            logger.warning("aborting the connection from %s: the client read nothing for %g s",
                           _peer(self.client), deadlines.write_timeout_s)
            # abort, not close: close would wait for the client to read the buffer first.
            self.transport.abort()

    return DeadlineHTTPProtocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
