import pytest

from conftest import PERF
from pdserve.sim.engine import SimEngine, SimRequest
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.events import EventQueue

pytestmark = pytest.mark.unit


class Bench:
    """One engine on a queue, recording first-token and finish times."""

    def __init__(self, profile, skip=True):
        self.q = EventQueue()
        self.first, self.done, self.steps = {}, {}, []
        self.engine = SimEngine("e0", "colocated", profile, self.q,
                                lambda r, e: self.first.setdefault(r.index, self.q.now),
                                lambda r, e: self.done.setdefault(r.index, self.q.now),
                                lambda e: None, lambda e, s: self.steps.append(s),
                                lambda r, e: None, record_steps=True, skip_steps=skip)

    def at(self, t, index, prompt, output):
        req = SimRequest(index, t, prompt, output)
        self.q.schedule(t, lambda r: self.engine.submit_prefill(r), req)
        return req


def test_step_time_is_the_documented_formula(profile):
    assert profile.step_s(0, 0) == 0.0
    assert profile.step_s(200, 0) == pytest.approx(0.010 + 0.200)
    assert profile.step_s(0, 4) == pytest.approx(0.010 + 0.004)
    assert profile.step_s(300, 1) == pytest.approx(0.010 + 0.001 + 0.300)
    assert profile.response_s == pytest.approx(0.040)
    ctx = profile.with_(decode_ctx_s_per_token=1e-6)
    assert ctx.step_s(0, 2, 1000) == pytest.approx(0.012 + 0.001)
    assert profile.blocks(16) == 1 and profile.blocks(17) == 2


def test_one_request_prefills_then_decodes_one_token_per_step(profile):
    b = Bench(profile)
    b.at(0.0, 0, 200, 5)
    b.q.run()
    assert b.first[0] == pytest.approx(0.21)  # 10 ms + 200 tokens at 1000/s
    assert b.done[0] == pytest.approx(0.21 + 4 * 0.011)  # 4 more tokens at batch 1
    assert b.engine.idle and b.engine.kv_used == 0


def test_long_prompts_are_prefilled_in_chunks_of_the_token_budget(profile):
    b = Bench(profile)
    b.at(0.0, 0, 1000, 1)
    b.q.run()
    assert b.first[0] == pytest.approx((0.010 + 0.512) + (0.010 + 0.488))
    assert b.engine.idle  # a one-token request ends with its prefill (the runner reports it)


def test_new_prompt_waits_for_the_step_in_flight_then_shares_the_batch(profile):
    b = Bench(profile)
    b.at(0.0, 0, 100, 10)
    b.at(0.05, 1, 300, 2)
    b.q.run()
    assert b.first[0] == pytest.approx(0.11)
    # Step 2 (from 0.11): A's decode + B's whole prompt = 10 + 1 + 300 ms.
    assert b.first[1] == pytest.approx(0.11 + 0.311)
    # Step 3: batch of 2 -> B's second (last) token.
    assert b.done[1] == pytest.approx(0.421 + 0.012)
    # A: 9 decode tokens: one in step 2, one in step 3 (batch 2), 7 alone.
    assert b.done[0] == pytest.approx(0.433 + 7 * 0.011)


def test_kv_capacity_holds_a_request_back_until_blocks_free():
    profile = EngineProfile(PERF, block_size=16, num_kv_blocks=10, max_num_batched_tokens=512)
    b = Bench(profile)
    b.at(0.0, 0, 100, 28)  # 128 tokens = 8 blocks
    b.at(0.0, 1, 40, 8)  # 48 tokens = 3 blocks: 11 > 10, waits for A
    b.q.run()
    assert b.first[0] == pytest.approx(0.11)
    assert b.done[0] == pytest.approx(0.11 + 27 * 0.011)
    assert b.first[1] == pytest.approx(b.done[0] + 0.010 + 0.040)


def test_skipping_decode_steps_gives_the_step_by_step_timeline(profile):
    import numpy as np

    rng = np.random.default_rng(3)
    rows = [(float(t), int(p), int(o)) for t, p, o in zip(
        np.cumsum(rng.exponential(0.3, 200)), rng.integers(10, 300, 200), rng.integers(2, 200, 200))]
    runs = []
    for skip in (False, True):
        b = Bench(profile, skip=skip)
        reqs = [b.at(t, i, p, o) for i, (t, p, o) in enumerate(rows)]
        b.q.run()
        runs.append((b, reqs))
    (slow, _), (fast, _) = runs
    assert slow.first.keys() == fast.first.keys() and len(slow.done) == 200
    for i in slow.first:
        assert fast.first[i] == pytest.approx(slow.first[i], abs=1e-9)
        assert fast.done[i] == pytest.approx(slow.done[i], abs=1e-9)
    assert fast.engine.steps == slow.engine.steps
    assert fast.engine.step_ends == pytest.approx(slow.engine.step_ends, abs=1e-9)
    assert fast.q.processed < slow.q.processed / 2  # the point of skipping


def test_first_tokens_of_a_decoding_step_wait_for_part_of_the_next_prefill(profile):
    """vLLM's async scheduling: the outputs of a step that decoded come out part way into the
    next step's prefill (EngineProfile.release_delay_s); the engine's own timeline is unchanged."""
    held = profile.with_(prefill_release_share=0.5)
    assert held.release_delay_s(300) == pytest.approx(0.5 * 0.300)
    assert held.release_delay_s(0) == 0.0 and profile.release_delay_s(300) == 0.0
    runs = {}
    for name, p in (("plain", profile), ("held", held)):
        b = Bench(p)
        b.at(0.0, 0, 100, 10)  # A alone: a prefill-only step, nothing to hold it
        b.at(0.05, 1, 300, 2)  # B prefills in step 2, beside A's decode
        b.at(0.30, 2, 200, 2)  # C arrives during step 2: step 3 prefills it, beside A and B
        b.q.run()
        runs[name] = b
    plain, held_run = runs["plain"], runs["held"]
    assert held_run.first[0] == pytest.approx(plain.first[0]) == pytest.approx(0.11)
    # Step 2 (A decodes, B's prompt) is followed by step 3 with C's 200 prompt tokens: B's first
    # token waits half of those 200 ms. C's own step is followed by a decode-only step.
    assert plain.first[1] == pytest.approx(0.421)
    assert held_run.first[1] == pytest.approx(0.421 + 0.100)
    assert held_run.first[2] == pytest.approx(plain.first[2])
    assert held_run.done == plain.done and held_run.steps == plain.steps


def prefill_leg(b, t, index, prompt):
    req = b.at(t, index, prompt, 2)
    req.leg = "prefill"
    return req


def test_async_scheduling_forms_the_next_batch_when_a_step_starts(profile):
    """vLLM's async scheduling: while A's prefill runs, its first decode is already scheduled
    for the next step, so B, arriving during the prefill, runs a step later than without it."""
    b = Bench(profile.with_(async_scheduling=True))
    b.at(0.0, 0, 100, 10)
    b.at(0.05, 1, 300, 2)
    b.q.run()
    assert b.first[0] == pytest.approx(0.11)
    # Step 2 (from 0.11) was formed at 0.0, before B came: A's decode alone, 11 ms. Step 3 (from
    # 0.121), formed at 0.11: A's decode and B's prompt (10 + 1 + 300 ms); without async
    # scheduling B's first token came at 0.421.
    assert b.first[1] == pytest.approx(0.121 + 0.311)
    assert b.done[1] == pytest.approx(0.432 + 0.012)
    # A: 9 decode tokens, in steps 2, 3 and 4, then 6 alone.
    assert b.done[0] == pytest.approx(0.444 + 6 * 0.011)


def test_async_scheduling_changes_nothing_for_a_lone_prompt_after_another(profile):
    """A prefill engine's lone prompts: after launching A's step the engine had nothing else to
    schedule; it formed B's step as B came, which runs when A's ends, as without async
    scheduling."""
    firsts = []
    for mode in (False, True):
        b = Bench(profile.with_(async_scheduling=mode))
        prefill_leg(b, 0.0, 0, 100)
        prefill_leg(b, 0.05, 1, 100)
        b.q.run()
        firsts.append(b.first)
    assert firsts[0] == firsts[1] == pytest.approx({0: 0.11, 1: 0.22})


def test_a_fresh_step_forms_the_next_batch_once_launched(profile):
    """A starts the idle engine: launching its step keeps vLLM's engine core busy for
    `lookahead_s`, then it forms the next batch from what came meanwhile (B) and waits for A;
    C, coming later, is held to A's end and runs a step after B (session 13's H100 trace).
    Without the delay (a look ahead at A's start finds nothing) B and C share the step after
    A's, as without async scheduling; with a longer one both came in time and share it too."""
    firsts = {}
    for lookahead in (0.0, 0.02, 0.06):
        b = Bench(profile.with_(async_scheduling=True, lookahead_s=lookahead))
        prefill_leg(b, 0.0, 0, 100)
        prefill_leg(b, 0.015, 1, 100)
        prefill_leg(b, 0.05, 2, 100)
        b.q.run()
        firsts[lookahead] = b.first
    together = {0: 0.11, 1: 0.11 + 0.21, 2: 0.11 + 0.21}
    assert firsts[0.0] == pytest.approx(together)
    assert firsts[0.02] == pytest.approx({0: 0.11, 1: 0.22, 2: 0.33})
    assert firsts[0.06] == pytest.approx(together)


def test_async_scheduling_holds_a_prompt_back_behind_one_scheduled_ahead(profile):
    """A starts the idle engine alone; B, already waiting, is scheduled ahead when A's step
    starts, so C, arriving during A's step, waits for the step after B's. Without async
    scheduling B and C share step 2 and come out together, B later and C sooner."""
    firsts = {}
    for mode in (False, True):
        b = Bench(profile.with_(async_scheduling=mode))
        prefill_leg(b, 0.0, 0, 400)
        prefill_leg(b, 0.0, 1, 400)
        prefill_leg(b, 0.1, 2, 100)
        b.q.run()
        firsts[mode] = b.first
    assert firsts[False] == pytest.approx({0: 0.41, 1: 0.41 + 0.51, 2: 0.41 + 0.51})
    assert firsts[True] == pytest.approx({0: 0.41, 1: 0.41 + 0.41, 2: 0.82 + 0.11})


def test_async_scheduling_keeps_the_timeline_of_skipped_decode_steps(profile):
    import numpy as np

    rng = np.random.default_rng(5)
    rows = [(float(t), int(p), int(o)) for t, p, o in zip(
        np.cumsum(rng.exponential(0.3, 200)), rng.integers(10, 300, 200), rng.integers(2, 200, 200))]
    runs = []
    for skip in (False, True):
        b = Bench(profile.with_(async_scheduling=True), skip=skip)
        for i, (t, p, o) in enumerate(rows):
            b.at(t, i, p, o)
        b.q.run()
        runs.append(b)
    slow, fast = runs
    assert len(slow.done) == 200
    assert fast.first == pytest.approx(slow.first, abs=1e-9)
    assert fast.done == pytest.approx(slow.done, abs=1e-9)
    assert fast.engine.step_ends == pytest.approx(slow.engine.step_ends, abs=1e-9)
    plain = Bench(profile, skip=True)
    for i, (t, p, o) in enumerate(rows):
        plain.at(t, i, p, o)
    plain.q.run()
    # Prompts wait longer on the whole (some go sooner: the batches differ, as in the test above).
    later = sum(fast.first[i] > plain.first[i] + 1e-9 for i in plain.first)
    sooner = sum(fast.first[i] < plain.first[i] - 1e-9 for i in plain.first)
    assert later > 2 * sooner and later > 20
    assert sum(fast.first[i] - r[0] for i, r in enumerate(rows)) > sum(
        plain.first[i] - r[0] for i, r in enumerate(rows))
