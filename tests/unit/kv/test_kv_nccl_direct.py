"""nccl_direct's logic on a CPU host: a fake NCCL library and no-op CUDA streams and events.

What runs on GPUs (the bytes moving, stream order) is measured by benchmarks/transfer_sweep.py
and benchmarks/gpu/x4.sh step l; these tests hold the host-side contract: set-up within the
timeout or a clear error, the communicator aborted whenever nobody will use it, the right NCCL
call per op, and no call on a communicator after abort.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import pytest
import torch

from pdserve.kv.transport import nccl_direct
from pdserve.kv.transport.errors import KVTransportError

pytestmark = pytest.mark.unit

UID = bytes(range(128))


class FakeNccl:
    """Records calls; ncclCommInitRank may wait on an event or fail."""

    def __init__(self, init_result: int = 0, init_gate: threading.Event | None = None):
        self.calls: list[tuple] = []
        self.init_result, self.init_gate = init_result, init_gate
        self.aborted: list[int] = []

    def ncclCommInitRank(self, comm_ref, nranks, uid, rank):
        if self.init_gate is not None:
            self.init_gate.wait(5)
        self.calls.append(("init", nranks, bytes(uid.internal), rank))
        ctypes.cast(comm_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0FFEE
        return self.init_result

    def ncclSend(self, ptr, nbytes, dtype, peer, comm, stream):
        self.calls.append(("send", ptr, nbytes, dtype, peer, comm))
        return 0

    def ncclRecv(self, ptr, nbytes, dtype, peer, comm, stream):
        self.calls.append(("recv", ptr, nbytes, dtype, peer, comm))
        return 0

    def ncclCommAbort(self, comm):
        self.aborted.append(comm)
        return 0

    def ncclGetErrorString(self, result):
        return b"unhandled system error"


class _Stream:
    cuda_stream = 7

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _Event:
    def record(self, stream=None):
        pass


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """A FakeNccl as the library, and CUDA stream/event calls that do nothing."""

    def install(**options) -> FakeNccl:
        lib = FakeNccl(**options)
        monkeypatch.setattr(nccl_direct, "library", lambda: lib)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
        monkeypatch.setattr(torch.cuda, "Event", _Event)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
        return lib

    return install


def connect(rank: int = 0, timeout_s: float = 5.0) -> nccl_direct.DirectGroup:
    warmup = torch.zeros(64, dtype=torch.uint8)
    return nccl_direct.DirectGroup.connect(UID, rank, torch.device("cpu"), timeout_s, warmup)


def test_connect_initializes_rank_and_moves_the_warmup_buffer_to_the_other_rank(fake):
    lib = fake()
    group = connect(rank=1)
    assert lib.calls[0] == ("init", 2, UID, 1)
    kind, _, nbytes, dtype, peer, comm = lib.calls[1]
    assert (kind, nbytes, dtype, peer, comm) == ("recv", 64, 1, 0, 0xC0FFEE)  # rank 1 receives
    assert not lib.aborted
    group.abort()


def test_ops_send_the_tensor_bytes_to_the_peer_and_none_runs_after_abort(fake):
    lib = fake()
    group = connect(rank=0)
    tensor = torch.zeros(1000, dtype=torch.int32)
    group.send([tensor], 1, 0).wait()
    assert lib.calls[-1] == ("send", tensor.data_ptr(), 4000, 1, 1, 0xC0FFEE)
    group.abort()
    group.abort()  # only the first acts
    assert lib.aborted == [0xC0FFEE]
    with pytest.raises(KVTransportError, match="aborted"):
        group.recv([tensor], 1, 0)
    with pytest.raises(ValueError, match="contiguous"):
        connect().send([torch.zeros(4, 4)[:, 0]], 1, 0)


def test_a_failed_init_is_a_clear_error(fake):
    fake(init_result=2)
    with pytest.raises(KVTransportError, match="ncclCommInitRank failed: unhandled system error"):
        connect()


def test_a_set_up_past_the_timeout_fails_and_its_late_communicator_is_aborted(fake):
    gate = threading.Event()
    lib = fake(init_gate=gate)
    with pytest.raises(KVTransportError, match="timed out"):
        connect(timeout_s=0.05)
    gate.set()  # the peer shows up after all: the init thread finishes, nobody wants the comm
    deadline = time.monotonic() + 5
    while not lib.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lib.aborted == [0xC0FFEE]


def test_a_malformed_unique_id_is_refused_before_any_nccl_call(fake):
    lib = fake()
    with pytest.raises(KVTransportError, match="malformed"):
        nccl_direct.DirectGroup.connect(b"short", 0, torch.device("cpu"), 1.0, torch.zeros(1))
    assert not lib.calls
