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
keeps its outputs while the engine core launches a prefill: pdserve.engine.step_trace), so
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
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.engine.step_trace import read_requests, read_steps, unpack_trace  # noqa: E402
from pdserve.sim.engine import SimEngine, SimRequest  # noqa: E402
from pdserve.sim.engine_profile import EngineProfile  # noqa: E402
from pdserve.sim.events import EventQueue  # noqa: E402

GAP_S = 2.0  # a pause this long between submissions separates two runs (rates) of the arm


def runs_of(submitted: np.ndarray) -> list[np.ndarray]:
    """Indices of each run: submissions split where they pause `GAP_S` or more."""
    cuts = np.where(np.diff(submitted) >= GAP_S)[0] + 1
    return np.split(np.arange(len(submitted)), cuts)


def replay(profile: EngineProfile, submitted: np.ndarray, prompt: int, output: int,
           prefill_leg: bool) -> tuple[np.ndarray, np.ndarray]:
    """Seconds from each submission to the simulated engine's first token, and to the start of
    the step that began its prefill; one engine alone."""
    queue, first = EventQueue(), {}
    requests = []

    def on_first(req: SimRequest, engine: SimEngine) -> None:
        first[req.index] = queue.now
        if prefill_leg:  # pulled at once by a decode engine that is not simulated here
            engine.release_prefill(req)

    engine = SimEngine("replay", "prefill" if prefill_leg else "colocated", profile, queue, on_first,
                       lambda req, e: e.release(req), lambda e: None, lambda e, s: None,
                       lambda req, e: None)
    t0 = float(submitted[0])
    for i, t in enumerate(submitted):
        req = SimRequest(i, float(t) - t0, prompt, output)
        if prefill_leg:
            req.leg = "prefill"
        requests.append(req)
        queue.schedule(float(t) - t0, engine.submit_prefill, req)
    queue.run()
    arrival = np.array([r.arrival for r in requests])
    return (np.array([first[r.index] for r in requests]) - arrival,
            np.array([r.prefill_start for r in requests]) - arrival)


def compare(profile: EngineProfile, rows: list[tuple[float, float]], prompt: int, output: int,
            prefill_leg: bool, starts: list[tuple[float, float, float]] | None = None,
            min_requests: int = 20) -> list[dict[str, float]]:
    """Per run of at least `min_requests`: measured and simulated submission-to-first (ms).
    With `starts` (the engine's step trace: (arrived at vLLM's scheduler, start and end of the
    step that began its prefill) per request, as many as `rows`), the means split too: measured
    `in` (to the scheduler), `wait`, `step`, `out` (to the actor's first output); simulated
    `wait` (to its prefill step) and `step` (to its first token)."""
    order = np.argsort([r[0] for r in rows], kind="stable")
    data = np.array(rows, dtype=float)[order]
    split = None
    if starts is not None and len(starts) == len(rows):
        split = np.array(sorted(starts), dtype=float)  # FCFS: arrivals in the actor's order
    out = []
    for run in runs_of(data[:, 0]):
        if len(run) < min_requests:
            continue
        submitted, first = data[run, 0], data[run, 1]
        measured = (first - submitted) * 1e3
        to_first, to_step = replay(profile, submitted, prompt, output, prefill_leg)
        simulated = to_first * 1e3
        span = float(submitted[-1] - submitted[0])
        row = {"requests": len(run), "rate": len(run) / span if span > 0 else float("nan"),
               **{f"measured_{k}": float(f(measured)) for k, f in STATS.items()},
               **{f"sim_{k}": float(f(simulated)) for k, f in STATS.items()}}
        if split is not None:
            arrived, start, end = split[run, 0], split[run, 1], split[run, 2]
            row.update({"measured_in": float(np.mean(arrived - submitted) * 1e3),
                        "measured_wait": float(np.mean(start - arrived) * 1e3),
                        "measured_step": float(np.mean(end - start) * 1e3),
                        "measured_out": float(np.mean(first - end) * 1e3),
                        "sim_wait": float(np.mean(to_step) * 1e3),
                        "sim_step": float(np.mean(to_first - to_step) * 1e3)})
        out.append(row)
    return out


def step_starts(steps) -> list[tuple[float, float, float]]:
    """(arrived, step start, step end) of every request an engine's steps started."""
    return [(a, s.t - (s.busy_s or 0.0), s.t) for s in steps for a in s.arrived or ()]


STATS = {"mean": np.mean, "p50": np.median, "p90": lambda x: np.percentile(x, 90)}


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
