"""Where a served request's TTFT goes, from a GPU arm's step trace and its bench results.

Each request of each rate is matched to the step that started it and its TTFT split into the way
in, the wait, the step and the way out (at the engine actor too, where the actors wrote their
side); pdserve.bench.ttft_breakdown says how. Also prints the look-ahead delays
(`pdserve.sim.calibration.step_fit.lookahead_delays`) the traces show.

    .venv/bin/python benchmarks/research/ttft_breakdown.py \\
        benchmarks/results/gpu/2026-11-27-h100-x2-s13/disagg-raw.tar.xz

A CPU profile's folder works too, with its runs named in the order they ran (`--runs`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.bench.ttft_breakdown import actor_rows, breakdown, starts_of  # noqa: E402
from pdserve.sim.calibration.step_fit import lookahead_delays  # noqa: E402
from pdserve.sim.calibration.trace_reader import read_requests, read_steps, unpack_trace  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="an arm's ARM-raw.tar.xz, or the folder it unpacks to")
    parser.add_argument("--runs", type=Path, nargs="*",
                        help="bench result JSONs, in the order they ran (default: the raw's "
                        "rate-R.json by rate, the order proof.py runs them)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, steps_dir = unpack_trace(args.raw, tmp)
        traces = read_steps(steps_dir, 0.0)
        runs = args.runs or sorted(root.rglob("rate-*.json"),
                                   key=lambda p: float(p.stem.split("-", 1)[1]))
        rows = starts_of(traces)
        actors = actor_rows(read_requests(steps_dir)) or None
        if actors is not None and len(actors) != len(rows):
            print(f"note: {len(actors)} actor rows against {len(rows)} arrivals: not split at the actor")
            actors = None
        columns = ["in", "wait", "step", "out"]
        if actors is not None:
            columns += ["to actor", "actor in", "actor out", "from actor"]
        print("| run | requests | " + " | ".join(f"{c} ms" for c in columns) + " | TTFT mean ms |")
        print("|---|---|" + "---|" * len(columns) + "---|")
        after = 0
        for path in runs:
            b = breakdown(json.loads(path.read_text()), rows, after, actors)
            after = b["end"]
            cells = " | ".join(f"{b[c]:.1f}" for c in columns)
            print(f"| {path.stem} | {b['requests']} | {cells} | {b['ttft']:.1f} |")
        delays = np.array(lookahead_delays(list(traces.values()))) * 1e3
        if len(delays):
            print(f"\nlook-ahead delays after a fresh step: n={len(delays)}, ms p10/50/90 "
                  f"{np.percentile(delays, 10):.1f}/{np.median(delays):.1f}/{np.percentile(delays, 90):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
