"""The request flow when engines die under a request (mock engines, no Ray): a request moves to
another engine and its client sees one stream, equal to an undisturbed run; replayed output is
dropped exactly; limits, waits and deadlines end a request with a clear error and closed books."""

import asyncio
import dataclasses

import pytest

from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.types import GenerateDelta, GenerateRequest, Leg, SamplingOptions
from pdserve.errors import EngineDiedError, RequestDeadlineError
from pdserve.scheduler.ledger import LegStarted, Migrated, RequestLedger
from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.routing import RoutingPolicy
from pdserve.serving.continuation import Replayed, Sent, StopStrings
from pdserve.serving.flow import FlowOptions, RequestFlow
from pdserve.serving.metrics import ServingMetrics
from pdserve.testing.inprocess import InProcessChannel

pytestmark = pytest.mark.unit

FAST = MockEngineConfig(decode_step_s=0.0, decode_step_per_seq_s=0.0, prefill_tokens_per_s=1e6)
NAMES = ("reference", "prefill", "decode-0", "decode-1")


@pytest.fixture
async def engines():
    engines = {name: MockEngine(name, "x", "m", FAST) for name in NAMES}
    for engine in engines.values():
        await engine.start()
    yield engines
    for engine in engines.values():
        await engine.shutdown()


def request(max_tokens=8, **sampling):
    return GenerateRequest("r", (5, 6, 7), SamplingOptions(**{"max_tokens": max_tokens,
                                                              "temperature": 0, **sampling}))


def dies_after(n, stream):
    """A leg stream that dies (as a killed engine) after `n` deltas."""
    async def dying(leg):
        count = 0
        async for delta in stream(leg):
            if count == n:
                raise EngineDiedError("engine decode-0 died")
            count += 1
            yield delta
    return dying


class _Channel:
    def __init__(self, stream):
        self.stream = stream

    async def release_kv(self, params):
        pass


class Setup:
    def __init__(self, engines, pools=("prefill", "decode"), decode=("decode-0", "decode-1"),
                 streams=None, options=FlowOptions(), coming=lambda pool: False):
        self.events, self.legs = [], []
        disaggregated = "prefill" in pools
        self.ledger = RequestLedger(list(pools), PerfModel(prefill_tokens_per_s=1e4, decode_step_s=0.01),
                                    policy=RoutingPolicy(local_prefill_max_tokens=0),
                                    prefix_aware=False, observer=self.events.append)
        self.pool = "decode" if disaggregated else "colocated"
        if disaggregated:
            self.ledger.engines.add("prefill", "prefill", 16, 1000)
        for rid in decode:
            self.ledger.engines.add(self.pool, rid, 16, 1000)
        self.streams = {rid: InProcessChannel(engines[rid]).stream for rid in NAMES}
        self.streams.update(streams or {})
        self.metrics = ServingMetrics()

        def channel(pool, rid):
            def recording(leg):
                self.legs.append((rid, leg))
                return self.streams[rid](leg)
            return _Channel(recording)

        self.flow = RequestFlow(self.ledger, channel, options, self.metrics, self.pool,
                                capacity_coming=coming)

    async def run(self, req):
        return [d async for d in self.flow.stream(req, self.flow.admit(req))]

    def migrated(self):
        return self.metrics.migrated.labels(self.pool)._value.get()

    def assert_books_closed(self):
        for record in self.ledger.engines:
            assert (record.reserved, record.pins, record.in_flight, record.num_decoding,
                    record.queued_prefill_tokens) == (0, 0, 0, 0, 0), record


async def reference(engines, req):
    return [d async for d in engines["reference"].generate(req)]


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


def text(deltas):
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize("sampling", [{}, {"presence_penalty": 0.5}, {"stop": ("never",)},
                                      {"seed": 7, "temperature": 0.5}],
                         ids=["greedy", "penalty", "stop", "seeded"])
@pytest.mark.parametrize("dies_at", [0, 1, 4])
async def test_a_decode_engine_dying_mid_stream_migrates_the_request(engines, sampling, dies_at):
    req = request(8, **sampling)
    want = await reference(engines, req)
    s = Setup(engines, streams={"decode-0": dies_after(dies_at, InProcessChannel(engines["decode-0"]).stream)})
    # The router sends the request to decode-0 (the other looks busier).
    s.ledger.engines["decode", "decode-1"].reserved = 5
    got = await s.run(req)
    s.ledger.engines["decode", "decode-1"].reserved = 0
    assert tokens(got) == tokens(want) and text(got) == text(want)
    # One token per delta, counted on; text held back for a stop string may come on its own.
    assert [d.num_output_tokens for d in got if d.token_ids] == list(range(1, 9))
    assert got[-1].finish_reason == "length"
    assert [e.replica_id for e in s.events if isinstance(e, Migrated)] == ["decode-1"]
    assert s.migrated() == 1
    decode_leg = s.legs[1][1]
    seeded = "seed" in sampling
    if seeded:  # the decode leg replays token 1, so the generator is where one engine's is
        assert decode_leg.replay_output_tokens == tuple(tokens(want)[:1])
        assert decode_leg.prompt_token_ids == req.prompt_token_ids
    else:  # token 1 joins the prompt
        assert decode_leg.prompt_token_ids == req.prompt_token_ids + tuple(tokens(want)[:1])
        assert decode_leg.prior_output_tokens == 1 and decode_leg.sampling.max_tokens == 7
    # Token 1 from the prefill leg, then what decode-0 made before dying (its first delta is
    # token 1 again when it replays).
    sent = 1 + max(dies_at - seeded, 0)
    rid, continued = s.legs[-1]
    assert rid == "decode-1" and continued.leg is Leg.FULL
    # The new engine prefills the client's prompt and replays what the client has.
    assert continued.replay_output_tokens == tuple(tokens(want)[:sent])
    assert continued.prompt_token_ids == req.prompt_token_ids
    assert continued.sampling.max_tokens == 8 and continued.prior_output_tokens == 0
    s.assert_books_closed()


async def test_a_colocated_engine_dying_mid_stream_migrates_the_request(engines):
    req = request(6)
    want = await reference(engines, req)
    s = Setup(engines, pools=("colocated",),
              streams={"decode-0": dies_after(2, InProcessChannel(engines["decode-0"]).stream)})
    s.ledger.engines["colocated", "decode-1"].reserved = 5
    got = await s.run(req)
    s.ledger.engines["colocated", "decode-1"].reserved = 0
    assert tokens(got) == tokens(want)
    assert [e.leg for e in s.events if isinstance(e, LegStarted)] == [Leg.FULL, Leg.FULL]
    s.assert_books_closed()


async def test_past_the_migration_limit_the_request_fails(engines):
    dying = dies_after(1, InProcessChannel(engines["decode-0"]).stream)
    s = Setup(engines, streams={"decode-0": dying, "decode-1": dying},
              options=FlowOptions(migration_limit=1))
    with pytest.raises(EngineDiedError):
        await s.run(request(8))
    assert s.migrated() == 1
    s.assert_books_closed()


async def test_with_no_engine_left_and_none_coming_the_request_fails_at_once(engines):
    s = Setup(engines, decode=("decode-0",),
              streams={"decode-0": dies_after(1, InProcessChannel(engines["decode-0"]).stream)})

    async def remove_dead():
        s.ledger.remove_engine("decode", "decode-0")

    stream = s.flow.stream(request(8), s.flow.admit(request(8)))
    assert len((await anext(stream)).token_ids) == 1
    await remove_dead()
    with pytest.raises(EngineDiedError, match="no live engine"):
        async for _ in stream:
            pass
    s.assert_books_closed()


async def test_a_migration_waits_for_a_starting_replacement(engines):
    coming = {"decode": True}
    s = Setup(engines, decode=("decode-0",),
              streams={"decode-0": dies_after(2, InProcessChannel(engines["decode-0"]).stream)},
              coming=lambda pool: coming[pool])
    req = request(8)
    want = await reference(engines, req)
    stream = s.flow.stream(req, s.flow.admit(req))
    got = [await anext(stream)]
    s.ledger.remove_engine("decode", "decode-0")  # the supervisor took the dead engine away

    async def replacement_starts():
        await asyncio.sleep(0.5)
        s.ledger.engines.add("decode", "decode-1", 16, 1000)
        coming["decode"] = False

    starter = asyncio.create_task(replacement_starts())
    got += [d async for d in stream]
    await starter
    assert tokens(got) == tokens(want)
    assert s.legs[-1][0] == "decode-1"
    s.assert_books_closed()


async def test_a_request_past_its_deadline_fails_and_aborts_its_leg(engines):
    slow = MockEngine("slow", "x", "m", MockEngineConfig(
        decode_step_s=0.2, decode_step_per_seq_s=0.0, prefill_tokens_per_s=1e6))
    await slow.start()
    try:
        s = Setup(engines, streams={"decode-0": InProcessChannel(slow).stream,
                                    "decode-1": InProcessChannel(slow).stream},
                  options=FlowOptions(request_timeout_s=0.5))
        with pytest.raises(RequestDeadlineError, match="deadline"):
            await s.run(request(50))
        s.assert_books_closed()
        await asyncio.sleep(0.3)
        assert slow.stats().num_running == 0  # the engine's leg was aborted
    finally:
        await slow.shutdown()


def _delta(text, ids, n, finish=None):
    return GenerateDelta("r", text, tuple(ids), 3, n, finish)


def test_replayed_output_is_dropped_by_tokens_and_characters():
    # The client has 3 tokens whose text the old engine partly held back ("ab" of "abc").
    sent = Sent(tokens=[1, 2, 3], text_chars=2)
    leg = GenerateRequest("r", (5,), SamplingOptions(max_tokens=9), replay_output_tokens=(1, 2, 3))
    replayed = Replayed(leg, sent)
    # The new engine's deltas coalesce replayed and new output in any way.
    assert replayed.new_part(_delta("a", [1], 1)) is None
    out = replayed.new_part(_delta("bc", [2, 3, 4], 3))
    assert (out.text, out.token_ids) == ("c", (4,))
    out = replayed.new_part(_delta("d", [5], 4, "stop"))
    assert (out.text, out.token_ids, out.finish_reason) == ("d", (5,), "stop")


def test_without_replay_nothing_is_dropped():
    leg = GenerateRequest("r", (5, 1, 2), SamplingOptions(max_tokens=9), prior_output_tokens=2)
    replayed = Replayed(leg, Sent(tokens=[1, 2], text_chars=4))
    delta = _delta("x", [7], 3)
    assert replayed.new_part(delta) is delta


@pytest.mark.parametrize("first, deltas, stop, want", [
    # Token 1 " s" (its "s" held back: it may begin "s."); "s." ends in token 2: cut before it.
    (" s", [(". Next", [9])], ("s.",), (("", (9,), "stop", "s."),)),
    # The leg's text is held back by the longest stop but one character, as vLLM does, then
    # released when no stop can complete any more, and whole at the end.
    (" ab", [("c", [9]), ("de", [10]), ("f", [11], "length")], ("bxyz",),
     ((" ", (9,), None, None), ("ab", (10,), None, None), ("cdef", (11,), "length", None))),
    # A stop entirely in the leg's text: found here too (the leg has no stop strings).
    (" a", [("zz", [9]), ("zz", [10])], ("zzz",),
     ((" a", (9,), None, None), ("", (10,), "stop", "zzz"))),
    # Two stops completed by one token: the one that ends first, as vLLM.
    (" ab", [("cd", [9])], ("bcd", "abc"), (("", (9,), "stop", "abc"),)),
])
def test_the_decode_legs_stop_strings_are_found_as_on_one_engine(first, deltas, stop, want):
    # The client has token 1's text less its held-back end.
    sampling = SamplingOptions(max_tokens=9, stop=stop)
    sent = max(0, len(first) - (max(len(s) for s in stop) - 1))
    join = StopStrings(first, sent, sampling)
    outs = []
    for n, d in enumerate(deltas, start=2):
        out = join.feed(_delta(d[0], d[1], n, d[2] if len(d) > 2 else None))
        outs.append((out.text, out.token_ids, out.finish_reason, out.stop_reason))
        if out.finished:
            break
    assert tuple(outs) == want


def test_a_stop_string_across_the_join_is_kept_with_include_stop_str_in_output():
    # Token 1 " Paris" was sent whole (nothing held back with include_stop_str_in_output);
    # the stop "s." ends in the decode leg's "." and the client's text ends after it.
    sampling = SamplingOptions(max_tokens=9, stop=("s.",), include_stop_str_in_output=True)
    join = StopStrings(" Paris", len(" Paris"), sampling)
    out = join.feed(_delta(". It", [9], 2))
    assert (out.text, out.finish_reason, out.stop_reason) == (".", "stop", "s.")


def test_a_stop_string_across_the_join_waits_for_min_tokens():
    # As vLLM: a stop string counts once the output holds more than min_tokens tokens. Token 1
    # + the leg's first token is 2 tokens: with min_tokens 2 the "s." there does not stop.
    sampling = SamplingOptions(max_tokens=9, stop=("s.",), min_tokens=2)
    out = StopStrings("s", 0, sampling).feed(_delta(". Next", [9], 2, "length"))
    assert (out.text, out.finish_reason) == ("s. Next", "length")
    sampling = dataclasses.replace(sampling, min_tokens=1)
    out = StopStrings("s", 0, sampling).feed(_delta(". Next", [9], 2))
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", "s.")


async def test_a_waiting_decode_leg_renews_its_prefill_lease_until_it_pulls(engines):
    renewed = []

    class Recording(_Channel):
        async def renew_kv(self, params):
            renewed.append(params["remote_engine_id"])

    decode = InProcessChannel(engines["decode-0"]).stream

    async def slow_decode(leg):
        await asyncio.sleep(0.35)  # waits behind a full batch: about three renewals
        async for delta in decode(leg):
            yield delta

    s = Setup(engines, decode=("decode-0",), streams={"decode-0": slow_decode},
              options=FlowOptions(kv_lease_s=0.3))
    s.flow._channels = lambda pool, rid: Recording(s.streams[rid])
    got = await s.run(request(6))
    assert tokens(got) == tokens(await reference(engines, request(6)))
    assert 2 <= len(renewed) <= 4 and set(renewed) == {"prefill"}, renewed
    count = len(renewed)
    await asyncio.sleep(0.3)
    assert len(renewed) == count  # no renewal once the leg pulled and the request ended
    s.assert_books_closed()


async def test_provenance_says_the_kv_was_pulled_and_how_much(engines, caplog):
    s = Setup(engines)
    req = request(6)
    stream = s.flow.stream(req, s.flow.admit(req))
    with caplog.at_level("INFO", logger="pdserve.provenance"):
        [d async for d in stream]
    p = stream.provenance
    assert (p.path, p.prefill, p.kv, p.migrations) == ("remote", "prefill", "pulled", [])
    # The mock decode engine pulls the 3 prompt tokens (it computes token 1's position).
    assert p.pull.nbytes == 3 * FAST.kv_bytes_per_token and p.pull.seconds > 0
    assert p.headers()["x-pdserve-kv-bytes"] == str(p.pull.nbytes)
    assert f"request r: path=remote prefill=prefill decode={p.decode} kv=pulled" in caplog.text


async def test_provenance_says_a_dead_prefill_engine_was_recomputed_and_a_migration(engines):
    async def dead_prefill(leg):
        raise EngineDiedError("engine prefill died")
        yield  # an async generator

    s = Setup(engines, decode=("decode-0", "decode-1"),
              streams={"prefill": dead_prefill,
                       "decode-0": dies_after(2, InProcessChannel(engines["decode-0"]).stream),
                       "decode-1": dies_after(2, InProcessChannel(engines["decode-1"]).stream)},
              options=FlowOptions(migration_limit=1))
    req = request(8)
    stream = s.flow.stream(req, s.flow.admit(req))
    with pytest.raises(EngineDiedError):
        [d async for d in stream]  # died twice: past the migration limit
    p = stream.provenance
    assert p.kv == "recomputed_prefill_failed" and p.headers()["x-pdserve-kv"] == p.kv
    assert len(p.migrations) == 1 and p.decode == p.migrations[0]
    assert p.headers()["x-pdserve-migrations"] == "1"
