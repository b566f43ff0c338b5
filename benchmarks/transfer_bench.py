"""KV transfer throughput of each pdserve transport beside a raw baseline, in the same run.

    python benchmarks/transfer_bench.py [--sizes-mib 16,64,256] [--repeats 5] [--out results.json]

A spawned child process plays the prefill worker: an NcclSource (which also serves gRPC pulls)
over Llama-3.1-8B-shaped KV (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token). This
process plays the decode worker and pulls a random, non-contiguous set of blocks whose total size
is each requested size, through:
  - grpc: GrpcSink (chunked server stream)       baseline: raw TCP socket copy on loopback
  - nccl: NcclSink (gloo on CPU, NCCL on CUDA)    baseline: raw socket (CPU), `tensor.to('cuda:1')` (2 GPUs)
  - fake: in-process memcpy through FakeSink      (no network; an upper bound of gather + scatter)
With two or more GPUs the source's KV lives on cuda:0 and the sink's on cuda:1 (vLLM GPU layout
per layer [2, num_blocks, 16, 8, 128]); otherwise on CPU (CPU vLLM layout [num_blocks, 8, 128, 256]).
Each figure is the median of `--repeats` timed pulls after one warm-up pull (handshake, pair
setup), timed from start_pull to DONE. On CUDA the NCCL rows also give where a pull's time went
(the sink's PullTrace: thread start, header sent, all ops queued, GPU done, reply read) and the
GPU-side bandwidth (CUDA events from the first receive queued to the last scatter done).
The staging sweep (batch size x ring depth x NCCL channels, each row against a peer copy of
the same run) is benchmarks/research/transfer_sweep.py.
`--torch-profile DIR` also records 3 NCCL pulls per size under torch's profiler on both ends and
prints each GPU's kernel timeline (do block copies, sends and receives overlap?).
`--gil-load` runs a pure-Python busy thread in both processes during the pulls, as a vLLM
engine's loop does, to show what thread hand-offs cost there. Not a test: nothing asserts on speed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import multiprocessing
import platform
import random
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.fake import FakeFabric, FakeSink, FakeSource
from pdserve.kv.transport.grpc import GrpcSink
from pdserve.kv.transport.nccl import DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, NcclSink, NcclSource
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec

TOKEN = "bench-token"
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
# vLLM's block size: 16 tokens on GPU backends, 128 on the CPU backend.
GPU_BLOCK_TOKENS, CPU_BLOCK_TOKENS = 16, 128
# Source and sink hold this many times the largest pull, so pulls pick scattered blocks.
KV_SLACK = 1.25


@dataclass(frozen=True, slots=True)
class Shape:
    """Where the KV lives and how one layer's tensor is laid out."""

    source_device: str
    sink_device: str
    block_tokens: int

    def layout(self) -> KVLayoutSpec:
        kind = "vllm-gpu:[2,nb,bs,h,d]" if self.block_tokens == GPU_BLOCK_TOKENS else "vllm-cpu:[nb,h,bs,2d]"
        return KVLayoutSpec("meta-llama/Llama-3.1-8B", "bfloat16", self.block_tokens, kind, 1, 0, LAYERS)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.block_tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2

    def region_shape(self, num_blocks: int) -> tuple[tuple[int, ...], int]:
        """One layer's tensor shape and its block dim."""
        if self.block_tokens == GPU_BLOCK_TOKENS:
            return (2, num_blocks, self.block_tokens, KV_HEADS, HEAD_DIM), 1
        return (num_blocks, KV_HEADS, self.block_tokens, 2 * HEAD_DIM), 0

    def regions(self, num_blocks: int, device: str) -> list[BlockRegion]:
        shape, block_dim = self.region_shape(num_blocks)
        return [BlockRegion(pattern(shape, layer, device), block_dim) for layer in range(LAYERS)]


def pattern(shape: tuple[int, ...], layer: int, device: str) -> torch.Tensor:
    """Contents both processes can rebuild: element (i0, i1, ...) = (layer + sum(i_k * p_k)) % 61
    with a distinct prime p_k per dim, exact in bf16, so a misplaced byte run shows up."""
    primes = (3, 5, 7, 11, 13)
    total = torch.full((1,) * len(shape), layer, dtype=torch.int32, device=device)
    for dim, size in enumerate(shape):
        view = [1] * len(shape)
        view[dim] = size
        total = total + torch.arange(size, dtype=torch.int32, device=device).view(view) * primes[dim]
    return (total % 61).to(torch.bfloat16)


def pick_shape(device: str) -> Shape:
    """cuda:0 -> cuda:1 when asked for (or by default when two GPUs exist), else CPU."""
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    if device == "cuda" or (device == "auto" and two_gpus):
        if not two_gpus:
            raise SystemExit("--device cuda needs two GPUs")
        return Shape("cuda:0", "cuda:1", GPU_BLOCK_TOKENS)
    return Shape("cpu", "cpu", CPU_BLOCK_TOKENS)


@contextlib.contextmanager
def busy_python(enabled: bool):
    """A thread that runs pure Python (holding the GIL) while enabled, like an engine's loop."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))

    thread = threading.Thread(target=spin, daemon=True) if enabled else None
    if thread:
        thread.start()
    try:
        yield
    finally:
        stop.set()


def run_source(conn, shape: Shape, num_blocks: int, staging_bytes: int, gil_load: bool = False) -> None:
    """Child process: an NcclSource over `num_blocks` blocks; pins and raw-socket sends on request."""
    if shape.source_device.startswith("cuda"):
        torch.cuda.set_device(shape.source_device)
    with busy_python(gil_load):
        _serve_source(conn, shape, num_blocks, staging_bytes)


def _serve_source(conn, shape: Shape, num_blocks: int, staging_bytes: int) -> None:
    """Serves one NcclSource at a time over the same KV; ("source", bytes, buffers, channels)
    replaces it with one of other pair settings (the sweep) and answers its address."""
    regions = shape.regions(num_blocks, shape.source_device)

    def make_source(staging: int, buffers: int = DEFAULT_STAGING_BUFFERS, channels: int = 0) -> NcclSource:
        return NcclSource(
            shape.layout(),
            regions,
            engine_id="bench-prefill",
            cluster_token=TOKEN,
            staging_bytes=staging,
            staging_buffers=buffers,
            nccl_min_channels=channels,
            trace=True,
        )

    source = make_source(staging_bytes)
    conn.send(source.address)
    profiler = None
    while (command := conn.recv())[0] != "stop":
        try:
            if command[0] == "profile_start":
                profiler = torch_profiler()
                profiler.start()
            elif command[0] == "profile_stop":  # ("profile_stop", path): stop, write the trace
                profiler.stop()
                profiler.export_chrome_trace(command[1])
            elif command[0] == "pin":
                source.pin(command[1], command[2])
            elif command[0] == "source_traces":  # the last N pulls' SourceTraces, as dicts
                conn.send([asdict(t) for t in source.completed_traces(command[1])])
                continue
            elif command[0] == "socket":
                _socket_send(command[1], command[2], command[3])
            elif command[0] == "source":
                source.close()
                source = make_source(*command[1:])
                conn.send((source.address, "triton" if source._runs is not None else "torch"))
                continue
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which records it
            conn.send(f"error: {exc!r}")
            continue
        conn.send("ok")
    source.close()


def torch_profiler():
    """A torch profiler of host calls and GPU kernels and copies (started by the caller)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def kernel_timeline(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start ms, duration ms, name) of each GPU kernel and copy of a chrome trace, from the
    first one; names shortened to what tells them apart (NCCL send/recv, the block copy)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    if not gpu:
        return []
    t0 = gpu[0]["ts"]
    return [((e["ts"] - t0) / 1e3, e.get("dur", 0) / 1e3, _short_kernel(e["name"])) for e in gpu]


def _short_kernel(name: str) -> str:
    for key, short in (("SendRecv", "nccl"), ("Send", "nccl send"), ("Recv", "nccl recv"),
                       ("_runs_kernel", "block copy"), ("Memcpy", "memcpy")):  # fmt: skip
        if key in name:
            return short
    return name[:40]


def _socket_send(port: int, nbytes: int, repeats: int) -> None:
    payload = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview((ctypes.c_char * nbytes).from_address(payload.data_ptr())).cast("B")
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(repeats):
            conn.recv(1)
            conn.sendall(view)


class Bench:
    """The decode side: pulls through each sink and times the baselines."""

    def __init__(self, args: argparse.Namespace, shape: Shape, num_blocks: int):
        self.args, self.shape, self.num_blocks = args, shape, num_blocks
        self.rng = random.Random(0)
        context = multiprocessing.get_context("spawn")
        self.pipe, child_end = context.Pipe()
        staging_bytes = args.staging_mib << 20
        self.child = context.Process(
            target=run_source, args=(child_end, shape, num_blocks, staging_bytes, args.gil_load), daemon=True
        )
        self.child.start()
        self.address = self.pipe.recv()
        self.dst_regions = shape.regions(num_blocks, shape.sink_device)
        self.pulls = 0

    def command(self, *command: object) -> object:
        """Sends a command to the source process; its answer, or RuntimeError if it failed or
        did not answer within 5 minutes (a dead or stuck child must not hang the sweep)."""
        self.pipe.send(command)
        if not self.pipe.poll(300):
            raise RuntimeError(f"source process did not answer {command[0]!r}")
        answer = self.pipe.recv()
        if isinstance(answer, str) and answer.startswith("error"):
            raise RuntimeError(f"source process: {answer}")
        return answer

    def time_pulls(self, sink, blocks_per_pull: int, address: str, pin, wait_s: float = 300) -> list[float]:
        """Seconds of each timed pull (after one warm-up). The destination KV is zeroed before
        the last pull, so `verify_last_pull` cannot pass on an earlier pull's bytes."""
        seconds = []
        for attempt in range(self.args.repeats + 1):
            if attempt == self.args.repeats:
                for region in self.dst_regions:
                    region.tensor.zero_()
                if self.shape.sink_device.startswith("cuda"):
                    torch.cuda.synchronize(self.shape.sink_device)
            elapsed = self.pull_once(sink, blocks_per_pull, address, pin, wait_s)
            if attempt:
                seconds.append(elapsed)
        return seconds

    def pull_once(self, sink, blocks_per_pull: int, address: str, pin, wait_s: float = 300) -> float:
        """One pull of random source blocks into random destination blocks; its seconds."""
        self.pulls += 1
        request_id = f"bench-{self.pulls}"
        src = self.rng.sample(range(self.num_blocks), blocks_per_pull)
        dst = self.rng.sample(range(self.num_blocks), blocks_per_pull)
        pin(request_id, src)
        transfer = sink.start_pull(address, request_id, src, dst)
        if transfer.wait(wait_s) is not TransferState.DONE:
            raise RuntimeError(f"pull failed: {transfer}")
        self.last_pull = (src, dst)
        return transfer.elapsed_s

    def profile_pulls(self, sink, blocks_per_pull: int, pin, stem: Path, count: int = 3) -> None:
        """`count` pulls under torch's profiler on both ends: writes STEM-sink.json and
        STEM-source.json (chrome traces) and prints both GPUs' kernel timelines, which show
        whether block copies, sends and receives overlap."""
        self.command("profile_start")
        profiler = torch_profiler()
        profiler.start()
        try:
            for _ in range(count):
                self.pull_once(sink, blocks_per_pull, self.address, pin)
        finally:
            profiler.stop()
            self.command("profile_stop", f"{stem}-source.json")
        profiler.export_chrome_trace(f"{stem}-sink.json")
        for side in ("source", "sink"):
            print(f"{stem.name} {side} GPU timeline (start ms, duration ms, kernel):")
            for start, duration, name in kernel_timeline(Path(f"{stem}-{side}.json")):
                print(f"  {start:9.3f} {duration:8.3f}  {name}")

    def verify_last_pull(self) -> bool:
        """Whether the last pull's destination blocks hold exactly the source blocks named."""
        src, dst = self.last_pull
        shape, block_dim = self.shape.region_shape(self.num_blocks)
        device = self.shape.sink_device
        src_index = torch.tensor(src, device=device)
        dst_index = torch.tensor(dst, device=device)
        for layer, region in enumerate(self.dst_regions):
            expected = pattern(shape, layer, device).index_select(block_dim, src_index)
            if not torch.equal(region.tensor.index_select(block_dim, dst_index), expected):
                return False
        return True

    def socket_baseline(self, nbytes: int) -> list[float]:
        """Raw loopback TCP: the child sends nbytes from memory, we recv_into a buffer."""
        target = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
        with socket.create_server(("127.0.0.1", 0)) as server:
            self.pipe.send(("socket", server.getsockname()[1], nbytes, self.args.repeats + 1))
            conn, _ = server.accept()
            seconds = []
            with conn:
                for attempt in range(self.args.repeats + 1):
                    started = time.perf_counter()
                    conn.sendall(b"g")
                    received = 0
                    while received < nbytes:
                        received += conn.recv_into(view[received:], nbytes - received)
                    if attempt:
                        seconds.append(time.perf_counter() - started)
        assert self.pipe.recv() == "ok"
        return seconds

    def peer_copy_baseline(self, nbytes: int) -> list[float]:
        """torch peer copy cuda:0 -> cuda:1 of one contiguous buffer."""
        source = torch.empty(nbytes, dtype=torch.uint8, device=self.shape.source_device)
        target = torch.empty(nbytes, dtype=torch.uint8, device=self.shape.sink_device)
        seconds = []
        for attempt in range(self.args.repeats + 1):
            torch.cuda.synchronize(self.shape.source_device)
            torch.cuda.synchronize(self.shape.sink_device)
            started = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize(self.shape.sink_device)
            if attempt:
                seconds.append(time.perf_counter() - started)
        return seconds

    def source_traces(self, count: int) -> list[dict]:
        """The source's SourceTraces of its last `count` pulls (dicts)."""
        return self.command("source_traces", count)

    def close(self) -> None:
        self.pipe.send(("stop",))
        self.child.join(30)


@dataclass(frozen=True, slots=True)
class Result:
    transport: str
    size_bytes: int
    seconds: list[float]
    baseline_of: str = ""
    phases_ms: dict[str, float] | None = None  # NCCL pulls: median ms from start_pull to each phase
    gpu_gbps: float | None = None  # NCCL pulls on CUDA: bytes / GPU time (CUDA events)
    verified: bool | None = None  # the last pull's blocks arrived exactly (transports only)
    pair_api: str | None = None  # NCCL pulls: "direct" or "torch" sends and receives (nccl_pair)

    @property
    def gbps(self) -> float:
        return self.size_bytes / statistics.median(self.seconds) / 1e9


def run(args: argparse.Namespace) -> tuple[Shape, list[Result]]:
    shape = pick_shape(args.device)
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    num_blocks = int(max(sizes) / shape.block_bytes() * KV_SLACK) + 1
    bench = Bench(args, shape, num_blocks)
    layout, results = shape.layout(), []
    tracing = {"trace": True} if "trace" in inspect.signature(NcclSink.__init__).parameters else {}
    sinks = {
        "grpc": GrpcSink(layout, bench.dst_regions, engine_id="bench-decode-grpc", cluster_token=TOKEN),
        "nccl": NcclSink(
            layout, bench.dst_regions, engine_id="bench-decode-nccl", cluster_token=TOKEN, **tracing
        ),
    }
    wanted = args.transports.split(",")
    sinks = {name: sink for name, sink in sinks.items() if name in wanted}
    remote_pin = lambda rid, ids: bench.command("pin", rid, ids)
    fabric = FakeFabric()
    fake_source = FakeSource(
        layout,
        shape.regions(num_blocks, shape.source_device),
        engine_id="fake-prefill",
        cluster_token=TOKEN,
        fabric=fabric,
    )
    fake_sink = FakeSink(
        layout, bench.dst_regions, engine_id="fake-decode", cluster_token=TOKEN, fabric=fabric
    )
    try:
        with busy_python(args.gil_load):
            for size in sizes:
                first = len(results)
                blocks_per_pull = max(1, size // shape.block_bytes())
                nbytes = blocks_per_pull * shape.block_bytes()
                for name, sink in sinks.items():
                    seconds = bench.time_pulls(sink, blocks_per_pull, bench.address, remote_pin)
                    phases, gpu_gbps = trace_summary(sink, args.repeats, bench.source_traces(args.repeats))
                    verified = bench.verify_last_pull()
                    api = pair_apis(sink) if name == "nccl" else None
                    results.append(Result(name, nbytes, seconds, "", phases, gpu_gbps, verified, api))
                    if args.torch_profile and name == "nccl" and shape.sink_device.startswith("cuda"):
                        args.torch_profile.mkdir(parents=True, exist_ok=True)
                        stem = args.torch_profile / f"nccl-{nbytes >> 20}MiB"
                        bench.profile_pulls(sink, blocks_per_pull, remote_pin, stem)
                if "fake" in wanted:
                    pin = fake_source.pin
                    seconds = bench.time_pulls(fake_sink, blocks_per_pull, fake_source.address, pin)
                    results.append(Result("fake", nbytes, seconds))
                if "raw-socket" in wanted:
                    results.append(Result("raw-socket", nbytes, bench.socket_baseline(nbytes), "grpc, gloo"))
                if shape.source_device.startswith("cuda"):
                    results.append(Result("peer-copy", nbytes, bench.peer_copy_baseline(nbytes), "nccl"))
                print_rows(results[first:], shape)
    finally:
        for sink in [*sinks.values(), fake_sink]:
            sink.close()
        fake_source.close()
        bench.close()
    return shape, results


def pair_apis(sink: NcclSink) -> str:
    """How the sink's pairs move bytes ("direct", "torch", or both joined by a comma)."""
    return ",".join(sorted({pair.api for pair in sink._pairs.values()}))


# The sink's phases (PullTrace) and the source's (SourceTrace), in the order a pull passes them.
SINK_PHASES = ("thread_start", "header_sent", "queued", "data_done", "reply_read")
SOURCE_PHASES = ("header_read", "queued", "replied", "done")


def trace_summary(
    sink, repeats: int, source_traces: list[dict] | None = None
) -> tuple[dict[str, float] | None, float | None]:
    """Median phase times (ms from start_pull) and GPU-side GB/s of the sink's last `repeats`
    pulls, if traced; with the source's traces of the same pulls (`Bench.source_traces`), its
    phases too, as `source_*` (one clock: both processes share the host's monotonic time)."""
    traces = list(getattr(sink, "traces", None) or [])[-repeats:]
    if not traces:
        return None, None
    medians = {p: statistics.median(getattr(t, p) for t in traces) * 1e3 for p in SINK_PHASES}
    by_id = {t["request_id"]: t for t in source_traces or []}
    matched = [(t, by_id[t.request_id]) for t in traces if t.request_id in by_id]
    for phase in SOURCE_PHASES if matched else ():
        medians[f"source_{phase}"] = statistics.median(s[phase] - t.started_at for t, s in matched) * 1e3
    gpu = [t.gpu_s for t in traces if t.gpu_s]
    gbps = traces[0].nbytes / statistics.median(gpu) / 1e9 if gpu else None
    return medians, gbps


def print_rows(rows: list[Result], shape: Shape) -> None:
    for row in rows:
        name = (
            row.transport
            if row.transport != "nccl" or shape.source_device.startswith("cuda")
            else "nccl(gloo)"
        )
        note = f"baseline for {row.baseline_of}" if row.baseline_of else ""
        if row.verified is not None:
            note = ("bytes verified " if row.verified else "BYTES DIFFER ") + note
        if row.pair_api:
            note += f"pair api {row.pair_api}; "
        if row.phases_ms:
            note += "phases ms: " + " ".join(f"{k}={v:.3f}" for k, v in row.phases_ms.items())
            note += f"  gpu {row.gpu_gbps:.1f} GB/s" if row.gpu_gbps else ""
        print(
            f"{name:<12} {row.size_bytes / 2**20:>9.0f} {statistics.median(row.seconds) * 1e3:>10.2f} "
            f"{row.gbps:>8.2f}  {note}",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="16,64,256", help="comma-separated pull sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per transport and size")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the KV lives (auto: two GPUs if present, else CPU)",
    )
    parser.add_argument(
        "--staging-mib",
        type=int,
        default=DEFAULT_STAGING_BYTES >> 20,
        help="NCCL/gloo staging buffer per pair (the batch size of one send)",
    )
    parser.add_argument(
        "--transports",
        default="grpc,nccl,fake,raw-socket",
        help="comma-separated subset of grpc,nccl,fake,raw-socket (peer-copy always runs on 2 GPUs)",
    )
    parser.add_argument(
        "--gil-load",
        action="store_true",
        help="a busy pure-Python thread in both processes (as in an engine)",
    )
    parser.add_argument(
        "--torch-profile",
        type=Path,
        metavar="DIR",
        help="CUDA: after each size's NCCL row, 3 more pulls under torch's profiler on both ends "
        "(chrome traces in DIR, kernel timelines printed)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    shape = pick_shape(args.device)
    print(
        f"KV on {shape.source_device} -> {shape.sink_device}, {shape.block_tokens}-token blocks "
        f"({shape.block_bytes() >> 10} KiB per block, 128 KiB per token), torch {torch.__version__}"
    )
    print(f"{'transport':<12} {'size MiB':>9} {'median ms':>10} {'GB/s':>8}")
    shape, results = run(args)
    if args.out:
        payload = {
            "host": platform.node(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "shape": asdict(shape),
            "repeats": args.repeats,
            "staging_mib": args.staging_mib,
            "gil_load": args.gil_load,
            "command": sys.argv,
            "results": [dict(asdict(r), gbps_median=r.gbps) for r in results],
        }
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
