"""vLLM logits processor for requests that continue output a client already has.

Two cases, both named in `SamplingParams.extra_args`:

- `pdserve_replay`: outputs the engine must produce again, forced, before it samples freely (a
  migrated request; a seeded decode leg). While the request has produced fewer outputs than
  that, only the next replayed token stays finite in its row of logits, so the engine samples
  exactly it, and everything vLLM derives from output tokens then matches a run on one engine:
  presence and frequency penalties count them, a seeded generator advances once per replayed
  token (a sampling step still draws), a stop string may span the join, min_tokens counts them.
  One engine step per replayed token.
- `pdserve_prior`: output tokens that sit at the end of the prompt instead (a decode leg
  continuing after token 1, `GenerateRequest.prior_output_tokens`). vLLM's presence and
  frequency penalties count output tokens only; this adds what those tokens contribute, so the
  penalties come out as if they were output: frequency x their count, and presence for a token
  the request has not produced itself.

vLLM loads it by name in the engine core process (`logits_processors` in the engine arguments,
`vllm_engine.py`); it applies to every request and does nothing for the others. Importing this
module requires vLLM and torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

REPLAY_KEY = "pdserve_replay"
PRIOR_KEY = "pdserve_prior"
QUALNAME = f"{__name__}:ReplayLogitsProcessor"  # vLLM's logits_processors name form


@dataclass(slots=True)
class _Continued:
    replay: tuple[int, ...]
    prior: dict[int, int]  # prior output token -> its count
    presence: float
    frequency: float
    output: Sequence[int]  # the request's live list of output token ids


class ReplayLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._requests: dict[int, _Continued] = {}  # by batch index

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._requests, batch_update, _new_request)
        done = [i for i, r in self._requests.items() if not r.prior and len(r.output) >= len(r.replay)]
        for index in done:
            del self._requests[index]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, r in self._requests.items():
            row = logits[index]
            position = len(r.output)
            if position < len(r.replay):
                token = r.replay[position]
                kept = row[token].clone()
                row.fill_(float("-inf"))
                row[token] = kept
                continue
            for token, count in r.prior.items():
                row[token] -= r.frequency * count + (r.presence if token not in r.output else 0.0)
        return logits


def _new_request(params: SamplingParams, _prompt: list[int] | None,
                 output_tok_ids: list[int]) -> _Continued | None:
    extra = params.extra_args or {}
    replay = tuple(extra.get(REPLAY_KEY) or ())
    presence, frequency = params.presence_penalty or 0.0, params.frequency_penalty or 0.0
    prior = dict(Counter(extra.get(PRIOR_KEY) or ())) if presence or frequency else {}
    if len(output_tok_ids) >= len(replay) and not prior:
        return None
    return _Continued(replay, prior, presence, frequency, output_tok_ids)
