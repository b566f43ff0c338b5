"""In-process fake transport: the same interface, with memcpy between buffers of one process.

Higher-level tests (connector, engine) use it instead of a network. A `FakeFabric` plays the
network: sources register on it and get a "fake://" address, sinks look them up there. The fabric
injects trouble: a delay before each piece, a failure message, or a source that disappears.
Handshake, token, layout and lease checks are the real ones, so fakes cannot drift from the
real transports on what is refused.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from pdserve.kv.transport import blocks
from pdserve.kv.transport.base import BlockSink, BlockSource, KVTransfer, ReleaseCallback
from pdserve.kv.transport.defaults import DEFAULT_LEASE_S
from pdserve.kv.transport.errors import KVTransportError
from pdserve.kv.transport.handshake import PeerInfo
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

# The fake moves data in pieces of this size so that delays and kills land mid-pull.
FAKE_PIECE_BYTES = 1 << 20


class FakeFabric:
    """The in-process "network". Tests set `delay_s` (sleep before each piece) and `fail_with`
    (every pull fails with this message) at any time; `kill(address)` removes a source."""

    def __init__(self, *, delay_s: float = 0.0, fail_with: str | None = None):
        self.delay_s = delay_s
        self.fail_with = fail_with
        self._sources: dict[str, FakeSource] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def register(self, source: FakeSource) -> str:
        """Gives a source its address; called by FakeSource's constructor."""
        with self._lock:
            address = f"fake://{source.engine_id}/{next(self._ids)}"
            self._sources[address] = source
            return address

    def lookup(self, address: str) -> FakeSource:
        """The source at `address`; raises KVTransportError when none is there."""
        with self._lock:
            source = self._sources.get(address)
        if source is None:
            raise KVTransportError(f"no KV source at {address} (unreachable)")
        return source

    def kill(self, address: str) -> None:
        """Makes a source unreachable at once, as if its process died; pulls in flight fail."""
        with self._lock:
            self._sources.pop(address, None)


class FakeSource(BlockSource):
    """A BlockSource that a FakeSink in the same process reads directly."""

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        cluster_token: str,
        fabric: FakeFabric,
        on_release: ReleaseCallback | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ):
        super().__init__(
            layout,
            regions,
            engine_id=engine_id,
            cluster_token=cluster_token,
            on_release=on_release,
            lease_s=lease_s,
        )
        self._fabric = fabric
        self._address = fabric.register(self)

    @property
    def address(self) -> str:
        """The fake:// address sinks use."""
        return self._address

    def close(self) -> None:
        """Leaves the fabric and drops every pin."""
        self._fabric.kill(self._address)
        self._pins.close()


class FakeSink(BlockSink):
    """A BlockSink that copies from FakeSources on a background thread per pull."""

    def __init__(
        self,
        layout: KVLayoutSpec,
        regions: Sequence[BlockRegion],
        *,
        engine_id: str,
        cluster_token: str,
        fabric: FakeFabric,
    ):
        super().__init__(layout, regions, engine_id=engine_id, cluster_token=cluster_token)
        self._fabric = fabric
        self._threads: set[threading.Thread] = set()
        self._peer_name = f"fake-sink-{id(self)}"  # its "connection", and its session's name

    def handshake(self, remote_address: str) -> PeerInfo:
        """Checks a source exactly as the real transports do; raises KVTransportError."""
        source = self._fabric.lookup(remote_address)
        peer = self._peer_name
        challenge = source.issue_challenge(self.wire_version, self.engine_id, peer)
        hello, transcript = self._hello(challenge)
        reply = source.accept_hello(hello, transcript.server_nonce, transcript.client_nonce, peer)
        regions = [r.info() for r in source.regions_for(self.layout)]
        return self._verify_source(remote_address, reply, regions, transcript)

    def release_remote(self, remote_address: str, request_id: str) -> None:
        """Unpins on the source at once; an unreachable source is ignored (its lease covers it)."""
        try:
            self._fabric.lookup(remote_address).release_by_peer(request_id, self.layout, self._peer_name)
        except (KVTransportError, PermissionError):
            pass

    def close(self) -> None:
        """Waits briefly for pulls in flight; they end on their own (fabric delays are short)."""
        for thread in list(self._threads):
            thread.join(timeout=1.0)

    def _submit(
        self, transfer: KVTransfer, src_block_ids: list[int], dst_block_ids: list[int], release: bool
    ) -> None:
        thread = threading.Thread(
            target=self._run,
            args=(transfer, src_block_ids, dst_block_ids, release),
            name="fake-kv-pull",
            daemon=True,
        )
        self._threads.add(thread)
        thread.start()

    def _run(self, transfer: KVTransfer, src: list[int], dst: list[int], release: bool) -> None:
        try:
            self._pull(transfer, src, dst, release)
        except Exception as exc:  # noqa: BLE001 - the contract: failures are state
            transfer.finish(str(exc))
        else:
            transfer.finish()
        finally:
            self._threads.discard(threading.current_thread())

    def _pull(self, transfer: KVTransfer, src: list[int], dst: list[int], release: bool) -> None:
        info = self.handshake(transfer.remote_address)
        source = self._fabric.lookup(transfer.remote_address)
        source.open_read(transfer.request_id, src, self._peer_name)
        completed = False
        try:
            transfer.set_transferring()
            self._copy(transfer, source.regions_for(self.layout), self.regions_for(info.layout), src, dst)
            completed = True
        finally:
            source.close_read(transfer.request_id, release=completed and release)

    def _copy(
        self,
        transfer: KVTransfer,
        src_regions: Sequence[BlockRegion],
        dst_regions: Sequence[BlockRegion],
        src: list[int],
        dst: list[int],
    ) -> None:
        """Copies piece by piece between the source's and this sink's views for each other."""
        src_index = {id(r): blocks.block_index(src, r.tensor.device) for r in src_regions}
        dst_index = {id(r): blocks.block_index(dst, r.tensor.device) for r in dst_regions}
        sizes = [r.info().block_nbytes for r in dst_regions]
        for piece in blocks.plan_pieces(sizes, len(src), FAKE_PIECE_BYTES):
            if self._fabric.delay_s:
                time.sleep(self._fabric.delay_s)
            if self._fabric.fail_with is not None:
                raise KVTransportError(self._fabric.fail_with)
            self._fabric.lookup(transfer.remote_address)  # raises once the source was killed
            src_region, dst_region = src_regions[piece.region], dst_regions[piece.region]
            data = blocks.gather(src_region, src_index[id(src_region)], piece)
            blocks.scatter(dst_region, dst_index[id(dst_region)], piece, data)
            transfer.add_bytes(piece.nbytes)
