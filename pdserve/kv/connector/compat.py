"""Every difference between the vLLM versions the connector supports (0.24 - 0.33), in one place.

- Completion reports. 0.24 has only `get_finished()`; 0.32 calls `get_transfer_results()`,
  whose default wraps `get_finished()`. The connector implements `get_finished()` only.
- Failed loads. Both read `get_block_ids_with_load_errors()` and apply `kv_load_failure_policy`
  (0.32 also offers `failed_recving`). The connector reports a failed pull's blocks there, in
  the same pass that reports the request finished receiving.
- `start_load_kv` runs before the forward on 0.24 and after it on 0.32 (unless a load is
  synchronous). The connector applies each step's plan in the first hook of the step
  (`bind_connector_metadata`, before the forward on both) and makes later hooks no-ops.
- `request_finished` gets every allocated block on 0.24 and the computed tokens' blocks on 0.32;
  `prompt_block_ids` keeps only the prompt's.
- Preempted-and-resumed requests: `CachedRequestData.resumed_req_ids` (older releases:
  `resumed_from_preemption`); `iter_scheduled` reads either.
- 0.32's scheduler-side `bind_kv_cache_manager` is not used: block ids come from
  `update_state_after_alloc` and the scheduler output, which both versions provide.
- Where the KV-heads axis of a layer's KV tensor sits (`heads_axis`): 0.32 views every layer as
  [B, H, N, C] (`vllm.v1.kv_cache_layout`; C = K and V of a head, 2*head_size); 0.24's
  FlashAttention [2, B, N, H, D] and FlashInfer / Triton [B, 2, N, H, D] put H just before
  head_size (FlashInfer's HND order is a stride permutation of that logical shape).

Only attribute access happens here; vLLM is imported lazily and only for names both versions
share, so this module (and the pure scheduler side) import without vLLM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kv.connector.metadata import prompt_blocks

__all__ = [
    "FinishKind",
    "KVHeads",
    "ScheduledRequest",
    "block_ids_of",
    "finish_kind",
    "heads_axis",
    "iter_scheduled",
    "kv_heads_of",
    "kv_num_blocks",
    "model_id_of",
    "prompt_block_ids",
    "tp_rank_and_size",
]


class FinishKind:
    """How a request ended, from vLLM's RequestStatus names (stable across versions)."""

    LENGTH = "length"  # FINISHED_LENGTH_CAPPED: the prefill's max_tokens=1 was reached
    STOPPED = "stopped"  # FINISHED_STOPPED: EOS or a stop token; nothing left to decode
    ABORTED = "aborted"  # FINISHED_ABORTED, _ERROR, _IGNORED, or anything unknown
    RUNNING = "running"  # not finished (should not reach request_finished)


def finish_kind(request: Any) -> str:
    """Classifies `request.status`; called once per finished request."""
    name = getattr(getattr(request, "status", None), "name", "")
    if name == "FINISHED_LENGTH_CAPPED":
        return FinishKind.LENGTH
    if name == "FINISHED_STOPPED":
        return FinishKind.STOPPED
    if name.startswith("FINISHED_"):
        return FinishKind.ABORTED
    return FinishKind.RUNNING


def block_ids_of(blocks: Any) -> list[int]:
    """The single KV cache group's block ids of a `KVCacheBlocks` (both versions pass every block
    of the request to `update_state_after_alloc`). The connector disables hybrid KV groups by not
    declaring `SupportsHMA`, so there is exactly one group."""
    groups = blocks.get_block_ids()
    return [int(b) for b in groups[0]] if groups else []


def prompt_block_ids(block_ids: Sequence[int], num_prompt_tokens: int, block_size: int) -> list[int] | None:
    """The blocks holding the prompt, from what `request_finished` got (0.24: all allocated
    blocks; 0.32: those of computed tokens); None if there are fewer than the prompt needs."""
    needed = prompt_blocks(num_prompt_tokens, block_size)
    if len(block_ids) < needed:
        return None
    return [int(b) for b in block_ids[:needed]]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request in a scheduler step, as far as the connector cares."""

    request_id: str
    new_block_ids: tuple[int, ...] | None  # group 0's new blocks, or None when none were added
    replaces: bool  # True: new_block_ids is the whole block list (new or resumed request)
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


def iter_scheduled(scheduler_output: Any) -> Iterator[ScheduledRequest]:
    """The requests scheduled in a `SchedulerOutput`, new and cached alike."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        group = _group0(new.block_ids)
        yield ScheduledRequest(
            new.req_id, group, True, int(new.num_computed_tokens), int(scheduled.get(new.req_id, 0))
        )
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is None:
        return
    resumed = _resumed_flags(cached)
    for i, req_id in enumerate(cached.req_ids):
        yield ScheduledRequest(
            req_id,
            _group0(cached.new_block_ids[i]),
            resumed[i],
            int(cached.num_computed_tokens[i]),
            int(scheduled.get(req_id, 0)),
        )


def _group0(block_ids: Any) -> tuple[int, ...] | None:
    if block_ids is None or len(block_ids) == 0:
        return None
    return tuple(int(b) for b in block_ids[0])


def _resumed_flags(cached: Any) -> list[bool]:
    resumed_ids = getattr(cached, "resumed_req_ids", None)
    if resumed_ids is not None:
        return [req_id in resumed_ids for req_id in cached.req_ids]
    flags = getattr(cached, "resumed_from_preemption", None)  # before resumed_req_ids existed
    return [bool(f) for f in flags] if flags is not None else [False] * len(cached.req_ids)


def kv_num_blocks(kv_cache_config: Any) -> int:
    """Blocks per KV tensor as the scheduler counts them."""
    return int(kv_cache_config.num_blocks)


def model_id_of(vllm_config: Any) -> str:
    """The model's name for the transport's compatibility check: the served name if set."""
    model_config = vllm_config.model_config
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model_config.model)


def tp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's tensor-parallel rank and the TP size; worker process only."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), int(vllm_config.parallel_config.tensor_parallel_size)


@dataclass(frozen=True, slots=True)
class KVHeads:
    """The model's KV heads as a worker's KV tensors hold them."""

    total: int  # the model's KV heads; 1 for MLA, whose latent every rank holds whole
    local: int  # this TP rank's
    head_size: int


def kv_heads_of(vllm_config: Any) -> KVHeads:
    """The KV heads of the engine's model; worker process, once at start."""
    model_config = vllm_config.model_config
    local = int(model_config.get_num_kv_heads(vllm_config.parallel_config))
    total = 1 if getattr(model_config, "use_mla", False) else int(model_config.get_total_num_kv_heads())
    return KVHeads(total, local, int(model_config.get_head_size()))


def _views_bhnc() -> bool:
    """0.32+: every layer's KV is a logical [B, H, N, C] view."""
    return importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


def heads_axis(shape: Sequence[int], heads: KVHeads, *, bhnc: bool | None = None) -> int | None:
    """The KV-heads axis of a layer's KV tensor of `shape` (as vLLM hands it, before any
    kernel-block split), or None when the layout is not one described above. `bhnc` overrides
    the installed version's rule (tests)."""
    bhnc = _views_bhnc() if bhnc is None else bhnc
    if bhnc:
        axis = 1 if len(shape) == 4 else None
    else:
        axis = len(shape) - 2 if len(shape) >= 4 and shape[-1] == heads.head_size else None
    return axis if axis is not None and shape[axis] == heads.local else None
