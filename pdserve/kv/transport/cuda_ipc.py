"""cuda_ipc transport: two engines on one node copy KV blocks straight between their paged caches.

The source exports its KV cache once (one CUDA IPC handle per allocation: ipc_memory); the sink
maps it once, behind the same authenticated gRPC session as every transport (Challenge,
Handshake: cluster-token proof, wire version, layout hash), and then each pull is one kernel
launch on the sink's GPU that reads the named source blocks over NVLink and writes them into the
sink's own blocks (peer_copy): no staging buffer, no second copy, no NCCL.

Per source (a "link"), once: the sink calls SetupCommunicator with backend "cuda_ipc"; the source
answers with the export (msgpack: handles as bytes, each region's place and geometry; checked
field by field before anything is mapped) and a per-link control connection (control.py: one TCP
socket, a key proved in the first frame). Per pull (ipc_link: pulls are pipelined on a link):

    sink: queues the copy (one CUDA graph launch) and sends a PullHeader (request, blocks, release)
    source: opens the read (open_read: the blocks must be pinned) and answers {"error": None}
            or why it refuses, in header order
    sink: reads the answer (while the copy runs), waits for the copy, ends the pull (DONE, or
          FAILED if refused), then sends {"done": request_id, "ok": true} for an accepted read
    source: ends the read (close_read), which frees the blocks when the sink asked to release

So the source's blocks stay pinned until the sink has finished reading them, and a pull is
DONE only if the source confirmed the pin (ipc_link says why reading before the answer is
safe). While reads are open, a sink silent for the link's timeout loses the link and the reads
end unreleased; a copy that took more than half that timeout fails the pull.

Where IPC cannot work, the link is refused with a reason in words (IpcUnavailableError): the
source on another node, a KV cache not on a GPU, the source's GPU not visible in the sink's
process, the driver's refusal. A `CudaIpcSource` is an NcclSource too, so by default
(`nccl_fallback`) the sink logs that reason once and pulls from that source over NCCL pairs;
without fallback, `handshake` and pulls fail with it.

GPU visibility: cudaIpcOpenMemHandle maps a peer GPU's allocation into the sink's context with
peer access enabled lazily. On 2 x H200 (driver 580) it worked with each process seeing only its
own GPU, as Ray places engine actors (benchmarks/results/gpu/2026-11-29-h200-x2-ipc/); where a
driver or container refuses, the refusal names the source GPU and CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections import deque
from collections.abc import Sequence

import grpc
import msgpack

from pdserve.kv.proto import kv_transfer_pb2 as pb
from pdserve.kv.transport import control, gpu_copy, ipc_memory, peer_copy, wire
from pdserve.kv.transport.base import KVTransfer
from pdserve.kv.transport.errors import KVTransportError
from pdserve.kv.transport.grpc import HANDSHAKE_TIMEOUT_S, SourceSession
from pdserve.kv.transport.handshake import PeerInfo
from pdserve.kv.transport.ipc_link import Link, LinkClosedError
from pdserve.kv.transport.ipc_memory import CudaIpc, Export, IpcUnavailableError, RegionExport
from pdserve.kv.transport.nccl import NcclSink, NcclSource
from pdserve.kv.transport.regions import BlockRegion
from pdserve.kv.transport.sessions import Session

logger = logging.getLogger(__name__)

__all__ = ["IPC_BACKEND", "CudaIpcSink", "CudaIpcSource", "IpcUnavailableError"]

# What a sink names in SetupCommunicatorRequest.backend to ask for a link instead of an NCCL pair.
IPC_BACKEND = "cuda_ipc"


class CudaIpcSource(NcclSource):
    """An NcclSource (so gRPC and NCCL pulls still work, for sinks that cannot map it) that also
    serves cuda_ipc links. Takes NcclSource's arguments plus `ipc` (the CUDA calls; tests pass a
    fake). Links count against the same limits as NCCL pairs (`max_pairs`, per session)."""

    def __init__(self, layout, regions: Sequence[BlockRegion], *, ipc: CudaIpc | None = None, **options):
        self.ipc = ipc or CudaIpc()
        self.host_id = ipc_memory.host_id()
        self._handles: dict[int, tuple[bytes, int]] = {}  # allocation base -> (handle, size)
        self._links: dict[str, socket.socket] = {}  # link id -> its listener, then its connection
        super().__init__(layout, regions, **options)

    def serve_setup_communicator(self, pair_id: str, backend: str, session: Session) -> tuple[str, bytes]:
        """Server thread, once per link (or NCCL pair: NcclSource's): exports the regions the
        session's pulls read, starts the link's thread and returns ("", settings). Raises
        IpcUnavailableError when this source cannot export (its KV is not on a GPU, say)."""
        if backend != IPC_BACKEND:
            return super().serve_setup_communicator(pair_id, backend, session)
        self._budget.reserve(session, pair_id)
        try:
            return self._start_link(pair_id, session)
        except BaseException:
            self._budget.release(session, pair_id)
            raise

    def export(self, regions: Sequence[BlockRegion]) -> Export:
        """The description of `regions` a sink maps; handles are made once per allocation."""
        allocations: dict[int, int] = {}  # base -> index in the export
        entries = []
        for i, region in enumerate(regions):
            runs = gpu_copy.describe(region)
            if runs is None:
                raise IpcUnavailableError(f"KV region {i}'s blocks are not 16-byte aligned runs")
            base, _ = self._allocation(runs.base)
            index = allocations.setdefault(base, len(allocations))
            entries.append(
                RegionExport(
                    index,
                    runs.base - base,
                    runs.block_stride,
                    region.num_blocks,
                    runs.offsets,
                    runs.run_bytes,
                )
            )
        handles = tuple(self._handles[base] for base in allocations)  # dicts keep insertion order
        uuid = self.ipc.device_uuid(self.device)
        return Export(self.host_id, uuid, os.getpid(), handles, tuple(entries))

    def _allocation(self, pointer: int) -> tuple[int, int]:
        base, size = self.ipc.allocation_of(pointer, self.device)
        with self._pairs_lock:
            known = base in self._handles
        if not known:
            handle = self.ipc.export_handle(base, self.device)
            with self._pairs_lock:
                self._handles[base] = (handle, size)
        return base, size

    def _start_link(self, pair_id: str, session: Session) -> tuple[str, bytes]:
        export = self.export(self.regions_for(session.layout))
        listener = control.listen(self.host)
        port = listener.getsockname()[1]
        key = secrets.token_bytes(32)
        with self._pairs_lock:
            if self._closing:
                listener.close()
                raise ValueError("the KV source is closing")
            self._links[pair_id] = listener
        threading.Thread(
            target=self._serve_link,
            args=(pair_id, listener, key, session),
            name=f"kv-ipc-{pair_id}",
            daemon=True,
        ).start()
        settings = {
            "timeout_s": self.pair_timeout_s,
            "control_port": port,
            "control_key": key,
            "export": ipc_memory.export_to_wire(export),
        }
        return "", msgpack.packb(settings, use_bin_type=True)

    def close(self) -> None:
        """Closes every link's socket (its thread ends), then closes as an NcclSource."""
        with self._pairs_lock:
            self._closing = True
            links, self._links = list(self._links.values()), {}
        for sock in links:
            sock.close()
        super().close()

    def _serve_link(self, pair_id: str, listener: socket.socket, key: bytes, session: Session) -> None:
        conn = None
        try:
            conn = control.accept(listener, key, self.pair_timeout_s)
            with self._pairs_lock:
                if self._closing:
                    return
                self._links[pair_id] = conn
            self._serve_frames(conn, session.session_id)
        except Exception as exc:  # noqa: BLE001 - a broken link is dropped; its sink sets up another
            level = logging.DEBUG if self._closing or isinstance(exc, ConnectionError) else logging.WARNING
            logger.log(level, "KV IPC link %s ended: %s", pair_id, exc)
        finally:
            with self._pairs_lock:
                self._links.pop(pair_id, None)
            listener.close()
            if conn is not None:
                conn.close()
            self._budget.release(session, pair_id)

    def _serve_frames(self, conn: socket.socket, reader: str) -> None:
        """Link thread: opens a read per header (answering at once), ends it per done frame.
        While reads are open, a sink silent for the link's timeout ends the link; its reads end
        without releasing (the blocks stay pinned until a release or the lease)."""
        reads: dict[str, bool] = {}  # request id -> release when done, of this link's open reads
        try:
            while True:
                conn.settimeout(self.pair_timeout_s if reads else None)
                frame = control.recv_frame(conn)
                if isinstance(frame, dict) and "done" in frame:
                    request_id, copied = _done_from_wire(frame)
                    if request_id not in reads:
                        raise KVTransportError(
                            f"done frame for {request_id!r}, which this link is not reading"
                        )
                    self.close_read(request_id, release=copied and reads.pop(request_id))
                    continue
                header = control.PullHeader.from_wire(frame)
                control.send_frame(conn, control.reply_to_wire(self._open(header, reads, reader)))
        finally:
            for request_id in reads:
                self.close_read(request_id, release=False)

    def _open(self, header: control.PullHeader, reads: dict[str, bool], reader: str) -> str | None:
        """Opens one pull's read; None, or why it is refused."""
        if header.request_id in reads:
            return "already being read on this link"
        try:
            self.open_read(header.request_id, header.block_ids, reader)
        except (LookupError, ValueError) as exc:
            return str(exc)
        reads[header.request_id] = header.release_after
        return None


def _done_from_wire(frame: dict) -> tuple[str, bool]:
    request_id, copied = frame.get("done"), frame.get("ok")
    if not isinstance(request_id, str) or not isinstance(copied, bool):
        raise KVTransportError("malformed done frame")
    return request_id, copied


class CudaIpcSink(NcclSink):
    """Pulls from CudaIpcSources through links where CUDA IPC works, over NCCL pairs otherwise
    (`nccl_fallback`; False: such pulls fail and `handshake` raises the reason). Takes
    NcclSink's arguments plus `ipc` (the CUDA calls; tests pass a fake) and the copy launch's
    settings (peer_copy.LaunchSettings: `block_elems`, `num_warps`, `programs_per_sm`, and
    `graphs`, False only to compare with launching step by step)."""

    def __init__(
        self,
        layout,
        regions: Sequence[BlockRegion],
        *,
        nccl_fallback: bool = True,
        ipc: CudaIpc | None = None,
        block_elems: int = peer_copy.DEFAULT_BLOCK_ELEMS,
        num_warps: int = peer_copy.DEFAULT_NUM_WARPS,
        programs_per_sm: int = peer_copy.DEFAULT_PROGRAMS_PER_SM,
        graphs: bool = True,
        **options,
    ):
        self.nccl_fallback = nccl_fallback
        self.ipc = ipc or CudaIpc()
        self.host_id = ipc_memory.host_id()
        self.launch = peer_copy.LaunchSettings(block_elems, num_warps, programs_per_sm, graphs)
        # Each link pull's phase times (ipc_link), kept when tracing (`trace`, for benchmarks).
        self.link_traces: deque[dict[str, float]] | None = (
            deque(maxlen=4096) if options.get("trace") else None
        )
        self._links: dict[str, Link | str] = {}  # address -> link, or why IPC is off for it
        self._link_locks: dict[str, threading.Lock] = {}
        super().__init__(layout, regions, **options)

    def handshake(self, remote_address: str) -> PeerInfo:
        """The session's handshake, then the link (once per source). Raises KVTransportError:
        the handshake's refusals, and without `nccl_fallback` why IPC is unavailable."""
        session = self.session(remote_address)
        self._link(session)
        return session.info

    def ipc_refusal(self, remote_address: str) -> str | None:
        """Why pulls from that source go over NCCL (None: they use IPC, or no link was tried)."""
        with self._lock:
            link = self._links.get(remote_address)
        return link if isinstance(link, str) else None

    def close(self) -> None:
        """Closes every link (fails its pulls in flight, unmaps), then closes as an NcclSink."""
        with self._lock:
            links = [v for v in self._links.values() if isinstance(v, Link)]
            self._links = {}
        for link in links:
            link.close()
        super().close()

    def _check_block_ids(self, src: list[int], dst: list[int]) -> str | None:
        """BlockSink's checks, passed with builtins over the lists when the ids are fine: this
        runs before every pull's launch. Any doubt goes to BlockSink's version for the message."""
        if (
            len(src) == len(dst)
            and (not dst or (min(dst) >= 0 and max(dst) < self.num_blocks and min(src) >= 0))
            and len(set(dst)) == len(dst)
        ):
            return None
        return super()._check_block_ids(src, dst)

    def _submit(self, transfer: KVTransfer, src: list[int], dst: list[int], release: bool) -> None:
        """With a link to the source, queues the copy and the header on the caller's thread (no
        thread hand-off before the copy starts); otherwise the pull thread sets the link up."""
        with self._lock:
            link = None if self._closed else self._links.get(transfer.remote_address)
        if not isinstance(link, Link) or link.closed is not None:
            super()._submit(transfer, src, dst, release)
            return
        nbytes = len(dst) * link.table.block_nbytes

        def on_end(error: str | None) -> None:
            if error is None:
                transfer.add_bytes(nbytes)
            transfer.finish(error)

        try:
            link.start(transfer.request_id, src, dst, release, on_end)
        except LinkClosedError:
            self._forget_link(transfer.remote_address, link)
            super()._submit(transfer, src, dst, release)
            return
        transfer.set_transferring()  # after the launch: the copy need not wait for it

    def _pull(
        self, session: SourceSession, transfer: KVTransfer, src: list[int], dst: list[int], release: bool
    ) -> None:
        """Pull thread (a source's first pull, or any without a link): the link, then the pull
        over it, waited for here; NCCL where IPC is off for that source."""
        link = self._link(session)
        if link is None:
            super()._pull(session, transfer, src, dst, release)
            return
        ended, errors = threading.Event(), []
        link.start(transfer.request_id, src, dst, release, lambda error: (errors.append(error), ended.set()))
        if not ended.wait(2 * link.timeout_s):
            raise KVTransportError(f"no answer from {session.info.address} within {2 * link.timeout_s} s")
        if errors[0] is not None:
            raise KVTransportError(errors[0])
        transfer.add_bytes(len(dst) * link.table.block_nbytes)

    def _forget_link(self, address: str, link: Link) -> None:
        with self._lock:
            if self._links.get(address) is link:
                del self._links[address]

    def _link(self, session: SourceSession) -> Link | None:
        """The source's link, set up on first use; None when IPC is off for it (NCCL then)."""
        address = session.info.address
        with self._lock:
            link = self._links.get(address)
            lock = self._link_locks.setdefault(address, threading.Lock())
        if link is None or (isinstance(link, Link) and link.closed is not None):
            with lock:
                with self._lock:
                    link = self._links.get(address)
                if link is None or (isinstance(link, Link) and link.closed is not None):
                    link = self._set_up(session)
                    with self._lock:
                        self._links[address] = link
        if isinstance(link, Link):
            return link
        if self.nccl_fallback:
            return None
        raise IpcUnavailableError(link)

    def _set_up(self, session: SourceSession) -> Link | str:
        address = session.info.address
        try:
            return self._map(session)
        except KVTransportError as exc:
            logger.log(
                logging.WARNING if self.nccl_fallback else logging.DEBUG,
                "CUDA IPC with the KV source at %s unavailable%s: %s",
                address, ", pulling over NCCL" if self.nccl_fallback else "", exc,
            )  # fmt: skip
            return f"CUDA IPC with the KV source at {address} unavailable: {exc}"

    def _map(self, session: SourceSession) -> Link:
        """SetupCommunicator, checks, then maps every allocation once and connects the link."""
        if self.device.type != "cuda" and not self.ipc.maps_host_memory:
            raise IpcUnavailableError(f"this sink's KV cache is on {self.device}, not a GPU")
        request = pb.SetupCommunicatorRequest(
            pair_id=f"{self.engine_id}-{secrets.token_hex(8)}", backend=IPC_BACKEND
        )
        try:
            response = session.stub.SetupCommunicator(
                request, timeout=HANDSHAKE_TIMEOUT_S, metadata=session.metadata
            )
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc, session.info.address) from None
        settings = _decode_settings(response.params)
        export = settings["export"]
        ipc_memory.check_same_host(export, self.host_id)
        mapped = self._open_all(export)
        try:
            local = [gpu_copy.describe(r) for r in session.regions]
            remote = [
                gpu_copy.RegionRuns(
                    mapped[r.allocation] + r.offset, r.block_stride, r.run_offsets, r.run_bytes
                )
                for r in export.regions
            ]
            try:
                table = peer_copy.PeerTable.pair(remote, local)
            except ValueError as exc:
                raise IpcUnavailableError(
                    f"the source's regions do not pair with this sink's: {exc}"
                ) from None
            host = session.info.address.rpartition(":")[0]
            conn = control.connect(
                host, settings["control_port"], settings["control_key"], settings["timeout_s"]
            )
            try:
                return Link(
                    session.info.address,
                    conn,
                    table,
                    min(r.num_blocks for r in export.regions),
                    settings["timeout_s"],
                    self.device,
                    lambda: self._close_all(mapped),
                    self.launch,
                    self.link_traces,
                )
            except BaseException:
                conn.close()
                raise
        except BaseException:
            self._close_all(mapped)
            raise

    def _open_all(self, export: Export) -> list[int]:
        mapped: list[int] = []
        try:
            for handle, _ in export.allocations:
                mapped.append(self.ipc.open_handle(handle, self.device))
        except IpcUnavailableError as exc:
            self._close_all(mapped)
            if export.device_uuid not in self.ipc.visible_uuids():
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
                raise IpcUnavailableError(
                    f"{exc}; the source's GPU {export.device_uuid} is not visible in this process "
                    f"(CUDA_VISIBLE_DEVICES={visible}): CUDA IPC needs it visible (own GPU first)"
                ) from None
            raise
        return mapped

    def _close_all(self, mapped: Sequence[int]) -> None:
        for pointer in mapped:
            try:
                self.ipc.close_handle(pointer, self.device)
            except KVTransportError as exc:
                logger.warning("unmapping a KV source's memory failed: %s", exc)


def _decode_settings(params: bytes) -> dict:
    """A link's settings from the source, type-checked; raises KVTransportError if malformed."""
    try:
        fields = msgpack.unpackb(params, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVTransportError(f"malformed CUDA IPC settings: {exc}") from None
    if not isinstance(fields, dict):
        raise KVTransportError("malformed CUDA IPC settings: not a map")
    timeout, port, key = fields.get("timeout_s"), fields.get("control_port"), fields.get("control_key")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise KVTransportError("malformed CUDA IPC settings: timeout_s")
    if type(port) is not int or not 0 < port < 65536 or not isinstance(key, bytes) or len(key) != 32:
        raise KVTransportError("malformed CUDA IPC settings: control_port or control_key")
    return {
        "timeout_s": float(timeout),
        "control_port": port,
        "control_key": key,
        "export": ipc_memory.export_from_wire(fields.get("export")),
    }
