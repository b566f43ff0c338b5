"""pdserve.sim.validation.repeats: every validation holds its target out, and the summary
counts what the scores count."""

import json

import pytest

from pdserve.sim.validation import repeats

pytestmark = pytest.mark.unit


def flag(args, name):
    """The values after `name` up to the next flag."""
    i = args.index(name) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def test_no_validation_fits_on_the_repeat_it_predicts(tmp_path):
    jobs = repeats.plan(tmp_path / "p", 3, tmp_path / "out")
    # 4 modes x 2 arms x (6 pairs + 3 leave-one-out)
    assert len(jobs) == 72 and len({where for where, _ in jobs}) == 72
    for where, args in jobs:
        measured, fitted = flag(args, "--measured"), flag(args, "--fit-run")
        assert len(measured) == 3 and not set(measured) & set(fitted)
        assert len(fitted) == (6 if where.name.endswith("others") else 3)
        assert len(flag(args, "--trace-runs")) == 9
        assert ("--shared-host" in args) == ("shared" in where.parent.name)
        assert ("--noise-seeds" in args) == where.parent.name.startswith("noise")


def test_the_summary_counts_each_cell_of_each_validation(tmp_path):
    def validation(measured, sim, goodput):
        row = {"arm": "a", "rate": 0.5, "metrics": {
            "p90_ttft_ms": {"measured": measured, "sim": sim, "error_pct": (sim / measured - 1) * 100},
            "request_goodput": {"measured": goodput, "sim": 0.5, "error_pct": (0.5 / goodput - 1) * 100}}}
        return {"rows": [row]}

    for mode in repeats.MODES:
        for short, _ in repeats.ARMS.values():
            # the first within 15% (+10%), the second not (+25%); against their mean (110), 0% and +36%
            for t, args in ((1, (100.0, 110.0, 0.5)), (2, (120.0, 150.0, 0.52))):
                where = tmp_path / mode / f"{short}-r{t}-fit-on-r{3 - t}"
                where.mkdir(parents=True)
                (where / "validation.json").write_text(json.dumps(validation(*args)))
    summary = repeats.summarize(tmp_path, 2)
    rows = [line for line in summary.splitlines() if line.startswith("| no-noise")]
    # per arm 1 of 2 latency cells within 15%, goodput 2 of 2; against the means the same
    assert rows == ["| no-noise | pair | 1/2 | 1/2 | 2/4 | 4/4 | 2/4 | 4/4 |"]
    assert (tmp_path / "noise" / "score-pair.md").exists()
