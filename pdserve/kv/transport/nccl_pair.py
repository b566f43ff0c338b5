"""One NCCL (or gloo) pair of a source and a sink worker: its settings, group, staging and stream.

`nccl.py` moves blocks over pairs; this module owns what a pair is. The source chooses the pair
settings (timeout, staging size and ring depth, control connection) and sends them in
SetupCommunicator.params as msgpack; the sink checks them (`decode_settings`) before use. A
pair's group is built directly, never through init_process_group (a worker may hold many
pairs), and a `Watchdog` per endpoint aborts pairs whose pull outlived its deadline.

An NCCL pair runs on one of two APIs: "direct" (nccl_direct: ncclSend/ncclRecv through ctypes, a
few microseconds of host time per op) or "torch" (a ProcessGroupNCCL). The sink offers direct
in SetupCommunicatorRequest.backend ("nccl+direct") when it can make direct calls; the source
picks (`pair_api`) and names its choice in the settings ("nccl_api"); both ends then build the
same kind of group. `resolve_api` turns an endpoint's `nccl_api` option ("auto", "direct",
"torch": the deployment's `kv.nccl_api`, carried by the connector's config) into what it can
actually use.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgpack
import torch
import torch.distributed as dist

from pdserve.kv.transport import gpu_copy, nccl_direct
from pdserve.kv.transport.defaults import NCCL_API_CHOICES
from pdserve.kv.transport.errors import KVTransportError
from pdserve.kv.transport.regions import BlockRegion

logger = logging.getLogger(__name__)

# Staging: a ring of 4 buffers of 64 MiB per pair and side (the same 256 MiB as the first
# design's 2 x 128 MiB). Measured NCCL send/recv between two H100s over NVLink: 20 GB/s at 1 MiB
# messages, 282 GB/s at 16 MiB, 348 GB/s at 128 MiB, 372 GB/s at 1 GiB; one Llama-8B block of one
# layer is 64 KiB, so sending slices one by one would crawl. Swept on 4 x H100 in one run
# (benchmarks/transfer_sweep.py; benchmarks/results/gpu/2026-11-26-x4/): a 256 MiB pull took
# 1.61 ms with 2 x 128 MiB, 1.60 with 4 x 32, 1.46 with 4 x 64 (best), 2.74-3.00 with 16 MiB
# batches (the host falls behind the wire); NCCL channel and chunk-size settings did not help.
DEFAULT_STAGING_BYTES = 64 << 20
DEFAULT_STAGING_BUFFERS = 4
# What a source that predates the setting uses (its settings lack "staging_buffers").
LEGACY_STAGING_BUFFERS = 2
# Rendezvous and per-pull timeout of a pair. A receive waits this long for a dead peer
# before failing the pull; keep it well above the longest pull (~1 s for 256 MiB on gloo).
DEFAULT_PAIR_TIMEOUT_S = 30.0
# How often the watchdog looks for pulls past their deadline; a timeout fires this much late.
WATCHDOG_PERIOD_S = 0.5
# The pair settings the source sends in SetupCommunicator.params (msgpack), with their types.
SETTINGS_KEYS: dict[str, type | tuple[type, ...]] = {
    "timeout_s": (int, float),
    "staging_bytes": int,
    "control_port": int,
    "control_key": bytes,
}
# Later settings, absent from older sources' params: (type, value when absent). Older sinks
# ignore them; the batch plan depends on staging_bytes only, so either side may differ in ring
# depth without losing step (send i still meets receive i).
OPTIONAL_SETTINGS: dict[str, tuple[type, object]] = {
    "staging_buffers": (int, LEGACY_STAGING_BUFFERS),
    "nccl_min_channels": (int, 0),  # 0: NCCL's own choice
    "nccl_api": (str, "torch"),  # "direct" or "torch" (module docstring)
}
NCCL_APIS = ("direct", "torch")
DIRECT_OFFER = "+direct"
# Staging ring depth and NCCL channels a source may ask for.
MAX_STAGING_BUFFERS = 16
MAX_NCCL_CHANNELS = 64


def backend_for(regions: Sequence[BlockRegion]) -> tuple[str, torch.device]:
    """("nccl", cuda device) or ("gloo", cpu) from where the regions live; all must share it."""
    devices = {r.tensor.device for r in regions}
    if len(devices) != 1:
        raise ValueError(f"all KV regions must live on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    return ("nccl" if device.type == "cuda" else "gloo"), device


def resolve_api(option: str, backend: str, min_channels: int = 0) -> str:
    """The pair API an endpoint uses: "torch" on gloo; for NCCL, `option` ("direct", "torch",
    or "auto": direct when the library loads and no NCCL channel minimum is asked for, which
    only torch's group can set). Raises ValueError when "direct" is asked for and cannot be had.
    Called once per endpoint."""
    if option not in NCCL_API_CHOICES:
        raise ValueError(f"nccl_api must be auto, direct or torch, got {option!r}")
    if backend != "nccl":
        return "torch"
    if option == "direct":
        if min_channels:
            raise ValueError("nccl_min_channels needs nccl_api='torch'")
        if not nccl_direct.available():
            raise ValueError("nccl_api='direct' but the NCCL library cannot be used here")
        return "direct"
    if option == "torch" or min_channels:
        return "torch"
    return "direct" if nccl_direct.available() else "torch"


def offered_backend(backend: str, api: str) -> str:
    """What a sink puts in SetupCommunicatorRequest.backend: its backend, plus "+direct" when
    it can run a direct pair."""
    return backend + DIRECT_OFFER if api == "direct" else backend


def pair_api(offered: str, backend: str, api: str) -> str:
    """The source's choice for a new pair: direct when both ends can, else torch. Raises
    KVTransportError when the sink's backend differs from the source's or the offer is
    malformed."""
    base, plus, extra = offered.partition("+")
    if base != backend or (plus and plus + extra != DIRECT_OFFER):
        raise KVTransportError(f"backend mismatch: source uses {backend}, sink asked for {offered!r}")
    return "direct" if plus and api == "direct" else "torch"


def make_pair_group(
    store: dist.Store, rank: int, backend: str, host: str, timeout_s: float, min_channels: int = 0
) -> dist.ProcessGroup:
    """A 2-rank group over `store`; blocks until the peer joins (gloo) or the first op (NCCL).
    `min_channels` > 0 asks NCCL for at least that many channels (CTAs) on this pair's
    communicators only (ncclConfig_t.minCTAs; no environment, no GPU setting changes).

    Called once per pair on each end, on a pair or pull thread.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    options = dist.ProcessGroupNCCL.Options()
    # Past our own watchdog's deadline, so a stuck pull is aborted by it, not by torch's.
    options._timeout = timeout + datetime.timedelta(seconds=30)
    if min_channels:
        try:
            # NCCL refuses a minimum without a maximum ("Invalid config min/max channels
            # attribute value 32/-2147483648", seen on H100): give both.
            options.config.min_ctas = min_channels
            options.config.max_ctas = MAX_NCCL_CHANNELS
        except AttributeError:  # torch built against an NCCL without ncclConfig_t CTAs
            logger.warning("this torch cannot set NCCL channels per communicator; using defaults")
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def local_ip_towards(host: str) -> str:
    """The local address that routes to `host` (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


@dataclass(slots=True)
class Pair:
    """One end of a pair: its communicator, control connection, staging ring and stream."""

    pair_id: str
    backend: str
    device: torch.device
    timeout_s: float
    staging_bytes: int
    store: dist.Store
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    min_channels: int = 0  # NCCL channels asked for (0: NCCL's choice)
    api: str = "torch"  # "direct" (nccl_direct.DirectGroup) or "torch" (a ProcessGroup)
    group: dist.ProcessGroup | nccl_direct.DirectGroup | None = None
    control: socket.socket | None = None
    staging: tuple[torch.Tensor, ...] = ()
    stream: torch.cuda.Stream | None = None
    deadline: float | None = None  # of the pull in flight; the watchdog aborts past it
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The views of this end's regions that the pair's pulls move (head slices when the peers'
    # TP sizes differ: heads.peer_regions), and their run table.
    regions: tuple[BlockRegion, ...] = ()
    runs: gpu_copy.RunTable | None = None
    region_nbytes: tuple[int, ...] = field(init=False)  # of one block per region, for plans

    def __post_init__(self) -> None:
        self.region_nbytes = tuple(r.info().block_nbytes for r in self.regions)

    def join(self, rank: int, host: str) -> None:
        """Builds the staging, stream and group; pair thread (source) or pull thread (sink), once."""
        # Allocated on the device's current stream; used only on the pair's own streams.
        self.staging = tuple(
            torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.staging_buffers)
        )
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        store = dist.PrefixStore(self.pair_id, self.store)
        if self.api == "direct":
            if rank == 0:
                store.set("nccl-unique-id", nccl_direct.unique_id())
            uid = store.get("nccl-unique-id")  # rank 1 waits for it (the store's timeout)
            self.group = nccl_direct.DirectGroup.connect(
                uid, rank, self.device, self.timeout_s, warmup=self.staging[0]
            )
        else:
            self.group = make_pair_group(
                store, rank, self.backend, host, self.timeout_s, self.min_channels
            )

    def live_group(self) -> dist.ProcessGroup | nccl_direct.DirectGroup:
        """The group, or KVTransportError once the pair was aborted."""
        group = self.group
        if group is None:
            raise KVTransportError(f"KV pair {self.pair_id} was closed or timed out")
        return group

    def finish_stream(self) -> None:
        """Waits, GIL released, until everything queued on the pair's stream has run (CUDA); a
        no-op on gloo, whose ops already waited. Raises if the pair was aborted meanwhile."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            event.synchronize()
        self.live_group()

    def abort(self) -> None:
        """Tears the group and control connection down so pending and later ops fail; any
        thread (close, watchdog, the pair's own threads); only the first call matters."""
        group, self.group = self.group, None
        conn, self.control = self.control, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if group is not None:
            try:
                group.abort()
            except Exception:
                logger.debug("abort of KV pair %s failed", self.pair_id, exc_info=True)


class Watchdog:
    """One thread per endpoint that aborts pairs whose pull outlived its deadline and, with
    `drop_closed` (sinks), drops idle pairs whose peer closed their control connection.

    NCCL operations never time out on the host side by themselves (the pull thread waits on a
    CUDA event), so a dead or stuck peer is caught here. A sink's pair to a source that went
    away would otherwise keep its staging ring (4 x 64 MiB of GPU memory) until the next pull
    from that address, which may never come; a source's pair thread sees the close itself.
    Lifecycle: start in the endpoint's constructor, `stop` in its close.
    """

    def __init__(
        self,
        pairs: dict,
        lock: threading.Lock,
        period_s: float = WATCHDOG_PERIOD_S,
        *,
        drop_closed: bool = False,
    ):
        self._pairs, self._lock, self._period_s = pairs, lock, period_s
        self._drop_closed = drop_closed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-nccl-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._check(time.monotonic())  # a call, so no pair stays referenced between checks

    def _check(self, now: float) -> None:
        with self._lock:
            entries = list(self._pairs.values())
        for entry in entries:
            pair = entry[0] if isinstance(entry, tuple) else entry
            if pair.deadline is not None and now > pair.deadline:
                logger.warning("KV pair %s: pull exceeded %.0f s, aborting", pair.pair_id, pair.timeout_s)
                pair.abort()
            elif self._drop_closed and _idle_and_closed(pair):
                logger.info("KV pair %s: the source closed it; dropping it and its staging", pair.pair_id)
                with self._lock:
                    for key in [k for k, v in self._pairs.items() if v is entry]:
                        del self._pairs[key]
                pair.abort()


def _idle_and_closed(pair: Pair) -> bool:
    """True when no pull holds the pair and its peer closed the control connection (EOF or
    reset). Reads nothing and never blocks: it skips a pair whose lock a pull holds."""
    if not pair.lock.acquire(blocking=False):
        return False
    try:
        conn = pair.control
        if conn is None:
            return pair.group is None  # aborted already: nothing more will use it
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            # Between pulls the source sends nothing: readable with nothing to read is EOF.
            return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # reset, or closed under us
            return True
    finally:
        pair.lock.release()


def decode_settings(params: bytes) -> dict[str, float | int | bytes]:
    """Pair settings from the network: msgpack of plain values only, checked before use."""
    settings = msgpack.unpackb(params, raw=False, strict_map_key=True)
    if not isinstance(settings, dict):
        raise KVTransportError("malformed pair settings from the KV source")
    for key, (kind, absent) in OPTIONAL_SETTINGS.items():
        settings.setdefault(key, absent)
    kinds = {**SETTINGS_KEYS, **{key: kind for key, (kind, _) in OPTIONAL_SETTINGS.items()}}
    for key, kind in kinds.items():
        if not isinstance(settings.get(key), kind) or isinstance(settings.get(key), bool):
            raise KVTransportError(f"malformed pair setting {key!r} from the KV source")
    if (
        not 0 < settings["staging_bytes"] <= 1 << 32
        or not 2 <= settings["staging_buffers"] <= MAX_STAGING_BUFFERS
        or not 0 <= settings["nccl_min_channels"] <= MAX_NCCL_CHANNELS
        or settings["nccl_api"] not in NCCL_APIS
        or not 0 < settings["timeout_s"] <= 3600
        or not 0 < settings["control_port"] < 65536
        or len(settings["control_key"]) != 32
    ):
        raise KVTransportError("pair settings from the KV source out of range")
    return settings


@contextlib.contextmanager
def on_stream(pair: Pair) -> Iterator[None]:
    """Runs a CUDA pair's block copies and ops on its own stream; no-op on CPU."""
    if pair.stream is None:
        yield
        return
    torch.cuda.set_device(pair.device)
    with torch.cuda.stream(pair.stream):
        yield
