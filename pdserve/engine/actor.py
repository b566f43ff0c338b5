"""The Ray actor that hosts one engine.

Lifecycle: the driver creates the actor (cheap), then awaits `start()`, which builds the engine
off the actor's event loop (a vLLM engine takes 20-75 s to start) and returns its `EngineInfo`,
which advertises the actor's request plane (`request_plane.py`): a socket that carries a
frontend's submits and aborts in and its outputs back without Ray's per-call cost. Through Ray
the same goes in through `submit()`, which returns once the request runs, and the deltas come
back multiplexed on ONE long-lived Ray stream per frontend, `outputs()`, each item a list of
every delta (or `GenerateFailure`) ready since the previous item. One stream (or link) per
engine and frontend instead of one per request: at thousands of tokens/s a Ray object per token
per request saturated the frontend's event loop (benchmarks/frontend_stream.py). A frontend names itself
as `name@incarnation` (its subscriber): several frontends (ingress replicas) share an engine,
each reading its own requests' deltas; a restarted frontend (same name, new incarnation)
subscribing aborts what its dead predecessor left running here. `abort()` ends a request
early; `stats()` is polled by the frontend (and says when the engine is dead); `release_kv()`
frees a prefill's KV that no decode leg will pull; `shutdown()` runs last.
The engine is built by its kind in the config (`engine.kind`, registry.py), so tests and
benchmarks run the mock engine without touching serving code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator

from pdserve.engine.protocol import Engine
from pdserve.engine.registry import build_engine
from pdserve.engine.request_plane import EngineOutput, PlaneServer, output_batches
from pdserve.engine.spec import EngineSpec
from pdserve.engine.step_trace import RequestTraceWriter
from pdserve.engine.types import (
    EngineInfo, EngineStats, GenerateDelta, GenerateFailure, GenerateRequest,
)

__all__ = ["EngineActor", "EngineOutput", "EngineSpec"]

# Early aborts remembered (ids of requests that finished before their abort land here too).
_ABORTED_EARLY_KEPT = 4096
# EngineStats' samples that no frontend owns: each goes to the first frontend that asks.
_POOLED_SAMPLES = ("kv_transfer_seconds", "vllm_ttft_seconds", "queue_seconds", "prefill_seconds")

logger = logging.getLogger(__name__)


class EngineActor:
    """Hosts one engine; all methods run on the actor's event loop (an async actor)."""

    def __init__(self, spec: EngineSpec) -> None:
        logging.basicConfig(level=spec.config.api.log_level.upper())
        self._spec = spec
        self._engine: Engine = build_engine(spec)
        self._info: EngineInfo | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        # Per frontend name: its current subscriber (name@incarnation) and output queue; and
        # which subscriber submitted each running request.
        self._streams: dict[str, _Stream] = {}
        self._owners: dict[str, str] = {}
        # Aborts that arrived before their request's submit (an async actor may run a caller's
        # calls out of order): the late submit is dropped instead of running unobserved.
        self._aborted_early: OrderedDict[str, None] = OrderedDict()
        # Arrival -> first output of each request, drained by `stats()`: the engine's share of
        # TTFT, to set beside the frontend's (the rest is Ray, the frontend and the network).
        # per frontend name (the subscriber that submitted the request), so that each frontend
        # counts its own requests' samples once, whoever else polls `stats()`.
        self._first_output_s: dict[str, deque[float]] = {}
        # What the engine reported and no frontend has taken yet (`stats()`): KV pull durations
        # and vLLM's own per-request timings (EngineStats fields).
        self._samples: dict[str, deque[float]] = {key: deque(maxlen=4096) for key in _POOLED_SAMPLES}
        # With step tracing on, the same two times per request beside the engine's step trace.
        trace_dir = spec.config.engine.step_trace_dir
        self._requests = RequestTraceWriter(trace_dir, spec.replica_id) if trace_dir else None
        self._plane: PlaneServer | None = None  # the request plane, once started

    async def start(self) -> EngineInfo:
        """Build the engine; called once by the driver, may take minutes."""
        if self._info is None:
            logger.info("starting engine %s (pid %d)", self._spec.replica_id, os.getpid())
            info = await self._engine.start()
            info = dataclasses.replace(info, pid=os.getpid(), node_ip=_node_ip())
            self._info = await self._open_plane(info)
        return self._info

    async def _open_plane(self, info: EngineInfo) -> EngineInfo:
        """Open the request plane (unless configured off) and advertise it in the info."""
        token = self._spec.config.kv.cluster_token
        if self._spec.config.engine.request_plane != "direct" or not token:
            return info
        self._plane = PlaneServer(self, token, self._spec.replica_id)
        endpoint = await self._plane.start(info.node_ip)
        return dataclasses.replace(info, extra={**info.extra, "request_plane": endpoint.as_extra()})

    async def submit(self, request: GenerateRequest, subscriber: str = "") -> None:
        """Start one request; its deltas appear on `subscriber`'s `outputs()`. Returns once it
        runs."""
        if request.request_id in self._aborted_early:
            del self._aborted_early[request.request_id]
            return  # aborted before it arrived: nobody listens for it
        self._subscribe(subscriber)
        self._owners[request.request_id] = subscriber
        task = asyncio.get_running_loop().create_task(self._run(request, time.monotonic()))
        self._running[request.request_id] = task

    async def outputs(self, subscriber: str = "") -> AsyncIterator[list[EngineOutput]]:
        """The deltas of every request `subscriber` submitted, in order per request, batched:
        waits for one, then takes all that are queued. Call with
        `.options(num_returns="streaming")`; a frontend keeps one open per actor (unless it
        reaches the actor's request plane). A newer call or link of the same subscriber takes
        over: the older stream ends, and outputs not yet taken go to the newer one."""
        async for batch in output_batches(self.attach(subscriber)):
            yield batch

    def attach(self, subscriber: str) -> asyncio.Queue[EngineOutput | None]:
        """A fresh output queue for `subscriber`, taking over its current one: the outputs
        waiting there move over, and whoever reads the old queue gets its end (None)."""
        stream = self._subscribe(subscriber)
        queue: asyncio.Queue[EngineOutput | None] = asyncio.Queue()
        while not stream.queue.empty():
            if (item := stream.queue.get_nowait()) is not None:
                queue.put_nowait(item)
        stream.queue.put_nowait(None)  # ends the older stream, if one reads it
        stream.queue = queue
        return queue

    def detach(self, subscriber: str, queue: asyncio.Queue[EngineOutput | None]) -> None:
        """`subscriber`'s request-plane link ended. Unless a newer link or stream took its
        queue over, nobody will read its requests' outputs: abort them."""
        stream = self._streams.get(subscriber.partition("@")[0])
        if stream is not None and stream.queue is queue:
            self._abort_requests_of(subscriber, f"the request plane link of {subscriber} ended")

    async def _run(self, request: GenerateRequest, arrived: float) -> None:
        rid = request.request_id
        failure: GenerateFailure | None = GenerateFailure(rid)
        first = last = None  # when its first and latest outputs left the engine
        outputs = 0
        try:
            async for delta in self._engine.generate(request):
                if delta.token_ids:
                    last = time.monotonic()
                    outputs += 1
                    if first is None:
                        first = last
                        name = self._owners.get(rid, "").partition("@")[0]
                        self._first_output_s.setdefault(name, deque(maxlen=4096)).append(
                            first - arrived)
                self._emit(delta)
                if delta.finished:
                    failure = None
                    return
        except asyncio.CancelledError:
            failure = None  # aborted by `abort()`: nobody listens any more
            raise
        except Exception as e:  # noqa: BLE001 - fails this request alone, or the engine died
            dead = self._engine.dead
            if dead:
                logger.error("request %s lost: engine %s is dead (%r)", rid,
                             self._spec.replica_id, e)
            elif _refused_input(e) and outputs == 0:
                # vLLM validates a request's input when it is submitted: the client sent
                # something this engine cannot run.
                logger.info("request %s refused by engine %s: %s", rid, self._spec.replica_id, e)
                failure = GenerateFailure(rid, str(e), rejected=True)
                return
            else:
                logger.exception("request %s failed in engine %s", rid, self._spec.replica_id)
            failure = GenerateFailure(rid, repr(e), engine_dead=dead)
        finally:
            self._running.pop(rid, None)
            if failure is not None:
                self._emit(failure)
            self._owners.pop(rid, None)
            if self._requests is not None and first is not None:
                self._requests.record(arrived, first, last, outputs)

    def _subscribe(self, subscriber: str) -> _Stream:
        """`subscriber`'s output stream (held until it opens `outputs()`). A new incarnation of
        a frontend name (its process restarted) replaces the old one's stream and aborts the
        requests the old one left here: nobody reads them any more."""
        name = subscriber.partition("@")[0]
        stream = self._streams.get(name)
        if stream is not None and stream.subscriber == subscriber:
            return stream
        self._streams[name] = _Stream(subscriber, asyncio.Queue())
        if stream is not None:
            stream.queue.put_nowait(None)
            self._abort_requests_of(stream.subscriber, f"frontend {name} restarted")
        return self._streams[name]

    def _abort_requests_of(self, subscriber: str, why: str) -> None:
        """Abort every request `subscriber` submitted here: nobody reads their outputs any more."""
        orphans = [rid for rid, owner in self._owners.items() if owner == subscriber]
        if orphans:
            logger.info("engine %s: %s; aborting %d request(s) it left", self._spec.replica_id,
                        why, len(orphans))
        for rid in orphans:
            asyncio.get_running_loop().create_task(self.abort(rid))

    def _emit(self, output: EngineOutput) -> None:
        subscriber = self._owners.get(output.request_id, "")
        stream = self._streams.get(subscriber.partition("@")[0])
        if stream is None:
            stream = self._subscribe(subscriber)
        if stream.subscriber == subscriber:
            stream.queue.put_nowait(output)
        # else: a dead frontend's request, aborted when its successor subscribed

    async def abort(self, request_id: str) -> None:
        """End a request early and release its KV; its remaining deltas are dropped."""
        await self._engine.abort(request_id)
        task = self._running.get(request_id)
        if task is not None:
            # Also covers an abort that overtook the request's start in the engine: closing
            # an engine's stream aborts the request there (the `Engine` contract).
            task.cancel()
        else:
            self._aborted_early[request_id] = None
            while len(self._aborted_early) > _ABORTED_EARLY_KEPT:
                self._aborted_early.popitem(last=False)

    async def stats(self, subscriber: str = "") -> EngineStats:
        """The engine's state now, and the samples collected since this frontend's previous
        call: its own requests' first-output times, and the KV pull durations and vLLM's own
        request timings no other frontend took yet (each counted by one frontend). A caller named '' (the controller of
        ingress replicas, a bare `stats()` with no frontend) takes no frontend's samples, unless
        requests were submitted under that name."""
        if self._engine.dead:
            return EngineStats(self._spec.replica_id, self._spec.pool, dead=True)
        stats = self._engine.stats()
        for key, samples in self._samples.items():
            samples.extend(getattr(stats, key))
        name = subscriber.partition("@")[0]
        firsts = self._first_output_s.pop(name, ())
        taken: dict[str, tuple[float, ...]] = {key: () for key in self._samples}
        if name or not self._streams or "" in self._streams:
            for key, samples in self._samples.items():
                taken[key] = tuple(samples)
                samples.clear()
        return dataclasses.replace(stats, first_output_seconds=tuple(firsts), **taken)

    async def release_kv(self, kv_transfer_params: dict) -> None:
        """End the KV pin of a prefill leg whose decode leg will never pull it."""
        await self._engine.release_kv(kv_transfer_params)

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        """Restart the lease of that pin: its decode leg still waits for its engine."""
        await self._engine.renew_kv(kv_transfer_params)

    async def shutdown(self) -> None:
        if self._plane is not None:
            await self._plane.close()
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        for stream in self._streams.values():
            stream.queue.put_nowait(None)
        await self._engine.shutdown()
        if self._requests is not None:
            self._requests.close()


@dataclasses.dataclass(slots=True)
class _Stream:
    """One frontend's output queue on this engine."""

    subscriber: str  # name@incarnation
    queue: asyncio.Queue[EngineOutput | None]


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - informational only
        return ""


def _refused_input(error: Exception) -> bool:
    """Whether vLLM refused a request's input: its client-error family (vLLM >= 0.30,
    `VLLMClientError`, 4xx in its own server), or the ValueError earlier versions raise."""
    return isinstance(error, ValueError) or any(
        cls.__name__ == "VLLMClientError" for cls in type(error).__mro__)
