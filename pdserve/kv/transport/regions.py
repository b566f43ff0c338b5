"""KV as the transports see it: the layout two engines must share to exchange blocks byte for byte
(`KVLayoutSpec`, hashed at handshake), and the registered KV tensors that blocks are read from
and written to (`BlockRegion`, described on the wire by `RegionInfo`).

Plain values: built once by the connector at `register_kv_caches` and at handshake, never
changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv.transport.errors import IncompatiblePeerError

__all__ = ["COMPAT_FIELDS", "MAX_BLOCK_NBYTES", "BlockRegion", "KVLayoutSpec", "RegionInfo", "check_regions"]

# Largest bytes of one block of one region. gRPC must hold a whole block in one message and NCCL
# in its staging buffer; realistic blocks are KiBs to a few MiB (a CPU block of SmolLM2: 192 KiB).
MAX_BLOCK_NBYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class KVLayoutSpec:
    """What must match for two engines to exchange KV blocks byte for byte.

    `kv_layout` describes a block TP-independently (heads axis as "[total heads]", heads.py);
    `tp_size` and `tp_rank` may differ between peers whose KV heads intersect (`heads.check_tp`).
    """

    model: str
    dtype: str
    block_size: int
    kv_layout: str
    tp_size: int = 1
    tp_rank: int = 0
    num_layers: int = 0

    def compat_hash(self) -> str:
        """Stable sha256 of every field but the TP ones; called once per handshake on each side."""
        fields = {name: getattr(self, name) for name in COMPAT_FIELDS}
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"pdserve.kv.layout\0" + canonical.encode()).hexdigest()


# Fields that must be equal on both sides (the compatibility hash); TP is checked by
# heads.check_tp instead.
COMPAT_FIELDS = tuple(f.name for f in dataclasses.fields(KVLayoutSpec) if not f.name.startswith("tp_"))


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """The wire description of one region: the shape and dtype of one of its blocks."""

    block_shape: tuple[int, ...]
    dtype: str
    block_nbytes: int


def check_regions(local: Sequence[RegionInfo], remote: Sequence[RegionInfo]) -> None:
    """Raises IncompatiblePeerError unless both sides register the same regions; handshake only."""
    if len(local) != len(remote):
        raise IncompatiblePeerError("regions", f"{len(local)} regions", f"{len(remote)} regions")
    for i, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        for name in ("block_shape", "dtype", "block_nbytes"):
            if getattr(mine, name) != getattr(theirs, name):
                raise IncompatiblePeerError(
                    f"regions[{i}].{name}", getattr(mine, name), getattr(theirs, name)
                )


@dataclass(frozen=True, slots=True)
class BlockRegion:
    """One registered KV tensor; block b of it is `tensor.select(block_dim, b)`.

    Built by the connector in `register_kv_caches`, one per layer tensor (or one per shared buffer).
    The transport copies whole blocks; it never assumes the block dim is first or that a block is
    contiguous in memory. `heads_dim`, when known, is the tensor's KV-heads axis: pulls between
    different TP sizes move a head slice of each block (`narrow_heads`).
    """

    tensor: torch.Tensor
    block_dim: int = 0
    heads_dim: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.block_dim < self.tensor.dim():
            raise ValueError(f"block_dim {self.block_dim} out of range for shape {tuple(self.tensor.shape)}")
        if self.heads_dim is not None and (
            self.heads_dim == self.block_dim or not 0 <= self.heads_dim < self.tensor.dim()
        ):
            raise ValueError(f"heads_dim {self.heads_dim} invalid for shape {tuple(self.tensor.shape)}")
        if self.info().block_nbytes > MAX_BLOCK_NBYTES:
            raise ValueError(f"a block of {self.info().block_nbytes} bytes exceeds {MAX_BLOCK_NBYTES}")

    @property
    def num_blocks(self) -> int:
        """How many blocks the region holds."""
        return self.tensor.shape[self.block_dim]

    def narrow_heads(self, start: int, count: int) -> BlockRegion:
        """A view of heads [start, start+count) of this region's own heads; at handshake."""
        if self.heads_dim is None:
            raise ValueError("this region has no known KV heads axis")
        view = self.tensor.narrow(self.heads_dim, start, count)
        return BlockRegion(view, self.block_dim, self.heads_dim)

    def info(self) -> RegionInfo:
        """The region's wire description; cheap, called at construction and handshake."""
        shape = tuple(s for d, s in enumerate(self.tensor.shape) if d != self.block_dim)
        nbytes = self.tensor.element_size() * int(torch.Size(shape).numel())
        return RegionInfo(
            block_shape=shape, dtype=str(self.tensor.dtype).removeprefix("torch."), block_nbytes=nbytes
        )
