"""Direct NCCL point-to-point for KV pairs: ncclSend / ncclRecv called through ctypes.

Why not torch.distributed: the host queued a 256 MiB pull's sends and block copies at 70-250 us
per operation (sessions 6 and 8, benchmarks/results/gpu/2026-11-26-h100-x2 and
2026-11-27-h100-x4-b), and the GPU moved the bytes at ~50% of a peer copy with NVLink idle
between sends. Here an op is one foreign call of a few microseconds that releases the GIL
(vLLM's pynccl does the same). Measured against torch's group in one run (session 9,
2026-11-27-h100-x4-c): 1.50 against 1.62 ms for 256 MiB. Most of the per-batch host time was
not torch's group: ~0.15-0.2 ms per batch remains with direct calls, and the GPU timeline
points at the block copies' launch.

`DirectGroup` mimics the part of a ProcessGroup that nccl.py uses, with the same stream
semantics: `send([t], peer, tag)` / `recv([t], peer, tag)` run on the group's own stream after
everything already queued on the caller's current stream, and return a work whose `wait()`
makes the current stream wait for the op. So the pair's copies (on its copy stream) overlap the
sends and receives exactly as they did with torch's group. Tags are ignored: NCCL matches
point-to-point ops of one pair in order, and both ends issue them in the same order.

Lifecycle: rank 0 makes a unique id and puts it in the pair's store; rank 1 reads it; both call
`DirectGroup.connect`, which initializes the communicator and moves one staging buffer from
rank 0 to rank 1, so NCCL's lazy connection set-up (which blocks the host until both ends
arrive) happens there, under the pair timeout, and never inside a pull. `abort()` is
ncclCommAbort: pending kernels exit, so a host thread waiting on a CUDA event returns, and every
later op raises KVTransportError.

The library is the libnccl.so.2 torch already loaded (or PDSERVE_NCCL_LIBRARY). `available()`
says whether it loads; NCCL pairs fall back to torch's group when it does not.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import torch

from pdserve.kv.transport.errors import KVTransportError

logger = logging.getLogger(__name__)

# Where the library comes from: torch's CUDA builds link libnccl.so.2, so this name resolves to
# the copy already in the process (the same NCCL torch uses).
LIBRARY_ENV = "PDSERVE_NCCL_LIBRARY"
DEFAULT_LIBRARY = "libnccl.so.2"
# ncclDataType_t of bytes.
_NCCL_UINT8 = 1
_UNIQUE_ID_BYTES = 128


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _UNIQUE_ID_BYTES)]


_c = ctypes
# name: (result type, argument types); ncclResult_t is an int, 0 = success.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (_c.c_int, [_c.POINTER(_c.c_int)]),
    "ncclGetErrorString": (_c.c_char_p, [_c.c_int]),
    "ncclGetUniqueId": (_c.c_int, [_c.POINTER(UniqueId)]),
    "ncclCommInitRank": (_c.c_int, [_c.POINTER(_c.c_void_p), _c.c_int, UniqueId, _c.c_int]),
    "ncclSend": (_c.c_int, [_c.c_void_p, _c.c_size_t, _c.c_int, _c.c_int, _c.c_void_p, _c.c_void_p]),
    "ncclRecv": (_c.c_int, [_c.c_void_p, _c.c_size_t, _c.c_int, _c.c_int, _c.c_void_p, _c.c_void_p]),
    "ncclCommAbort": (_c.c_int, [_c.c_void_p]),
    "ncclCommDestroy": (_c.c_int, [_c.c_void_p]),
}

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The NCCL library with its signatures set (loaded once); KVTransportError if it cannot load."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is None and _lib_error is None:
            name = os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY
            try:
                lib = ctypes.CDLL(name)
                for symbol, (restype, argtypes) in _SIGNATURES.items():
                    function = getattr(lib, symbol)
                    function.restype, function.argtypes = restype, argtypes
                _lib = lib
            except (OSError, AttributeError) as exc:
                _lib_error = f"cannot use NCCL library {name!r}: {exc}"
        if _lib is None:
            raise KVTransportError(_lib_error)
        return _lib


def available() -> bool:
    """Whether direct NCCL calls can be made here: a CUDA torch and a loadable libnccl."""
    if not torch.cuda.is_available():
        return False
    try:
        library()
    except KVTransportError as exc:
        logger.info("direct NCCL unavailable (%s); NCCL pairs use torch.distributed", exc)
        return False
    return True


def version() -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded library."""
    code = ctypes.c_int()
    _check("ncclGetVersion", library().ncclGetVersion(ctypes.byref(code)))
    return code.value // 10000, code.value // 100 % 100, code.value % 100


def unique_id() -> bytes:
    """A fresh communicator id (rank 0 makes it; the pair's store carries it to rank 1)."""
    uid = UniqueId()
    _check("ncclGetUniqueId", library().ncclGetUniqueId(ctypes.byref(uid)))
    return bytes(uid.internal)


def _check(name: str, result: int) -> None:
    if result != 0:
        message = library().ncclGetErrorString(result)
        text = message.decode(errors="replace") if message else "unknown error"
        raise KVTransportError(f"{name} failed: {text} (ncclResult {result})")


class _Work:
    """One queued op: wait() makes the caller's current stream wait for it (no host wait)."""

    __slots__ = ("_done",)

    def __init__(self, done: torch.cuda.Event):
        self._done = done

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._done)


class DirectGroup:
    """A 2-rank NCCL communicator driven by direct calls; see the module docstring."""

    def __init__(self, comm: int, device: torch.device):
        self._comm: int | None = comm
        self._lock = threading.Lock()  # no op may use the comm once abort has freed it
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def connect(
        cls, uid: bytes, rank: int, device: torch.device, timeout_s: float, warmup: torch.Tensor
    ) -> DirectGroup:
        """Initializes rank `rank` of the pair's communicator and moves `warmup` (a staging
        buffer: the largest message the pair will send) 0 -> 1. Both ends must call it; each
        blocks until the other has. Raises KVTransportError if that takes longer than
        `timeout_s` (the stuck thread is left behind: a blocking NCCL init cannot be
        interrupted; it aborts its communicator if it ever finishes)."""
        if len(uid) != _UNIQUE_ID_BYTES:
            raise KVTransportError(f"malformed NCCL unique id ({len(uid)} bytes)")
        outcome: dict[str, Any] = {}
        decided = threading.Lock()  # the init thread's result and the caller's timeout: one wins

        def init() -> None:
            group, error = None, None
            try:
                torch.cuda.set_device(device)
                comm = ctypes.c_void_p()
                raw = UniqueId()
                ctypes.memmove(raw.internal, uid, _UNIQUE_ID_BYTES)
                _check("ncclCommInitRank", library().ncclCommInitRank(ctypes.byref(comm), 2, raw, rank))
                group = cls(comm.value, device)
                with torch.cuda.stream(group.stream):
                    op = group.send if rank == 0 else group.recv
                    op([warmup], 1 - rank, 0)
                group.stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                error = exc
            with decided:
                gave_up = "timed_out" in outcome
                if gave_up:
                    pass
                elif error is None:
                    outcome["group"] = group
                else:
                    outcome["error"] = error
            if group is not None and (gave_up or error is not None):
                group.abort()  # a failed warm-up, or the caller gave up: nobody will use it

        thread = threading.Thread(target=init, name="kv-nccl-init", daemon=True)
        thread.start()
        thread.join(timeout_s)
        with decided:
            if not outcome:
                outcome["timed_out"] = True
                raise KVTransportError(f"NCCL pair set-up (rank {rank}) timed out after {timeout_s:.0f} s")
        if "error" in outcome:
            error = outcome["error"]
            if isinstance(error, KVTransportError):
                raise error
            raise KVTransportError(f"NCCL pair set-up failed: {error}") from error
        return outcome["group"]

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> _Work:
        return self._op("ncclSend", tensors, peer)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> _Work:
        return self._op("ncclRecv", tensors, peer)

    def _op(self, name: str, tensors: list[torch.Tensor], peer: int) -> _Work:
        (tensor,) = tensors
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"{name} needs one contiguous tensor on {self.device}")
        ready = torch.cuda.Event()
        ready.record()  # the caller's stream: what it queued so far (the gather, the scatter)
        self.stream.wait_event(ready)
        with self._lock:
            if self._comm is None:
                raise KVTransportError("NCCL pair was aborted")
            function = getattr(library(), name)
            result = function(
                tensor.data_ptr(), tensor.numel() * tensor.element_size(), _NCCL_UINT8, peer,
                self._comm, self.stream.cuda_stream,
            )  # fmt: skip
        _check(name, result)
        done = torch.cuda.Event()
        done.record(self.stream)
        return _Work(done)

    def abort(self) -> None:
        """ncclCommAbort (any thread; only the first call acts): pending ops end, later ones raise."""
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            result = library().ncclCommAbort(comm)
            if result != 0:
                logger.debug("ncclCommAbort returned %d", result)
