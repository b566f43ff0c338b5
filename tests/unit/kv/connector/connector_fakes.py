"""Fakes for the connector's unit tests: vLLM-shaped requests and an in-process transport.

`FakeRequest` carries only what the connector reads from vLLM's Request; `Status` mimics
RequestStatus by name (the connector reads `status.name`). `FakeTransports` builds the
transport layer's fake source and sink on one `FakeFabric`, so worker-side tests move real
bytes between two tensors without a network.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kv.connector.config import ConnectorConfig
from pdserve.kv.connector.metadata import WorkerEndpoint
from pdserve.kv.connector.scheduler_side import SchedulerSide
from pdserve.kv.transport.base import BlockSink, BlockSource, ReleaseCallback
from pdserve.kv.transport.fake import FakeFabric, FakeSink, FakeSource
from pdserve.kv.transport.handshake import WIRE_VERSION
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

BLOCK = 128
TOKEN = "unit-token"


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    status: Status = Status.WAITING


def config(role: str = "kv_both", **extra: Any) -> ConnectorConfig:
    return ConnectorConfig.from_extra(role, {"transport": "grpc", "cluster_token": TOKEN, **extra})


def scheduler_side(
    role: str = "kv_both", *, tp_addresses: Sequence[str] = ("10.0.0.1:5000",)
) -> SchedulerSide:
    side = SchedulerSide(config(role), engine_id="engine-p", block_size=BLOCK)
    side.set_endpoints({r: WorkerEndpoint(r, a, "grpc", "engine-p") for r, a in enumerate(tp_addresses)})
    return side


def remote_params(
    num_prompt_tokens: int, *, request_id: str = "p-1", first_block: int = 40
) -> dict[str, Any]:
    """What a prefill engine returns for a prompt of `num_prompt_tokens` tokens."""
    n = -(-num_prompt_tokens // BLOCK)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_request_id": request_id,
        "remote_address": "10.0.0.1:5000",
        "remote_block_ids": list(range(first_block, first_block + n)),
        "num_prompt_tokens": num_prompt_tokens,
        "transport": "grpc",
        "wire_version": WIRE_VERSION,
    }


@dataclass
class FakeTransports:
    """The transport layer's fakes on one fabric; records what it built."""

    fabric: FakeFabric = field(default_factory=FakeFabric)
    lease_s: float = 30.0
    sources: list[FakeSource] = field(default_factory=list)
    sinks: list[FakeSink] = field(default_factory=list)

    def make_source(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        on_release: ReleaseCallback,
        tp_rank: int,
    ) -> BlockSource:
        source = FakeSource(
            layout,
            regions,
            engine_id=engine_id,
            cluster_token=TOKEN,
            fabric=self.fabric,
            on_release=on_release,
            lease_s=self.lease_s,
        )
        self.sources.append(source)
        return source

    def make_sink(
        self, transport: str, layout: KVLayoutSpec, regions: Sequence[BlockRegion], *, engine_id: str
    ) -> BlockSink:
        sink = FakeSink(layout, regions, engine_id=engine_id, cluster_token=TOKEN, fabric=self.fabric)
        self.sinks.append(sink)
        return sink


def kv_caches(num_blocks: int, *, layers: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """CPU-vLLM-like KV caches: per-layer views [num_blocks, kv_heads, block, 2*head_dim] of one
    buffer (small heads to keep tests fast)."""
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(layers, num_blocks, 2, BLOCK, 8, generator=generator)
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(layers)}


# How long a test engine steps before a wait for a connector event fails.
WAIT_S = 10.0


class Stepping:
    """`step_until` for the tests' engine stand-ins, which define `step()`."""

    def step_until(self, predicate, what: str) -> None:
        """Steps every 5 ms until `predicate()`; fails naming `what` after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()
            time.sleep(0.005)
