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

    .venv/bin/python benchmarks/research/sim_validate_repeats.py --profiles benchmarks/results/sim/cpu-profile-16 \\
        --repeats 3 --out benchmarks/results/sim/2026-11-28-s16-validation/cpu-16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_validate_score import Score, means, score, spreads, table  # noqa: E402

ARMS = {"disaggregated-pinned": ("1p1d-pinned", ("0.25", "0.375", "0.5")),
        "colocated": ("colocated", ("0.25", "0.5", "0.75"))}
MODES = {"no-noise": [], "noise": ["--noise-seeds", "21"], "shared": ["--shared-host"],
         "noise-shared": ["--noise-seeds", "21", "--shared-host"]}
TOLERANCE = 15.0
TOTALS = ("within", "total", "goodput_within", "goodput_total", "mean_within", "mean_total",
          "mean_goodput_within", "mean_goodput_total")


def runs(profiles: Path, arm: str, repeat: int) -> list[str]:
    return [str(profiles / f"{arm}-bench-rate{rate}-r{repeat}.json") for rate in ARMS[arm][1]]


def plan(profiles: Path, repeats: int, out: Path) -> list[tuple[Path, list[str]]]:
    """(out dir, sim_validate.py arguments) of every validation."""
    jobs = []
    every = range(1, repeats + 1)
    for mode, flags in MODES.items():
        for arm, (short, _) in ARMS.items():
            fits = [(t, [f], f"r{f}") for t in every for f in every if f != t]
            if repeats > 2:
                fits += [(t, [f for f in every if f != t], "others") for t in every]
            for target, fitted, name in fits:
                where = out / mode / f"{short}-r{target}-fit-on-{name}"
                args = ["--profile", str(profiles / f"{arm}.json"), "--arm", arm,
                        "--measured", *runs(profiles, arm, target),
                        "--fit-trace", str(profiles / f"steps-{arm}"),
                        "--trace-runs", *(p for r in every for p in runs(profiles, arm, r)),
                        "--fit-run", *(p for f in fitted for p in runs(profiles, arm, f)),
                        "--out", str(where), *flags]
                jobs.append((where, args))
    return jobs


def validate(job: tuple[Path, list[str]]) -> None:
    where, args = job
    script = os.path.relpath(Path(__file__).parent / "sim_validate.py")  # as the command records it
    subprocess.run([sys.executable, script, *args],
                   check=True, capture_output=True)


def groups(out: Path, mode: str, short: str, repeats: int, protocol: str) -> list[list[Path]]:
    """The validations scored together: one group per fitted repeat (pair), or all (loo)."""
    every = range(1, repeats + 1)
    if protocol == "loo":
        return [[out / mode / f"{short}-r{t}-fit-on-others" for t in every]]
    if repeats == 2:
        return [[out / mode / f"{short}-r{t}-fit-on-r{3 - t}" for t in every]]
    return [[out / mode / f"{short}-r{t}-fit-on-r{f}" for t in every if t != f] for f in every]


def summarize(out: Path, repeats: int) -> str:
    lines = ["| mode | protocol | 1P1D | colocated | all | goodput | against the mean | goodput |",
             "|" + "---|" * 8]
    for mode in MODES:
        for protocol in ("pair", "loo") if repeats > 2 else ("pair",):
            per_arm, tables = {}, []
            for short, _ in ARMS.values():
                total = Score()
                for group in groups(out, mode, short, repeats, protocol):
                    found = [json.loads((p / "validation.json").read_text()) for p in group]
                    spread = spreads(found)
                    mean = means(found) if protocol == "pair" else None
                    rows = [(p.name, score(v, spread, TOLERANCE, mean)) for p, v in zip(group, found)]
                    for _, s in rows:
                        for key in TOTALS:
                            setattr(total, key, getattr(total, key) + getattr(s, key))
                    tables.append(table(rows, TOLERANCE, True, protocol == "pair"))
                per_arm[short] = total
            (out / mode / f"score-{protocol}.md").write_text("\n\n".join(tables) + "\n")
            a, c = per_arm.values()

            def of(within: str, total: str) -> str:
                return f"{getattr(a, within) + getattr(c, within)}/{getattr(a, total) + getattr(c, total)}"

            means_ = ([of("mean_within", "mean_total"), of("mean_goodput_within", "mean_goodput_total")]
                      if protocol == "pair" else ["-", "-"])
            cols = [mode, protocol, f"{a.within}/{a.total}", f"{c.within}/{c.total}",
                    of("within", "total"), of("goodput_within", "goodput_total"), *means_]
            lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


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
