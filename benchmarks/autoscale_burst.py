"""One autoscaling burst run: pool sizes and SLO attainment over time.

Starts `pdserve serve --autoscale` (mock engines by default: their prefill and decode timings
follow the latency model of `engine.mock`, so the run shows the scheduler and the autoscaler,
not the 2-core CPU), drives it through quiet / burst / quiet phases of Poisson arrivals, samples
/metrics for the pool sizes, and writes the run's JSON and a plot: engines per pool and the
share of requests meeting both SLO targets per 5 s bucket, with each scaling decision.

    .venv/bin/python benchmarks/autoscale_burst.py --out benchmarks/results/autoscale/DATE

With `--engine vllm --model DIR` it runs real vLLM engines instead (a GPU host; DIR holds a
config.json and tokenizer, weights are vLLM's `dummy`), starting from 1P1D with every other
`pdserve serve` flag passed through `--serve-arg` (bounds, `--max-gpus`, SLO); see
benchmarks/gpu/x4.sh for the 4-GPU ramp of issue 7.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
from pathlib import Path

from pdserve.testing import save_tiny_model
from pdserve.testing.burst import Phase, run_phases
from pdserve.testing.server import start_server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--ttft-ms", type=float, default=1500)
    p.add_argument("--tpot-ms", type=float, default=150)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--phases", default="2:20:quiet,8:40:burst,1:60:after",
                   help="rate:seconds:name,... (requests/s)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra `pdserve serve` argument (repeat)")
    p.add_argument("--engine", choices=("mock", "vllm"), default="mock")
    p.add_argument("--model", type=Path, help="--engine vllm: config.json + tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=500, help="prompt token ids are below this")
    args = p.parse_args()
    if args.engine == "vllm" and args.model is None:
        p.error("--engine vllm needs --model")
    phases = [Phase(float(r), float(s), n) for r, s, n in
              (item.split(":") for item in args.phases.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--autoscale",
                  "--ttft-ms", str(args.ttft_ms), "--tpot-ms", str(args.tpot_ms),
                  "--served-model-name", "tiny"]
        if args.engine == "mock":
            model_dir = save_tiny_model(Path(tmp) / "tiny")
            serve_args = [
                "--engine", "mock", "--model", str(model_dir), *common,
                "--max-prefill", "4", "--max-decode", "4",
                "--set", "engine.mock.prefill_tokens_per_s=5000",
                "--set", "engine.mock.decode_step_s=0.03",
                "--set", "engine.mock.decode_step_per_seq_s=0.0005",
                "--set", "engine.mock.max_model_len=4096",
                "--set", "pools.prefill.num_cpus=0.1", "--set", "pools.decode.num_cpus=0.1",
                "--set", "autoscale.interval_s=2", "--set", "autoscale.upscale_cooldown_s=6",
                "--set", "autoscale.downscale_cooldown_s=10", "--set", "autoscale.downscale_intervals=3",
                "--set", "scheduler.window_s=10", "--set", "scheduler.admit_ttft_factor=20",
                *args.serve_arg]
        else:  # real engines: bounds, budget, engine and autoscale settings from --serve-arg
            serve_args = ["--model", str(args.model), *common, *args.serve_arg]
        server = start_server(serve_args, args.out / "pdserve.log", start_timeout_s=900)
        try:
            run = asyncio.run(run_phases(server.base_url, "tiny", phases, args.prompt_tokens,
                                         args.output_tokens, ("prefill", "decode"), settle_s=5,
                                         vocab_size=args.vocab_size))
        finally:
            server.stop()
    ttft_s, tpot_s = args.ttft_ms / 1000, args.tpot_ms / 1000
    summary = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()} " + (
            "(mock engines: latency model, no model)" if args.engine == "mock" else _gpus()),
        "serve_args": serve_args[4:] if len(serve_args) > 4 else serve_args,
        "slo": {"ttft_s": ttft_s, "tpot_s": tpot_s},
        "phases": [{"rate": p.rate, "seconds": p.seconds, "name": p.name} for p in phases],
        "requests": len(run.outcomes),
        "failed": sum(o.status != 200 for o in run.outcomes),
        "attainment": {ph.name: round(run.attainment(ttft_s, tpot_s, ph.name), 3) for ph in phases}
        | {"all": round(run.attainment(ttft_s, tpot_s), 3)},
        "max_pool": {pool: max((r[pool] or 0) for r in run.pools) for pool in ("prefill", "decode")},
        "final_pool": {pool: run.pools[-1][pool] for pool in ("prefill", "decode")},
        "decisions": [d for d in run.decisions if d["direction"] != "none"],
        "pool_timeline": _changes(run.pools),
    }
    (args.out / "run.json").write_text(run.to_json())
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(run, phases, ttft_s, tpot_s, args.out / "burst.png", args.out / "pdserve.log")
    print(json.dumps({k: summary[k] for k in ("requests", "failed", "attainment", "max_pool",
                                               "final_pool")}, indent=1))
    return 0


def _changes(samples: list[dict]) -> list[dict]:
    """The samples where any pool's ready/starting/draining count changed (the chosen ratio)."""
    keys = [k for k in (samples[0] if samples else {}) if k != "t"]
    out, last = [], None
    for row in samples:
        now = tuple(row[k] for k in keys)
        if now != last:
            out.append(row)
            last = now
    return out


def _gpus() -> str:
    import subprocess

    try:
        return "; ".join(subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
            text=True, check=True).stdout.split("\n")[:-1])
    except (OSError, subprocess.CalledProcessError):
        return "no GPU"


def plot(run, phases, ttft_s, tpot_s, path: Path, log: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t = [r["t"] for r in run.pools]
    for pool, style in (("prefill", "-"), ("decode", "--")):
        ax1.step(t, [r[pool] or 0 for r in run.pools], style, where="post", label=f"{pool} engines")
    start = 0.0
    for ph in phases:
        ax1.axvspan(start, start + ph.seconds, alpha=0.08 if ph.rate > 2 else 0.0, color="red")
        ax1.text(start + 1, 0.2, f"{ph.name} {ph.rate:g} req/s", fontsize=8)
        start += ph.seconds
    ax1.set_ylabel("engines")
    ax1.legend(loc="upper right")
    bucket = 5.0
    rows: dict[int, list[bool]] = {}
    for o in run.outcomes:
        ok = (o.status == 200 and o.ttft_s is not None and o.ttft_s <= ttft_s
              and (o.tpot_s is None or o.tpot_s <= tpot_s))
        rows.setdefault(int(o.sent_s // bucket), []).append(ok)
    xs = sorted(rows)
    ax2.bar([x * bucket for x in xs], [sum(rows[x]) / len(rows[x]) for x in xs], width=bucket * 0.9,
            align="edge", color="tab:green")
    ax2.axhline(0.9, color="gray", linestyle=":")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel(f"SLO attainment\n(TTFT<={ttft_s:g}s, TPOT<={tpot_s:g}s)")
    ax2.set_xlabel("seconds (by request send time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
