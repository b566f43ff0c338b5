"""The prefill -> decode request flow over mock engines (no Ray, no vLLM)."""

import pytest

from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.types import GenerateRequest, SamplingOptions
from pdserve.errors import EngineRequestError
from pdserve.serving.disaggregated import generate_disaggregated

pytestmark = pytest.mark.unit

FAST = MockEngineConfig(decode_step_s=0.0, decode_step_per_seq_s=0.0, prefill_tokens_per_s=1e6)


@pytest.fixture
async def engines():
    engines = {name: MockEngine(name, name, "m", FAST) for name in ("colocated", "prefill", "decode")}
    for engine in engines.values():
        await engine.start()
    yield engines
    for engine in engines.values():
        await engine.shutdown()


def request(max_tokens, prompt=(5, 6, 7), stop=()):
    return GenerateRequest("r", prompt, SamplingOptions(max_tokens=max_tokens, temperature=0, stop=stop))


async def run(engines, req, policy="recompute", prefill=None):
    sent = []

    def recording_prefill(leg):
        sent.append(leg)
        return (prefill or engines["prefill"].generate)(leg)

    deltas = [d async for d in generate_disaggregated(
        req, recording_prefill, engines["decode"].generate, policy)]
    return deltas, sent


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
async def test_disaggregated_output_equals_colocated(engines, max_tokens):
    colocated = [d async for d in engines["colocated"].generate(request(max_tokens))]
    deltas, sent = await run(engines, request(max_tokens))
    assert [t for d in deltas for t in d.token_ids] == [t for d in colocated for t in d.token_ids]
    assert [d.num_output_tokens for d in deltas] == list(range(1, max_tokens + 1))
    assert deltas[-1].finish_reason == "length"
    assert all(d.request_id == "r" and d.num_prompt_tokens == 3 for d in deltas)
    # The prefill engine keeps blocks only when a decode leg will pull them.
    keep = (sent[0].kv_transfer_params or {}).get("do_remote_decode", False)
    assert keep is (max_tokens > 1)
    assert engines["decode"].stats().num_finished_total == (0 if max_tokens == 1 else 1)


async def test_first_token_hitting_a_stop_string_ends_the_request(engines):
    first = [d async for d in engines["colocated"].generate(request(1))][0].text.strip()
    deltas, _ = await run(engines, request(5, stop=(first,)))
    assert deltas[-1].finish_reason == "stop" and len(deltas) == 1
    assert engines["decode"].stats().num_finished_total == 0


async def failing_prefill(req):
    raise EngineRequestError("engine prefill-0 died")
    yield  # pragma: no cover - makes this an async generator


async def test_dead_prefill_is_recomputed_on_the_decode_engine(engines):
    colocated = [d async for d in engines["colocated"].generate(request(4))]
    deltas, _ = await run(engines, request(4), "recompute", prefill=failing_prefill)
    assert [t for d in deltas for t in d.token_ids] == [t for d in colocated for t in d.token_ids]


async def test_dead_prefill_fails_the_request_under_the_fail_policy(engines):
    with pytest.raises(EngineRequestError, match="died"):
        await run(engines, request(4), "fail", prefill=failing_prefill)


async def test_failed_pull_under_the_fail_policy_is_a_clear_error(engines):
    from pdserve.engine.types import GenerateDelta

    async def failing_decode(leg):
        yield GenerateDelta(leg.request_id, "", (), len(leg.prompt_token_ids), 0, "error")

    stream = generate_disaggregated(request(4), engines["prefill"].generate, failing_decode, "fail")
    first = await anext(stream)
    assert first.num_output_tokens == 1
    with pytest.raises(EngineRequestError, match="KV transfer .* failed"):
        await anext(stream)
