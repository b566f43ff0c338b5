"""The prefill side of the cross-process KV tests, run in a spawned child process.

The child builds KV-like regions from a fixed seed (the parent rebuilds the same bytes to check
what it pulled), serves them with an NcclSource (gRPC pulls and NCCL-over-gloo pulls alike), and
reports over a pipe: ("ready",
address), then ("released", request_id, reason) for each pin that ends. It stops when the parent
sends "stop" or closes the pipe.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

import torch

from pdserve.kv.transport import blocks
from pdserve.kv.transport.leases import ReleaseReason
from pdserve.kv.transport.nccl import NcclSource
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

TOKEN = "cluster-secret"
LAYOUT = KVLayoutSpec("test/llama-shaped", "float16", 4, "mixed", 1, 0, 2)
NUM_BLOCKS = 32
SOURCE_SEED = 11
# One request per sink kind; the source (an NcclSource, which is also a GrpcSource) serves both.
REQUEST_IDS = {"grpc": "req-grpc", "nccl": "req-nccl"}
SRC_IDS = [30, 2, 17, 5, 11, 23, 8, 0]


def kv_regions(
    num_blocks: int, seed: int, *, sink_side: bool = False, device: str = "cpu"
) -> list[BlockRegion]:
    """Two layer-like regions; the sink's puts the block dim elsewhere (same block shapes)."""
    generator = torch.Generator().manual_seed(seed)
    flash = torch.randn(2, num_blocks, 4, 2, 8, generator=generator).half().to(device)
    cpu_like = torch.randn(num_blocks, 2, 4, 16, generator=generator).half().to(device)
    if sink_side:
        return [BlockRegion(flash.movedim(1, 0).contiguous(), 0), BlockRegion(cpu_like, 0)]
    return [BlockRegion(flash, 1), BlockRegion(cpu_like, 0)]


def run_source(conn: Connection, gather_delay_s: float, device: str = "cpu") -> None:
    """Child process entry point: serve the pinned requests until told to stop."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if gather_delay_s:
        for name in ("gather", "gather_bytes"):
            setattr(blocks, name, _delayed(getattr(blocks, name), gather_delay_s))
    lock = threading.Lock()

    def report(request_id: str, reason: ReleaseReason) -> None:
        with lock:
            conn.send(("released", request_id, reason.value))

    source = NcclSource(
        LAYOUT,
        kv_regions(NUM_BLOCKS, SOURCE_SEED, device=device),
        engine_id="prefill-proc",
        cluster_token=TOKEN,
        on_release=report,
        staging_bytes=1 if gather_delay_s else 1 << 20,  # many small batches when slowed down
        pair_timeout_s=5.0,
    )
    for request_id in REQUEST_IDS.values():
        source.pin(request_id, SRC_IDS)
    with lock:
        conn.send(("ready", source.address))
    try:
        conn.recv()
    except EOFError:
        pass
    finally:
        source.close()


def _delayed(function, delay_s: float):
    def slow(*args: object, **kwargs: object) -> object:
        threading.Event().wait(delay_s)
        return function(*args, **kwargs)

    return slow
