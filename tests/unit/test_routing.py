"""The pure routing policy: placement by predicted TTFT and decode headroom, conditional
disaggregation, admission."""

import pytest

from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.routing import (
    EngineLoad, Placement, Rejection, RouteRequest, RoutingPolicy, SloTargets,
    local_prefill_limit, place, place_colocated, predicted_ttft,
)

pytestmark = pytest.mark.unit

# 1000 prompt tokens/s, 10 ms + 1 ms per running request per decode step, 1 GB/s KV pulls of
# 1 KB per token (1 us per token), no fixed costs: easy numbers to check by hand.
MODEL = PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.010, decode_step_per_seq_s=0.001,
                  kv_bytes_per_token=1000, transfer_bytes_per_s=1e9)
SLO = SloTargets.from_s(1.0, 0.020)


def test_prefill_goes_to_the_engine_with_the_lowest_predicted_ttft():
    prefill = [EngineLoad("p0", queued_prefill_tokens=900), EngineLoad("p1", queued_prefill_tokens=300),
               EngineLoad("p2", queued_prefill_tokens=600)]
    decode = [EngineLoad("d0")]
    placed = place(RouteRequest(200, 10), prefill, decode, MODEL, MODEL)
    assert isinstance(placed, Placement) and placed.prefill == "p1" and placed.reason == "remote"
    # (300 queued + 200 own) / 1000 tok/s; the first token is the prefill engine's
    assert placed.predicted_ttft_s == pytest.approx(0.5)
    assert placed.queued_ahead_tokens == 300


def test_the_kv_pull_delays_token_two_not_the_first():
    placed = place(RouteRequest(2000, 10), [EngineLoad("p0")], [EngineLoad("d0")], MODEL, MODEL)
    assert placed.predicted_ttft_s == pytest.approx(2.0)
    # One decode step at batch 1 (11 ms) + the 2 ms pull of 2000 tokens spread over 10 tokens.
    assert placed.predicted_tpot_s == pytest.approx(0.011 + 0.002 / 10)


def test_prefix_cache_hits_lower_the_predicted_ttft():
    prefill = [EngineLoad("p0", queued_prefill_tokens=100), EngineLoad("p1", queued_prefill_tokens=300)]
    # p1 holds 900 of the 1000 prompt tokens: 300 + 100 beats 100 + 1000.
    request = RouteRequest(1000, 10, cached_tokens={"p1": 900})
    assert predicted_ttft(prefill[1], request, MODEL) == pytest.approx(0.4)
    placed = place(request, prefill, [EngineLoad("d0")], MODEL, MODEL)
    assert placed.prefill == "p1"


def test_decode_goes_where_the_batch_is_smaller_and_kv_fits():
    decode = [EngineLoad("d0", num_decoding=30), EngineLoad("d1", num_decoding=5, kv_free_blocks=3),
              EngineLoad("d2", num_decoding=12)]
    placed = place(RouteRequest(100, 100), [EngineLoad("p0")], decode, MODEL, MODEL)
    # d1 would be the fastest but needs ceil(200 / 16) = 13 free blocks and has 3.
    assert placed.decode == "d2"
    # Batch 13 with this request, plus the 100-token pull (0.1 ms) spread over 100 tokens.
    assert placed.predicted_tpot_s == pytest.approx(0.010 + 0.001 * 13 + 0.0001 / 100)


def test_unhealthy_and_draining_engines_get_nothing():
    prefill = [EngineLoad("p0", healthy=False), EngineLoad("p1", queued_prefill_tokens=5000),
               EngineLoad("p2", accepting=False)]
    decode = [EngineLoad("d0", accepting=False), EngineLoad("d1", num_decoding=50)]
    placed = place(RouteRequest(10, 10), prefill, decode, MODEL, MODEL)
    assert (placed.prefill, placed.decode) == ("p1", "d1")
    assert isinstance(place(RouteRequest(10, 10), prefill, [EngineLoad("d", healthy=False)],
                            MODEL, MODEL), Rejection)


def test_short_prompts_are_prefilled_on_the_decode_engine_when_that_is_faster():
    prefill = [EngineLoad("p0", queued_prefill_tokens=2000)]
    decode = [EngineLoad("d0")]
    # Model-derived limit: one TPOT (20 ms) of stall at 1000 tok/s = 20 tokens.
    assert local_prefill_limit(RoutingPolicy(), MODEL, SLO) == 20
    short = place(RouteRequest(15, 50), prefill, decode, MODEL, MODEL, SLO)
    assert short.local and short.decode == "d0" and short.reason == "local_short_prompt"
    long = place(RouteRequest(500, 50), prefill, decode, MODEL, MODEL, SLO)
    assert long.prefill == "p0"
    # A configured threshold wins; 0 disables local prefill.
    never = place(RouteRequest(15, 50), prefill, decode, MODEL, MODEL, SLO,
                  RoutingPolicy(local_prefill_max_tokens=0))
    assert never.prefill == "p0"


def test_prompts_mostly_cached_on_the_decode_engine_stay_there():
    request = RouteRequest(1000, 50, cached_tokens={"d0": 990})
    placed = place(request, [EngineLoad("p0")], [EngineLoad("d0")], MODEL, MODEL, SLO)
    assert placed.local and placed.reason == "local_cached"
    assert placed.predicted_ttft_s == pytest.approx(0.010)


def test_local_prefill_is_not_chosen_when_remote_predicts_a_lower_ttft():
    decode = [EngineLoad("d0", queued_prefill_tokens=500)]
    placed = place(RouteRequest(15, 50), [EngineLoad("p0")], decode, MODEL, MODEL, SLO)
    assert placed.prefill == "p0"


def test_admission_refuses_when_the_ttft_slo_cannot_be_met():
    prefill = [EngineLoad("p0", queued_prefill_tokens=10_000)]
    slo = SloTargets.from_s(1.0, 0.05)
    refused = place(RouteRequest(1000, 10), prefill, [EngineLoad("d0")], MODEL, MODEL, slo,
                    RoutingPolicy(admit_ttft_factor=4.0))
    assert isinstance(refused, Rejection) and refused.reason == "ttft_slo"
    # 11 s predicted vs 4 s allowed: retry in about 7 s.
    assert refused.retry_after_s == pytest.approx(11.0 - 4.0, rel=1e-3)
    # Without an SLO nothing is refused, however long the queue.
    assert isinstance(place(RouteRequest(1000, 10), prefill, [EngineLoad("d0")], MODEL, MODEL),
                      Placement)


def test_admission_never_refuses_a_request_that_would_start_at_once():
    # A model that says a lone 1000-token prefill takes 100 s (10 tok/s): 25x the allowed 4 s.
    slow = PerfModel(prefill_tokens_per_s=10, decode_step_s=0.010, decode_step_per_seq_s=0.001,
                     kv_bytes_per_token=1000, transfer_bytes_per_s=1e9)
    slo = SloTargets.from_s(1.0, 0.05)
    idle = place(RouteRequest(1000, 10), [EngineLoad("p0")], [EngineLoad("d0")], slow, slow, slo)
    assert isinstance(idle, Placement) and idle.predicted_ttft_s == pytest.approx(100.0)
    alone = place_colocated(RouteRequest(1000, 10), [EngineLoad("c0")], slow, slo)
    assert isinstance(alone, Placement)
    # With a queue ahead the same model sheds load, remote, local or colocated alike.
    queued = [EngineLoad("p0", queued_prefill_tokens=1)]
    assert isinstance(place(RouteRequest(1000, 10), queued, [EngineLoad("d0")], slow, slow, slo),
                      Rejection)
    assert isinstance(place_colocated(RouteRequest(1000, 10), [EngineLoad("c0", queued_prefill_tokens=1)],
                                      slow, slo), Rejection)
    # One idle engine among busy ones is enough.
    mixed = [EngineLoad("p0", queued_prefill_tokens=5000), EngineLoad("p1")]
    assert place(RouteRequest(1000, 10), mixed, [EngineLoad("d0")], slow, slow, slo).prefill == "p1"


def test_admission_refuses_when_no_decode_engine_has_room_for_the_kv():
    decode = [EngineLoad("d0", kv_free_blocks=10, block_size=16)]
    refused = place(RouteRequest(1000, 100), [EngineLoad("p0")], decode, MODEL, MODEL, SLO)
    assert isinstance(refused, Rejection) and refused.reason == "kv_capacity"


def test_colocated_placement_balances_ttft_then_batch():
    engines = [EngineLoad("c0", queued_prefill_tokens=100), EngineLoad("c1", num_decoding=3),
               EngineLoad("c2", num_decoding=1)]
    placed = place_colocated(RouteRequest(10, 10), engines, MODEL)
    assert placed.decode == "c2" and placed.prefill is None
    # A flat decode cost still spreads requests: ties go to the smaller batch.
    flat = PerfModel(prefill_tokens_per_s=1000, decode_step_s=0.01)
    tied = [EngineLoad("c0", num_decoding=1), EngineLoad("c1", num_decoding=0)]
    assert place_colocated(RouteRequest(10, 10), tied, flat).decode == "c1"




def test_a_prefill_engine_without_kv_room_for_the_prompt_gets_nothing():
    # p0 is idle but its KV is held by prompts waiting to be pulled (it reports few free
    # blocks); p1 is busier and has room. A 320-token prompt needs 20 blocks of 16.
    prefill = [EngineLoad("p0", kv_free_blocks=5), EngineLoad("p1", queued_prefill_tokens=400)]
    placed = place(RouteRequest(320, 10), prefill, [EngineLoad("d0")], MODEL, MODEL)
    assert placed.prefill == "p1"
    # With no prefill engine that has room, the decode engine prefills the prompt itself.
    placed = place(RouteRequest(320, 10), prefill[:1], [EngineLoad("d0")], MODEL, MODEL)
    assert placed.prefill is None and placed.decode == "d0"


# --- adaptive disaggregation (overflow_ttft_share) ------------------------------------------
ADAPTIVE = RoutingPolicy(overflow_ttft_share=0.5)


def test_a_prefill_pool_behind_the_target_overflows_long_prompts_to_the_decode_engines():
    # p0 has 900 tokens queued: a 500-token prompt would see its first token after 1.4 s, past
    # the 1 s target; d0 prefills it at once (0.5 s) and its TPOT stays 11 ms + 0.5 s / 100.
    prefill, decode = [EngineLoad("p0", queued_prefill_tokens=900)], [EngineLoad("d0")]
    request = RouteRequest(500, 100)
    assert place(request, prefill, decode, MODEL, MODEL, SLO).prefill == "p0"  # off: never
    placed = place(request, prefill, decode, MODEL, MODEL, SLO, ADAPTIVE)
    assert placed.local and placed.decode == "d0" and placed.reason == "overflow"
    assert placed.predicted_ttft_s == pytest.approx(0.5)
    assert placed.predicted_tpot_s == pytest.approx(0.011 + 0.5 / 100)


def test_a_prefill_pool_keeping_up_keeps_every_long_prompt():
    # 400 queued: 0.9 s predicted, above half the target (0.5 s) -> overflow; 0 queued: 0.5 s,
    # not above it -> remote, even though d0 is as fast.
    request = RouteRequest(500, 100)
    behind = place(request, [EngineLoad("p0", queued_prefill_tokens=400)], [EngineLoad("d0")],
                   MODEL, MODEL, SLO, ADAPTIVE)
    keeping_up = place(request, [EngineLoad("p0")], [EngineLoad("d0")], MODEL, MODEL, SLO, ADAPTIVE)
    assert behind.reason == "overflow" and keeping_up.reason == "remote"


def test_overflow_never_takes_a_decode_engine_past_the_tpot_target():
    # d0's batch of 5 decodes at 16 ms; prefilling 500 tokens there adds 5 ms per token of a
    # 100-token request: 21 ms > 20 ms. d1 (batch 1) has room; with only d0, the prompt stays
    # queued on the prefill engine.
    prefill = [EngineLoad("p0", queued_prefill_tokens=900)]
    request = RouteRequest(500, 100)
    busy = [EngineLoad("d0", num_decoding=5)]
    assert place(request, prefill, busy, MODEL, MODEL, SLO, ADAPTIVE).prefill == "p0"
    roomy = place(request, prefill, busy + [EngineLoad("d1")], MODEL, MODEL, SLO, ADAPTIVE)
    assert roomy.local and roomy.decode == "d1"
    # Prompts already queued on a decode engine count against its TPOT too.
    queued = [EngineLoad("d0", queued_prefill_tokens=600)]
    assert place(request, prefill, queued, MODEL, MODEL, SLO, ADAPTIVE).prefill == "p0"


def test_overflow_needs_an_slo():
    request = RouteRequest(500, 100)
    placed = place(request, [EngineLoad("p0", queued_prefill_tokens=5000)], [EngineLoad("d0")],
                   MODEL, MODEL, None, ADAPTIVE)
    assert placed.prefill == "p0"
