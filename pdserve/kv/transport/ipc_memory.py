"""CUDA IPC memory handles for the `cuda_ipc` transport: what a source exports of its KV cache, how
a sink checks that description and maps it, and the CUDA calls beneath (ctypes, no extension).

Lifecycle: a source describes the regions a peer pulls (`describe_export`: one CUDA IPC handle per
allocation that holds a region, exported once and cached, plus each region's geometry inside its
allocation) and sends it as msgpack bytes over the authenticated session. The sink validates every
field (`decode_export`: types, alignment, and that every byte a pull can touch lies inside its
allocation) before it opens anything, opens each allocation once (`open_handle`,
cudaIpcOpenMemHandle with lazy peer access) and closes them when it forgets the source.

Handles are plain 64-byte values (cudaIpcMemHandle_t): nothing is unpickled. Where IPC cannot
work, `local_identity` and `check_same_host` give the reason in words: another node (the host ids
differ), a source GPU not visible in this process, or a driver refusal (its error string).

CUDA calls go through the runtime library that torch already loaded (cudart) and, for the
allocation's base and size, the driver (libcuda). `StreamCalls` holds the three runtime calls
of a pull's launch (peer_copy.LaunchRing), made without releasing the GIL. Allocations made
through CUDA's virtual memory API (torch's `expandable_segments`) have no legacy IPC handle;
export fails naming that.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv.transport.errors import KVTransportError

__all__ = [
    "HANDLE_BYTES",
    "CudaIpc",
    "StreamCalls",
    "Export",
    "IpcUnavailableError",
    "RegionExport",
    "check_same_host",
    "export_from_wire",
    "export_to_wire",
    "host_id",
]

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# Addresses, strides and runs must be multiples of this, so the copy kernel's accesses are 128-bit.
ALIGN = 16
# cudaIpcMemLazyEnablePeerAccess: the runtime enables peer access to the owning GPU when it maps.
_LAZY_PEER_ACCESS = 1
# Bounds a malformed description: a KV cache has a few hundred regions at most.
MAX_REGIONS = 4096
MAX_RUNS_PER_BLOCK = 1024


class IpcUnavailableError(KVTransportError):
    """CUDA IPC cannot connect this sink to that source; the message says why."""


@dataclass(frozen=True, slots=True)
class RegionExport:
    """Where one region lives inside an exported allocation, and its block geometry (bytes)."""

    allocation: int  # index into Export.allocations
    offset: int  # of the region's first byte (its data_ptr) from the allocation's base
    block_stride: int
    num_blocks: int
    run_offsets: tuple[int, ...]  # of each contiguous run of a block, from the block's start
    run_bytes: int

    def extent(self) -> int:
        """One past the last byte, from the allocation's base, that a block of this region holds."""
        return (
            self.offset + (self.num_blocks - 1) * self.block_stride + max(self.run_offsets) + self.run_bytes
        )


@dataclass(frozen=True, slots=True)
class Export:
    """What a source tells a sink so that the sink can map its KV: who and where it is, the
    allocations (IPC handle, size) and each region's place in one of them."""

    host_id: str
    device_uuid: str
    pid: int
    allocations: tuple[tuple[bytes, int], ...]
    regions: tuple[RegionExport, ...]


def host_id() -> str:
    """This host's identity for the same-node check: the kernel's boot id (shared by every
    process and container of one boot, distinct across machines), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def check_same_host(export: Export, local_host_id: str) -> None:
    """Raises IpcUnavailableError when the source runs on another node."""
    if export.host_id != local_host_id:
        raise IpcUnavailableError(
            f"CUDA IPC needs both engines on one node; the source is on another ({export.host_id} "
            f"vs {local_host_id}): use the nccl transport across nodes"
        )


def export_to_wire(export: Export) -> dict:
    """The msgpack-able form a source sends inside SetupCommunicatorResponse.params."""
    return {
        "host_id": export.host_id,
        "device_uuid": export.device_uuid,
        "pid": export.pid,
        "allocations": [[handle, size] for handle, size in export.allocations],
        "regions": [
            [r.allocation, r.offset, r.block_stride, r.num_blocks, list(r.run_offsets), r.run_bytes]
            for r in export.regions
        ],
    }


def export_from_wire(fields: object) -> Export:
    """Validates a description from the network before anything is mapped; raises
    KVTransportError naming the first bad field. Every byte that a pull of any block of any
    region can touch must lie inside the region's allocation."""
    if not isinstance(fields, dict):
        raise KVTransportError("malformed CUDA IPC export: not a map")
    strings = {name: fields.get(name) for name in ("host_id", "device_uuid")}
    if not all(isinstance(v, str) for v in strings.values()) or type(fields.get("pid")) is not int:
        raise KVTransportError("malformed CUDA IPC export: host_id, device_uuid or pid")
    allocations = _allocations(fields.get("allocations"))
    raw = fields.get("regions")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_REGIONS:
        raise KVTransportError("malformed CUDA IPC export: regions")
    regions = tuple(_region(i, entry, allocations) for i, entry in enumerate(raw))
    return Export(strings["host_id"], strings["device_uuid"], fields["pid"], allocations, regions)


def _allocations(raw: object) -> tuple[tuple[bytes, int], ...]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_REGIONS:
        raise KVTransportError("malformed CUDA IPC export: allocations")
    out = []
    for entry in raw:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], bytes)
            or len(entry[0]) != HANDLE_BYTES
            or type(entry[1]) is not int
            or entry[1] <= 0
        ):
            raise KVTransportError("malformed CUDA IPC export: an allocation is not (64-byte handle, size)")
        out.append((entry[0], entry[1]))
    return tuple(out)


def _region(index: int, entry: object, allocations: Sequence[tuple[bytes, int]]) -> RegionExport:
    def bad(why: str) -> KVTransportError:
        return KVTransportError(f"malformed CUDA IPC export: regions[{index}]: {why}")

    if not isinstance(entry, list) or len(entry) != 6:
        raise bad("not 6 fields")
    allocation, offset, stride, num_blocks, runs, run_bytes = entry
    if not all(type(v) is int for v in (allocation, offset, stride, num_blocks, run_bytes)):
        raise bad("a field is not an integer")
    if (
        not isinstance(runs, list)
        or not 0 < len(runs) <= MAX_RUNS_PER_BLOCK
        or not all(type(o) is int for o in runs)
    ):
        raise bad("run offsets")
    if not 0 <= allocation < len(allocations):
        raise bad(f"allocation {allocation} of {len(allocations)}")
    if offset < 0 or stride <= 0 or num_blocks <= 0 or run_bytes <= 0 or min(runs) < 0:
        raise bad("negative or zero geometry")
    if any(v % ALIGN for v in (offset, stride, run_bytes, *runs)):
        raise bad(f"not {ALIGN}-byte aligned")
    region = RegionExport(allocation, offset, stride, num_blocks, tuple(runs), run_bytes)
    size = allocations[allocation][1]
    if region.extent() > size:
        raise bad(f"blocks reach byte {region.extent()} of an allocation of {size}")
    return region


# --- CUDA calls -------------------------------------------------------------------------------


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found in this process's mappings), else one by name."""
    torch.cuda.init()
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "libcudart.so" in os.path.basename(path):
                paths.add(path)
    for name in sorted(paths) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
        return lib
    raise IpcUnavailableError("CUDA IPC: no CUDA runtime library (libcudart) in this process")


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64,
    ]  # fmt: skip
    return lib


def _check(result: int, what: str, error: type[KVTransportError] = IpcUnavailableError) -> None:
    if result != 0:
        message = _cudart().cudaGetErrorString(result).decode(errors="replace")
        raise error(f"CUDA IPC: {what} failed: {message} (error {result})")


def _set_device(index: int) -> None:
    """Makes `index`'s primary context current on this thread (driver calls need one)."""
    _check(_cudart().cudaSetDevice(index), f"cudaSetDevice({index})")


def allocation_of(pointer: int, device_index: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation holding `pointer`."""
    _set_device(device_index)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    result = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer)
    if result != 0:
        raise IpcUnavailableError(f"CUDA IPC: cuMemGetAddressRange failed (driver error {result})")
    return base.value, size.value


def export_handle(base: int, device_index: int) -> bytes:
    """The IPC handle of the allocation starting at `base`; the source, once per allocation."""
    _set_device(device_index)
    handle = _Handle()
    result = _cudart().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base))
    if result != 0:
        raise IpcUnavailableError(
            "CUDA IPC: cudaIpcGetMemHandle failed on the KV cache "
            f"({_cudart().cudaGetErrorString(result).decode(errors='replace')}); memory from CUDA's "
            "virtual memory API (PYTORCH_CUDA_ALLOC_CONF=expandable_segments) has no IPC handle"
        )
    return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES)  # .reserved would stop at a NUL


def open_handle(handle: bytes, device_index: int) -> int:
    """Maps a peer's allocation into this process, for access from `device_index`; returns its
    address here. The sink, once per allocation; undo with `close_handle`."""
    _set_device(device_index)
    pointer = ctypes.c_void_p()
    raw = _Handle()
    ctypes.memmove(ctypes.addressof(raw), handle, HANDLE_BYTES)
    _check(
        _cudart().cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle"
    )
    return pointer.value or 0


def close_handle(pointer: int, device_index: int) -> None:
    """Unmaps what `open_handle` mapped."""
    _set_device(device_index)
    _check(_cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)), "cudaIpcCloseMemHandle")


class StreamCalls:
    """The runtime calls of a pull's launch (peer_copy.LaunchRing), through ctypes.PyDLL: each
    only queues work, so the GIL stays held; a CDLL call would release it, and the launching
    thread could then wait for another Python thread's time slice (up to 5 ms) to get it back.
    Raise KVTransportError naming CUDA's error."""

    _TO_DEVICE = 1  # cudaMemcpyHostToDevice
    _EXTERNAL = 1  # cudaEventRecordExternal: a graph captures the record as a node

    def __init__(self) -> None:
        lib = ctypes.PyDLL(_cudart()._name)
        void = ctypes.c_void_p
        lib.cudaMemcpyAsync.argtypes = [void, void, ctypes.c_size_t, ctypes.c_int, void]
        lib.cudaGraphLaunch.argtypes = [void, void]
        lib.cudaEventRecordWithFlags.argtypes = [void, void, ctypes.c_uint]
        self._lib = lib

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queues a copy of `nbytes` from pinned host memory at `src` to the GPU at `dst`."""
        result = self._lib.cudaMemcpyAsync(dst, src, nbytes, self._TO_DEVICE, stream)
        _check(result, "cudaMemcpyAsync", KVTransportError)

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        """Queues an instantiated graph (cudaGraphExec_t) on `stream`."""
        _check(self._lib.cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch", KVTransportError)

    def record_external(self, event: int, stream: int) -> None:
        """Records `event` on `stream`; inside a capture, as a node of the graph."""
        result = self._lib.cudaEventRecordWithFlags(event, stream, self._EXTERNAL)
        _check(result, "cudaEventRecordWithFlags", KVTransportError)


class CudaIpc:
    """The CUDA calls the cuda_ipc transport makes, on torch devices; tests substitute a fake
    that maps CPU tensors, so the protocol around them runs without a GPU."""

    maps_host_memory = False  # True only in fakes over CPU tensors

    @staticmethod
    def _index(device: torch.device) -> int:
        if device.type != "cuda":
            raise IpcUnavailableError(f"CUDA IPC needs the KV cache on a GPU; it is on {device}")
        return device.index if device.index is not None else torch.cuda.current_device()

    def allocation_of(self, pointer: int, device: torch.device) -> tuple[int, int]:
        """(base, size) of the allocation holding `pointer`."""
        return allocation_of(pointer, self._index(device))

    def export_handle(self, base: int, device: torch.device) -> bytes:
        return export_handle(base, self._index(device))

    def open_handle(self, handle: bytes, device: torch.device) -> int:
        return open_handle(handle, self._index(device))

    def close_handle(self, pointer: int, device: torch.device) -> None:
        close_handle(pointer, self._index(device))

    def device_uuid(self, device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(self._index(device)).uuid)

    def visible_uuids(self) -> list[str]:
        """The UUIDs of the GPUs this process sees, in CUDA index order."""
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
