"""One multiplexed output stream per engine actor on real local Ray (mock engine), through the
actor's request plane and through Ray: interleaved requests reach their own streams in order,
an abort ends one request only, and a killed actor fails every request in flight on it at once
with Ray's verdict (`RayActorError`, which makes the supervisor replace it)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray.exceptions import RayActorError

from pdserve.config.schema import PdserveConfig
from pdserve.engine.actor import EngineActor, EngineSpec
from pdserve.engine.types import GenerateDelta, GenerateRequest, SamplingOptions
from pdserve.engine.request_plane import PlaneEndpoint
from pdserve.serving.engine_outputs import EngineOutputs, PlaneAccess, StreamLost

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def local_ray():
    # address="local": a fresh instance, never a cluster another `ray start` left running.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             namespace="test-engine-outputs")
    yield
    ray.shutdown()


TOKEN = "integration-token"


class Outputs(EngineOutputs):
    """The frontend's end, with the plane its channel would hand to `open()`."""

    plane: PlaneAccess | None = None


@pytest.fixture(params=["direct", "ray"])
async def engine(local_ray, request):
    config = PdserveConfig.model_validate(
        {"engine": {"kind": "mock", "mock": {"decode_step_s": 0.005},
                    "request_plane": request.param},
         "kv": {"cluster_token": TOKEN}})
    actor = ray.remote(EngineActor).options(num_cpus=0.1, max_concurrency=4096).remote(
        EngineSpec("colocated-0", "colocated", "m", "m", config))
    info = await actor.start.remote()
    endpoint = PlaneEndpoint.of(info)
    assert (endpoint is not None) == (request.param == "direct")
    outputs = Outputs("colocated-0", actor)
    outputs.plane = PlaneAccess(endpoint, TOKEN) if endpoint else None
    yield actor, outputs
    await outputs.aclose()
    ray.kill(actor)


def request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, (3, 1, 4), SamplingOptions(max_tokens=max_tokens, temperature=0))


async def run(actor, outputs: EngineOutputs, req: GenerateRequest, received: list) -> None:
    outputs.open(req.request_id, outputs.plane)
    try:
        await outputs.submit(req)
        while True:
            output = await outputs.next(req.request_id)
            received.append(output)
            if not isinstance(output, GenerateDelta) or output.finished:
                return
    finally:
        outputs.close(req.request_id)


async def test_interleaved_requests_reach_their_own_streams_in_order(engine):
    actor, outputs = engine
    received: dict[str, list] = {f"r{i}": [] for i in range(12)}
    await asyncio.wait_for(asyncio.gather(
        *(run(actor, outputs, request(rid, 10 + 5 * i), received[rid])
          for i, rid in enumerate(received))), 60)
    for i, (rid, deltas) in enumerate(received.items()):
        assert {d.request_id for d in deltas} == {rid}
        assert [d.num_output_tokens for d in deltas] == list(range(1, 11 + 5 * i))
        assert deltas[-1].finish_reason == "length"


async def test_an_abort_ends_one_request_and_the_others_finish(engine):
    actor, outputs = engine
    kept: list[list] = [[], [], []]
    tasks = [asyncio.create_task(run(actor, outputs, request(f"keep{i}", 80), kept[i]))
             for i in range(3)]
    gone: list = []
    doomed = asyncio.create_task(run(actor, outputs, request("gone", 100_000), gone))
    while len(gone) < 3:
        await asyncio.sleep(0.01)
    doomed.cancel()  # the client went away: `_stream` closes its queue and aborts
    await asyncio.gather(doomed, return_exceptions=True)
    await outputs.abort("gone")
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert [[d.num_output_tokens for d in k] for k in kept] == [list(range(1, 81))] * 3
    stats = await actor.stats.remote()
    assert stats.num_aborted_total == 1 and stats.num_running == 0


async def test_a_killed_actor_fails_every_request_in_flight_promptly(engine):
    actor, outputs = engine
    received: list[list] = [[] for _ in range(5)]
    tasks = [asyncio.create_task(run(actor, outputs, request(f"r{i}", 100_000), received[i]))
             for i in range(5)]
    while min(len(r) for r in received) < 2:
        await asyncio.sleep(0.01)
    killed = time.monotonic()
    ray.kill(actor)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert time.monotonic() - killed < 10
    assert all(isinstance(r[-1], StreamLost) and isinstance(r[-1].error, RayActorError)
               for r in received)
