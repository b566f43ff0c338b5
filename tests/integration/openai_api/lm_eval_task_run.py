"""Run the local lm-eval task (`lm_eval_task/`, 40 four-choice questions) against an
OpenAI-compatible server's /v1/completions with lm-eval's `local-completions` model.

lm-eval scores a multiple-choice question by one loglikelihood request per choice: the prompt is
the question plus that choice as token ids, sent with `echo`, `logprobs=1` and `max_tokens=1`; it
sums the echoed prompt logprobs of the choice's tokens. So 40 questions make 160 requests. The
tokenizer is the local checkpoint's (lm-eval needs one to split context from continuation), so
nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TASK_DIR = Path(__file__).with_name("lm_eval_task")
TASK = "pdserve_easy_mc"


@dataclass(frozen=True, slots=True)
class TaskScores:
    """What lm-eval measured: the task's accuracies and, per question (in the dataset's order),
    the summed loglikelihood of each choice."""

    acc: float
    acc_norm: float
    choice_loglikelihoods: tuple[tuple[float, ...], ...]


def run_task(base_url: str, model: str, tokenizer: Path) -> TaskScores:
    """Score the task against the server at `base_url` (http://HOST:PORT) serving `model`, one
    request at a time and without retries (a failed request fails the run)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{base_url}/v1/completions",
            "model": model,
            "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface",
            "num_concurrent": 1,
            # tenacity's stop_after_attempt: 1 is one attempt, no retry.
            "max_retries": 1,
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=1,
        log_samples=True,
        # No standard errors: bootstrapping them costs seconds and the tests compare means.
        bootstrap_iters=0,
    )
    metrics = results["results"][TASK]
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return TaskScores(
        acc=metrics["acc,none"],
        acc_norm=metrics["acc_norm,none"],
        choice_loglikelihoods=tuple(
            tuple(float(loglikelihood) for loglikelihood, _is_greedy in sample["filtered_resps"])
            for sample in samples),
    )


def request_prompts(tokenizer: Path) -> list[list[int]]:
    """The prompts lm-eval sends for the task, one per question and choice, as token ids: the
    question's text, lm-eval's target delimiter (a space) and the choice, tokenized whole with
    `tokenizer` without special tokens (lm-eval's `local-completions` with `add_bos_token` off)."""
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    task = TaskManager(include_path=str(TASK_DIR)).load([TASK])["tasks"][TASK]
    encode = AutoTokenizer.from_pretrained(tokenizer)
    return [encode(task.doc_to_text(doc) + task.config.target_delimiter + choice,
                   add_special_tokens=False).input_ids
            for doc in task.test_docs() for choice in task.doc_to_choice(doc)]
