"""The `pdserve_easy_mc` task's data: questions.jsonl beside this file, as one `test` split.

lm-eval calls `load` (the YAML's `custom_dataset`) with the task's metadata as keyword arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

QUESTIONS = Path(__file__).with_name("questions.jsonl")


def load(**_metadata) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
