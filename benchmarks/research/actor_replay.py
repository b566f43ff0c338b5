"""Replay one engine's requests, as its engine actor took them, through one simulated engine.

A GPU arm's trace (`benchmarks/gpu/proof.sh`'s `ARM-raw.tar.xz`, recorded with
`PROOF_STEP_TRACE`, sessions 13 on) has each engine actor's request trace
(`{replica}.requests.jsonl`: when the actor took each request and when its first output left the
engine). This feeds those submission times, run by run, to a `SimEngine` on a profile and
compares the time to the first output, measured at the actor against simulated:
the engine model alone, without the frontend, Ray or the routing. With the engine's step trace
the means split: measured, to vLLM's scheduler (`in`: input processing and its input queue), to
the step that began the prefill (`wait`), that step as the trace times it, and back to the
actor (`out`); simulated, to that step and from its start to the first token. Under async
scheduling a step's recorded start can come after its work began on the GPU (the step before it
keeps its outputs while the engine core launches a prefill: pdserve.sim.calibration.step_fit), so
`wait` holds some of the prefill and `step` less of it. A colocated engine's request
is a full leg; a disaggregated prefill engine's (`prefill-N`) a prefill leg that its decode
engine pulls at once. Every request is the arm's shape (`--prompt`, `--output`).

    D=benchmarks/results/gpu/2026-11-28-h100-x2-s14
    .venv/bin/python benchmarks/research/actor_replay.py $D/colocated-raw.tar.xz \\
        --profile $D/profile-1/profile-handoff.json --replica colocated-0

Session 14 (2 x H100, 2048-token prompts): the colocated engines' requests came out within
0.3-3.1 ms of the simulated at 4-8 req/s per engine (means), while the prefill engine's took
8-19 ms longer than the simulated at 8-16 req/s (two runs): the prefill engine's actor-side time
(vLLM's input processing, its input queue, the output's way back to the actor) is not in the
simulated engine, and the colocated engine's simulated steps and waits carry about as much of
their own. The profile's response path (a lone request's TTFT less the engine's own time)
carries that actor-side time too, so colocated TTFTs come out high by about that much.

The replay is pdserve.sim.validation.actor_replay.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.sim.calibration.trace_reader import read_requests, read_steps, unpack_trace  # noqa: E402
from pdserve.sim.engine_profile import EngineProfile  # noqa: E402
from pdserve.sim.validation.actor_replay import STATS, compare, step_starts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="an arm's ARM-raw.tar.xz, or its unpacked folder")
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--replica", default="colocated-0", help="the engine (colocated-N, prefill-N)")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--output", type=int, default=256)
    args = parser.parse_args()
    profile = EngineProfile.load(args.profile)
    with tempfile.TemporaryDirectory() as tmp:
        folder = unpack_trace(args.trace, tmp)[1]
        requests = read_requests(folder)
        steps = read_steps(folder)
    if args.replica not in requests:
        parser.error(f"no request trace for {args.replica} (have: {', '.join(sorted(requests)) or 'none'})")
    rows = compare(profile, requests[args.replica], args.prompt, args.output,
                   args.replica.startswith("prefill-"), step_starts(steps.get(args.replica, [])))
    print(f"{args.replica}: submission to first output at the actor, ms (measured / simulated); "
          "the means split: measured in + wait + step + out, simulated wait + step")
    print("| run | requests | req/s | mean | p50 | p90 | measured split | simulated split |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        cells = " | ".join(f"{r[f'measured_{k}']:.1f} / {r[f'sim_{k}']:.1f}" for k in STATS)
        split = (f"{r['measured_in']:.1f} + {r['measured_wait']:.1f} + {r['measured_step']:.1f} + "
                 f"{r['measured_out']:.1f} | {r['sim_wait']:.1f} + {r['sim_step']:.1f}"
                 if "sim_wait" in r else " | ")
        print(f"| {i} | {r['requests']} | {r['rate']:.1f} | {cells} | {split} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
