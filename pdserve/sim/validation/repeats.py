"""Every held-out validation of a CPU profile folder with repeats: the plan, and the summary.

A folder from `benchmarks/research/sim_profile_cpu.py --bench-repeats R --step-trace` holds, per
arm, R repeats of the same rates on the same arrivals and the engines' step traces. For every mode
(no noise; step noise, the median of 21 seeds; engines on one host; both) the plan validates with
the step model fitted on some repeats and every other repeat predicted:

- `pair`: fitted on repeat F, predicting each T != F (R (R - 1) validations per arm), scored per
  F against each target run and against the mean of the repeats not fitted on (with R = 2 that
  is the one target; the mean of both repeats instead, as session 14 scored it);
- `loo` (R >= 3): fitted on all repeats but T, predicting T.

Validations go to OUT/MODE/SHORT-rT-fit-on-{rF,others}/; `summarize` writes
OUT/MODE/score-{pair,loo}.md (`score.table`) and returns the summary: cells within 15% per mode
and protocol. `benchmarks/research/sim_validate_repeats.py` runs the plan.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.sim.validation.score import Score, means, score, spreads, table

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
