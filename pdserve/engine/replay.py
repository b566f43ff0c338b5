"""vLLM logits processor that makes an engine replay output a client already has.

A request that continues on another engine (the decode leg after its prefill leg, a migrated
request) carries the outputs the client already has in `SamplingParams.extra_args
["pdserve_replay"]` (from `GenerateRequest.replay_output_tokens`). While the request has
produced fewer outputs than that, this processor leaves only the next replayed token finite in
its row of logits, so the engine samples exactly it. Everything vLLM derives from output tokens
then matches a run on one engine: presence and frequency penalties count them, a seeded
generator advances once per replayed token (a sampling step still draws), a stop string may
span the join, min_tokens counts them. The cost is one engine step per replayed token.

vLLM loads it by name in the engine core process (`logits_processors` in the engine
arguments, `vllm_engine.py`); it applies to every request and does nothing for the others.
Importing this module requires vLLM and torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

REPLAY_KEY = "pdserve_replay"
QUALNAME = f"{__name__}:ReplayLogitsProcessor"


class ReplayLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (tokens to replay, the request's live list of output token ids)
        self._replays: dict[int, tuple[Sequence[int], Sequence[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._replays, batch_update, _new_replay)
        for index in [i for i, (replay, out) in self._replays.items() if len(out) >= len(replay)]:
            del self._replays[index]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (replay, out) in self._replays.items():
            position = len(out)
            if position < len(replay):
                row = logits[index]
                token = replay[position]
                kept = row[token].clone()
                row.fill_(float("-inf"))
                row[token] = kept
        return logits


def _new_replay(params: SamplingParams, _prompt: list[int] | None,
                output_tok_ids: list[int]) -> tuple[Sequence[int], Sequence[int]] | None:
    replay = (params.extra_args or {}).get(REPLAY_KEY)
    if not replay or len(output_tok_ids) >= len(replay):
        return None
    return tuple(replay), output_tok_ids
