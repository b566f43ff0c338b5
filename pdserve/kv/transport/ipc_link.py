"""A cuda_ipc sink's link to one source: the mapped source memory, the copy table, and the pulls in
flight over the link's control connection.

Per pull, on the caller's thread (`start`, from `start_pull`): the block ids are checked against
the source's cache, the copy is queued on the link's CUDA stream (one graph launch of the
link's peer_copy.LaunchRing) and then the pull's header is sent; nothing waits. The source
answers each header in order (its read is open, or why it refuses); the link's waiter thread
reads the answers in the same order, waits for each copy on the GPU, ends the pull (its
`on_end(error)`), and then tells the source the read is done, so the source frees the blocks
after DONE, as every transport's `release` does.

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

import torch

from pdserve.kv.transport import control, peer_copy
from pdserve.kv.transport.errors import KVTransportError

logger = logging.getLogger(__name__)

__all__ = ["Link", "LinkClosedError"]


class LinkClosedError(KVTransportError):
    """The link broke or was closed; a pull that meets it may set up a new one."""


@dataclass(slots=True)
class _Pull:
    request_id: str
    started: float
    on_end: Callable[[str | None], None]
    copy: peer_copy.Launched | None = None  # the queued copy (None: copied on the host)
    stamps: dict[str, float] | None = None  # phase -> time.monotonic(), when tracing


class Link:
    """One source mapped into this sink; built by CudaIpcSink once per source, after the checks.

    `unmap` undoes the mapping of `mapped` (called once, by `close`, after every copy ended).
    `launch` says how the copy kernel is launched (peer_copy.LaunchSettings).
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
        launch: peer_copy.LaunchSettings,
        traces: deque | None = None,
    ):
        self.name = name
        self.conn = conn
        self.src_num_blocks = src_num_blocks
        self.timeout_s = timeout_s
        self.device = device
        self.traces = traces  # each pull's phase times (benchmarks), when given
        self._unmap = unmap
        self.table = table
        self.stream = self.ring = None
        if device.type == "cuda":
            self.table = table.uploaded(device)
            self.stream = torch.cuda.Stream(device)
            anchor = torch.empty(4, dtype=torch.int32, device=device)  # the kernel's base pointer
            self.ring = peer_copy.LaunchRing(self.table, anchor, self.stream, launch)
        self._lock = threading.Lock()  # launches, frames sent, and the closed flag
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
        the source's range, a launch CUDA refused) or LinkClosedError; then `on_end` is never
        called. The copy is queued first: everything after it overlaps the copy."""
        if src and not (min(src) >= 0 and max(src) < self.src_num_blocks):
            raise KVTransportError(f"source block ids out of range [0, {self.src_num_blocks})")
        started = time.monotonic()  # before the header: the source's wait starts later
        with self._lock:
            if self.closed is not None:
                raise LinkClosedError(f"the CUDA IPC link to {self.name} is closed: {self.closed}")
            if self.ring is None:  # CPU regions under a fake `ipc` (tests)
                peer_copy.copy_on_host(self.table, src, dst)
                copy = None
            else:
                copy = self.ring.launch(src, dst)
            pull = _Pull(request_id, started, on_end, copy)
            if self.traces is not None:
                pull.stamps = {"start": started, "launched": time.monotonic()}
                self.traces.append(pull.stamps)
            try:
                control.send_frame(self.conn, control.PullHeader(request_id, list(src), release).to_wire())
            except OSError as exc:
                self._wait_copy(pull)
                raise LinkClosedError(f"the CUDA IPC link to {self.name} broke: {exc}") from None
            self._pulls.put(pull)
        _stamp(pull, "header_sent")

    @staticmethod
    def _wait_copy(pull: _Pull) -> None:
        if pull.copy is not None:
            pull.copy.wait()

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
            self.ring.close()
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
