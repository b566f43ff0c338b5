"""Every held-out validation of a CPU profile directory with repeats, and their scores.

A directory from `sim_profile_cpu.py --bench-repeats R --step-trace` holds, per arm, R repeats of
the same rates on the same arrivals and the engines' step traces. For every mode (no noise; step
noise, the median of 21 seeds; engines on one host; both) this runs `sim_validate.py` with the
step model fitted on some repeats and every other repeat predicted:

- `pair`: fitted on repeat F, predicting each T != F (R (R - 1) validations per arm), scored per
  F against each target run and against the mean of the repeats not fitted on (with R = 2 that
  is the one target; the mean of both repeats instead, as session 14 scored it);
- `loo` (R >= 3): fitted on all repeats but T, predicting T.

Writes OUT/MODE/SHORT-rT-fit-on-{rF,others}/ (sim_validate.py's), OUT/MODE/score-{pair,loo}.md
(`sim_validate_score.py`'s tables) and OUT/summary.md: cells within 15% per mode and protocol.
The plan and the summary are pdserve.sim.validation.repeats.

    .venv/bin/python benchmarks/research/sim_validate_repeats.py --profiles benchmarks/results/sim/cpu-profile-16 \\
        --repeats 3 --out benchmarks/results/sim/2026-11-28-s16-validation/cpu-16
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.sim.validation.repeats import plan, summarize


def validate(job: tuple[Path, list[str]]) -> None:
    where, args = job
    script = os.path.relpath(Path(__file__).parent / "sim_validate.py")  # as the command records it
    subprocess.run([sys.executable, script, *args],
                   check=True, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, required=True, help="sim_profile_cpu.py's --out")
    parser.add_argument("--repeats", type=int, required=True, help="its --bench-repeats (2 or more)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2, help="validations run at once")
    parser.add_argument("--score-only", action="store_true", help="score what OUT holds")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats: two or more (one repeat has no other to predict)")
    if not args.score_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(validate, plan(args.profiles, args.repeats, args.out)))
    summary = summarize(args.out, args.repeats)
    (args.out / "summary.md").write_text(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
