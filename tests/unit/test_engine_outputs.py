"""One multiplexed output stream per engine actor (`EngineActor.outputs` + `EngineOutputs`),
driven in process: the actor class with the mock engine, its stream handed over as Ray would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from pdserve.config.schema import PdserveConfig
from pdserve.engine.actor import EngineActor, EngineSpec
from pdserve.engine.types import GenerateDelta, GenerateFailure, GenerateRequest, SamplingOptions
from pdserve.serving.engine_outputs import EngineOutputs, PlaneAccess, StreamLost

pytestmark = pytest.mark.unit


async def _resolved(value):
    return value


class InProcessHandle:
    """Stands in for the actor's Ray handle: `outputs.options(...).remote()` gives an async
    iterator of awaitables, like Ray's `ObjectRefGenerator`; `fail()` breaks it as a dying
    actor would."""

    def __init__(self, actor: EngineActor) -> None:
        self.actor = actor
        self.outputs = self
        self.submit = SimpleNamespace(remote=actor.submit)  # `handle.submit.remote(...)`
        self.opened = 0
        self._broken = asyncio.Event()

    def options(self, **_: object) -> InProcessHandle:
        return self

    def remote(self, subscriber: str = "") -> AsyncIterator:
        self.opened += 1
        return self._stream(subscriber)

    def fail(self) -> None:
        self._broken.set()

    async def _stream(self, subscriber: str) -> AsyncIterator:
        batches = self.actor.outputs(subscriber)
        broken = asyncio.ensure_future(self._broken.wait())
        batch = None
        try:
            while True:
                batch = asyncio.ensure_future(batches.__anext__())
                await asyncio.wait([batch, broken], return_when=asyncio.FIRST_COMPLETED)
                if broken.done():
                    batch.cancel()
                    await asyncio.gather(batch, return_exceptions=True)
                    raise ConnectionResetError("actor died")
                if isinstance(batch.exception(), StopAsyncIteration):
                    return  # the actor closed its outputs (shutdown)
                yield _resolved(batch.result())
        finally:
            broken.cancel()
            if batch is not None:
                batch.cancel()
                await asyncio.gather(batch, return_exceptions=True)


def request(rid: str, max_tokens: int = 20, prompt: tuple[int, ...] = (1, 2, 3)) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingOptions(max_tokens=max_tokens, temperature=0))


def engine_actor(decode_step_s: float = 0.001) -> EngineActor:
    config = PdserveConfig.model_validate(
        {"engine": {"kind": "mock", "mock": {"decode_step_s": decode_step_s}}})
    return EngineActor(EngineSpec("colocated-0", "colocated", "m", "m", config))


@pytest.fixture
async def served():
    actor = engine_actor()
    await actor.start()
    handle = InProcessHandle(actor)
    outputs = EngineOutputs("colocated-0", handle)
    yield actor, handle, outputs
    await outputs.aclose()
    await actor.shutdown()


async def run(outputs: EngineOutputs, req: GenerateRequest, plane: PlaneAccess | None = None) -> list:
    """One leg as `RayEngineChannel.stream` runs it: register, submit (through the engine's
    request plane when `plane` is given, else its Ray handle), read until the end."""
    outputs.open(req.request_id, plane)
    try:
        await outputs.submit(req)
        received = []
        while True:
            output = await outputs.next(req.request_id)
            received.append(output)
            if not isinstance(output, GenerateDelta) or output.finished:
                return received
    finally:
        outputs.close(req.request_id)


async def test_interleaved_requests_each_get_their_own_deltas_in_order(served):
    actor, handle, outputs = served
    requests = [request(f"r{i}", 5 + 7 * i, prompt=(i, 9)) for i in range(8)]
    results = await asyncio.gather(*(run(outputs, r) for r in requests))
    reference = engine_actor()
    await reference.start()
    for req, deltas in zip(requests, results, strict=True):
        assert all(d.request_id == req.request_id for d in deltas)
        assert [d.num_output_tokens for d in deltas] == list(range(1, req.sampling.max_tokens + 1))
        assert deltas[-1].finish_reason == "length"
        # The same tokens as the request alone on an engine (the mock is deterministic).
        alone = [d async for d in reference._engine.generate(req)]
        assert [d.token_ids for d in deltas] == [d.token_ids for d in alone]
    await reference.shutdown()
    assert handle.opened == 1  # one stream served every request


async def test_batches_carry_every_delta_ready_since_the_previous_one():
    actor = engine_actor(decode_step_s=0.005)
    await actor.start()
    for i in range(10):
        await actor.submit(request(f"r{i}", max_tokens=3))
    while actor._running:
        await asyncio.sleep(0.01)
    stream = actor.outputs()
    # Everything produced while nobody read comes as one batch, in order per request.
    batch = await stream.__anext__()
    assert len(batch) == 30
    for i in range(10):
        mine = [d.num_output_tokens for d in batch if d.request_id == f"r{i}"]
        assert mine == [1, 2, 3]
    await stream.aclose()
    await actor.shutdown()


async def test_an_abort_ends_that_request_only(served):
    actor, _, outputs = served
    long = [asyncio.create_task(run(outputs, request(f"keep{i}", 60))) for i in range(3)]
    outputs.open("gone")
    await actor.submit(request("gone", 1000), outputs.subscriber)
    assert isinstance(await outputs.next("gone"), GenerateDelta)
    outputs.close("gone")  # the client went away
    await actor.abort("gone")
    kept = await asyncio.wait_for(asyncio.gather(*long), 10)
    assert [[d.num_output_tokens for d in k] for k in kept] == [list(range(1, 61))] * 3
    stats = await actor.stats()
    assert stats.num_aborted_total == 1 and stats.num_running == 0
    assert "gone" not in actor._running


async def test_a_lost_stream_fails_every_open_request_at_once(served):
    actor, handle, outputs = served
    tasks = [asyncio.create_task(run(outputs, request(f"r{i}", 10_000))) for i in range(4)]
    while len(actor._running) < 4:
        await asyncio.sleep(0.01)
    handle.fail()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert all(isinstance(r[-1], StreamLost) for r in results)
    assert all(isinstance(r[-1].error, ConnectionResetError) for r in results)
    assert outputs.open_requests == 0


async def test_after_a_lost_stream_the_next_request_opens_a_new_one(served):
    actor, handle, outputs = served
    await run(outputs, request("before", 2))
    handle.fail()
    await asyncio.sleep(0.05)
    handle._broken = asyncio.Event()  # the actor is reachable again
    deltas = await asyncio.wait_for(run(outputs, request("after", 3)), 5)
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3]
    assert handle.opened == 2


async def test_an_engine_error_fails_only_that_request(served):
    actor, _, outputs = served
    engine_generate = actor._engine.generate

    async def generate(req: GenerateRequest):
        if req.request_id == "bad":
            raise RuntimeError("engine broke on this request")
        async for delta in engine_generate(req):
            yield delta

    actor._engine.generate = generate
    bad, good = await asyncio.gather(run(outputs, request("bad")),
                                     run(outputs, request("good", 5)))
    assert len(bad) == 1 and isinstance(bad[0], GenerateFailure)
    assert "engine broke" in bad[0].error
    assert [d.num_output_tokens for d in good] == [1, 2, 3, 4, 5]


async def test_a_stream_that_ends_unfinished_is_reported(served):
    actor, _, outputs = served

    async def generate(req: GenerateRequest):
        yield GenerateDelta(req.request_id, "x", (1,), 3, 1)  # then stops, unfinished

    actor._engine.generate = generate
    received = await run(outputs, request("cut"))
    assert isinstance(received[-1], GenerateFailure) and received[-1].error == ""


async def test_an_abort_that_overtakes_its_submit_keeps_the_request_from_running():
    # An async actor may run one caller's calls out of order: abort can land before submit.
    actor = engine_actor(decode_step_s=0.005)
    await actor.start()
    await actor.abort("late")
    await actor.submit(request("late", max_tokens=50))
    assert "late" not in actor._running
    await actor.submit(request("other", max_tokens=2))  # others still run
    while actor._running:
        await asyncio.sleep(0.01)
    batch = await actor.outputs().__anext__()
    assert {d.request_id for d in batch} == {"other"}
    await actor.shutdown()


async def test_the_actor_reports_each_requests_engine_side_first_output_once(served):
    from prometheus_client import generate_latest

    from pdserve.serving.metrics import ServingMetrics

    actor, _, outputs = served
    before = await actor.stats(outputs.subscriber)  # drains whatever came before
    assert before.first_output_seconds == ()
    await asyncio.gather(*(run(outputs, request(f"f{i}", 4)) for i in range(3)))
    assert (await actor.stats("@controller")).first_output_seconds == ()  # not a frontend's
    stats = await actor.stats(outputs.subscriber)
    assert len(stats.first_output_seconds) == 3 and all(s > 0 for s in stats.first_output_seconds)
    assert (await actor.stats(outputs.subscriber)).first_output_seconds == ()  # counted once
    metrics = ServingMetrics()
    metrics.update_engines([stats], ["colocated"])
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_engine_time_to_first_output_seconds_count{pool="colocated"} 3.0' in text


async def test_with_step_tracing_the_actor_records_each_requests_submit_first_and_last_output(tmp_path):
    from pdserve.sim.calibration.trace_reader import read_request_spans, read_requests

    config = PdserveConfig.model_validate({"engine": {
        "kind": "mock", "mock": {"decode_step_s": 0.01}, "step_trace_dir": str(tmp_path)}})
    actor = EngineActor(EngineSpec("colocated-0", "colocated", "m", "m", config))
    await actor.start()
    before = time.monotonic()
    for i in range(3):
        await actor.submit(request(f"r{i}", max_tokens=6))
    while actor._running:
        await asyncio.sleep(0.01)
    await actor.shutdown()
    rows = read_requests(tmp_path)["colocated-0"]
    assert len(rows) == 3  # one line per request
    assert all(before <= submitted <= first <= time.monotonic() for submitted, first in rows)
    spans = read_request_spans(tmp_path)["colocated-0"]
    assert [s[:2] for s in spans] == rows
    for submitted, first, last, outputs in spans:
        assert outputs >= 2 and last >= first + 0.01  # a decode step at least between them
    assert read_requests(tmp_path / "none") == {}
    # Without tracing, nothing is written.
    plain = engine_actor()
    await plain.start()
    await plain.submit(request("r", max_tokens=2))
    while plain._running:
        await asyncio.sleep(0.01)
    await plain.shutdown()
    assert plain._requests is None


async def test_two_frontends_each_read_their_own_requests():
    """Ingress replicas share an engine: each reads only the deltas of what it submitted."""
    actor = engine_actor()
    await actor.start()
    handle = InProcessHandle(actor)
    a = EngineOutputs("colocated-0", handle, "ingress-0@one")
    b = EngineOutputs("colocated-0", handle, "ingress-1@one")
    results = await asyncio.gather(run(a, request("ra", 7)), run(b, request("rb", 9)))
    assert [d.request_id for d in results[0]] == ["ra"] * 7
    assert [d.request_id for d in results[1]] == ["rb"] * 9
    assert handle.opened == 2
    await a.aclose()
    await b.aclose()
    await actor.shutdown()


async def test_each_frontend_counts_its_own_requests_first_outputs():
    actor = engine_actor()
    await actor.start()
    handle = InProcessHandle(actor)
    a = EngineOutputs("colocated-0", handle, "ingress-0@one")
    b = EngineOutputs("colocated-0", handle, "ingress-1@one")
    await asyncio.gather(*(run(a, request(f"a{i}", 3)) for i in range(2)),
                         *(run(b, request(f"b{i}", 3)) for i in range(3)))
    assert len((await actor.stats("ingress-1@one")).first_output_seconds) == 3
    assert len((await actor.stats("ingress-0@one")).first_output_seconds) == 2
    for outputs in (a, b):
        await outputs.aclose()
    await actor.shutdown()


async def test_a_restarted_frontend_aborts_what_its_predecessor_left():
    """A frontend process that died left requests running; its successor (same name, new
    incarnation) subscribing aborts them, and the other frontend's requests go on."""
    actor = engine_actor()
    await actor.start()
    handle = InProcessHandle(actor)
    dead = EngineOutputs("colocated-0", handle, "ingress-0@old")
    other = EngineOutputs("colocated-0", handle, "ingress-1@one")
    dead.open("orphan")
    await actor.submit(request("orphan", 100_000), dead.subscriber)
    assert isinstance(await dead.next("orphan"), GenerateDelta)
    kept = asyncio.create_task(run(other, request("kept", 50)))
    await dead.aclose()  # the process is gone: nobody reads its stream
    successor = EngineOutputs("colocated-0", handle, "ingress-0@new")
    fresh = await run(successor, request("fresh", 5))
    assert [d.num_output_tokens for d in fresh] == [1, 2, 3, 4, 5]
    for _ in range(100):
        if "orphan" not in actor._running:
            break
        await asyncio.sleep(0.01)
    assert "orphan" not in actor._running
    assert [d.num_output_tokens for d in await kept] == list(range(1, 51))
    for outputs in (successor, other):
        await outputs.aclose()
    await actor.shutdown()


async def test_vllms_own_request_timings_reach_metrics_through_one_frontend(served, monkeypatch):
    """vLLM's iteration stats (its TTFT; queue and prefill times of finished requests), as the
    vLLM adapter's stat logger folds them in, go to the first frontend that asks, once, and onto
    /metrics by pool."""
    import dataclasses

    from prometheus_client import generate_latest

    from pdserve.engine.vllm_engine import _LatestSchedulerStats
    from pdserve.serving.metrics import ServingMetrics

    sink = _LatestSchedulerStats()
    finished = [SimpleNamespace(queued_time=0.002, prefill_time=0.050)]
    sink.add_iteration(SimpleNamespace(time_to_first_tokens_iter=[0.06, 0.07], finished_requests=[]))
    sink.add_iteration(SimpleNamespace(time_to_first_tokens_iter=[], finished_requests=finished))
    timings = sink.take_timings()
    assert timings == {"vllm_ttft_seconds": (0.06, 0.07), "queue_seconds": (0.002,),
                       "prefill_seconds": (0.050,)}
    assert set(sink.take_timings().values()) == {()}  # drained

    actor, _, outputs = served
    engine_stats = actor._engine.stats
    monkeypatch.setattr(actor._engine, "stats", lambda: dataclasses.replace(engine_stats(), **timings))
    first = await actor.stats(outputs.subscriber)
    monkeypatch.setattr(actor._engine, "stats", engine_stats)
    assert (first.vllm_ttft_seconds, first.queue_seconds) == ((0.06, 0.07), (0.002,))
    assert (await actor.stats(outputs.subscriber)).vllm_ttft_seconds == ()  # counted once
    metrics = ServingMetrics()
    metrics.update_engines([first], ["colocated"])
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_engine_vllm_time_to_first_token_seconds_count{pool="colocated"} 2.0' in text
    assert 'pdserve_engine_queue_time_seconds_sum{pool="colocated"} 0.002' in text
    assert 'pdserve_engine_prefill_time_seconds_count{pool="colocated"} 1.0' in text
