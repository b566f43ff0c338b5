"""KV pulls between two OS processes (spawned), for the gRPC and NCCL-over-gloo transports."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from contextlib import contextmanager

import kv_peer
import pytest
import torch

from pdserve.kv.transport.base import BlockSink, TransferState
from pdserve.kv.transport.grpc import GrpcSink
from pdserve.kv.transport.nccl import NcclSink

pytestmark = pytest.mark.integration

# A spawned child imports torch and grpc before it is ready: seconds on a small CI box.
STARTUP_S = 60.0
WAIT_S = 20.0


@contextmanager
def source_process(
    gather_delay_s: float = 0.0, device: str = "cpu"
) -> Iterator[tuple[str, multiprocessing.Process, object]]:
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(
        target=kv_peer.run_source, args=(child_end, gather_delay_s, device), daemon=True
    )
    process.start()
    try:
        assert parent_end.poll(STARTUP_S), "source process did not start"
        message, address = parent_end.recv()
        assert message == "ready"
        yield address, process, parent_end
    finally:
        if process.is_alive():
            parent_end.send("stop")
            process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
        parent_end.close()


def make_sink(kind: str, regions, small_pieces: bool = False) -> BlockSink:
    cls = GrpcSink if kind == "grpc" else NcclSink
    chunk = 1 if small_pieces else 64 << 10
    return cls(
        kv_peer.LAYOUT,
        regions,
        engine_id=f"decode-{kind}",
        cluster_token=kv_peer.TOKEN,
        max_chunk_bytes=chunk,
    )


def test_pulls_across_processes_move_the_exact_bytes():
    pull_from_another_process(source_device="cpu", sink_device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pulls_between_two_gpus_move_the_exact_bytes():
    torch.cuda.set_device("cuda:1")
    pull_from_another_process(source_device="cuda:0", sink_device="cuda:1")


def pull_from_another_process(source_device: str, sink_device: str) -> None:
    expected = kv_peer.kv_regions(kv_peer.NUM_BLOCKS, kv_peer.SOURCE_SEED)
    dst_ids = [19, 0, 7, 3, 12, 1, 15, 9]
    with source_process(device=source_device) as (address, _, pipe):
        for kind, request_id in kv_peer.REQUEST_IDS.items():
            dst_regions = kv_peer.kv_regions(20, seed=99, sink_side=True, device=sink_device)
            sink = make_sink(kind, dst_regions)
            try:
                transfer = sink.start_pull(address, request_id, kv_peer.SRC_IDS, dst_ids)
                assert transfer.wait(WAIT_S) is TransferState.DONE, transfer
                assert pipe.poll(WAIT_S), "the source never reported the release"
                assert pipe.recv() == ("released", request_id, "pulled")
            finally:
                sink.close()
            assert_pulled(expected, dst_regions, dst_ids, kind)


def assert_pulled(expected, dst_regions, dst_ids, kind) -> None:
    for src_region, dst_region in zip(expected, dst_regions, strict=True):
        for s, d in zip(kv_peer.SRC_IDS, dst_ids, strict=True):
            want = src_region.tensor.select(src_region.block_dim, s)
            got = dst_region.tensor.select(dst_region.block_dim, d).cpu()
            assert torch.equal(want, got), f"{kind}: block {s} -> {d} differs"


def test_source_process_killed_mid_stream_fails_both_kinds_of_pull():
    ids = list(range(8))
    with source_process(gather_delay_s=0.1) as (address, process, _):
        sinks = {
            kind: make_sink(kind, kv_peer.kv_regions(20, seed=99, sink_side=True), True)
            for kind in kv_peer.REQUEST_IDS
        }
        try:
            transfers = {
                kind: sinks[kind].start_pull(address, kv_peer.REQUEST_IDS[kind], kv_peer.SRC_IDS, ids)
                for kind in sinks
            }
            deadline = time.monotonic() + WAIT_S
            while (
                any(t.bytes_moved == 0 and not t.done for t in transfers.values())
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            process.kill()
            for kind, transfer in transfers.items():
                assert transfer.wait(WAIT_S) is TransferState.FAILED, f"{kind}: {transfer}"
                assert transfer.error and transfer.bytes_moved > 0
        finally:
            for sink in sinks.values():
                sink.close()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
                ),
            ],
        ),
    ],
)
def test_a_sink_drops_its_pair_once_the_source_process_is_gone(device):
    # A killed process's sockets are closed by its kernel: the sink sees the control
    # connection end between pulls and frees the pair's staging without another pull.
    source_device, sink_device = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    if device == "cuda":
        torch.cuda.set_device(sink_device)
    with source_process(device=source_device) as (address, process, _):
        sink = make_sink("nccl", kv_peer.kv_regions(20, seed=99, sink_side=True, device=sink_device))
        try:
            before = torch.cuda.memory_allocated(sink_device) if device == "cuda" else 0
            transfer = sink.start_pull(address, kv_peer.REQUEST_IDS["nccl"], kv_peer.SRC_IDS, list(range(8)))
            assert transfer.wait(WAIT_S) is TransferState.DONE, transfer
            assert len(sink._pairs) == 1  # white box: the pair outlives the pull
            held = torch.cuda.memory_allocated(sink_device) - before if device == "cuda" else 0
            process.kill()
            deadline = time.monotonic() + WAIT_S
            while sink._pairs and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not sink._pairs
            if device == "cuda":
                torch.cuda.synchronize(sink_device)
                freed = before + held - torch.cuda.memory_allocated(sink_device)
                ring = 4 * (1 << 20)  # the pair's staging: kv_peer's source asks for 4 x 1 MiB
                assert held >= ring and freed >= ring, (held, freed)
        finally:
            sink.close()
