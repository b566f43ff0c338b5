"""A cuda_ipc sink's link to one source: the mapped source memory, the copy table, and the pulls in
flight over the link's control connection.

Per pull, on the caller's thread (`start`, from `start_pull`): the block ids are checked against
the source's cache, the copy is queued on the link's CUDA stream (one launch: peer_copy) and the
pull's header is sent; nothing waits. The source answers each header in order (its read is open,
or why it refuses); the link's waiter thread reads the answers in the same order, waits for each
copy on the GPU, ends the pull (its `on_end(error)`), and then tells the source the read is done,
so the source frees the blocks after DONE, as every transport's `release` does.

The copy starts before the source's answer arrives, so the answer's round trip overlaps the copy
instead of preceding it. That is safe because the answer is what counts: blocks are pinned from
the end of their prefill until the read that the answer opens has ended, so an accepted pull read
pinned blocks throughout; a refused one (the pin ended: lease, abort) may have read blocks the
source already reused, and fails: its destination blocks are reported failed and recomputed.
Reading a peer's memory changes nothing there.

No copy runs on unmapped memory: launches happen under the link's lock after checking that the
link is open, and `close` marks it closed under that lock, waits for the stream, then unmaps.
Every pull ends after its copy has finished, so nothing writes a destination block after its pull
ended, whatever the outcome.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv.transport import control, peer_copy
from pdserve.kv.transport.errors import KVTransportError

logger = logging.getLogger(__name__)

# Slots of the pinned ring of block ids: more than the pulls a link has in flight in practice.
_ID_SLOTS = 16

__all__ = ["Link", "LinkClosedError"]


class LinkClosedError(KVTransportError):
    """The link broke or was closed; a pull that meets it may set up a new one."""


@dataclass(slots=True)
class _Pull:
    request_id: str
    started: float
    on_end: Callable[[str | None], None]
    done: torch.cuda.Event | None = None  # recorded after the copy (None: copied on the host)
    ids: torch.Tensor | None = None  # the block ids on the GPU, alive until the copy has run
    stamps: dict[str, float] | None = None  # phase -> time.monotonic(), when tracing


class Link:
    """One source mapped into this sink; built by CudaIpcSink once per source, after the checks.

    `unmap` undoes the mapping of `mapped` (called once, by `close`, after every copy ended).
    `launch` holds the copy kernel's settings (peer_copy.copy's keywords).
    """

    def __init__(
        self,
        name: str,
        conn: socket.socket,
        table: peer_copy.PeerTable,
        src_num_blocks: int,
        timeout_s: float,
        device: torch.device,
        unmap: Callable[[], None],
        launch: dict,
        traces: deque | None = None,
    ):
        self.name = name
        self.conn = conn
        self.src_num_blocks = src_num_blocks
        self.timeout_s = timeout_s
        self.device = device
        self.launch = launch
        self.traces = traces  # each pull's phase times (benchmarks), when given
        self._unmap = unmap
        cuda = device.type == "cuda"
        self.table = table.uploaded(device) if cuda else table
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.anchor = torch.empty(4, dtype=torch.int32, device=device) if cuda else None
        self._lock = threading.Lock()  # launches, frames sent, and the closed flag
        # Pinned ring of block-id slots; a slot is reused once the copy that read it has run.
        self._host = torch.empty((_ID_SLOTS, 1024), dtype=torch.int64, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._slot = 0
        self._slot_done: list[torch.cuda.Event | None] = [None] * _ID_SLOTS
        self._pulls: queue.SimpleQueue[_Pull | None] = queue.SimpleQueue()
        self.closed: str | None = None  # why, once closed
        threading.Thread(target=self._wait_loop, name=f"kv-ipc-link-{name}", daemon=True).start()

    def start(
        self,
        request_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        release: bool,
        on_end: Callable[[str | None], None],
    ) -> None:
        """Queues the copy and sends the header; returns at once. `on_end(None)` or
        `on_end(error)` follows on the waiter thread. Raises KVTransportError (block ids out of
        the source's range) or LinkClosedError; then `on_end` is never called."""
        padding = [0] * (len(src) % 2)  # the dst ids start 16-byte aligned (peer_copy needs it)
        ids = np.array([*src, *padding, *dst], dtype=np.int64)
        if len(src) and not (0 <= ids[: len(src)].min() and ids[: len(src)].max() < self.src_num_blocks):
            raise KVTransportError(f"source block ids out of range [0, {self.src_num_blocks})")
        pull = _Pull(request_id, time.monotonic(), on_end)
        if self.traces is not None:
            pull.stamps = {"start": pull.started}
            self.traces.append(pull.stamps)
        header = control.PullHeader(request_id, list(src), release).to_wire()
        with self._lock:
            if self.closed is not None:
                raise LinkClosedError(f"the CUDA IPC link to {self.name} is closed: {self.closed}")
            self._copy(pull, src, dst, ids)
            _stamp(pull, "launched")
            try:
                control.send_frame(self.conn, header)
            except OSError as exc:
                self._wait_copy(pull)
                raise LinkClosedError(f"the CUDA IPC link to {self.name} broke: {exc}") from None
            self._pulls.put(pull)
        _stamp(pull, "header_sent")

    def _copy(self, pull: _Pull, src: Sequence[int], dst: Sequence[int], ids: np.ndarray) -> None:
        if self.stream is None:  # CPU regions under a fake `ipc` (tests)
            peer_copy.copy_on_host(self.table, src, dst)
            return
        with torch.cuda.stream(self.stream):  # and its device
            pull.ids = self._upload(ids)
            _stamp(pull, "uploaded")
            dst_at = len(ids) - len(dst)  # src ids padded to an even count: 16-byte aligned
            peer_copy.copy(self.table, pull.ids[: len(src)], pull.ids[dst_at:], self.anchor, **self.launch)
            pull.done = torch.cuda.Event()
            pull.done.record(self.stream)
        self._slot_done[self._slot] = pull.done

    def _upload(self, ids: np.ndarray) -> torch.Tensor:
        """The ids on the GPU, through the next slot of a pinned ring (no allocation of pinned
        memory per pull, one small copy on the link's stream). Under the link's lock."""
        if len(ids) > self._host.shape[1]:
            self._host = torch.empty((_ID_SLOTS, 2 * len(ids)), dtype=torch.int64, pin_memory=True)
            self._host_np = self._host.numpy()  # torch keeps the old ring until its copies ran
        self._slot = (self._slot + 1) % _ID_SLOTS
        previous = self._slot_done[self._slot]
        if previous is not None and not previous.query():
            previous.synchronize()  # that slot's copy to the GPU may not have run yet
        self._host_np[self._slot, : len(ids)] = ids
        on_device = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        on_device.copy_(self._host[self._slot, : len(ids)], non_blocking=True)
        return on_device  # allocated on the link's stream (current here): no record_stream needed

    @staticmethod
    def _wait_copy(pull: _Pull) -> None:
        if pull.done is not None:
            pull.done.synchronize()
        pull.ids = None

    def close(self, why: str = "closed") -> None:
        """Fails what is in flight, waits for the copies, then unmaps; any thread, idempotent."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = why
        try:
            self.conn.shutdown(socket.SHUT_RDWR)  # wakes the waiter's read; close alone may not
        except OSError:
            pass
        self.conn.close()
        if self.stream is not None:
            self.stream.synchronize()
        self._pulls.put(None)
        self._unmap()

    def _wait_loop(self) -> None:
        while (pull := self._pulls.get()) is not None:
            self._settle(pull)
        while not self._pulls.empty():  # queued before close: their copies have run
            if (pull := self._pulls.get()) is not None:
                self._end(pull, f"the CUDA IPC link to {self.name} is closed: {self.closed}")

    def _settle(self, pull: _Pull) -> None:
        """Waiter thread, once per pull in header order: the source's answer, the copy, the end."""
        try:
            refusal = control.reply_from_wire(control.recv_frame(self.conn))
        except (OSError, KVTransportError) as exc:
            self._wait_copy(pull)
            self._end(pull, f"the CUDA IPC link to {self.name} broke: {exc}")
            self.close(f"broke: {exc}")
            return
        _stamp(pull, "answer_read")
        self._wait_copy(pull)
        _stamp(pull, "copied")
        if refusal is not None:
            self._end(pull, f"refused by {self.name}: {refusal}")
            return
        in_time = time.monotonic() - pull.started < self.timeout_s / 2  # the source waits timeout_s
        error = (
            None
            if in_time
            else "the copy outlived half the link's timeout; the source may have freed the blocks"
        )
        self._end(pull, error)
        _stamp(pull, "ended")
        try:
            with self._lock:
                control.send_frame(self.conn, {"done": pull.request_id, "ok": in_time})
        except OSError as exc:
            self.close(f"broke: {exc}")

    @staticmethod
    def _end(pull: _Pull, error: str | None) -> None:
        try:
            pull.on_end(error)
        except Exception:
            logger.exception("ending KV pull %s failed", pull.request_id)


def _stamp(pull: _Pull, phase: str) -> None:
    if pull.stamps is not None:
        pull.stamps[phase] = time.monotonic()
