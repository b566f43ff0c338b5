"""NCCL KV pull sweep: staging batch size x ring depth x NCCL channels, against the peer copy.

    python benchmarks/research/transfer_sweep.py --out sweep.json

Needs two GPUs (KV on cuda:0 -> cuda:1, Llama-3.1-8B shape, as transfer_bench.py). For each
pair API (`--nccl-api`, the deployment's `kv.nccl_api`: direct ncclSend/ncclRecv or torch's
ProcessGroupNCCL) and NCCL environment variant (`--nccl-env`; each variant runs in fresh
processes: NCCL reads its environment once per process), each pair configuration (`--configs`,
"BATCH_MIB:BUFFERS[:MIN_CHANNELS]"; MIN_CHANNELS is the pair's ncclConfig_t.minCTAs, 0 for
NCCL's choice) and each pull size (`--sizes-mib`), it times `--repeats` pulls after a warm-up
and, just before them, a torch peer copy of the same bytes (the baseline of that row, same process
and GPUs). Every row is byte-verified (the last pull of each row lands in zeroed KV and is
compared block by block). A configuration that fails is recorded with its error and the sweep
goes on. The first configuration, 128:2, is the design before the ring (two 128 MiB buffers):
the baseline.

Prints one table per variant and a summary (best configuration per size), and writes every row
as JSON to `--out`. Not a test: nothing asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/transfer_bench.py

import transfer_bench as tb  # noqa: E402

from pdserve.kv.transport.defaults import DEFAULT_NCCL_API, NCCL_API_CHOICES  # noqa: E402
from pdserve.kv.transport.nccl import NcclSink  # noqa: E402

DEFAULT_CONFIGS = "128:2,16:2,16:4,32:2,32:4,64:2,64:4,128:4,32:4:32,64:4:32"
# Environment variants: knobs of NCCL's P2P path only (channels, chunk size), no GPU settings.
DEFAULT_ENVS = ["", "NCCL_MIN_NCHANNELS=32 NCCL_MIN_P2P_NCHANNELS=32", "NCCL_P2P_NVL_CHUNKSIZE=1048576"]
DEFAULT_ENV_CONFIGS = "128:2,32:4,64:4"
# A pull that takes this long has failed (the pair's own timeout is 30 s).
PULL_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class PairConfig:
    batch_mib: int
    buffers: int
    min_channels: int = 0

    @classmethod
    def parse(cls, text: str) -> PairConfig:
        fields = [int(f) for f in text.split(":")]
        return cls(*fields)

    @property
    def label(self) -> str:
        channels = f" ch>={self.min_channels}" if self.min_channels else ""
        return f"{self.buffers}x{self.batch_mib}MiB{channels}"


@dataclass(slots=True)
class Row:
    env: str
    config: str
    batch_mib: int
    buffers: int
    min_channels: int
    size_bytes: int
    copy_path: str = ""  # "triton" or "torch" on each side: source/sink
    ms: float | None = None
    gbps: float | None = None
    peer_ms: float | None = None
    peer_gbps: float | None = None
    pct_of_peer: float | None = None
    gpu_gbps: float | None = None
    verified: bool | None = None
    phases_ms: dict[str, float] | None = None
    seconds: list[float] = field(default_factory=list)
    peer_seconds: list[float] = field(default_factory=list)
    error: str | None = None
    pair_api: str | None = None  # "direct" or "torch": how the pair's sends and receives ran


def sweep(args: argparse.Namespace, env_label: str) -> list[Row]:
    """Runs every configuration and size in this process (the sink) and one source child."""
    shape = tb.pick_shape(args.device)
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    configs = [PairConfig.parse(c) for c in args.configs.split(",")]
    num_blocks = int(max(sizes) / shape.block_bytes() * tb.KV_SLACK) + 1
    args.staging_mib, args.gil_load = configs[0].batch_mib, False
    bench = tb.Bench(args, shape, num_blocks)
    pin = lambda rid, ids: bench.command("pin", rid, ids)
    rows: list[Row] = []
    try:
        for config in configs:
            rows.extend(_run_config(args, bench, shape, config, sizes, env_label, pin))
    finally:
        bench.close()
    return rows


def _run_config(args, bench, shape, config: PairConfig, sizes, env_label, pin) -> list[Row]:
    rows = [
        Row(env_label, config.label, config.batch_mib, config.buffers, config.min_channels, size)
        for size in sizes
    ]
    sink = None
    try:
        address, source_path = bench.command(
            "source", config.batch_mib << 20, config.buffers, config.min_channels
        )
        # The sink offers direct calls only with that API; the source picks it only where offered.
        sink = NcclSink(
            shape.layout(), bench.dst_regions, engine_id="bench-sweep", cluster_token=tb.TOKEN, trace=True,
            nccl_api=args.nccl_api[0] if args.nccl_api else DEFAULT_NCCL_API,
        )
        copy_path = f"{source_path}/{'triton' if sink._runs is not None else 'torch'}"
        for row in rows:
            row.copy_path = copy_path
            try:
                _measure(args, bench, shape, sink, address, pin, row)
            except Exception as exc:  # noqa: BLE001 - record and go on with the next size
                row.error = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            _print_row(row)
    except Exception as exc:  # noqa: BLE001 - record and go on with the next configuration
        traceback.print_exc()
        for row in rows:
            if row.ms is None and row.error is None:
                row.error = f"{type(exc).__name__}: {exc}"
                _print_row(row)
    finally:
        if sink is not None:
            sink.close()
    return rows


def _measure(args, bench, shape, sink, address, pin, row: Row) -> None:
    blocks_per_pull = max(1, row.size_bytes // shape.block_bytes())
    row.size_bytes = blocks_per_pull * shape.block_bytes()
    on_gpus = shape.source_device.startswith("cuda")
    row.peer_seconds = bench.peer_copy_baseline(row.size_bytes) if on_gpus else []
    row.seconds = bench.time_pulls(sink, blocks_per_pull, address, pin, PULL_WAIT_S)
    row.verified = bench.verify_last_pull()
    row.pair_api = tb.pair_apis(sink)
    row.phases_ms, row.gpu_gbps = tb.trace_summary(sink, args.repeats, bench.source_traces(args.repeats))
    row.ms = statistics.median(row.seconds) * 1e3
    row.gbps = row.size_bytes / row.ms / 1e6
    if row.peer_seconds:
        row.peer_ms = statistics.median(row.peer_seconds) * 1e3
        row.peer_gbps = row.size_bytes / row.peer_ms / 1e6
        row.pct_of_peer = 100 * row.peer_ms / row.ms


HEADER = (
    f"{'env':<28} {'config':<18} {'MiB':>5} {'ms':>7} {'GB/s':>7} {'peer ms':>8} {'% peer':>7} "
    f"{'GPU GB/s':>9}  check"
)


def _print_row(row: Row) -> None:
    head = f"{row.env or 'default':<28.28} {row.config:<18} {row.size_bytes / 2**20:>5.0f}"
    if row.error:
        print(f"{head}  FAILED: {row.error}", flush=True)
        return
    gpu = f"{row.gpu_gbps:>9.1f}" if row.gpu_gbps else f"{'-':>9}"
    peer = f"{row.peer_ms:>8.3f} {row.pct_of_peer:>6.1f}%" if row.peer_ms else f"{'-':>8} {'-':>7}"
    check = "verified" if row.verified else "BYTES DIFFER"
    print(
        f"{head} {row.ms:>7.3f} {row.gbps:>7.1f} {peer} {gpu}  "
        f"{check} ({row.copy_path}, {row.pair_api})",
        flush=True,
    )


def print_summary(rows: list[Row]) -> None:
    """The best verified configuration per size, beside the baseline (first configuration)."""
    print("\nbest per size (verified rows only; % of the peer copy measured in the same row):")
    good = [r for r in rows if r.verified and r.pct_of_peer is not None]
    for size in sorted({r.size_bytes for r in rows}):
        of_size = [r for r in good if r.size_bytes == size]
        if not of_size:
            print(f"  {size >> 20:>5} MiB: no verified row")
            continue
        best = max(of_size, key=lambda r: r.pct_of_peer)
        base = [r for r in of_size if (r.batch_mib, r.buffers, r.min_channels, r.env) == (128, 2, 0, "")]
        base_text = ""
        if base:
            base_text = f"; baseline 2x128MiB {base[0].ms:.3f} ms = {base[0].pct_of_peer:.1f}%"
        print(
            f"  {size >> 20:>5} MiB: {best.config} [{best.env or 'default'}] {best.ms:.3f} ms = "
            f"{best.pct_of_peer:.1f}% of peer copy ({best.peer_ms:.3f} ms){base_text}"
        )
    failed = [r for r in rows if r.error or not r.verified]
    print(f"{len(rows)} rows, {len(failed)} failed or unverified")


def variant_label(env_text: str, api: str) -> str:
    """A variant's name in the rows: its environment, and its pair API unless the default."""
    return " ".join(filter(None, [env_text, "" if api == DEFAULT_NCCL_API else f"nccl_api={api}"]))


def run_variant(args: argparse.Namespace, env_text: str, api: str, configs: str) -> list[Row]:
    """One environment variant and pair API in a fresh interpreter (this script, --variant-child)."""
    variant = dict(item.split("=", 1) for item in shlex.split(env_text))
    env = {**os.environ, **variant, "NCCL_NVLS_ENABLE": "0"}  # NVLS stays off in every variant
    if args.nccl_log_dir:
        args.nccl_log_dir.mkdir(parents=True, exist_ok=True)
        tag = "".join(c if c.isalnum() else "_" for c in env_text) or "default"
        env |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(args.nccl_log_dir / f"nccl-{tag}-%h-%p.log")}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [
            sys.executable, __file__, "--variant-child", "--env-label", variant_label(env_text, api),
            "--nccl-api", api, "--configs", configs,
            "--sizes-mib", args.sizes_mib, "--repeats", str(args.repeats), "--out", str(out),
            "--device", args.device,
        ]  # fmt: skip
        try:
            done = subprocess.run(command, env=env, timeout=args.variant_timeout_s)
            failure = None if out.exists() else f"variant process exited {done.returncode} without results"
        except subprocess.TimeoutExpired:
            failure = f"variant process exceeded {args.variant_timeout_s} s"
        if failure is None:
            return [Row(**r) for r in json.loads(out.read_text())["rows"]]
    return [Row(variant_label(env_text, api), "*", 0, 0, 0, 0, error=failure)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="64,256,1024", help="pull sizes, MiB")
    parser.add_argument("--repeats", type=int, default=10, help="timed pulls per configuration and size")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="BATCH_MIB:BUFFERS[:MIN_CHANNELS],...")
    parser.add_argument(
        "--nccl-env",
        action="append",
        help=f"an NCCL environment variant, e.g. 'NCCL_MIN_NCHANNELS=32' ('' = default; repeatable; "
        f"default: {DEFAULT_ENVS})",
    )
    parser.add_argument(
        "--nccl-api",
        action="append",
        choices=NCCL_API_CHOICES,
        help=f"how the pairs send and receive (kv.nccl_api); repeatable, each run with every --nccl-env "
        f"(default: {DEFAULT_NCCL_API})",
    )
    parser.add_argument(
        "--env-configs", default=DEFAULT_ENV_CONFIGS, help="configs run under the non-default variants"
    )
    parser.add_argument("--nccl-log-dir", type=Path, help="NCCL_DEBUG=INFO logs per variant (channel counts)")
    parser.add_argument("--variant-timeout-s", type=int, default=420, help="per environment variant")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a gloo smoke run")
    parser.add_argument("--out", type=Path, help="write every row as JSON here")
    parser.add_argument("--variant-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--env-label", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_child:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        rows = sweep(args, args.env_label)
        args.out.write_text(json.dumps({"rows": [asdict(r) for r in rows]}))
        return 0
    started = time.time()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"{len(gpus)} GPUs: {gpus}; NCCL_NVLS_ENABLE=0 in every variant")
    print(HEADER, flush=True)
    rows: list[Row] = []
    for api in args.nccl_api or [DEFAULT_NCCL_API]:
        for env_text in args.nccl_env if args.nccl_env is not None else DEFAULT_ENVS:
            default = not variant_label(env_text, api)
            rows += run_variant(args, env_text, api, args.configs if default else args.env_configs)
    print_summary(rows)
    if args.out:
        payload = {
            "host": platform.node(),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "command": sys.argv,
            "seconds": time.time() - started,
            "rows": [asdict(r) for r in rows],
        }
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")
    return 0 if rows and all(r.verified for r in rows) else 1  # 1: some row failed or differed


if __name__ == "__main__":
    sys.exit(main())
