"""The HTTP server that serves the app: uvicorn with pdserve's stop (`DrainingServer`) and
connection deadlines (`uvicorn_config`), and the model's tokenizer the app loads. Used by
`pdserve serve` in one process (`service.py`) and by each ingress replica
(`ingress.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from pdserve.api.connections import ConnectionDeadlines, deadline_protocol
from pdserve.config.schema import PdserveConfig

logger = logging.getLogger("pdserve")


# How long the requests cancelled at the grace's end get to abort their engine legs (an actor
# call each, milliseconds) before the engines go.
_CANCELLED_WAIT_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with pdserve's stop. The first SIGTERM or SIGINT drains: the app's
    `state.shutting_down` is set (readiness answers 503), uvicorn stops accepting connections,
    closes idle kept-alive ones, lets running requests and streams finish (closing each
    connection after its response) for up to `timeout_graceful_shutdown` (api.shutdown_grace_s),
    then cancels the rest, which aborts their engine requests. A second SIGINT stops waiting.
    Unlike uvicorn's own server it does not raise the signal again once it has stopped: `serve`
    then releases engines and Ray, and the process exits 0."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.shutting_down = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; whoever runs this thread stops it
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        logger.info("draining: %d request(s) in flight may finish within %g s "
                    "(api.shutdown_grace_s); new connections are refused",
                    len(self.server_state.tasks), self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
        # uvicorn cancels the requests that outlived the grace (after a second Ctrl-C it leaves
        # them running) and does not wait for them: here they abort their engine legs and close
        # their books while the engines still exist.
        running = list(self.server_state.tasks)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=_CANCELLED_WAIT_S)
        if self.force_exit:
            # uvicorn skips the app's shutdown then; its stats poller would go on calling the
            # engines after Ray is shut down, and Ray would start a new instance for the call.
            await self.lifespan.shutdown()


def uvicorn_config(app: Any, config: PdserveConfig) -> uvicorn.Config:
    api = config.api
    deadlines = ConnectionDeadlines(api.header_timeout_s, api.write_timeout_s,
                                    api.max_header_bytes)
    return uvicorn.Config(
        app, host=api.host, port=api.port, log_level=api.log_level, loop="none",
        lifespan="on", timeout_graceful_shutdown=api.shutdown_grace_s,
        timeout_keep_alive=api.keep_alive_s,
        http=deadline_protocol(deadlines), limit_concurrency=api.max_connections,
        h11_max_incomplete_event_size=api.max_header_bytes,
        ssl_certfile=api.ssl_certfile, ssl_keyfile=api.ssl_keyfile)


def load_tokenizer(path: str, config: PdserveConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
