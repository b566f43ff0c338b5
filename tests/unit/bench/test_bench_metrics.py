"""Metrics on hand-made timelines, checked against numbers computed by hand (vllm bench serve rules)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.client import RequestOutcome
from pdserve.bench.metrics import compute_metrics, input_length, output_length
from pdserve.slo import SloTargets

pytestmark = pytest.mark.unit


def _ok(
    start: float,
    ttft: float,
    itls: tuple[float, ...],
    output_tokens: int | None,
    prompt_len: int = 10,
    **extra,
) -> RequestOutcome:
    return RequestOutcome(
        success=True,
        prompt_len=prompt_len,
        start_s=start,
        ttft_s=ttft,
        itls_s=itls,
        e2el_s=ttft + sum(itls),
        output_tokens=output_tokens,
        chunk_count=1 + len(itls),
        **extra,
    )


# A: TTFT 100 ms, 4 tokens, E2EL 200 ms -> TPOT (200-100)/3 = 33.33 ms
# B: TTFT 300 ms, 2 tokens, E2EL 400 ms -> TPOT 100 ms
# C: failed
# D: TTFT 50 ms, 1 token -> no TPOT (counts as 0 for goodput)
TIMELINE = (
    _ok(0.0, 0.1, (0.02, 0.03, 0.05), 4, prompt_len=10),
    _ok(0.05, 0.3, (0.1,), 2, prompt_len=20),
    RequestOutcome(success=False, prompt_len=30, error="HTTP 500"),
    _ok(0.1, 0.05, (), 1, prompt_len=40),
)


def test_counts_tokens_and_throughputs_over_successful_requests() -> None:
    metrics = compute_metrics(TIMELINE, duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert metrics.total_input == 10 + 20 + 40  # the failed request's 30 tokens do not count
    assert metrics.total_output == 4 + 2 + 1
    assert metrics.output_lens == (4, 2, 0, 1)
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(3.5)
    assert metrics.total_token_throughput == pytest.approx(77 / 2)


def test_ttft_statistics_match_hand_computation() -> None:
    ttft = compute_metrics(TIMELINE, 1.0, percentiles=(50, 90, 99)).ttft  # values 100, 300, 50 ms
    assert ttft.mean_ms == pytest.approx(150.0)
    assert ttft.median_ms == pytest.approx(100.0)
    assert ttft.std_ms == pytest.approx(math.sqrt(35000 / 3))  # population std, as numpy/vllm
    assert ttft.percentile(90) == pytest.approx(260.0)  # linear: 100 + 0.8 * (300 - 100)
    assert ttft.percentile(99) == pytest.approx(296.0)


def test_tpot_excludes_first_token_and_single_token_requests() -> None:
    metrics = compute_metrics(TIMELINE, 1.0, percentiles=(90,))
    assert metrics.tpots_s == pytest.approx((0.1 / 3, 0.1))
    assert metrics.tpot.mean_ms == pytest.approx((100 / 3 + 100) / 2)
    assert metrics.tpot.percentile(90) == pytest.approx(100 / 3 + 0.9 * (100 - 100 / 3))


def test_itl_pools_every_gap_and_e2el_is_per_request() -> None:
    metrics = compute_metrics(TIMELINE, 1.0, percentiles=(90, 99))
    assert metrics.itl.mean_ms == pytest.approx(50.0)  # gaps 20, 30, 50, 100 ms
    assert metrics.itl.median_ms == pytest.approx(40.0)
    assert metrics.itl.percentile(90) == pytest.approx(85.0)
    assert metrics.itl.percentile(99) == pytest.approx(98.5)
    assert metrics.e2el.mean_ms == pytest.approx((200 + 400 + 50) / 3)
    assert metrics.e2el.median_ms == pytest.approx(200.0)


def test_goodput_counts_requests_meeting_every_target() -> None:
    slo = SloTargets(ttft_ms=150, tpot_ms=50)
    metrics = compute_metrics(TIMELINE, 2.0, slo=slo)
    # A meets both; B misses TTFT and TPOT; D meets TTFT and has TPOT 0; C failed.
    assert metrics.request_goodput == pytest.approx(2 / 2.0)


def test_attainment_is_over_all_requests_and_failures_never_attain() -> None:
    metrics = compute_metrics(TIMELINE, 1.0, slo=SloTargets(ttft_ms=150, tpot_ms=150))
    assert metrics.attainment is not None
    assert dict(metrics.attainment.per_slo) == pytest.approx({"ttft": 2 / 4, "tpot": 3 / 4})
    assert metrics.attainment.all == pytest.approx(2 / 4)
    assert metrics.attainment.as_dict()["all"] == pytest.approx(0.5)


def test_meeting_a_target_exactly_counts_as_good() -> None:
    metrics = compute_metrics(TIMELINE[:1], 1.0, slo=SloTargets(ttft_ms=100))
    assert metrics.request_goodput == pytest.approx(1.0)


def test_no_slo_means_no_attainment() -> None:
    assert compute_metrics(TIMELINE, 1.0).attainment is None


def test_all_failed_gives_zeros_not_nan() -> None:
    failed = [RequestOutcome(success=False, prompt_len=5, error="boom")] * 3
    metrics = compute_metrics(failed, 1.0, slo=SloTargets(ttft_ms=1))
    assert (metrics.completed, metrics.failed, metrics.total_output) == (0, 3, 0)
    assert metrics.ttft.mean_ms == 0.0 and metrics.itl.percentile(99) == 0.0
    assert metrics.attainment is not None and metrics.attainment.all == 0.0
    assert (metrics.max_output_tokens_per_s, metrics.max_concurrent_requests) == (0.0, 0)


def test_output_length_falls_back_to_tokenizer_then_chunks() -> None:
    no_usage = _ok(0.0, 0.1, (0.1, 0.1), None, generated_text="a b c d e")
    assert output_length(no_usage, lambda text: len(text.split())) == 5
    assert output_length(no_usage, None) == 3  # three token chunks
    assert output_length(_ok(0.0, 0.1, (0.1,), 7), lambda text: 999) == 7  # usage wins


def test_input_length_prefers_the_servers_prompt_token_count() -> None:
    assert input_length(_ok(0.0, 0.1, (), 1, prompt_len=10, prompt_tokens=11)) == 11
    assert input_length(_ok(0.0, 0.1, (), 1, prompt_len=10)) == 10


def test_peak_tokens_per_second_and_concurrency() -> None:
    outcomes = [
        _ok(0.0, 0.2, (0.2, 0.2, 0.2), 4),  # tokens at 0.2, 0.4, 0.6, 0.8 s; runs until 0.8 s
        _ok(0.5, 0.2, (0.2, 0.2), 3),  # tokens at 0.7, 0.9, 1.1 s; runs until 1.1 s
        _ok(1.5, 0.1, (), 1),  # token at 1.6 s
    ]
    metrics = compute_metrics(outcomes, 2.0)
    assert metrics.max_output_tokens_per_s == 6.0  # bucket [0, 1): 4 + 2 tokens
    assert metrics.max_concurrent_requests == 2


@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        (["ttft:200", "tpot:50"], SloTargets(ttft_ms=200, tpot_ms=50)),
        (["e2el:1000.5"], SloTargets(e2el_ms=1000.5)),
        ([], SloTargets()),
    ],
)
def test_parse_goodput_pairs(pairs: list[str], expected: SloTargets) -> None:
    assert SloTargets.parse(pairs) == expected


@pytest.mark.parametrize("bad", ["ttft", "latency:10", "ttft:fast", "tpot:-1"])
def test_parse_goodput_rejects_malformed_pairs(bad: str) -> None:
    with pytest.raises(ValueError):
        SloTargets.parse([bad])


def test_duration_must_be_positive() -> None:
    with pytest.raises(ValueError):
        compute_metrics(TIMELINE, 0.0)
