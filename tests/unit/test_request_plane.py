"""The direct request plane (`pdserve.engine.request_plane`): its codec, its handshake, and an
engine actor (mock engine, in process) serving a frontend's `EngineOutputs` through it."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from pdserve.config.schema import PdserveConfig
from pdserve.engine import request_plane as rp
from pdserve.engine.actor import EngineActor, EngineSpec
from pdserve.engine.request_plane import PlaneEndpoint, PlaneError, PlaneLink, decode, encode
from pdserve.engine.types import (
    GenerateDelta, GenerateFailure, GenerateRequest, KVPull, Leg, SamplingOptions, TokenLogprob,
)
from pdserve.serving.engine_outputs import EngineOutputs, PlaneAccess, StreamLost
from tests.unit.test_engine_outputs import InProcessHandle, run

pytestmark = pytest.mark.unit

TOKEN = "cluster-token-for-tests"


def request(rid: str, max_tokens: int = 5) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingOptions(max_tokens=max_tokens, temperature=0))


# ----------------------------------------------------------------------------------- codec
def test_requests_and_outputs_cross_the_wire_unchanged():
    sampling = SamplingOptions(max_tokens=7, temperature=0.5, stop=("a", "b"), seed=3,
                               logit_bias=((5, -1.5), (9, 2.0)), allowed_token_ids=None,
                               structured_output={"json": {"type": "object"}}, logprobs=2)
    req = GenerateRequest("r1", tuple(range(2048)), sampling, Leg.DECODE, prior_output_tokens=1,
                          replay_output_tokens=(4, 5),
                          kv_transfer_params={"remote_block_ids": [1, 2, 3], "engine": "p-0",
                                              "nested": {"ids": [[1, 2]]}, "none": None})
    position = (TokenLogprob(4, -0.25, 1, "a"), TokenLogprob(7, -1.5, 2, "b"))
    delta = GenerateDelta("r1", "ab", (4, 7), 2048, 2, "stop", {"x": [1]}, (position, position),
                          (None, position), stop_reason="b", kv_pull=KVPull(1 << 20, 0.002))
    failure = GenerateFailure("r2", "boom", engine_dead=True)
    for value in (req, delta, failure, [delta, failure]):
        back = decode(encode(value))
        assert back == value
    back = decode(encode(req))
    # Tuples stay tuples and lists stay lists: vLLM gets the KV params as the prefill gave them.
    assert type(back.prompt_token_ids) is tuple and type(back.sampling.logit_bias[0]) is tuple
    assert type(back.kv_transfer_params["remote_block_ids"]) is list
    assert back.leg is Leg.DECODE


def test_the_codec_refuses_what_it_does_not_know():
    with pytest.raises(TypeError, match="does not travel"):
        encode({"x": object()})
    import msgpack
    with pytest.raises(PlaneError, match="unknown value type"):
        decode(msgpack.packb(msgpack.ExtType(99, b"")))


# --------------------------------------------------------------------------------- serving
def engine_actor(token: str | None = TOKEN, decode_step_s: float = 0.001) -> EngineActor:
    config = PdserveConfig.model_validate({
        "engine": {"kind": "mock", "mock": {"decode_step_s": decode_step_s}},
        "kv": {"cluster_token": token}})
    return EngineActor(EngineSpec("colocated-0", "colocated", "m", "m", config))


class NoRay:
    """An actor handle that must not be used: the request plane carries everything."""

    def __getattr__(self, name: str):
        raise AssertionError(f"Ray path used: {name}")


@pytest.fixture
async def engine():
    actor = engine_actor()
    info = await actor.start()
    yield actor, PlaneEndpoint.of(info)
    await actor.shutdown()


async def test_an_engine_serves_a_frontend_through_its_plane(engine):
    actor, endpoint = engine
    assert endpoint is not None and os.path.exists(endpoint.unix_path)
    outputs = EngineOutputs("colocated-0", NoRay())
    plane = PlaneAccess(endpoint, TOKEN)
    requests = [request(f"r{i}", 3 + i) for i in range(6)]
    results = await asyncio.wait_for(
        asyncio.gather(*(run(outputs, r, plane) for r in requests)), 10)
    for req, deltas in zip(requests, results, strict=True):
        assert [d.num_output_tokens for d in deltas] == list(range(1, req.sampling.max_tokens + 1))
        assert deltas[-1].finish_reason == "length"
    await outputs.aclose()


async def test_tcp_reaches_an_engine_on_another_node(engine):
    actor, endpoint = engine
    elsewhere = PlaneEndpoint("/nonexistent/engine.sock", endpoint.host, endpoint.port)
    outputs = EngineOutputs("colocated-0", NoRay())
    deltas = await asyncio.wait_for(run(outputs, request("r", 4), PlaneAccess(elsewhere, TOKEN)), 10)
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3, 4]
    await outputs.aclose()


async def test_an_abort_on_the_plane_ends_that_request(engine):
    actor, endpoint = engine
    outputs = EngineOutputs("colocated-0", NoRay())
    outputs.open("gone", PlaneAccess(endpoint, TOKEN))
    await outputs.submit(request("gone", 100_000))
    assert isinstance(await outputs.next("gone"), GenerateDelta)
    outputs.close("gone")
    await outputs.abort("gone")
    for _ in range(200):
        if not actor._running:
            break
        await asyncio.sleep(0.01)
    assert not actor._running and (await actor.stats()).num_aborted_total == 1
    await outputs.aclose()


async def test_a_broken_link_fails_its_requests_and_the_engine_drops_them(engine):
    actor, endpoint = engine
    outputs = EngineOutputs("colocated-0", NoRay())
    plane = PlaneAccess(endpoint, TOKEN)
    tasks = [asyncio.create_task(run(outputs, request(f"r{i}", 100_000), plane)) for i in range(3)]
    while len(actor._running) < 3:
        await asyncio.sleep(0.01)
    for task in list(actor._plane._links):  # the engine's side of the link goes away
        task.cancel()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(isinstance(r[-1], StreamLost) for r in results)
    for _ in range(200):  # nobody reads them any more: aborted, their KV freed
        if not actor._running:
            break
        await asyncio.sleep(0.01)
    assert not actor._running
    assert (await actor.stats()).num_aborted_total == 3
    # The next request connects again.
    deltas = await asyncio.wait_for(run(outputs, request("after", 2), plane), 10)
    assert [d.num_output_tokens for d in deltas] == [1, 2]
    await outputs.aclose()


async def test_a_newer_link_of_the_same_frontend_takes_over(engine):
    actor, endpoint = engine
    first = await PlaneLink.connect(endpoint, TOKEN, "front@1")
    second = await PlaneLink.connect(endpoint, TOKEN, "front@1")
    ended = [batch async for batch in first.batches()]  # the older link ends, empty
    assert ended == []
    await second.submit(request("r", 2))
    batches = second.batches()
    got = []
    while not got or not got[-1].finished:
        got.extend(await asyncio.wait_for(batches.__anext__(), 5))
    assert [d.num_output_tokens for d in got] == [1, 2]
    first.close()
    second.close()


async def test_an_engine_that_stops_ends_its_links(engine):
    actor, endpoint = engine
    outputs = EngineOutputs("colocated-0", NoRay())
    task = asyncio.create_task(run(outputs, request("r", 100_000), PlaneAccess(endpoint, TOKEN)))
    while not actor._running:
        await asyncio.sleep(0.01)
    await actor.shutdown()
    result = await asyncio.wait_for(task, 10)
    assert isinstance(result[-1], (StreamLost, GenerateFailure))
    assert not os.path.exists(os.path.dirname(endpoint.unix_path))  # its socket is gone


async def test_without_a_reachable_plane_the_frontend_uses_ray():
    actor = engine_actor()
    await actor.start()
    handle = InProcessHandle(actor)
    outputs = EngineOutputs("colocated-0", handle)
    nowhere = PlaneAccess(PlaneEndpoint("/nonexistent/engine.sock", "127.0.0.1", 9), TOKEN)
    deltas = await asyncio.wait_for(run(outputs, request("r", 3), nowhere), 10)
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3]
    assert handle.opened == 1  # the Ray stream
    await outputs.aclose()
    await actor.shutdown()


# ------------------------------------------------------------------------------ handshake
async def test_a_wrong_token_is_refused_and_nothing_runs(engine):
    actor, endpoint = engine
    with pytest.raises(PlaneError):
        await PlaneLink.connect(endpoint, "not-the-token", "front@1")
    assert not actor._running and "front" not in actor._streams


async def _hello(endpoint: PlaneEndpoint, token: str, name: bytes = b"front@1",
                 version: int = rp.WIRE_VERSION, replayed: bytes | None = None):
    """A hand-made handshake: (the hello sent, the engine's answer or None if it hung up)."""
    reader, writer = await asyncio.open_unix_connection(endpoint.unix_path)
    try:
        nonce_e = await rp._read_frame(reader)
        nonce_f = secrets.token_bytes(rp.NONCE_BYTES)
        hello = replayed or (bytes([version]) + nonce_f
                             + rp._proof(token, b"frontend", nonce_e, nonce_f, name) + name)
        writer.write(rp._frame(hello))
        try:
            answer = await asyncio.wait_for(rp._read_frame(reader), 5)
        except asyncio.IncompleteReadError:
            answer = None
        return hello, answer
    finally:
        writer.close()


async def test_a_recorded_hello_replays_nowhere(engine):
    actor, endpoint = engine
    hello, answer = await _hello(endpoint, TOKEN)
    assert answer is not None  # the genuine one was accepted
    _, replayed = await _hello(endpoint, TOKEN, replayed=hello)
    assert replayed is None  # the engine's nonce is fresh: the old proof does not match


async def test_another_wire_version_is_refused(engine):
    actor, endpoint = engine
    _, answer = await _hello(endpoint, TOKEN, version=rp.WIRE_VERSION + 1)
    assert answer is None


async def test_no_plane_without_a_cluster_token():
    actor = engine_actor(token=None)
    info = await actor.start()
    assert PlaneEndpoint.of(info) is None
    await actor.shutdown()


async def test_an_unproven_peer_cannot_make_the_engine_buffer_a_large_frame(engine):
    actor, endpoint = engine
    reader, writer = await asyncio.open_unix_connection(endpoint.unix_path)
    await rp._read_frame(reader)  # the engine's nonce
    writer.write(rp._HEADER.pack(200 << 20))  # announces a 200 MiB hello, sends nothing more
    with pytest.raises(asyncio.IncompleteReadError):
        await asyncio.wait_for(reader.readexactly(1), 2)  # refused at once, not after 200 MiB
    writer.close()
