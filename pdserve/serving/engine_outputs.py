"""The frontend end of one engine actor's multiplexed output stream.

Lifecycle: each `Replica` owns one `EngineOutputs`. A request `open()`s its queue (which starts
the consumer task on first use), then submits to the actor, so no delta can arrive unrouted;
its stream reads the queue with `next()` and `close()`s it when done. The consumer task holds
ONE Ray stream, `EngineActor.outputs(subscriber)`, and routes each batch of deltas to the
requests' queues; deltas of closed requests are dropped. The subscriber (`name@incarnation`,
this process's: `frontend_subscriber`) is how an engine shared by several frontends (ingress
replicas) tells their requests apart. If the stream fails (the actor died) or ends,
every open request gets the failure at once and the next `open()` starts a fresh consumer.
`aclose()` cancels the consumer when the replica is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.engine.types import GenerateDelta, GenerateFailure

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamLost:
    """The actor's output stream failed or ended: every open request on it is lost."""

    error: BaseException


RequestOutput = GenerateDelta | GenerateFailure | StreamLost

_subscriber = f"frontend-{os.getpid()}@{uuid.uuid4().hex[:12]}"


def frontend_subscriber() -> str:
    """This process's name as engines' output streams know it: `name@incarnation`."""
    return _subscriber


def name_frontend(name: str) -> str:
    """Name this process's frontend (an ingress replica: the same name after a restart, so
    engines abort what its previous incarnation left running); a fresh incarnation."""
    global _subscriber
    _subscriber = f"{name}@{uuid.uuid4().hex[:12]}"
    return _subscriber


class EngineOutputs:
    """Routes one engine actor's output stream into per-request asyncio queues."""

    def __init__(self, replica_id: str, actor: Any, subscriber: str | None = None) -> None:
        self._replica_id = replica_id
        self._actor = actor  # ray.actor.ActorHandle, or any object with `outputs` (tests)
        self.subscriber = subscriber or frontend_subscriber()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._consumer: asyncio.Task[None] | None = None

    def open(self, request_id: str) -> None:
        """Register a request before it is submitted; called once per request leg."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already streaming from {self._replica_id}")
        self._queues[request_id] = asyncio.Queue()
        if self._consumer is None or self._consumer.done():
            self._consumer = asyncio.get_running_loop().create_task(self._consume())

    async def next(self, request_id: str) -> RequestOutput:
        """The request's next delta, its engine failure, or the loss of the whole stream."""
        return await self._queues[request_id].get()

    def close(self, request_id: str) -> None:
        """The request's stream is done (finished, failed or abandoned): drop what follows."""
        self._queues.pop(request_id, None)

    @property
    def open_requests(self) -> int:
        return len(self._queues)

    async def aclose(self) -> None:
        """Stop consuming (the replica is being stopped); open requests get `StreamLost`."""
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)

    async def _consume(self) -> None:
        try:
            stream = self._actor.outputs.options(num_returns="streaming").remote(self.subscriber)
            async for ref in stream:
                for output in await ref:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            lost: BaseException = ConnectionError(f"engine {self._replica_id} closed its outputs")
        except asyncio.CancelledError as e:
            self._fail_all(e)
            raise
        except Exception as e:  # noqa: BLE001 - reported to every request instead
            lost = e
        logger.warning("output stream of engine %s lost: %r", self._replica_id, lost)
        self._fail_all(lost)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(StreamLost(error))
