"""The cuda_ipc transport against the torch peer copy and the NCCL transport, on two GPUs of one host.

    python benchmarks/gpu/ipc_transfer.py --out DIR [--sizes-mib 16,64,256,1024] [--repeats 20]

Three processes, each with its own CUDA_VISIBLE_DEVICES, as engines under Ray would have them:
  - the source (a CudaIpcSource, which also serves NCCL pulls) sees only physical GPU 0;
  - the probe sink sees only physical GPU 1 and tries a cuda_ipc link without fallback: does IPC
    work when the source's GPU is not visible? (the answer is recorded either way);
  - the measuring sink sees "1,0" (its own GPU first, as vLLM's custom all-reduce arranges) and
    times, per size: cuda_ipc pulls, NCCL pulls (NcclSink) from the same source, and a torch
    peer copy of one contiguous buffer of the same size (GPU 0 -> GPU 1), plus the IPC copy
    kernel alone (CUDA events) and a sweep of its launch settings at 256 MiB.
KV: Llama-3.1-8B shape (32 layers, vLLM GPU layout [2, blocks, 16, 8, 128] bf16, 128 KiB per
token); each pull names random, non-contiguous source and destination blocks. A pull's time is
start_pull to DONE (the handle). Every verified pull zeroes the destination first and compares
every destination block with the source pattern (transfer_bench.pattern). Writes
DIR/ipc_transfer.json and prints a table. Not a test: nothing asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]  # the repository, benchmarks/

TOKEN = "ipc-bench-token"
BLOCK_BYTES = 16 * 128 * 1024  # one 16-token block of every layer: 2 MiB


def source_main(num_blocks: int) -> None:
    """Source process: serves pins over stdin/stdout (JSON lines) until told to stop."""
    import torch
    from transfer_bench import GPU_BLOCK_TOKENS, Shape

    from pdserve.kv.transport.cuda_ipc import CudaIpcSource

    shape = Shape("cuda:0", "cuda:0", GPU_BLOCK_TOKENS)
    torch.cuda.set_device(0)
    regions = shape.regions(num_blocks, "cuda:0")
    torch.cuda.synchronize()
    source = CudaIpcSource(shape.layout(), regions, engine_id="bench-prefill", cluster_token=TOKEN)
    print(json.dumps({"address": source.address}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            break
        if command["op"] == "pin":
            source.pin(command["request_id"], command["blocks"])
        print(json.dumps({"ok": True}), flush=True)
    source.close()


class Source:
    """The source process, seen from a sink process."""

    def __init__(self, num_blocks: int):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("IPC_BENCH_SOURCE_GPU", "0"))
        self.process = subprocess.Popen(
            [sys.executable, str(HERE), "--role", "source", "--blocks", str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.address = self._answer()["address"]

    def _answer(self) -> dict:
        """The source's next JSON line (other output is skipped); RuntimeError if it exited."""
        while line := self.process.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the source process exited ({self.process.wait()})")

    def pin(self, request_id: str, blocks: list[int]) -> None:
        self.process.stdin.write(json.dumps({"op": "pin", "request_id": request_id, "blocks": blocks}) + "\n")
        self.process.stdin.flush()
        self._answer()

    def close(self) -> None:
        self.process.stdin.write(json.dumps({"op": "stop"}) + "\n")
        self.process.stdin.flush()
        self.process.wait(timeout=60)


class Puller:
    """A sink process's side: its KV, the pulls, their verification."""

    def __init__(self, num_blocks: int):
        import torch
        from transfer_bench import GPU_BLOCK_TOKENS, Shape

        self.torch = torch
        self.shape = Shape("cuda:0", "cuda:0", GPU_BLOCK_TOKENS)
        self.num_blocks = num_blocks
        self.regions = self.shape.regions(num_blocks, "cuda:0")
        self.source = Source(num_blocks)
        self.rng = random.Random(0)
        self.count = 0

    def pull(self, sink, blocks: int, verify: bool = False) -> tuple[float, bool | None]:
        """One pull of random blocks; (seconds start_pull -> DONE, verified or None)."""
        from pdserve.kv.transport.base import TransferState

        self.count += 1
        request_id = f"pull-{self.count}"
        src = self.rng.sample(range(self.num_blocks), blocks)
        dst = self.rng.sample(range(self.num_blocks), blocks)
        if verify:
            for region in self.regions:
                region.tensor.zero_()
            self.torch.cuda.synchronize()
        self.source.pin(request_id, src)
        transfer = sink.start_pull(self.source.address, request_id, src, dst)
        if transfer.wait(120) is not TransferState.DONE:
            raise RuntimeError(f"pull failed: {transfer}")
        return transfer.elapsed_s, (self.verify(src, dst) if verify else None)

    def back_to_back(self, sink, blocks: int, count: int, repeats: int) -> dict:
        """`count` pulls started together (disjoint destinations), timed from the first start to
        the last DONE; the last round is verified. Shows the per-pull host cost amortized."""
        from pdserve.kv.transport.base import TransferState

        seconds, verified = [], None
        for attempt in range(repeats + 2):
            last = attempt == repeats + 1
            if last:
                for region in self.regions:
                    region.tensor.zero_()
                self.torch.cuda.synchronize()
            dst_all = self.rng.sample(range(self.num_blocks), blocks * count)
            pulls = []
            for i in range(count):
                self.count += 1
                src = self.rng.sample(range(self.num_blocks), blocks)
                self.source.pin(f"pull-{self.count}", src)
                pulls.append((f"pull-{self.count}", src, dst_all[i * blocks : (i + 1) * blocks]))
            started = time.perf_counter()
            handles = [sink.start_pull(self.source.address, r, s, d) for r, s, d in pulls]
            if any(h.wait(120) is not TransferState.DONE for h in handles):
                raise RuntimeError(f"pull failed: {handles}")
            if 0 < attempt <= repeats:
                seconds.append(time.perf_counter() - started)
            if last:
                verified = all(self.verify(s, d) for _, s, d in pulls)
        return summary(seconds, blocks * count * BLOCK_BYTES) | {"verified": verified, "pulls": count}

    def verify(self, src: list[int], dst: list[int]) -> bool:
        from transfer_bench import pattern

        torch = self.torch
        shape, block_dim = self.shape.region_shape(self.num_blocks)
        src_index, dst_index = torch.tensor(src, device="cuda:0"), torch.tensor(dst, device="cuda:0")
        for layer, region in enumerate(self.regions):
            expected = pattern(shape, layer, "cuda:0").index_select(block_dim, src_index)
            if not torch.equal(region.tensor.index_select(block_dim, dst_index), expected):
                return False
        return True

    def timed(self, sink, blocks: int, repeats: int) -> dict:
        """One warm-up, `repeats` timed pulls, then one verified pull (not timed)."""
        self.pull(sink, blocks)
        seconds = [self.pull(sink, blocks)[0] for _ in range(repeats)]
        _, verified = self.pull(sink, blocks, verify=True)
        return summary(seconds, blocks * BLOCK_BYTES) | {"verified": verified}


def summary(seconds: list[float], nbytes: int) -> dict:
    median = statistics.median(seconds)
    return {
        "nbytes": nbytes,
        "median_ms": median * 1e3,
        "min_ms": min(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "p90_ms": sorted(seconds)[int(0.9 * (len(seconds) - 1))] * 1e3,
        "gbps": nbytes / median / 1e9,
        "repeats": len(seconds),
    }


def probe_main(args: argparse.Namespace) -> None:
    """Probe sink (sees only its own GPU): a link without fallback, then one verified pull."""
    from pdserve.kv.transport.cuda_ipc import CudaIpcSink

    puller = Puller(args.blocks)
    sink = CudaIpcSink(
        puller.shape.layout(), puller.regions, engine_id="probe", cluster_token=TOKEN, nccl_fallback=False
    )
    result: dict = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        sink.handshake(puller.source.address)
        _, result["verified"] = puller.pull(sink, 16, verify=True)
        result["link"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the probe records what happened
        result["link"] = f"refused: {exc}"
    print(json.dumps({"probe": result}), flush=True)
    sink.close()
    puller.source.close()


def measure_main(args: argparse.Namespace) -> None:
    """Measuring sink (sees "1,0"): every row of the table, written as one JSON line."""
    import torch

    from pdserve.kv.transport import peer_copy
    from pdserve.kv.transport.cuda_ipc import CudaIpcSink
    from pdserve.kv.transport.nccl import NcclSink

    sizes = [int(s) for s in args.sizes_mib.split(",")]
    puller = Puller(args.blocks)
    layout = puller.shape.layout()
    common = {"cluster_token": TOKEN, "nccl_fallback": False, "trace": True}
    ipc = CudaIpcSink(layout, puller.regions, engine_id="ipc-sink", **common)
    # The same transport launching each copy's three steps one by one (no graph): the comparison.
    steps = CudaIpcSink(layout, puller.regions, engine_id="ipc-steps", graphs=False, **common)
    nccl = NcclSink(layout, puller.regions, engine_id="nccl-sink", cluster_token=TOKEN)
    ipc.handshake(puller.source.address)
    steps.handshake(puller.source.address)
    link = ipc._links[puller.source.address]
    rows: list[dict] = []
    for mib in sizes:
        blocks = (mib << 20) // BLOCK_BYTES
        rows.append({"path": "cuda_ipc", **puller.timed(ipc, blocks, args.repeats)})
        rows[-1]["phases_ms"] = phases(list(ipc.link_traces)[-args.repeats - 1 : -1])
        if mib == 256:
            rows.append({"path": "cuda_ipc_steps", **puller.timed(steps, blocks, args.repeats)})
        rows.append({"path": "nccl", **puller.timed(nccl, blocks, args.repeats)})
        rows.append({"path": "peer_copy", **peer_copy_baseline(torch, mib << 20, args.repeats)})
        rows.append({"path": "ipc_kernel", **kernel_only(torch, peer_copy, link, ipc.launch, blocks, args)})
        print(json.dumps(rows[-4:]), file=sys.stderr, flush=True)
    blocks = (256 << 20) // BLOCK_BYTES
    for path, sink in (("cuda_ipc_x4", ipc), ("nccl_x4", nccl)):
        rows.append({"path": path, **puller.back_to_back(sink, blocks, 4, args.repeats)})
    sweep = []
    for block_elems, num_warps, programs_per_sm, streaming in SWEEP:
        launch = peer_copy.LaunchSettings(block_elems, num_warps, programs_per_sm, streaming=streaming)
        row = kernel_only(torch, peer_copy, link, launch, blocks, args)
        settings = {"block_elems": block_elems, "num_warps": num_warps, "programs_per_sm": programs_per_sm}
        sweep.append(settings | {"streaming": streaming} | row)
    costs = host_costs(torch, np_module(), peer_copy, ipc, link, steps._links[puller.source.address])
    graph_errors = {"graphs": link.ring.graph_error, "programs": link.ring.programs}
    print(json.dumps({"rows": rows, "sweep": sweep, "host_us": costs, "ring": graph_errors}), flush=True)
    for sink in (ipc, steps, nccl):
        sink.close()
    puller.source.close()


# Kernel settings timed alone at 256 MiB: (int32 per step, warps, programs per SM, streaming).
SWEEP = [
    (4096, 8, 8, False), (4096, 8, 8, True), (4096, 8, 2, False), (4096, 4, 8, False),
    (8192, 8, 4, False), (8192, 8, 4, True), (8192, 8, 2, False), (8192, 8, 2, True),
]  # fmt: skip


def np_module():
    import numpy

    return numpy


def host_costs(torch, np, peer_copy, sink, link, steps_link, count: int = 200) -> dict[str, float]:
    """Mean host microseconds of the steps of a link pull's start (128 blocks), each alone; the
    launches copy nothing (zero blocks), so the GPU never holds the loop up."""
    src, dst = list(range(0, 256, 2)), list(range(1, 256, 2))
    buffer = peer_copy.id_buffer(np.zeros(2 + 2 * 128, dtype=np.int64))
    steps = {
        "check_block_ids": lambda: sink._check_block_ids(src, dst),
        "write_ids_128_blocks": lambda: peer_copy.write_ids(buffer, src, dst),
        "ring_launch_graph": lambda: link.ring.launch([], []),
        "ring_launch_steps": lambda: steps_link.ring.launch([], []),
        "current_device": lambda: torch.cuda.current_device(),
    }
    costs = {}
    with torch.cuda.device(0):
        for name, step in steps.items():
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(count):
                step()
            costs[name] = (time.perf_counter() - started) / count * 1e6
            torch.cuda.synchronize()
    return costs


def phases(traces: list[dict[str, float]]) -> dict[str, float]:
    """Median ms from a link pull's start to each phase (ipc_link's stamps)."""
    names = [n for n in traces[0] if n != "start"] if traces else []
    return {n: statistics.median(t[n] - t["start"] for t in traces if n in t) * 1e3 for n in names}


def peer_copy_baseline(torch, nbytes: int, repeats: int) -> dict:
    """torch copy of one contiguous buffer, physical GPU 0 (cuda:1 here) -> GPU 1 (cuda:0)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device="cuda:1")
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    seconds = []
    for attempt in range(repeats + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize("cuda:0")
        if attempt:
            seconds.append(time.perf_counter() - started)
    verified = bool(torch.equal(target, source.to("cuda:0")))
    del source, target
    return summary(seconds, nbytes) | {"verified": verified}


def kernel_only(torch, peer_copy, link, launch, blocks: int, args) -> dict:
    """The link's copy kernel alone on random blocks, timed by CUDA events (GPU time)."""
    rng = random.Random(1)
    seconds = []
    ids = torch.zeros(2 + 2 * blocks, dtype=torch.int64)
    programs = peer_copy.programs_for(link.device, launch)
    with torch.cuda.device(0):
        for attempt in range(args.repeats + 1):
            picks = rng.sample(range(args.blocks), blocks), rng.sample(range(args.blocks), blocks)
            peer_copy.write_ids(peer_copy.id_buffer(ids), *picks)
            on_device = ids.to("cuda:0")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            peer_copy.launch_kernel(link.table, on_device, link.ring.anchor, launch, programs)
            end.record()
            end.synchronize()
            if attempt:
                seconds.append(start.elapsed_time(end) / 1e3)
    return summary(seconds, blocks * BLOCK_BYTES)


def driver(args: argparse.Namespace) -> int:
    """Runs the probe and the measurement in their processes; writes and prints the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args)}
    smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    results["gpus"] = (
        subprocess.run(smi, capture_output=True, text=True, check=False).stdout.strip().splitlines()
    )
    versions = "import torch, triton, grpc; print(torch.__version__, triton.__version__, grpc.__version__)"
    results["versions"] = subprocess.run(
        [sys.executable, "-c", versions], capture_output=True, text=True, check=False
    ).stdout.strip()
    common = ["--blocks", str(args.blocks), "--repeats", str(args.repeats), "--sizes-mib", args.sizes_mib]
    for role, visible in (("probe", "1"), ("measure", "1,0")):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
        done = subprocess.run(
            [sys.executable, str(HERE), "--role", role, *common],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
        sys.stderr.write(done.stderr[-4000:])
        lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        results[role] = lines[-1] if lines else {"error": done.stderr[-2000:], "rc": done.returncode}
    (out / "ipc_transfer.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    print("probe (sink sees only its own GPU):", json.dumps(results.get("probe")))
    measure = results.get("measure", {})
    rows = measure.get("rows", [])
    peer = {r["nbytes"]: r["gbps"] for r in rows if r["path"] == "peer_copy"}
    print(
        f"{'path':<11} {'MiB':>5} {'median ms':>10} {'min':>7} {'p90':>7} {'max':>7} {'GB/s':>6} {'/peer':>6} verified"
    )
    for r in rows:
        share = r["gbps"] / peer[r["nbytes"]] if r["nbytes"] in peer else float("nan")
        print(
            f"{r['path']:<11} {r['nbytes'] >> 20:>5} {r['median_ms']:>10.3f} {r['min_ms']:>7.3f} "
            f"{r['p90_ms']:>7.3f} {r['max_ms']:>7.3f} {r['gbps']:>6.0f} {share:>6.0%} {r.get('verified', '')}"
        )
    for r in rows:
        if "phases_ms" in r:
            steps = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms"].items())
            print(f"cuda_ipc {r['nbytes'] >> 20} MiB, median ms from start_pull: {steps}")
    for r in measure.get("sweep", []):
        print(
            f"sweep 256 MiB kernel: block_elems {r['block_elems']:>5} warps {r['num_warps']:>2} "
            f"programs/SM {r['programs_per_sm']} streaming {r['streaming']:d}: {r['median_ms']:.3f} ms "
            f"{r['gbps']:.0f} GB/s"
        )
    print("ring:", json.dumps(measure.get("ring")))
    for name, us in measure.get("host_us", {}).items():
        print(f"host cost {name}: {us:.1f} us")
    if "error" in measure:
        print("measure failed:", measure["error"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--role", default="driver", choices=["driver", "source", "probe", "measure"])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--sizes-mib", default="16,64,256,1024")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--blocks", type=int, default=640, help="KV blocks per side (1.25 x the largest pull)"
    )
    args = parser.parse_args()
    if args.role == "source":
        source_main(args.blocks)
    elif args.role == "probe":
        probe_main(args)
    elif args.role == "measure":
        measure_main(args)
    else:
        return driver(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
