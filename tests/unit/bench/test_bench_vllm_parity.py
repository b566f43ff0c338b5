"""Our metrics against vllm's own `calculate_metrics` on the same random timelines.

Marked slow: importing vllm takes seconds. Run with `-m slow`; skipped where vllm is not installed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.bench.client import RequestOutcome
from pdserve.bench.metrics import compute_metrics, input_length
from pdserve.slo import SloTargets

pytestmark = [pytest.mark.unit, pytest.mark.slow]

PERCENTILES = [50.0, 90.0, 99.0, 99.9]


def _random_outcomes(seed: int, count: int = 300) -> list[RequestOutcome]:
    rng = random.Random(seed)
    outcomes = []
    for _ in range(count):
        if rng.random() < 0.1:
            outcomes.append(RequestOutcome(success=False, prompt_len=5, error="HTTP 503"))
            continue
        tokens = rng.randint(1, 40)
        itls = tuple(rng.uniform(0.005, 0.2) for _ in range(tokens - 1))
        ttft = rng.uniform(0.01, 2.0)
        outcomes.append(
            RequestOutcome(
                success=True,
                prompt_len=rng.randint(1, 900),
                prompt_tokens=rng.choice([None, rng.randint(1, 900)]),
                start_s=rng.uniform(0.0, 30.0),
                ttft_s=ttft,
                itls_s=itls,
                e2el_s=ttft + sum(itls),
                output_tokens=tokens,
                chunk_count=tokens,
            )
        )
    return outcomes


def _vllm_outputs(outcomes: list[RequestOutcome]) -> list:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    outputs = []
    for outcome in outcomes:
        output = RequestFuncOutput()
        output.success, output.error = outcome.success, outcome.error
        output.prompt_len = input_length(outcome)  # what vllm's client stores after reading usage
        output.ttft, output.itl, output.latency = outcome.ttft_s, list(outcome.itls_s), outcome.e2el_s
        output.output_tokens, output.start_time = outcome.output_tokens, outcome.start_s
        outputs.append(output)
    return outputs


@pytest.mark.parametrize("seed", [0, 1])
def test_metrics_equal_vllm_calculate_metrics(seed: int) -> None:
    serve = pytest.importorskip("vllm.benchmarks.serve")
    outcomes = _random_outcomes(seed)
    slo = SloTargets(ttft_ms=500, tpot_ms=60, e2el_ms=3000)
    theirs, their_lens = serve.calculate_metrics(
        input_requests=None,
        outputs=_vllm_outputs(outcomes),
        dur_s=11.0,
        tokenizer=None,
        selected_percentiles=PERCENTILES,
        goodput_config_dict=slo.as_dict(),
    )
    ours = compute_metrics(outcomes, 11.0, PERCENTILES, slo)
    for name in (
        "completed",
        "failed",
        "total_input",
        "total_output",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
    ):
        assert getattr(ours, name) == pytest.approx(getattr(theirs, name), rel=1e-12), name
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = ours.stats(metric)
        assert stats.mean_ms == pytest.approx(getattr(theirs, f"mean_{metric}_ms"), rel=1e-12)
        assert stats.median_ms == pytest.approx(getattr(theirs, f"median_{metric}_ms"), rel=1e-12)
        assert stats.std_ms == pytest.approx(getattr(theirs, f"std_{metric}_ms"), rel=1e-12)
        their_percentiles = [value for _, value in getattr(theirs, f"percentiles_{metric}_ms")]
        assert np.allclose([value for _, value in stats.percentiles_ms], their_percentiles, rtol=1e-12)
    assert list(ours.output_lens) == list(their_lens)
