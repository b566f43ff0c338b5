"""lm-evaluation-harness scores the same on the colocated and the disaggregated service.

lm-eval's `local-completions` model runs a local 40-question multiple-choice task
(`lm_eval_task/`) against each service's /v1/completions: 160 echo + logprobs requests, each
scoring one choice by its prompt logprobs. A disaggregated service whose prefill engine or KV
transfer changed a single prompt logprob would change a choice's loglikelihood here, and an
accuracy if it changed which choice wins.
"""

from __future__ import annotations

import httpx
import pytest

from .conftest import LOCAL_PREFILL_MAX_TOKENS, MODEL
from .lm_eval_task_run import TaskScores, request_prompts, run_task

pytestmark = pytest.mark.integration

# Float32 on CPU: the two services run the same kernels on the same tokens, so their logprobs
# agree far closer than this; the task's closest two choices are 0.008 apart (vLLM's own server),
# so loglikelihoods this close cannot change an answer.
LOGLIKELIHOOD_TOLERANCE = 1e-4
# Chance is 0.25; vLLM 0.32's own OpenAI server scores 0.575 (23/40, acc and acc_norm). Logprobs
# read from the wrong positions tie or scramble the choices and fall near chance.
MIN_ACCURACY = 0.45


@pytest.fixture(scope="module")
def colocated_scores(colocated, embedded_checkpoint) -> TaskScores:
    return run_task(colocated.base_url, MODEL, embedded_checkpoint)


@pytest.fixture(scope="module")
def disaggregated_scores(disaggregated, embedded_checkpoint) -> TaskScores:
    return run_task(disaggregated.base_url, MODEL, embedded_checkpoint)


def test_task_prompts_take_the_prefill_engine(disaggregated, embedded_checkpoint):
    """Every prompt of the task is longer than the local-prefill limit, so each was prefilled on
    the prefill engine and its logprobs crossed the KV transfer: the shortest one shows it."""
    shortest = min(request_prompts(embedded_checkpoint), key=len)
    assert len(shortest) > LOCAL_PREFILL_MAX_TOKENS

    # The request lm-eval sends for a choice (lm_eval.models.openai_completions).
    response = httpx.post(f"{disaggregated.base_url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": [shortest], "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True})

    assert response.status_code == 200, response.text
    assert response.headers.get("x-pdserve-prefill-engine", "").startswith("prefill-"), \
        dict(response.headers)
    # lm-eval reads one logprob per prompt token and one for the generated token.
    assert len(response.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(shortest) + 1


def test_accuracy_is_the_same(colocated_scores, disaggregated_scores):
    assert colocated_scores.acc >= MIN_ACCURACY, colocated_scores
    assert disaggregated_scores.acc == colocated_scores.acc
    assert disaggregated_scores.acc_norm == colocated_scores.acc_norm


def test_choice_loglikelihoods_are_the_same(colocated_scores, disaggregated_scores):
    colocated, disaggregated = (
        [loglikelihood for choices in scores.choice_loglikelihoods for loglikelihood in choices]
        for scores in (colocated_scores, disaggregated_scores))
    assert len(colocated) == 160  # 40 questions, 4 choices each, question by question
    assert disaggregated == pytest.approx(colocated, abs=LOGLIKELIHOOD_TOLERANCE)
