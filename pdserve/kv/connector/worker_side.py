"""Worker side of the connector: owns the transport endpoints and moves the blocks.

Runs in each vLLM worker process (one per TP rank; the EngineCore process itself when TP=1).
Lifecycle: `register_kv_caches` (once: regions, layout, a BlockSource on prefill engines) ->
per engine step `apply(plan)` (pins, pulls, releases; from whichever vLLM hook runs first) and
`get_finished()` (reports) -> `shutdown`. Sinks (decode side) are created on first use, one per
transport named by the requests: an NCCL source also serves gRPC pulls.

Prefill pins: pinned when their prompt completes (`plan.pins`), reported in the sending set
only after vLLM confirms it waits on them (`plan.confirms`) AND the pin ended (pulled, released
by the decode side, or lease expiry). Transport threads end pins; `_on_release` records that
under a lock, and the engine thread reports it at the next `get_finished`.

Decode pulls: started at once (`BlockSink.start_pull` never blocks), polled each step, each
reported exactly once in the receiving set, whether it succeeded or failed. get_finished waits
for the pulls in flight while the GPU still runs the step before (step_window: the engine
thread would block that long anyway), so a pull that ends meanwhile is reported a step earlier.
A failed pull's destination blocks are reported by `take_load_errors` in the same step, so vLLM
applies kv_load_failure_policy; the remote pin is released (best effort; its lease covers the
rest). The transports bound every pull (gRPC deadline, NCCL pair timeout), so none hangs. When
the prefill and decode TP sizes differ, a request's pull is one transport pull per prefill rank
holding some of this rank's KV heads, reported once all of them ended (pulls.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kv.connector.compat import KVHeads
from pdserve.kv.connector.config import ConnectorConfig
from pdserve.kv.connector.layout import build_layout, build_regions
from pdserve.kv.connector.metadata import KVPin, KVPull, RemotePrefill, StepPlan, WorkerEndpoint
from pdserve.kv.connector.pulls import PullGroup, SourcePlan, plan_sources
from pdserve.kv.connector.step_window import ClosedWindow, StepWindow, wait_for_pulls, window_for
from pdserve.kv.transport.base import BlockSink, BlockSource, KVTransfer, ReleaseCallback, TransferState
from pdserve.kv.transport.leases import ReleaseReason
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

logger = logging.getLogger(__name__)

# Completed pulls kept for inspection (tests, debugging); old ones fall off.
_HISTORY = 1024


class Transports(Protocol):
    """Builds a worker's endpoints; the network one below, or a fake in tests."""

    def make_source(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        on_release: ReleaseCallback,
        tp_rank: int,
    ) -> BlockSource: ...

    def make_sink(
        self, transport: str, layout: KVLayoutSpec, regions: Sequence[BlockRegion], *, engine_id: str
    ) -> BlockSink: ...


class NetworkTransports:
    """gRPC, NCCL or cuda_ipc endpoints from the connector config. An NCCL source serves gRPC
    pulls too, and a cuda_ipc source NCCL pulls (its sinks' fallback where IPC cannot map it),
    so a decode worker pulls over whichever transport a request names."""

    def __init__(self, config: ConnectorConfig):
        self.config = config

    def make_source(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        on_release: ReleaseCallback,
        tp_rank: int,
    ) -> BlockSource:
        """Starts serving at once (binds the port); called once per producer worker."""
        from pdserve.kv.transport.cuda_ipc import CudaIpcSource
        from pdserve.kv.transport.grpc import GrpcSource
        from pdserve.kv.transport.nccl import NcclSource

        port = self.config.port + tp_rank if self.config.port else 0  # one port per TP rank
        options = dict(
            engine_id=engine_id,
            cluster_token=self.config.cluster_token,
            on_release=on_release,
            lease_s=self.config.lease_s,
            host=self.config.bind_host or self.config.host,
            port=port,
            advertise_host=self.config.host,
            tls=self.config.tls,
        )
        if self.config.transport in ("nccl", "cuda_ipc"):
            kind = CudaIpcSource if self.config.transport == "cuda_ipc" else NcclSource
            return kind(
                layout,
                regions,
                nccl_api=self.config.nccl_api,
                max_pairs=self.config.nccl_max_pairs,
                max_pairs_per_session=self.config.nccl_max_pairs_per_session,
                **options,
            )
        return GrpcSource(layout, regions, **options)

    def make_sink(
        self, transport: str, layout: KVLayoutSpec, regions: Sequence[BlockRegion], *, engine_id: str
    ) -> BlockSink:
        """A sink pulling over `transport`; called on the first pull that names it."""
        from pdserve.kv.transport.cuda_ipc import CudaIpcSink
        from pdserve.kv.transport.grpc import GrpcSink
        from pdserve.kv.transport.nccl import NcclSink

        options = dict(
            engine_id=engine_id,
            cluster_token=self.config.cluster_token,
            pull_timeout_s=self.config.pull_timeout_s,
            tls=self.config.tls,
        )
        if transport == "nccl":
            return NcclSink(layout, regions, nccl_api=self.config.nccl_api, **options)
        if transport == "cuda_ipc":  # NCCL pairs where CUDA IPC cannot map the source
            return CudaIpcSink(layout, regions, nccl_api=self.config.nccl_api, **options)
        return GrpcSink(layout, regions, **options)


@dataclass(slots=True)
class _Send:
    """A pinned prefill request on this worker."""

    block_ids: tuple[int, ...]
    confirmed: bool = False
    ended: ReleaseReason | None = None


@dataclass(frozen=True, slots=True)
class PullRecord:
    """One finished pull: what a benchmark or test wants to know about it."""

    request_id: str
    state: TransferState
    num_blocks: int
    nbytes: int
    seconds: float
    error: str | None


class WorkerSide:
    """Transport endpoints and per-request transfer state of one worker."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        block_size: int,
        num_blocks: int,
        model_id: str,
        transports: Transports | None = None,
        window: StepWindow | None = None,
    ):
        self.config = config
        self.transports = transports or NetworkTransports(config)
        self.engine_id = engine_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model_id = model_id
        self.tp_rank = 0
        self.layout: KVLayoutSpec | None = None
        self.regions: list[BlockRegion] = []
        self.source: BlockSource | None = None
        self._sinks: dict[str, BlockSink] = {}
        self._lock = threading.Lock()  # guards _sends and _ready (transport threads end pins)
        self._sends: dict[str, _Send] = {}
        self._ready: set[str] = set()
        self._pulls: dict[str, tuple[PullGroup, KVPull, SourcePlan | None]] = {}
        self._load_errors: set[int] = set()
        self._plan: StepPlan | None = None
        self.history: deque[PullRecord] = deque(maxlen=_HISTORY)
        self._unreported: list[PullRecord] = []
        # The step window (step_window): the one given (tests), else the KV cache's device's,
        # chosen in register_kv_caches.
        self.window: StepWindow = window or ClosedWindow()
        self._window_given = window is not None

    # ---- start and stop ------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        tp_rank: int,
        tp_size: int,
        heads: KVHeads | None = None,
    ) -> None:
        """Builds regions and layout, and on a producer starts serving. Called once by vLLM's
        model runner after allocating the KV cache; blocks only to bind the server port.
        `heads` lets the layout declare its KV-heads axis, so peers of another TP size can pull."""
        self.tp_rank = tp_rank
        self.regions = build_regions(kv_caches, self.num_blocks, heads)
        self.layout = build_layout(
            self.regions,
            model_id=self.model_id,
            block_size=self.block_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_kv_heads=heads.total if heads is not None else 0,
        )
        if not self._window_given:
            self.window = window_for(self.regions)
        if self.config.is_producer:
            self.source = self.transports.make_source(
                self.layout,
                self.regions,
                engine_id=self._transport_id(),
                on_release=self._on_release,
                tp_rank=tp_rank,
            )
        info = self.regions[0].info() if self.regions else None
        logger.info(
            "pdserve KV connector worker %s (tp %d/%d): %d regions, block %s, source %s",
            self.engine_id,
            tp_rank,
            tp_size,
            len(self.regions),
            info,
            self.source.address if self.source else None,
        )

    def _sink(self, transport: str) -> BlockSink:
        # Every source serves gRPC, so a transport this worker does not know falls back to it.
        transport = transport if transport in ("grpc", "nccl", "cuda_ipc") else "grpc"
        if transport not in self._sinks:
            assert self.layout is not None
            self._sinks[transport] = self.transports.make_sink(
                transport, self.layout, self.regions, engine_id=self._transport_id()
            )
        return self._sinks[transport]

    def _transport_id(self) -> str:
        return f"{self.engine_id}-tp{self.tp_rank}"

    def endpoint(self) -> WorkerEndpoint:
        """What vLLM hands the scheduler side at engine start (handshake metadata)."""
        address = self.source.address if self.source is not None else None
        return WorkerEndpoint(self.tp_rank, address, self.config.transport, self.engine_id)

    def shutdown(self) -> None:
        """Stops serving and pulling; called once by vLLM at worker shutdown. Each endpoint is
        closed on its own so one failure does not leak the others."""
        for sink in list(self._sinks.values()):
            try:
                sink.close()
            except Exception:
                logger.exception("closing a KV sink failed")
        self._sinks.clear()
        if self.source is not None:
            try:
                self.source.close()
            except Exception:
                logger.exception("closing the KV source failed")
            self.source = None

    # ---- each step -----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Opens the step's window (step_window). Called by the facade from
        bind_connector_metadata, the step's first hook, before its forward is queued."""
        try:
            self.window.open()
        except Exception:  # noqa: BLE001 - the wait only saves time: it never fails a step
            self._drop_window()

    def apply(self, plan: StepPlan) -> None:
        """Carries out a step's plan once, however many hooks hand it over. Called by the
        facade from bind_connector_metadata / start_load_kv / get_finished on the engine
        thread; never blocks on the network (pins and pull starts return at once)."""
        if plan is self._plan:
            return
        self._plan = plan
        for request_id in plan.drops:
            self._drop(request_id)
        for pin in plan.pins:
            self._pin(pin, confirmed=False)
        for pin in plan.confirms:
            self._confirm(pin)
        for pull in plan.pulls:
            self._start_pull(pull)
        for release in plan.releases:
            self._release_remote(release.remote)

    def _release_remote(self, remote: RemotePrefill, addresses: Sequence[str] | None = None) -> None:
        """Asks the prefill ranks at `addresses` (default: every one this rank must release) to
        unpin a request. Fire and forget; a failure only delays the free until the lease ends."""
        try:
            assert self.layout is not None
            if addresses is None:
                addresses = plan_sources(remote, self.layout).releases
            sink = self._sink(remote.transport)
            for address in addresses:
                sink.release_remote(address, remote.remote_request_id)
        except Exception:
            logger.warning(
                "release of %s at %s failed", remote.remote_request_id, remote.remote_address, exc_info=True
            )

    def release_pin(self, request_id: str) -> bool:
        """The frontend says no decode leg will pull this request's KV (it failed, or its
        client left between the legs): end the pin now rather than at the lease's end. vLLM
        frees the blocks once `get_finished` reports the request. False if it was not pinned."""
        if self.source is None:
            return False
        return self.source.release(request_id)

    def renew_pin(self, request_id: str) -> bool:
        """The frontend says a decode leg for this request still waits to be taken by its
        engine: restart the pin's lease, so a backed-up decode pool does not turn the wait into
        an expired lease and a recompute. False if it is not pinned."""
        return self.source is not None and self.source.renew(request_id)

    def _drop(self, request_id: str) -> None:
        with self._lock:
            self._sends.pop(request_id, None)
            self._ready.discard(request_id)
        if self.source is not None:
            self.source.release(request_id)  # its on_release finds no entry and is ignored

    def _pin(self, pin: KVPin, *, confirmed: bool) -> None:
        with self._lock:
            self._sends[pin.request_id] = _Send(pin.block_ids, confirmed=confirmed)
        try:
            if self.source is None:
                raise RuntimeError("this engine has no KV source (kv_role is kv_consumer)")
            self.source.pin(pin.request_id, pin.block_ids, self.config.lease_s)
        except Exception as exc:  # noqa: BLE001 - a pin that cannot exist ends at once
            logger.error("request %s: cannot pin blocks %s: %s", pin.request_id, pin.block_ids, exc)
            self._on_release(pin.request_id, ReleaseReason.LOCAL)

    def _confirm(self, pin: KVPin) -> None:
        with self._lock:
            send = self._sends.get(pin.request_id)
            repin = (
                send is None or send.block_ids != pin.block_ids or send.ended is ReleaseReason.LEASE_EXPIRED
            )
            if not repin:
                send.confirmed = True
                if send.ended is not None:
                    self._ready.add(pin.request_id)
        if repin:
            self._pin(pin, confirmed=True)

    def _on_release(self, request_id: str, reason: ReleaseReason) -> None:
        """A pin ended (transport thread, lease reaper, or this thread)."""
        with self._lock:
            send = self._sends.get(request_id)
            if send is None:
                return
            send.ended = reason
            if send.confirmed:
                self._ready.add(request_id)
        if reason is ReleaseReason.LEASE_EXPIRED:
            logger.warning("request %s: KV lease expired before a decode engine pulled it", request_id)

    def _start_pull(self, pull: KVPull) -> None:
        """One transport pull per prefill rank this rank takes KV heads from (plan_sources)."""
        remote = pull.remote
        plan: SourcePlan | None = None
        try:
            assert self.layout is not None
            plan = plan_sources(remote, self.layout)
            sink = self._sink(remote.transport)
            transfers = [
                sink.start_pull(
                    part.address,
                    remote.remote_request_id,
                    pull.src_block_ids,
                    pull.dst_block_ids,
                    release=part.release_after,
                )
                for part in plan.parts
            ]
        except Exception as exc:  # noqa: BLE001 - failures are state, reported with the policy
            failed = KVTransfer(remote.remote_request_id, remote.remote_address, len(pull.dst_block_ids))
            failed.finish(f"could not start the pull: {type(exc).__name__}: {exc}")
            transfers = [failed]
        self._pulls[pull.request_id] = (PullGroup(transfers), pull, plan)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(prefill requests whose blocks may be freed, decode requests whose pull ended).

        Called by vLLM's model runner once per step on the engine thread, after the step's
        forward is queued. Waits for the pulls in flight only while the GPU still runs the step
        before (step_window; at most `step_wait_max_s`); never otherwise blocks on the network.
        On a step that scheduled no tokens while transfers are outstanding it sleeps
        `idle_sleep_s` to slow vLLM's idle loop (see config.DEFAULT_IDLE_SLEEP_S).
        """
        self._wait_in_window()
        with self._lock:
            sending, self._ready = self._ready, set()
            for request_id in sending:
                self._sends.pop(request_id, None)
        recving = {request_id for request_id, (handle, _, _) in self._pulls.items() if handle.done}
        for request_id in recving:
            self._finish_pull(request_id)
        idle = self._plan is None or self._plan.num_scheduled_tokens == 0
        if idle and not sending and not recving and (self._pulls or self._sends) and self.config.idle_sleep_s:
            time.sleep(self.config.idle_sleep_s)
        return sending, recving

    def _wait_in_window(self) -> None:
        """Waits for the pulls in flight while the step's window is open, then closes it."""
        try:
            if self._pulls and self.config.step_wait_max_s:
                transfers = [t for group, _, _ in self._pulls.values() for t in group.transfers]
                wait_for_pulls(transfers, self.window, self.config.step_wait_max_s)
            self.window.close()
        except Exception:  # noqa: BLE001 - the wait only saves time: it never fails a step
            self._drop_window()

    def _drop_window(self) -> None:
        logger.warning("step window failed; reporting pulls without waiting from now on", exc_info=True)
        self.window = ClosedWindow()

    def _finish_pull(self, request_id: str) -> None:
        handle, pull, plan = self._pulls.pop(request_id)
        succeeded = handle.state is TransferState.DONE
        record = PullRecord(
            request_id,
            handle.state,
            len(pull.dst_block_ids),
            handle.bytes_moved,
            handle.elapsed_s,
            handle.error,
        )
        self.history.append(record)
        self._unreported.append(record)
        if plan is not None and plan.releases_after(succeeded):
            # Prefill ranks read by several decode ranks (or never read): their pins end once
            # every rank that must release them has.
            self._release_remote(pull.remote, plan.releases_after(succeeded))
        if succeeded:
            logger.info(
                "request %s: pulled %d blocks (%.1f MiB) in %.1f ms from %s",
                request_id,
                record.num_blocks,
                record.nbytes / 2**20,
                record.seconds * 1e3,
                handle.remote_address,
            )
            return
        logger.warning(
            "request %s: KV pull from %s failed (%s); kv_load_failure_policy=%s applies",
            request_id,
            handle.remote_address,
            handle.error,
            self.config.failure_policy,
        )
        self._load_errors.update(pull.dst_block_ids)
        if plan is None:
            self._release_remote(pull.remote)

    def take_load_errors(self) -> set[int]:
        """Destination blocks of pulls that failed since the last call; called by vLLM right
        after get_finished in the same step (so failures arrive with the receiving report)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_pull_records(self) -> list[PullRecord]:
        """Pulls finished since the last call, for vLLM's connector stats (once per step)."""
        records, self._unreported = self._unreported, []
        return records

    @property
    def num_outstanding(self) -> int:
        """Pins and pulls not yet reported; tests check it returns to zero."""
        with self._lock:
            return len(self._sends) + len(self._pulls)
