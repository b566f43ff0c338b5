"""The cuda_ipc transport on CPU: its handshake, link protocol and refusals, with the CUDA calls
replaced by a fake that "maps" CPU tensors (HostIpc), and the real calls refusing CPU memory
(then the sink falls back to NCCL pairs over gloo). The copy kernel itself runs on GPUs only
(benchmarks/gpu/ipc_transfer.py); here its host reference does the copy."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
from kv_helpers import LAYOUT, TOKEN, WAIT_S, assert_blocks_equal

from pdserve.kv.transport import ipc_memory
from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.cuda_ipc import CudaIpcSink, CudaIpcSource, _decode_settings
from pdserve.kv.transport.errors import KVTransportError
from pdserve.kv.transport.ipc_memory import CudaIpc, IpcUnavailableError
from pdserve.kv.transport.leases import ReleaseReason
from pdserve.kv.transport.regions import BlockRegion

pytestmark = pytest.mark.unit


def gpu_like_regions(num_blocks: int, seed: int, layers: int = 3) -> list[BlockRegion]:
    """vLLM's GPU layout per layer, [2, blocks, 4, 2, 64] fp16: a block is a K and a V run."""
    generator = torch.Generator().manual_seed(seed)
    return [
        BlockRegion(torch.randn(2, num_blocks, 4, 2, 64, generator=generator).half(), block_dim=1)
        for _ in range(layers)
    ]


class HostIpc(CudaIpc):
    """CUDA IPC over CPU tensors of this process: a handle is the allocation's address."""

    maps_host_memory = True

    def __init__(
        self, uuid: str = "GPU-source", visible: tuple[str, ...] = ("GPU-sink", "GPU-source"), refuse=None
    ):
        self.uuid, self.visible, self.refuse = uuid, visible, refuse
        self.allocations: list[tuple[int, int]] = []
        self.opened: list[int] = []
        self.closed: list[int] = []

    def register(self, regions: list[BlockRegion]) -> HostIpc:
        for region in regions:
            storage = region.tensor.untyped_storage()
            self.allocations.append((storage.data_ptr(), storage.nbytes()))
        return self

    def allocation_of(self, pointer, device):
        return next((b, s) for b, s in self.allocations if b <= pointer < b + s)

    def export_handle(self, base, device):
        return base.to_bytes(8, "little").ljust(ipc_memory.HANDLE_BYTES, b"\0")

    def open_handle(self, handle, device):
        if self.refuse:
            raise IpcUnavailableError(f"CUDA IPC: cudaIpcOpenMemHandle failed: {self.refuse}")
        self.opened.append(int.from_bytes(handle[:8], "little"))
        return self.opened[-1]

    def close_handle(self, pointer, device):
        self.closed.append(pointer)

    def device_uuid(self, device):
        return self.uuid

    def visible_uuids(self):
        return list(self.visible)


@pytest.fixture
def ends(request):
    """A source over 16 blocks and a sink over 12 (other strides), both with HostIpc."""
    released = []
    made = []

    def make(*, sink_ipc=None, fallback=False, source_ipc=None):
        src = gpu_like_regions(16, seed=1)
        source = CudaIpcSource(
            LAYOUT, src, engine_id="prefill-0", cluster_token=TOKEN, pair_timeout_s=5,
            on_release=lambda rid, reason: released.append((rid, reason)),
            ipc=source_ipc if source_ipc is not None else HostIpc().register(src),
        )  # fmt: skip
        dst = gpu_like_regions(12, seed=2)
        sink = CudaIpcSink(
            LAYOUT, dst, engine_id="decode-0", cluster_token=TOKEN, nccl_fallback=fallback,
            ipc=sink_ipc if sink_ipc is not None else HostIpc(),
        )  # fmt: skip
        made.extend([sink, source])
        return source, sink, released

    yield make
    for end in made:
        end.close()


def wait_until(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def pull(source, sink, request_id, src, dst, pin=True):
    if pin:
        source.pin(request_id, src)
    transfer = sink.start_pull(source.address, request_id, src, dst)
    return transfer.wait(WAIT_S), transfer


def test_a_link_copies_the_named_blocks_and_releases_the_pin_when_done(ends):
    source, sink, released = ends()
    assert sink.handshake(source.address).engine_id == "prefill-0"
    assert sink.ipc_refusal(source.address) is None

    state, transfer = pull(source, sink, "r1", [3, 15, 0], [11, 2, 5])

    assert state is TransferState.DONE, transfer.error
    assert_blocks_equal(source.regions, [3, 15, 0], sink.regions, [11, 2, 5])
    assert transfer.bytes_moved == 3 * 3 * 2048
    wait_until(lambda: released)  # the source ends the read once the sink said done, just after DONE
    assert released == [("r1", ReleaseReason.PULLED)]
    assert source.pinned_blocks("r1") is None


def test_the_link_maps_each_allocation_once_and_unmaps_at_close(ends):
    source, sink, _ = ends()
    for i in range(3):
        assert pull(source, sink, f"r{i}", [i], [i])[0] is TransferState.DONE
    mapped = list(sink.ipc.opened)
    assert len(mapped) == 3  # one allocation per layer, mapped at the first pull only
    sink.close()
    assert sorted(sink.ipc.closed) == sorted(mapped)


def test_an_unpinned_pull_is_refused_and_the_link_stays_in_step(ends):
    source, sink, _ = ends()
    state, refused = pull(source, sink, "never-pinned", [1], [1], pin=False)
    assert state is TransferState.FAILED and "refused by" in refused.error

    state, transfer = pull(source, sink, "r2", [4, 5], [6, 7])
    assert state is TransferState.DONE, transfer.error
    assert_blocks_equal(source.regions, [4, 5], sink.regions, [6, 7])
    assert len(sink.ipc.opened) == 3  # the same link


def test_pulls_started_together_share_one_link_in_order_and_each_releases_its_pin(ends):
    source, sink, released = ends()
    sink.handshake(source.address)
    plan = {f"r{i}": ([i, 15 - i], [2 * i, 2 * i + 1]) for i in range(5)}
    for request_id, (src, _) in plan.items():
        source.pin(request_id, src)
    source.release("r3")  # one of them is refused mid-stream; the others must not mind

    handles = {rid: sink.start_pull(source.address, rid, src, dst) for rid, (src, dst) in plan.items()}

    states = {rid: h.wait(WAIT_S) for rid, h in handles.items()}
    assert states.pop("r3") is TransferState.FAILED and "refused by" in handles["r3"].error
    assert set(states.values()) == {TransferState.DONE}
    for request_id in states:
        assert_blocks_equal(source.regions, plan[request_id][0], sink.regions, plan[request_id][1])
    wait_until(lambda: len(released) == 5)
    assert sorted(rid for rid, reason in released if reason is ReleaseReason.PULLED) == [
        "r0",
        "r1",
        "r2",
        "r4",
    ]


def test_closing_the_sink_ends_the_link_and_the_source_frees_nothing_it_did_not_finish(ends):
    source, sink, _ = ends()
    sink.handshake(source.address)
    assert pull(source, sink, "r1", [1], [1])[0] is TransferState.DONE
    sink.close()
    source.pin("r2", [2])
    wait_until(lambda: not source._links)  # white box: the source's link thread saw the close
    assert source.pinned_blocks("r2") == (2,)


def test_source_ids_beyond_the_source_cache_never_reach_the_copy(ends):
    source, sink, _ = ends()
    sink.handshake(source.address)
    state, transfer = pull(source, sink, "bad", [16], [0], pin=False)
    assert state is TransferState.FAILED and "out of range" in transfer.error


def test_a_source_on_another_node_is_refused_at_handshake_naming_why(ends):
    source, sink, _ = ends()
    sink.host_id = "boot:another-machine"
    with pytest.raises(IpcUnavailableError, match="one node.*nccl transport across nodes"):
        sink.handshake(source.address)


def test_an_invisible_source_gpu_is_named_when_the_driver_refuses(ends, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    source, sink, _ = ends(sink_ipc=HostIpc(visible=("GPU-sink",), refuse="invalid device context"))
    with pytest.raises(IpcUnavailableError) as refused:
        sink.handshake(source.address)
    message = str(refused.value)
    assert "invalid device context" in message and "GPU-source is not visible" in message
    assert "CUDA_VISIBLE_DEVICES=1" in message


def test_without_gpus_the_sink_falls_back_to_nccl_pairs_and_says_why(ends):
    source, sink, _ = ends(source_ipc=CudaIpc(), sink_ipc=CudaIpc(), fallback=True)
    sink.handshake(source.address)
    assert "not a GPU" in sink.ipc_refusal(source.address)

    state, transfer = pull(source, sink, "r1", [2, 9], [3, 4])

    assert state is TransferState.DONE, transfer.error
    assert_blocks_equal(source.regions, [2, 9], sink.regions, [3, 4])
    assert sink._pairs  # white box: the pull went over an NCCL (gloo) pair


def test_without_fallback_a_source_that_cannot_export_fails_the_handshake(ends):
    source, sink, _ = ends(source_ipc=CudaIpc())
    with pytest.raises(KVTransportError, match="needs the KV cache on a GPU"):
        sink.handshake(source.address)
    state, transfer = pull(source, sink, "r1", [1], [1])
    assert state is TransferState.FAILED and "needs the KV cache on a GPU" in transfer.error


def test_the_export_survives_the_wire_and_bounds_every_region_by_its_allocation():
    export = ipc_memory.Export(
        "boot:x", "GPU-0", 7, ((b"h" * 64, 4096),), (ipc_memory.RegionExport(0, 1024, 512, 4, (0, 256), 256),)
    )
    wire = msgpack.unpackb(msgpack.packb(ipc_memory.export_to_wire(export)), raw=False)
    assert ipc_memory.export_from_wire(wire) == export

    def broken(**change) -> dict:
        fields = ipc_memory.export_to_wire(export)
        region = dict(
            zip(("allocation", "offset", "stride", "blocks", "runs", "run_bytes"), fields["regions"][0])
        )
        region.update(change)
        fields["regions"] = [list(region.values())]
        return fields

    for change, why in [
        ({"blocks": 7}, "reach byte"),  # 1024 + 6 * 512 + 256 + 256 > 4096
        ({"offset": 8}, "aligned"),
        ({"allocation": 1}, "allocation 1 of 1"),
        ({"runs": []}, "run offsets"),
        ({"stride": 0}, "zero"),
    ]:
        with pytest.raises(KVTransportError, match=why):
            ipc_memory.export_from_wire(broken(**change))
    short = ipc_memory.export_to_wire(export) | {"allocations": [[b"h" * 63, 4096]]}
    with pytest.raises(KVTransportError, match="64-byte handle"):
        ipc_memory.export_from_wire(short)


def test_malformed_link_settings_are_refused_before_use():
    good = {"timeout_s": 5.0, "control_port": 1234, "control_key": b"k" * 32, "export": {}}
    for change in ({"control_key": b"short"}, {"control_port": 0}, {"timeout_s": True}, {"export": []}):
        with pytest.raises(KVTransportError, match="malformed CUDA IPC"):
            _decode_settings(msgpack.packb(good | change))
    with pytest.raises(KVTransportError, match="malformed"):
        _decode_settings(b"\xc1")


def test_copy_plans_pair_each_run_of_each_block_across_differently_sized_caches():
    from pdserve.kv.transport import gpu_copy, peer_copy

    src, dst = gpu_like_regions(16, seed=1, layers=2), gpu_like_regions(12, seed=2, layers=2)
    table = peer_copy.PeerTable.pair([gpu_copy.describe(r) for r in src], [gpu_copy.describe(r) for r in dst])
    pairs = table.addresses([3, 15], [11, 2])
    assert len(pairs) == 2 * 2 * 2  # regions x blocks x runs (K, V)
    k_of = lambda region, block: region.tensor[0, block].data_ptr()
    v_of = lambda region, block: region.tensor[1, block].data_ptr()
    assert pairs[0].tolist() == [k_of(src[0], 3), k_of(dst[0], 11)]
    assert pairs[1].tolist() == [v_of(src[0], 3), v_of(dst[0], 11)]
    assert pairs[7].tolist() == [v_of(src[1], 15), v_of(dst[1], 2)]
    assert table.block_nbytes == 2 * 2048

    other = [BlockRegion(torch.zeros(12, 4, 2, 128, dtype=torch.float16), block_dim=0)] * 2  # one run
    with pytest.raises(ValueError, match="not alike runs"):
        peer_copy.PeerTable.pair([gpu_copy.describe(r) for r in src], [gpu_copy.describe(r) for r in other])


def test_the_deployments_cuda_ipc_setting_builds_ipc_endpoints_that_keep_the_nccl_settings(monkeypatch):
    from types import SimpleNamespace

    from pdserve.config.schema import PdserveConfig
    from pdserve.engine import vllm_engine
    from pdserve.engine.spec import EngineSpec
    from pdserve.kv.connector.config import ConnectorConfig
    from pdserve.kv.connector.worker_side import NetworkTransports
    from pdserve.kv.transport import cuda_ipc

    tree = PdserveConfig.model_validate(
        {"kv": {"transport": "cuda_ipc", "cluster_token": "t", "nccl_max_pairs": 3}}
    )
    vllm_config = vllm_engine._kv_transfer_config(EngineSpec("prefill-0", "prefill", "/m", "m", tree))
    config = ConnectorConfig.from_vllm(SimpleNamespace(**vllm_config))
    assert config.transport == "cuda_ipc"
    built = []
    monkeypatch.setattr(cuda_ipc, "CudaIpcSource", lambda *a, **o: built.append(("source", o["max_pairs"])))
    monkeypatch.setattr(cuda_ipc, "CudaIpcSink", lambda *a, **o: built.append(("sink", o["nccl_api"])))
    transports = NetworkTransports(config)
    transports.make_source(None, [], engine_id="e", on_release=lambda *a: None, tp_rank=0)
    transports.make_sink("cuda_ipc", None, [], engine_id="e")
    assert built == [("source", 3), ("sink", "auto")]


def test_the_copy_kernel_moves_exactly_the_named_blocks_whatever_its_chunking(monkeypatch):
    """The GPU kernel's own arithmetic, run by Triton's interpreter on CPU tensors: every run of
    every named block lands in its destination block, and no other block is written."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from pdserve.kv.transport import gpu_copy, peer_copy

    monkeypatch.setattr(peer_copy, "_peer_kernel", interpreter.InterpretedFunction(peer_copy._peer_kernel.fn))
    src, dst = gpu_like_regions(16, seed=1, layers=2), gpu_like_regions(12, seed=2, layers=2)
    table = peer_copy.PeerTable.pair([gpu_copy.describe(r) for r in src], [gpu_copy.describe(r) for r in dst])
    table = table.uploaded(torch.device("cpu"))
    ids = torch.zeros(2 + 2 * 8, dtype=torch.int64)
    assert peer_copy.write_ids(peer_copy.id_buffer(ids), [15, 0, 7], [2, 11, 5]) == 2 + 2 * 3
    assert ids[:8].tolist() == [3, 0, 15, 0, 7, 2, 11, 5]
    anchor = torch.empty(4, dtype=torch.int32)
    before = [region.tensor.clone() for region in dst]
    # 64 int32: a run (256 int32) in 4 chunks; 4096: one masked chunk per run. 3 programs loop.
    for block_elems in (64, 4096):
        launch = peer_copy.LaunchSettings(block_elems=block_elems)
        peer_copy.launch_kernel(table, ids, anchor, launch, programs=3)
        for s, d, old in zip(src, dst, before):
            assert torch.equal(d.tensor[:, [2, 11, 5]], s.tensor[:, [15, 0, 7]])
            untouched = [b for b in range(12) if b not in (2, 11, 5)]
            assert torch.equal(d.tensor[:, untouched], old[:, untouched])
            d.tensor.copy_(old)


def test_the_sinks_quick_block_id_check_agrees_with_every_sinks_check(ends):
    from pdserve.kv.transport.base import BlockSink

    _, sink, _ = ends()
    cases = [
        ([1, 2], [3, 4]), ([], []), ([1], [3, 4]), ([1, 2], [3, 3]), ([1, 2], [3, 12]),
        ([1, 2], [-1, 4]), ([-1, 2], [3, 4]), ([99, 2], [3, 4]),
    ]  # fmt: skip
    for src, dst in cases:
        assert sink._check_block_ids(src, dst) == BlockSink._check_block_ids(sink, src, dst), (src, dst)
