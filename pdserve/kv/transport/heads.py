"""Which KV heads each tensor-parallel rank holds, and which heads two peers exchange.

vLLM shards attention KV heads over TP ranks: rank i of TP size T holds heads
[i*H/T, (i+1)*H/T) of the model's H; when T > H every head is replicated on T/H consecutive
ranks (rank i holds head i*H//T). A decode rank pulls, from every prefill rank whose heads
intersect its own, the intersection; with replicas to choose from it takes one. Both ends of a
pull derive the same intersection from the two layouts exchanged at handshake, and move the
matching head slice of each block (`BlockRegion.narrow_heads`), so blocks of different TP
sizes travel in the one wire form of blocks.py.

A layout whose heads axis is unknown (`num_kv_heads == 0`, e.g. an attention backend pdserve
does not recognise) can only pair rank r with rank r of an equal TP size, as before.

Lifecycle of one request's KV over TP sizes P -> D: each prefill rank pins it; decode rank d
pulls its `sources_for` shares; a source rank's pin ends once every decode rank in its
`releasers_of` set has released it (a sole reader releases with its pull). Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv.transport.errors import IncompatiblePeerError
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

__all__ = [
    "SourceShare",
    "check_tp",
    "heads_form",
    "num_kv_heads",
    "peer_regions",
    "rank_heads",
    "readers_of",
    "release_targets",
    "releasers_of",
    "shared_heads",
    "sources_for",
    "split_problem",
]

# In `KVLayoutSpec.kv_layout`, the heads axis of a block shape is written as the model's total
# KV heads in brackets ("2x16x[8]x128"), so the string is the same at every TP size.
_HEADS_MARK = re.compile(r"\[(\d+)\]")


def split_problem(total: int, tp_size: int) -> str | None:
    """Why vLLM cannot shard `total` KV heads over `tp_size` ranks, or None when it can."""
    if total < 1 or tp_size < 1:
        return f"{total} KV heads over TP {tp_size}"
    if total % tp_size and tp_size % total:
        return f"{total} KV heads do not split evenly over tensor_parallel_size {tp_size}"
    return None


def rank_heads(total: int, tp_size: int, rank: int) -> range:
    """The model's KV heads that TP rank `rank` of `tp_size` holds; ValueError if uneven."""
    problem = split_problem(total, tp_size)
    if problem is not None:
        raise ValueError(problem)
    if not 0 <= rank < tp_size:
        raise ValueError(f"TP rank {rank} out of range for TP size {tp_size}")
    if tp_size <= total:
        per_rank = total // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * total // tp_size  # replicated: tp_size // total ranks per head
    return range(head, head + 1)


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


@dataclass(frozen=True, slots=True)
class SourceShare:
    """One source TP rank a sink rank pulls from, and the model's KV heads it pulls there."""

    rank: int
    heads: range


def sources_for(total: int, source_tp: int, sink_tp: int, sink_rank: int) -> tuple[SourceShare, ...]:
    """The source ranks decode rank `sink_rank` pulls from, ordered by head; their heads cover
    the sink rank's exactly. Among replicas holding the same heads it takes the
    `sink_rank % replicas`-th, which is the sink's own rank when both TP sizes are equal."""
    wanted = rank_heads(total, sink_tp, sink_rank)
    candidates: dict[tuple[int, int], list[int]] = {}
    for rank in range(source_tp):
        common = _intersect(rank_heads(total, source_tp, rank), wanted)
        if len(common):
            candidates.setdefault((common.start, common.stop), []).append(rank)
    return tuple(
        SourceShare(ranks[sink_rank % len(ranks)], range(*span)) for span, ranks in sorted(candidates.items())
    )


def readers_of(total: int, source_tp: int, source_rank: int, sink_tp: int) -> frozenset[int]:
    """The sink ranks of a TP group of `sink_tp` that pull from `source_rank`."""
    return frozenset(
        d
        for d in range(sink_tp)
        if any(s.rank == source_rank for s in sources_for(total, source_tp, sink_tp, d))
    )


def releasers_of(total: int, source_tp: int, source_rank: int, sink_tp: int) -> frozenset[int]:
    """The sink ranks whose releases end `source_rank`'s pin: its readers, or, for a replica
    nobody reads, sink rank `source_rank % sink_tp` (so no pin waits for its lease)."""
    return readers_of(total, source_tp, source_rank, sink_tp) or frozenset({source_rank % sink_tp})


def release_targets(total: int, source_tp: int, sink_tp: int, sink_rank: int) -> tuple[int, ...]:
    """The source ranks whose pins decode rank `sink_rank` must release (pulled or not)."""
    return tuple(r for r in range(source_tp) if sink_rank in releasers_of(total, source_tp, r, sink_tp))


def heads_form(block_shape: Sequence[int], heads_dim: int | None, total: int) -> str:
    """A block shape as `kv_layout` writes it: the heads axis as "[total]", TP-independent."""
    return "x".join(f"[{total}]" if d == heads_dim else str(s) for d, s in enumerate(block_shape))


def num_kv_heads(layout: KVLayoutSpec) -> int:
    """The model's KV heads as the layout declares them; 0 when its heads axis is unknown."""
    totals = {int(m) for m in _HEADS_MARK.findall(layout.kv_layout)}
    return totals.pop() if len(totals) == 1 else 0


def shared_heads(local: KVLayoutSpec, peer: KVLayoutSpec) -> range | None:
    """The model's KV heads both ranks hold; None when the heads axis is unknown (whole blocks)."""
    total = num_kv_heads(local)
    if not total:
        return None
    mine = rank_heads(total, local.tp_size, local.tp_rank)
    return _intersect(mine, rank_heads(total, peer.tp_size, peer.tp_rank))


def check_tp(local: KVLayoutSpec, peer: KVLayoutSpec) -> None:
    """Raises IncompatiblePeerError unless the two ranks can exchange KV heads; handshake only
    (after the compatibility hash matched, so both declare the same heads)."""
    total = num_kv_heads(local)
    if not total:
        for field in ("tp_size", "tp_rank"):
            mine, theirs = getattr(local, field), getattr(peer, field)
            if mine != theirs:
                raise IncompatiblePeerError(
                    field,
                    message=f"incompatible KV peer: {field} differs (local {mine}, remote {theirs}) and "
                    f"this KV layout ({local.kv_layout}) has no known heads axis, so prefill and decode "
                    "need equal tensor_parallel_size",
                )
        return
    for side, layout in (("local", local), ("remote", peer)):
        problem = split_problem(total, layout.tp_size)
        if problem is not None:
            raise IncompatiblePeerError("tp_size", message=f"incompatible KV peer ({side}): {problem}")
    if not shared_heads(local, peer):
        raise IncompatiblePeerError(
            "tp_rank",
            message=f"incompatible KV peer: TP rank {local.tp_rank}/{local.tp_size} and rank "
            f"{peer.tp_rank}/{peer.tp_size} hold no KV heads in common",
        )


def peer_regions(
    regions: Sequence[BlockRegion], local: KVLayoutSpec, peer: KVLayoutSpec
) -> tuple[BlockRegion, ...]:
    """The views of this rank's regions that pulls with `peer` move: the head slice both ranks
    hold, or `regions` itself (the very tuple: endpoints reuse what they built for it) when that
    is all of this rank's heads. Call `check_tp` first."""
    whole = regions if isinstance(regions, tuple) else tuple(regions)
    shared = shared_heads(local, peer)
    if shared is None:
        return whole
    mine = rank_heads(num_kv_heads(local), local.tp_size, local.tp_rank)
    if shared == mine:
        return whole
    return tuple(r.narrow_heads(shared.start - mine.start, len(shared)) for r in regions)
