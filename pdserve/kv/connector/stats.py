"""Transfer statistics in vLLM's KVConnectorStats form.

Path: each worker returns the pulls it finished since the last step (`get_kv_connector_stats`);
vLLM aggregates them across TP ranks, and hands `SchedulerStats.kv_connector_stats` (the `data`
dict below) to every stat logger, where pdserve's metrics read them. `data` is plain lists of
numbers (and the pulls' request ids), as vLLM requires (it crosses vLLM's process boundary).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["PdserveKVStats"]

# pull_request_ids: vLLM's (internal) id of the request each pull was for.
_KEYS = ("pull_bytes", "pull_seconds", "pull_blocks", "pull_failed", "pull_request_ids")


@dataclass
class PdserveKVStats(KVConnectorStats):
    """Per-pull observations of one interval: bytes, seconds, blocks, and 1 if it failed."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def of_pulls(cls, records: Iterable[Any]) -> PdserveKVStats:
        """From the worker's PullRecords; called by the worker once per step with new pulls."""
        stats = cls()
        for r in records:
            stats.data["pull_bytes"].append(int(r.nbytes))
            stats.data["pull_seconds"].append(float(r.seconds))
            stats.data["pull_blocks"].append(int(r.num_blocks))
            stats.data["pull_failed"].append(0 if r.error is None else 1)
            stats.data["pull_request_ids"].append(str(r.request_id))
        return stats

    def reset(self) -> None:
        """Empties the observations."""
        self.data = {key: [] for key in _KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Appends another interval's (or TP rank's) observations; vLLM calls it per step."""
        for key in _KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        """One summary line for vLLM's periodic log."""
        seconds, nbytes = self.data.get("pull_seconds", []), self.data.get("pull_bytes", [])
        total_s = sum(seconds)
        return {
            "num_pulls": len(seconds),
            "num_failed": sum(self.data.get("pull_failed", [])),
            "MiB": round(sum(nbytes) / 2**20, 3),
            "avg_ms": round(1e3 * total_s / len(seconds), 3) if seconds else 0.0,
            "GB/s": round(sum(nbytes) / total_s / 1e9, 3) if total_s else 0.0,
        }

    def is_empty(self) -> bool:
        """True when no pull finished in the interval."""
        return not self.data.get("pull_seconds")
