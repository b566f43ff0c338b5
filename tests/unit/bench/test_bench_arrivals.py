"""Arrival schedules: vllm's gamma/Poisson semantics, determinism, trace replay."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalSpec, rate_offsets, schedule, trace_offsets

pytestmark = pytest.mark.unit

N = 20_000


def _gaps(rate: float, burstiness: float, seed: int = 0, count: int = N) -> np.ndarray:
    offsets = rate_offsets(count, rate, burstiness, np.random.default_rng(seed))
    return np.diff(np.concatenate(([0.0], offsets)))


def test_poisson_gaps_have_mean_one_over_rate_and_unit_cv() -> None:
    gaps = _gaps(rate=10.0, burstiness=1.0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_variance(burstiness: float) -> None:
    rate = 5.0
    gaps = _gaps(rate, burstiness)
    # Gamma(k = burstiness, theta = 1/(rate*k)): variance k * theta^2 = 1 / (rate^2 * burstiness).
    assert gaps.var() == pytest.approx(1.0 / (rate**2 * burstiness), rel=0.1)


def test_last_arrival_is_rescaled_to_num_requests_over_rate() -> None:
    offsets = rate_offsets(500, 4.0, 1.0, np.random.default_rng(3))
    assert offsets[-1] == pytest.approx(500 / 4.0)
    assert np.all(np.diff(offsets) >= 0)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_is_regular() -> None:
    assert np.all(rate_offsets(5, math.inf, 1.0, np.random.default_rng(0)) == 0.0)
    regular = rate_offsets(4, 2.0, math.inf, np.random.default_rng(0))
    assert regular == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    spec = ArrivalSpec(request_rate=3.0, burstiness=0.5)
    first = schedule(spec, 100, np.random.default_rng(7))
    assert np.array_equal(first, schedule(spec, 100, np.random.default_rng(7)))
    assert not np.array_equal(first, schedule(spec, 100, np.random.default_rng(8)))


def test_trace_offsets_start_at_zero_and_scale_with_speedup() -> None:
    assert trace_offsets([2.0, 3.0, 6.0]) == pytest.approx([0.0, 1.0, 4.0])
    assert trace_offsets([2.0, 3.0, 6.0], speedup=2.0) == pytest.approx([0.0, 0.5, 2.0])
    with pytest.raises(ValueError):
        trace_offsets([0.0, None])


def test_schedule_uses_trace_timestamps_when_asked() -> None:
    spec = ArrivalSpec(use_trace_timestamps=True, trace_speedup=10.0)
    offsets = schedule(spec, 3, np.random.default_rng(0), [0.0, 5.0, 10.0])
    assert offsets == pytest.approx([0.0, 0.5, 1.0])
    with pytest.raises(ValueError):
        schedule(spec, 4, np.random.default_rng(0), [0.0, 5.0, 10.0])


@pytest.mark.parametrize(
    "kwargs", [{"request_rate": 0.0}, {"request_rate": -1.0}, {"burstiness": 0.0}, {"trace_speedup": 0.0}]
)
def test_arrival_spec_rejects_non_positive_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArrivalSpec(**kwargs)


def test_distribution_names_follow_vllm() -> None:
    assert ArrivalSpec(request_rate=1.0).distribution == "Poisson process"
    assert ArrivalSpec(request_rate=1.0, burstiness=0.5).distribution == "Gamma distribution"
    assert ArrivalSpec(use_trace_timestamps=True).distribution == "trace timestamps"
