"""The request flow over mock engines (no Ray, no vLLM): prefill -> decode legs, fallbacks, and
the ledger's books after each (nothing left reserved, pinned, queued or in flight)."""

import asyncio

import pytest

from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.types import GenerateDelta, GenerateRequest, Leg, SamplingOptions
from pdserve.errors import EngineDiedError, EngineRequestError
from pdserve.scheduler.ledger import FirstOutput, LegFinished, LegStarted, RequestLedger
from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.routing import RoutingPolicy
from pdserve.serving.flow import FlowOptions, RequestFlow
from pdserve.serving.metrics import ServingMetrics
from pdserve.testing.inprocess import InProcessChannel

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


class _Channel:
    """An engine reached in process, or a stand-in stream function."""

    def __init__(self, stream, released=None):
        self.stream = stream
        self._released = released

    async def release_kv(self, params):
        if self._released is not None:
            self._released.append(params)


def flow_over(engines, policy="recompute", prefill=None, decode=None, sent=None, released=None):
    events = []
    # Never prefill locally: every request takes the remote path.
    ledger = RequestLedger(["prefill", "decode"], PerfModel(prefill_tokens_per_s=1e4, decode_step_s=0.01),
                           policy=RoutingPolicy(local_prefill_max_tokens=0), prefix_aware=False,
                           observer=events.append)
    ledger.engines.add("prefill", "prefill", 16, 1000)
    ledger.engines.add("decode", "decode", 16, 1000)

    def recording(stream):
        def record(leg):
            if sent is not None:
                sent.append(leg)
            return stream(leg)
        return record

    streams = {"prefill": recording(prefill or InProcessChannel(engines["prefill"]).stream),
               "decode": decode or InProcessChannel(engines["decode"]).stream}
    flow = RequestFlow(ledger, lambda pool, rid: _Channel(streams[rid], released), FlowOptions(policy),
                       ServingMetrics(), "decode")
    return flow, ledger, events


async def run(flow, req):
    return [d async for d in flow.stream(req, flow.admit(req))]


def assert_books_closed(ledger):
    for record in ledger.engines:
        assert (record.reserved, record.pins, record.in_flight, record.num_decoding,
                record.queued_prefill_tokens) == (0, 0, 0, 0, 0), record


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
async def test_disaggregated_output_equals_colocated(engines, max_tokens):
    colocated = [d async for d in engines["colocated"].generate(request(max_tokens))]
    sent = []
    flow, ledger, events = flow_over(engines, sent=sent)
    deltas = await run(flow, request(max_tokens))
    assert [t for d in deltas for t in d.token_ids] == [t for d in colocated for t in d.token_ids]
    assert [d.num_output_tokens for d in deltas] == list(range(1, max_tokens + 1))
    assert deltas[-1].finish_reason == "length"
    assert all(d.request_id == "r" and d.num_prompt_tokens == 3 for d in deltas)
    # The prefill engine keeps blocks only when a decode leg will pull them.
    keep = (sent[0].kv_transfer_params or {}).get("do_remote_decode", False)
    assert keep is (max_tokens > 1)
    assert engines["decode"].stats().num_finished_total == (0 if max_tokens == 1 else 1)
    legs = [(type(e).__name__, e.leg) for e in events if isinstance(e, (LegStarted, FirstOutput, LegFinished))]
    expected = [("LegStarted", Leg.PREFILL), ("FirstOutput", Leg.PREFILL), ("LegFinished", Leg.PREFILL)]
    if max_tokens > 1:
        expected += [("LegStarted", Leg.DECODE), ("FirstOutput", Leg.DECODE), ("LegFinished", Leg.DECODE)]
    assert legs == expected
    assert_books_closed(ledger)


async def test_first_token_hitting_a_stop_string_ends_the_request(engines):
    first = [d async for d in engines["colocated"].generate(request(1))][0].text.strip()
    flow, ledger, _ = flow_over(engines)
    deltas = await run(flow, request(5, stop=(first,)))
    assert deltas[-1].finish_reason == "stop" and len(deltas) == 1
    assert engines["decode"].stats().num_finished_total == 0
    assert_books_closed(ledger)


async def failing_prefill(req):
    raise EngineDiedError("engine prefill-0 died")
    yield  # pragma: no cover - makes this an async generator


async def test_a_prefill_the_request_itself_failed_is_not_recomputed(engines):
    async def refusing_prefill(req):
        raise EngineRequestError("engine prefill-0 failed: ValueError('bad request')")
        yield  # pragma: no cover

    flow, ledger, events = flow_over(engines, "recompute", prefill=refusing_prefill)
    with pytest.raises(EngineRequestError, match="bad request"):
        await run(flow, request(4))
    assert [e.leg for e in events if isinstance(e, LegStarted)] == [Leg.PREFILL]
    assert engines["decode"].stats().num_finished_total == 0
    assert_books_closed(ledger)


async def test_dead_prefill_is_recomputed_on_the_decode_engine(engines):
    colocated = [d async for d in engines["colocated"].generate(request(4))]
    flow, ledger, events = flow_over(engines, "recompute", prefill=failing_prefill)
    deltas = await run(flow, request(4))
    assert [t for d in deltas for t in d.token_ids] == [t for d in colocated for t in d.token_ids]
    assert [e.leg for e in events if isinstance(e, LegStarted)] == [Leg.PREFILL, Leg.FULL]
    assert_books_closed(ledger)


async def test_dead_prefill_fails_the_request_under_the_fail_policy(engines):
    flow, ledger, _ = flow_over(engines, "fail", prefill=failing_prefill)
    with pytest.raises(EngineRequestError, match="died"):
        await run(flow, request(4))
    assert_books_closed(ledger)


async def test_failed_pull_under_the_fail_policy_is_a_clear_error(engines):
    async def failing_decode(leg):
        yield GenerateDelta(leg.request_id, "", (), len(leg.prompt_token_ids), 0, "error")

    flow, ledger, _ = flow_over(engines, "fail", decode=failing_decode)
    stream = flow.stream(request(4), flow.admit(request(4)))
    first = await anext(stream)
    assert first.num_output_tokens == 1
    with pytest.raises(EngineRequestError, match="KV transfer .* failed"):
        await anext(stream)
    assert_books_closed(ledger)


async def test_a_client_gone_between_the_legs_releases_the_prefill_pin(engines):
    released = []
    flow, ledger, _ = flow_over(engines, released=released)
    stream = flow.stream(request(6), flow.admit(request(6)))
    await anext(stream)  # the first token, from the prefill leg
    assert ledger.engine("prefill", "prefill").pins == 1
    await stream.aclose()
    assert_books_closed(ledger)
    await asyncio.sleep(0)  # the release runs as its own task
    # The prefill engine is told to free the KV now, with the parameters that name it.
    assert [p["remote_engine_id"] for p in released] == ["prefill"]


async def test_a_decode_leg_that_pulled_releases_nothing(engines):
    released = []
    flow, ledger, _ = flow_over(engines, released=released)
    await run(flow, request(6))
    await asyncio.sleep(0)
    assert released == []
    assert_books_closed(ledger)


async def test_an_admitted_request_dropped_before_it_starts_releases_its_reservation(engines):
    flow, ledger, _ = flow_over(engines)
    stream = flow.stream(request(6), flow.admit(request(6)))
    assert ledger.engine("decode", "decode").reserved == 1
    await stream.aclose()
    assert_books_closed(ledger)
