"""The frontend end of one engine actor's requests and multiplexed outputs.

Lifecycle: each `Replica` owns one `EngineOutputs`. A request `open()`s its queue (which starts
the consumer task on first use), then `submit()`s, so no delta can arrive unrouted; its stream
reads the queue with `next()` and `close()`s it when done (`abort()` if it ends early). The
consumer task holds ONE connection to the actor and routes each batch of deltas to the
requests' queues; deltas of closed requests are dropped. That connection is the actor's request
plane (`pdserve.engine.request_plane`: a socket, authenticated with the cluster token) when the
actor advertises one and `open()` was given the token; otherwise, or when it cannot connect, a
Ray stream, `EngineActor.outputs(subscriber)`, with submits and aborts as actor calls. The
subscriber (`name@incarnation`, this process's: `frontend_subscriber`) is how an engine shared
by several frontends (ingress replicas) tells their requests apart. If the connection fails
(the actor died) or ends, every open request gets the failure at once and the next `open()`
starts a fresh consumer. `aclose()` cancels the consumer when the replica is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError

from pdserve.engine.request_plane import PlaneEndpoint, PlaneError, PlaneLink
from pdserve.engine.types import GenerateDelta, GenerateFailure, GenerateRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamLost:
    """The actor's output stream failed or ended: every open request on it is lost."""

    error: BaseException


RequestOutput = GenerateDelta | GenerateFailure | StreamLost

# How long a broken request-plane link waits for Ray to say whether its actor died (Ray
# reports a death within 5-15 ms; a live actor answers in ~1 ms).
_ACTOR_CHECK_S = 5.0

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


@dataclass(frozen=True, slots=True)
class PlaneAccess:
    """How to reach an engine's request plane: where it listens and the cluster token."""

    endpoint: PlaneEndpoint
    token: str


class EngineOutputs:
    """Routes one engine actor's outputs into per-request asyncio queues; sends its requests."""

    def __init__(self, replica_id: str, actor: Any, subscriber: str | None = None) -> None:
        self._replica_id = replica_id
        self._actor = actor  # ray.actor.ActorHandle, or any object with `outputs` (tests)
        self.subscriber = subscriber or frontend_subscriber()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._consumer: asyncio.Task[None] | None = None
        # The consumer's connection once it is set up: its request-plane link, or None (Ray).
        self._link: asyncio.Future[PlaneLink | None] | None = None
        self._plane_refused = False  # logged once: this engine's plane could not be reached

    def open(self, request_id: str, plane: PlaneAccess | None = None) -> None:
        """Register a request before it is submitted; called once per request leg. `plane`:
        connect through the engine's request plane (when a fresh consumer starts)."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already streaming from {self._replica_id}")
        self._queues[request_id] = asyncio.Queue()
        if self._consumer is None or self._consumer.done():
            loop = asyncio.get_running_loop()
            self._link = loop.create_future()
            self._consumer = loop.create_task(self._consume(self._link, plane))

    async def submit(self, request: GenerateRequest) -> None:
        """Start an `open()`ed request on the engine (through the consumer's connection)."""
        assert self._link is not None, "open() the request first"
        link = await asyncio.shield(self._link)
        if link is not None:
            await link.submit(request)
        else:
            await self._actor.submit.remote(request, self.subscriber)

    async def abort(self, request_id: str) -> None:
        """End a request early in the engine."""
        link = self._link.result() if self._link is not None and self._link.done() else None
        if link is not None:
            try:
                await link.abort(request_id)
                return
            except (OSError, PlaneError):
                pass  # the link broke; the engine aborts its requests itself, Ray says so too
        await self._actor.abort.remote(request_id)

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

    async def _consume(self, ready: asyncio.Future[PlaneLink | None],
                       plane: PlaneAccess | None) -> None:
        link = None
        try:
            link = await self._connect(plane)
            ready.set_result(link)
            if link is not None:
                batches = link.batches()
            else:
                batches = self._ray_batches()
            async for batch in batches:
                for output in batch:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            lost: BaseException = ConnectionError(f"engine {self._replica_id} closed its outputs")
        except asyncio.CancelledError as e:
            self._fail_all(e)
            raise
        except Exception as e:  # noqa: BLE001 - reported to every request instead
            lost = e
        finally:
            if not ready.done():
                ready.set_result(None)
            if link is not None:
                link.close()
        if link is not None:
            lost = await self._why_lost(lost)
        logger.warning("output stream of engine %s lost: %r", self._replica_id, lost)
        self._fail_all(lost)

    async def _connect(self, plane: PlaneAccess | None) -> PlaneLink | None:
        if plane is None:
            return None
        try:
            return await PlaneLink.connect(plane.endpoint, plane.token, self.subscriber)
        except (OSError, PlaneError, TimeoutError) as e:
            if not self._plane_refused:
                self._plane_refused = True
                logger.warning("engine %s: request plane at %s unreachable (%r); using Ray",
                               self._replica_id, plane.endpoint, e)
            return None

    async def _why_lost(self, lost: BaseException) -> BaseException:
        """A request-plane link ended: Ray's verdict on the actor (its `RayActorError` when it
        died, so the supervisor replaces it, as for a broken Ray stream), else `lost`."""
        try:
            await asyncio.wait_for(self._actor.__ray_ready__.remote(), _ACTOR_CHECK_S)
        except RayActorError as e:
            return e
        except Exception:  # noqa: BLE001 - alive but slow, or not a Ray actor (tests)
            pass
        return lost

    async def _ray_batches(self) -> AsyncIterator[list[RequestOutput]]:
        stream = self._actor.outputs.options(num_returns="streaming").remote(self.subscriber)
        async for ref in stream:
            yield await ref

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(StreamLost(error))
