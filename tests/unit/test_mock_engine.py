import asyncio
import typing

import pytest

from pdserve.config.schema import EngineConfig, MockEngineConfig, PdserveConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.registry import ENGINE_KINDS, build_engine
from pdserve.engine.spec import EngineSpec
from pdserve.engine.types import GenerateRequest, SamplingOptions

pytestmark = pytest.mark.unit


def request(rid="r", prompt=(1, 2, 3), max_tokens=4):
    return GenerateRequest(rid, prompt, SamplingOptions(max_tokens=max_tokens, temperature=0))


async def collect(engine, req):
    return [d async for d in engine.generate(req)]


async def test_streams_max_tokens_then_length():
    engine = MockEngine("e", "colocated", "m", MockEngineConfig(decode_step_s=0.001))
    await engine.start()
    deltas = await collect(engine, request(max_tokens=4))
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3, 4]
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert engine.stats().num_finished_total == 1
    await engine.shutdown()


async def test_same_prompt_same_tokens():
    engine = MockEngine("e", "colocated", "m", MockEngineConfig(decode_step_s=0.001))
    await engine.start()
    a, b = await asyncio.gather(collect(engine, request("a")), collect(engine, request("b")))
    assert [d.token_ids for d in a] == [d.token_ids for d in b]
    await engine.shutdown()


async def test_abort_ends_the_stream_and_frees_the_request():
    engine = MockEngine("e", "colocated", "m", MockEngineConfig(decode_step_s=0.01))
    await engine.start()
    stream = engine.generate(request(max_tokens=1000))
    await anext(stream)
    assert engine.stats().num_running == 1
    assert engine.stats().kv_cache_usage > 0
    await engine.abort("r")
    rest = [d async for d in stream]
    assert rest[-1].finish_reason == "abort"
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_aborted_total == 1 and stats.kv_cache_usage == 0
    await engine.shutdown()


async def test_prefill_time_follows_the_latency_model():
    engine = MockEngine("e", "colocated", "m", MockEngineConfig(prefill_tokens_per_s=1000))
    await engine.start()
    loop = asyncio.get_running_loop()
    start = loop.time()
    stream = engine.generate(request(prompt=tuple(range(200)), max_tokens=1))
    await anext(stream)
    assert loop.time() - start >= 0.2  # 200 tokens at 1000 tokens/s, never faster
    await stream.aclose()
    await engine.shutdown()


def test_every_engine_kind_the_config_accepts_can_be_built():
    assert set(typing.get_args(EngineConfig.model_fields["kind"].annotation)) == set(ENGINE_KINDS)


def test_an_actor_configured_for_the_mock_kind_builds_the_mock_engine():
    config = PdserveConfig.model_validate({"engine": {"kind": "mock"}})
    engine = build_engine(EngineSpec("decode-0", "decode", "/m", "served", config))
    assert isinstance(engine, MockEngine)
    assert engine.stats().replica_id == "decode-0" and engine.stats().pool == "decode"
