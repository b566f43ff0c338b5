"""Replay a recorded autoscaler ramp (`proof.sh ... ramp` on a GPU host) in the simulator.

The simulator runs pdserve's own routing, admission and autoscaling code on virtual time, so a
replay with the ramp's very arrivals, pool bounds, GPU budget, SLO and autoscale settings shows
what that code does against a model of the engines, and whether a change to it changes the
outcome. Each 10 s bucket: requests admitted and refused, TTFT and TPOT p90 of the admitted,
serving engines per pool; each phase: attainment of both targets (refused requests count as
misses, as in the GPU run); every scaling decision with its reason.

    .venv/bin/python benchmarks/research/sim_ramp_replay.py \\
        --run benchmarks/results/gpu/2026-11-27-h100-x4/ramp-run.json.xz \\
        --summary benchmarks/results/gpu/2026-11-27-h100-x4/ramp-summary.json \\
        --profile benchmarks/results/gpu/2026-11-26-x4/profile.json --startup-s 54 \\
        --out benchmarks/results/sim/2026-11-27-ramp-replay/replay.json

Nothing is fitted to the GPU run: the engine profile is the H100 one recorded by
`pdserve sim profile`, the start-up delay is what the GPU run's engines took to join under
load. The production router is seeded with the engine's own profile here (the GPU run seeded it
with the H200 calibration); both are refitted online from what the requests show.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from pdserve.autoscaler.controller import scaling_policy_from_config
from pdserve.autoscaler.policy import PoolBounds
from pdserve.config.schema import AutoscaleConfig
from pdserve.slo import SloTargets
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.runner import SimConfig, Topology, simulate
from pdserve.sim.workload import Workload

BUCKET_S = 10.0


def _load(path: Path) -> dict:
    raw = lzma.open(path).read() if path.suffix == ".xz" else path.read_bytes()
    return json.loads(raw)


def _serve_settings(summary: dict) -> dict[str, str]:
    """`--set key=value` and bound flags of the GPU run's `pdserve serve` command line."""
    args, out = summary["serve_args"], {}
    for i, arg in enumerate(args[:-1]):
        if arg == "--set":
            key, _, value = args[i + 1].partition("=")
            out[key] = value
        elif arg in ("--max-prefill", "--max-decode", "--max-gpus", "--ttft-ms", "--tpot-ms"):
            out[arg.lstrip("-")] = args[i + 1]
    return out


def _prompt_tokens(summary: dict) -> int:
    """`--prompt-tokens` of the GPU run's `autoscale_burst.py` command line."""
    args = shlex.split(summary["command"])
    return int(args[args.index("--prompt-tokens") + 1])


def _p90(values: list[float]) -> float | None:
    return round(float(np.percentile(values, 90)) * 1e3, 1) if values else None


def _buckets() -> defaultdict[int, dict]:
    return defaultdict(lambda: {"admitted": 0, "refused": 0, "ttft": [], "tpot": []})


def _rows(buckets: dict[int, dict]) -> list[dict]:
    return [{"t": k * BUCKET_S, "admitted": b["admitted"], "refused": b["refused"],
             "ttft_p90_ms": _p90(b["ttft"]), "tpot_p90_ms": _p90(b["tpot"])}
            for k, b in sorted(buckets.items())]


def replay(run: dict, summary: dict, profile: EngineProfile) -> dict:
    settings = _serve_settings(summary)
    outcomes = sorted(run["outcomes"], key=lambda o: o["sent_s"])
    phases, edges, t = summary["phases"], [], 0.0
    for ph in phases:
        edges.append((t, t + ph["seconds"], ph["name"]))
        t += ph["seconds"]
    arrivals = np.array([o["sent_s"] for o in outcomes])
    prompt = _prompt_tokens(summary)
    output = max(o["output_tokens"] for o in outcomes)
    workload = Workload(arrivals, np.full(len(arrivals), prompt), np.full(len(arrivals), output),
                        name="gpu ramp arrivals")
    auto = AutoscaleConfig(**{k.split(".", 1)[1]: float(v) if "." in v else int(v)
                              for k, v in settings.items() if k.startswith("autoscale.")})
    slo = SloTargets.from_s(summary["slo"]["ttft_s"], summary["slo"]["tpot_s"])
    topology = Topology.disaggregated(
        1, 1, PoolBounds(1, int(settings["max-prefill"])), PoolBounds(1, int(settings["max-decode"])))
    config = SimConfig(profile, topology, slo, scaling=scaling_policy_from_config(auto),
                       autoscale_interval_s=auto.interval_s, sample_interval_s=1.0,
                       window_s=float(settings.get("scheduler.window_s", 30)),
                       record_itls=False, max_gpus=int(settings["max-gpus"]))
    result = simulate(config, workload)
    response = profile.response_of

    def phase_of(t: float) -> str:
        return next((name for lo, hi, name in edges if lo <= t < hi), edges[-1][2])

    buckets = _buckets()
    met: dict[str, list[bool]] = defaultdict(list)
    for req in result.requests:
        b = buckets[int(req.arrival // BUCKET_S)]
        ok = False
        if req.error:
            b["refused"] += 1
        else:
            b["admitted"] += 1
            ttft = req.first_token + response(req.prompt) - req.arrival
            tpot = (req.finish - req.first_token) / (req.output - 1) if req.output > 1 else 0.0
            b["ttft"].append(ttft)
            b["tpot"].append(tpot)
            ok = ttft <= slo.ttft_s and tpot <= slo.tpot_s
        met[phase_of(req.arrival)].append(ok)
    pools = defaultdict(dict)
    for s in result.samples:
        pools[int(s.t // BUCKET_S)][s.pool] = s.ready
    rows = [{**row, "prefill": pools[int(row["t"] // BUCKET_S)].get("prefill"),
             "decode": pools[int(row["t"] // BUCKET_S)].get("decode")} for row in _rows(buckets)]
    return {
        "requests": len(result.requests), "refused": sum(r["refused"] for r in rows),
        "rejected_by_reason": result.rejected,
        "attainment": {name: round(float(np.mean(v)), 3) for name, v in met.items()},
        "decisions": [{"t": round(t, 1), "pool": d.pool, "from": d.current, "to": d.target,
                       "reason": d.reason, "detail": d.detail} for t, d in result.decisions],
        "buckets": rows,
    }


def gpu_buckets(run: dict) -> list[dict]:
    """The GPU run's own per-bucket counts, for the side-by-side table."""
    buckets = _buckets()
    for o in run["outcomes"]:
        b = buckets[int(o["sent_s"] // BUCKET_S)]
        if o["status"] == 200:
            b["admitted"] += 1
            b["ttft"].append(o["ttft_s"])
            if o["tpot_s"]:
                b["tpot"].append(o["tpot_s"])
        else:
            b["refused"] += 1
    return _rows(buckets)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True, help="ramp-run.json(.xz) of the GPU run")
    p.add_argument("--summary", type=Path, required=True, help="ramp-summary.json of the GPU run")
    p.add_argument("--profile", type=Path, required=True, help="engine profile JSON")
    p.add_argument("--startup-s", type=float, help="engine start-up delay (default: the profile's)")
    p.add_argument("--decode-ctx-s-per-token", type=float,
                   help="decode step cost per context token of the batch (default: the profile's)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    run, summary = _load(args.run), json.loads(args.summary.read_text())
    overrides = {k: v for k, v in (("startup_s", args.startup_s),
                                   ("decode_ctx_s_per_token", args.decode_ctx_s_per_token)) if v is not None}
    profile = EngineProfile.load(args.profile, **overrides)
    sim = replay(run, summary, profile)
    gpu = gpu_buckets(run)
    out = {"command": " ".join([sys.executable, *sys.argv]), "profile": str(args.profile),
           "startup_s": profile.startup_s, "decode_ctx_s_per_token": profile.decode_ctx_s_per_token,
           "gpu": {"attainment": summary["attainment"],
           "decisions": summary["decisions"], "buckets": gpu}, "sim": sim}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print("| t (s) | GPU admitted / refused | sim admitted / refused | GPU TTFT p90 | sim TTFT p90 "
          "| GPU TPOT p90 | sim TPOT p90 | sim P/D |")
    print("|---|---|---|---|---|---|---|---|")
    by_t = {r["t"]: r for r in sim["buckets"]}
    for g in gpu:
        s = by_t.get(g["t"], {})
        print(f"| {g['t']:.0f} | {g['admitted']} / {g['refused']} | {s.get('admitted')} / "
              f"{s.get('refused')} | {g['ttft_p90_ms']} | {s.get('ttft_p90_ms')} | "
              f"{g['tpot_p90_ms']} | {s.get('tpot_p90_ms')} | {s.get('prefill')}/{s.get('decode')} |")
    print("attainment GPU:", summary["attainment"])
    print("attainment sim:", sim["attainment"], "refused:", sim["rejected_by_reason"])
    for d in sim["decisions"]:
        print(f"  sim t={d['t']:.0f}s {d['pool']} {d['from']}->{d['to']} {d['reason']}: {d['detail']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
