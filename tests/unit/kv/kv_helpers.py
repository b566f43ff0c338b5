"""Helpers of the KV transport tests: a layout, KV-like regions, and a factory per transport.

The factory builds sources and sinks of one kind ("fake", "grpc", or "nccl": the NCCL code over
gloo on CPU) in this one process, servers on 127.0.0.1 port 0, and closes them all afterwards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import pytest
import torch

from pdserve.kv.transport.base import BlockSink, BlockSource
from pdserve.kv.transport.fake import FakeFabric, FakeSink, FakeSource
from pdserve.kv.transport.grpc import GrpcSink, GrpcSource
from pdserve.kv.transport.leases import ReleaseReason
from pdserve.kv.transport.nccl import NcclSink, NcclSource
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

TRANSPORTS = ["fake", "grpc", "nccl"]
TOKEN = "cluster-secret"
LAYOUT = KVLayoutSpec(
    model="test/llama-shaped",
    dtype="float16",
    block_size=4,
    kv_layout="mixed",
    tp_size=1,
    tp_rank=0,
    num_layers=3,
)
# Generous upper bound on any single wait: a pull here moves well under 1 MiB.
WAIT_S = 15.0


def kv_regions(num_blocks: int, *, seed: int, sink_side: bool = False) -> list[BlockRegion]:
    """Four layer-like regions whose blocks have the same shapes on both sides but sit in
    differently laid out tensors (block dim first or second, strided views, a transposed block),
    so both the memmove path and the torch path of blocks.py are exercised on CPU."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    if not sink_side:
        gpu_like = BlockRegion(rand(2, num_blocks, 4, 2, 64, dtype=torch.float16), block_dim=1)
        first = BlockRegion(rand(num_blocks, 2, 4, 2, 64, dtype=torch.float16), block_dim=0)
        transposed = BlockRegion(rand(num_blocks, 16, 4, dtype=torch.float32).transpose(1, 2), block_dim=0)
    else:  # same block shapes, other layouts: the wire form must not care
        gpu_like = BlockRegion(rand(num_blocks, 2, 4, 2, 64, dtype=torch.float16), block_dim=0)
        first = BlockRegion(rand(2, num_blocks, 4, 2, 64, dtype=torch.float16), block_dim=1)
        transposed = BlockRegion(rand(num_blocks, 4, 16, dtype=torch.float32), block_dim=0)
    # CPU-vLLM-like layer: [num_blocks, kv_heads, block_size, 2*head_dim], a view into a buffer
    # shared by layers (here a non-contiguous slice of it).
    shared = rand(num_blocks, 2, 3, 4, 32, dtype=torch.bfloat16)
    cpu_like = BlockRegion(shared[:, 1], block_dim=0)
    return [gpu_like, first, cpu_like, transposed]


def block_bytes(region: BlockRegion, block: int) -> torch.Tensor:
    """The bytes of one block (flat uint8), independent of the tensor's layout."""
    return region.tensor.select(region.block_dim, block).contiguous().reshape(-1).view(torch.uint8)


def assert_blocks_equal(
    src: list[BlockRegion], src_ids: list[int], dst: list[BlockRegion], dst_ids: list[int]
) -> None:
    """Every pulled block arrived byte for byte, in every region."""
    for i, (a, b) in enumerate(zip(src, dst, strict=True)):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(block_bytes(a, s), block_bytes(b, d)), f"region {i}: block {s} -> {d} differs"


@dataclass
class TransportFactory:
    """Builds sources and sinks of one transport kind and closes them after the test."""

    kind: str
    monkeypatch: pytest.MonkeyPatch
    fabric: FakeFabric = field(default_factory=FakeFabric)
    released: list[tuple[str, ReleaseReason]] = field(default_factory=list)
    release_event: threading.Event = field(default_factory=threading.Event)
    _built: list[BlockSource | BlockSink] = field(default_factory=list)

    def on_release(self, request_id: str, reason: ReleaseReason) -> None:
        self.released.append((request_id, reason))
        self.release_event.set()

    def source(
        self,
        regions: list[BlockRegion],
        *,
        layout: KVLayoutSpec = LAYOUT,
        token: str = TOKEN,
        small_pieces: bool = False,
        **kwargs: object,
    ) -> BlockSource:
        common = dict(engine_id="prefill-0", cluster_token=token, on_release=self.on_release, **kwargs)
        if self.kind == "fake":
            if small_pieces:
                self.monkeypatch.setattr("pdserve.kv.transport.fake.FAKE_PIECE_BYTES", 1)
            built = FakeSource(layout, regions, fabric=self.fabric, **common)
        elif self.kind == "grpc":
            built = GrpcSource(layout, regions, **common)
        else:
            staging = 1 if small_pieces else 1 << 20
            built = NcclSource(layout, regions, staging_bytes=staging, pair_timeout_s=3.0, **common)
        self._built.append(built)
        return built

    def sink(
        self,
        regions: list[BlockRegion],
        *,
        layout: KVLayoutSpec = LAYOUT,
        token: str = TOKEN,
        small_pieces: bool = False,
    ) -> BlockSink:
        common = {"engine_id": "decode-0", "cluster_token": token}
        if self.kind == "fake":
            built = FakeSink(layout, regions, fabric=self.fabric, **common)
        else:
            cls = GrpcSink if self.kind == "grpc" else NcclSink
            chunk = 1 if small_pieces else 64 << 10
            built = cls(layout, regions, max_chunk_bytes=chunk, pull_timeout_s=10.0, **common)
        self._built.append(built)
        return built

    def close(self) -> None:
        for built in reversed(self._built):
            built.close()


def other_layout(**changes: object) -> KVLayoutSpec:
    """LAYOUT with some fields changed."""
    return replace(LAYOUT, **changes)
