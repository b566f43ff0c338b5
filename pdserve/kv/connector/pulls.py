"""Which prefill TP ranks a decode worker pulls a request from, and that pull as one handle.

Prefill TP P and decode TP D may differ (transport.heads): decode rank d pulls its KV heads
from one or more prefill ranks, one transport pull each. `plan_sources` decides, from the
request's `RemotePrefill` and the worker's own layout, where to pull and which prefill pins this
rank must release by message; `PullGroup` is the request's pull as the worker polls it: done
only once every part ended (a failed part never leaves another still writing into blocks vLLM
is about to reuse), failed if any part failed. Pure apart from the handles' transport threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv.connector.metadata import RemotePrefill
from pdserve.kv.transport import heads
from pdserve.kv.transport.base import KVTransfer, TransferState
from pdserve.kv.transport.regions import KVLayoutSpec

__all__ = ["PullGroup", "PullPart", "SourcePlan", "plan_sources"]


@dataclass(frozen=True, slots=True)
class PullPart:
    """One source rank's share of a request: where to pull, and whether the pull itself ends
    the source's pin (this decode rank is its only reader)."""

    address: str
    release_after: bool


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """A decode rank's pulls of one request, and every source whose pin it must release (after
    its pulls, unless a `release_after` pull did; or at once when it gives the request up)."""

    parts: tuple[PullPart, ...]
    releases: tuple[str, ...]

    def releases_after(self, succeeded: bool) -> tuple[str, ...]:
        """The Release messages to send once the pull ended."""
        done = {p.address for p in self.parts if p.release_after} if succeeded else set()
        return tuple(a for a in self.releases if a not in done)


def plan_sources(remote: RemotePrefill, layout: KVLayoutSpec) -> SourcePlan:
    """The pulls of decode rank `layout.tp_rank` for a request prefilled at TP
    len(remote.source_addresses). Raises ValueError naming the TP sizes when the two cannot
    exchange KV (no known heads axis with unequal sizes, or heads that do not split evenly)."""
    addresses = remote.source_addresses
    source_tp, sink_tp, rank = len(addresses), layout.tp_size, layout.tp_rank
    total = heads.num_kv_heads(layout)
    if not total:
        if source_tp != sink_tp:
            raise ValueError(
                f"prefill tensor_parallel_size {source_tp} != decode {sink_tp}, and this KV layout "
                f"({layout.kv_layout}) has no known heads axis to split"
            )
        return SourcePlan((PullPart(addresses[rank], True),), (addresses[rank],))
    for tp in (source_tp, sink_tp):
        problem = heads.split_problem(total, tp)
        if problem is not None:
            raise ValueError(problem)
    parts = tuple(
        PullPart(addresses[s.rank], heads.releasers_of(total, source_tp, s.rank, sink_tp) == {rank})
        for s in heads.sources_for(total, source_tp, sink_tp, rank)
    )
    releases = tuple(addresses[r] for r in heads.release_targets(total, source_tp, sink_tp, rank))
    return SourcePlan(parts, releases)


class PullGroup:
    """One request's transport pulls, read like one `KVTransfer` (the fields the worker reads)."""

    def __init__(self, transfers: Sequence[KVTransfer]):
        self.transfers = tuple(transfers)

    @property
    def done(self) -> bool:
        """True once every part ended."""
        return all(t.done for t in self.transfers)

    @property
    def state(self) -> TransferState:
        """FAILED if any part failed, DONE if all are done; else the least advanced part's."""
        states = [t.state for t in self.transfers]
        if not self.done:
            moving = TransferState.TRANSFERRING in states
            return TransferState.TRANSFERRING if moving else TransferState.PENDING
        return TransferState.FAILED if TransferState.FAILED in states else TransferState.DONE

    @property
    def error(self) -> str | None:
        """The failed parts' errors, each with its source."""
        errors = [f"{t.remote_address}: {t.error}" for t in self.transfers if t.error is not None]
        return "; ".join(errors) if errors else None

    @property
    def bytes_moved(self) -> int:
        return sum(t.bytes_moved for t in self.transfers)

    @property
    def elapsed_s(self) -> float:
        """From the first start to the last end (or now)."""
        return max(t.elapsed_s for t in self.transfers)

    @property
    def remote_address(self) -> str:
        return ",".join(t.remote_address for t in self.transfers)

    def wait(self, timeout: float | None = None) -> TransferState:
        """Blocks until every part ended or `timeout` passed; tests only."""
        for transfer in self.transfers:
            transfer.wait(timeout)
        return self.state
