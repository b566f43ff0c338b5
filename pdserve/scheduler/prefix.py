"""Which prompt prefixes each engine probably holds in its prefix cache.

The frontend cannot see inside vLLM's cache, but it knows which prompts it sent where. Each
engine gets an LRU set of chained block hashes (the hash of a block covers every token before
it, as in vLLM's prefix caching), bounded by the engine's KV capacity. `cached_tokens` answers
"how many leading tokens of this prompt would hit": the router subtracts them from the prefill
work it predicts. An estimate: evictions inside the engine are not seen, the bound keeps it from
drifting far.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (a partial last block is never cached)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(parent + b",".join(str(t).encode() for t in block),
                                 digest_size=16).digest()
        hashes.append(digest)
        parent = digest
    return hashes


class PrefixIndex:
    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self._capacity = capacity_blocks
        self._engines: dict[str, OrderedDict[bytes, None]] = {}

    def cached_tokens(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        blocks = self._engines.get(replica_id)
        if not blocks:
            return 0
        hit = 0
        for h in hashes:
            if h not in blocks:
                break
            hit += 1
        return hit * self.block_size

    def insert(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        blocks = self._engines.setdefault(replica_id, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        self._engines.pop(replica_id, None)
