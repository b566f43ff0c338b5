"""The profile's prefill-only steps, response line and handoff, and the simulated prefill
engine's handoff (pdserve.sim.engine_profile, pdserve.sim.engine)."""

import pytest

from pdserve.sim.engine import SimEngine, SimRequest
from pdserve.sim.engine_profile import EngineProfile, response_line
from pdserve.sim.events import EventQueue

pytestmark = pytest.mark.unit

BASE = {"prefill_tokens_per_s": 40000.0, "tpot_ms_by_batch": {"1": 10.0, "8": 17.0}}
FIT = {"decode_step_s": 0.006, "decode_step_per_seq_s": 0.001, "prefill_tokens_per_s": 44000.0}
LONE = {"256": 0.02, "1024": 0.04, "2048": 0.06, "3072": 0.08}  # the engine's own lone prefills


def measured(gaps: dict[str, float], lone: dict[str, float] = LONE) -> dict:
    """A profile whose lone TTFTs are the engine's lone prefills plus these response paths."""
    singles = {k: (lone[k] + g) * 1000 for k, g in gaps.items()}
    return {**BASE, "ttft_single_ms": singles, "step_fit": {**FIT, "lone_prefill_s": lone}}


def on_line(fixed: float, per_token: float, sizes=LONE) -> dict[str, float]:
    return {k: fixed + per_token * int(k) for k in sizes}


def test_a_step_that_only_prefills_takes_its_own_line_and_floor(profile):
    only = profile.with_(prefill_only_step_s=0.002, prefill_only_tokens_per_s=4000.0,
                         prefill_only_floor_s=0.013)
    assert only.step_s(200, 0) == pytest.approx(0.002 + 0.050)
    assert only.step_s(16, 0) == pytest.approx(0.013)  # 6 ms on the line: the floor
    assert only.step_s(0, 0) == 0.0
    # A decode batch: the general line (10 ms + 1 ms per request + tokens / 1000).
    assert only.step_s(200, 1) == pytest.approx(0.010 + 0.001 + 0.200)
    assert only.step_s(0, 4) == pytest.approx(0.014)
    assert profile.step_s(200, 0) == pytest.approx(0.210)  # without the line
    fitted = EngineProfile.from_json({**BASE, "step_fit": {**FIT, "prefill_only": {
        "step_s": 0.002, "tokens_per_s": 4000.0, "floor_s": 0.013, "steps": 12}}})
    assert fitted.step_s(200, 0) == pytest.approx(0.052) and fitted.step_s(16, 0) == pytest.approx(0.013)
    assert fitted.step_s(200, 1) == pytest.approx(0.006 + 0.001 + 200 / 44000)
    assert not fitted.mixed_prefill_only


def test_a_mixed_step_prices_its_prefill_by_a_line_from_quiet_steps(profile):
    mixed = profile.with_(prefill_only_step_s=0.002, prefill_only_tokens_per_s=4000.0,
                          prefill_only_floor_s=0.013, mixed_prefill_only=True)
    # the line, plus 1 ms per decoding request (not the general line's 10 ms + tokens / 1000)
    assert mixed.step_s(200, 1) == pytest.approx(0.002 + 0.050 + 0.001)
    assert mixed.step_s(200, 0) == pytest.approx(0.052)  # a prefill-only step: as before
    assert mixed.step_s(0, 4) == pytest.approx(0.014)  # decodes alone: as before
    # a small chunk beside decodes never costs less than decoding alone (10 ms fixed)
    assert mixed.step_s(8, 4) == pytest.approx(0.010 + 0.004)
    ctx = mixed.with_(decode_ctx_s_per_token=1e-6)
    assert ctx.step_s(200, 2, 1000) == pytest.approx(0.052 + 0.002 + 0.001)
    # from a profile: only where the line came from quiet steps (the trace recorded arrivals)
    only = {"step_s": 0.002, "tokens_per_s": 4000.0, "floor_s": 0.013, "steps": 12}
    for quiet in (True, False):
        fitted = EngineProfile.from_json({**BASE, "step_fit": {**FIT, "prefill_only": {
            **only, "quiet": quiet}}})
        assert fitted.mixed_prefill_only is quiet
        general = 0.006 + 0.001 + 200 / 44000
        assert fitted.step_s(200, 1) == pytest.approx(0.053 if quiet else general)


def test_the_response_line_goes_through_the_lone_ttfts_less_the_engines_prefills():
    assert response_line(measured(on_line(0.005, 5e-6))) == pytest.approx((0.005, 5e-6))
    three = {k: v for k, v in on_line(0.005, 5e-6).items() if k != "3072"}
    assert response_line(measured(three)) == pytest.approx((0.005, 5e-6))
    two = {k: v for k, v in three.items() if k != "2048"}
    assert response_line(measured(two)) is None
    assert response_line(measured(on_line(0.02, -2e-6))) is None  # shrinks with the prompt
    assert response_line(measured(on_line(-0.002, 5e-6))) is None  # a negative fixed cost
    noisy = dict(zip(LONE, [0.012, 0.006, 0.020, 0.014]))  # R^2 0.22
    assert response_line(measured(noisy)) is None
    assert response_line(measured(noisy), min_explained=0.2) == pytest.approx((0.009455, 2.216e-6), rel=1e-3)


def test_a_profile_takes_the_response_line_else_the_constant():
    p = EngineProfile.from_json(measured(on_line(0.005, 5e-6)))
    assert p.response_s == pytest.approx(0.005)
    assert p.response_of(2048) == pytest.approx(0.005 + 5e-6 * 2048)
    # Two lengths: no line; the constant is the mean gap, 8.2 ms, whatever the prompt.
    flat = EngineProfile.from_json(measured(on_line(0.005, 5e-6, sizes=("256", "1024"))))
    assert flat.response_fixed_s is None and flat.response_s_per_token == 0.0
    assert flat.response_s == pytest.approx((0.00628 + 0.01012) / 2)
    assert flat.response_of(2048) == flat.response_of(16) == flat.response_s


def test_a_profile_takes_its_own_handoff_not_the_step_fits():
    assert EngineProfile.from_json(BASE).handoff_s == 0.0
    assert EngineProfile.from_json({**BASE, "step_fit": {**FIT, "handoff_s": 0.002}}).handoff_s == 0.0
    own = EngineProfile.from_json({**BASE, "handoff_s": 0.001, "step_fit": {**FIT, "handoff_s": 0.002}})
    assert own.handoff_s == 0.001 and own.handoff_window_s == 0.030


def run_prefill_engine(profile, rows, leg="prefill"):
    """First-token times of (arrival, prompt, output) legs on one prefill engine."""
    q, first = EventQueue(), {}
    engine = SimEngine("prefill-0", "prefill", profile, q,
                       lambda r, e: first.setdefault(r.index, q.now), lambda r, e: None,
                       lambda e: None, lambda e, s: None, lambda r, e: None)
    for i, (t, prompt, output) in enumerate(rows):
        req = SimRequest(i, t, prompt, output)
        req.leg = leg
        q.schedule(t, engine.submit_prefill, req)
    q.run()
    return first


def test_the_step_after_a_prefill_serves_its_handoffs(profile):
    plain = profile.with_(async_scheduling=False)
    handing = plain.with_(handoff_s=0.001)
    # A's step (10 + 100 ms) ends at 0.11; B, waiting since 0.05, starts then and hands A over.
    rows = [(0.0, 100, 2), (0.05, 100, 2)]
    assert run_prefill_engine(plain, rows) == pytest.approx({0: 0.11, 1: 0.22})
    assert run_prefill_engine(handing, rows) == pytest.approx({0: 0.11, 1: 0.221})
    # B and C prefill together (10 + 200 ms, 1 ms for A); D's step then hands both over.
    more = [(0.0, 100, 2), (0.05, 100, 2), (0.06, 100, 2), (0.3, 100, 2)]
    assert run_prefill_engine(plain, more) == pytest.approx({0: 0.11, 1: 0.32, 2: 0.32, 3: 0.43})
    assert run_prefill_engine(handing, more) == pytest.approx({0: 0.11, 1: 0.321, 2: 0.321, 3: 0.433})
    # B starting at 0.15, past the 30 ms window after A's step: nothing added.
    late = [(0.0, 100, 2), (0.15, 100, 2)]
    assert run_prefill_engine(handing, late) == pytest.approx({0: 0.11, 1: 0.26})
    # Nothing to hand over: a one-token prefill leg, or a request served whole here.
    assert run_prefill_engine(handing, [(0.0, 100, 1), (0.05, 100, 2)]) == pytest.approx({0: 0.11, 1: 0.22})
    full = run_prefill_engine(handing, rows, leg="full")
    assert full == run_prefill_engine(plain, rows, leg="full") == pytest.approx({0: 0.11, 1: 0.221})
