"""benchmarks/results/ holds recorded runs, not raw data (issue 27).

A run folder is `benchmarks/results/<kind>/<run>/`: it has a README.md (what, when, on what
hardware, the exact commands, the table), or is named in its kind's README.md (the simulator's
runs are all described in `sim/README.md`), and holds at most ~1 MiB of small summaries.
Archives, traces and logs stay out of git: a README names the commit where they can be read."""

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RUN_LIMIT_BYTES = 1 << 20  # 1 MiB of tracked files per run folder
LOOSE_LIMIT_BYTES = 256 << 10  # a file lying in a kind folder itself (sim/README.md, sim/speed.json)
RAW_SUFFIXES = (".tar.xz", ".tar.gz", ".tgz", ".tar", ".xz", ".gz", ".zst", ".bz2", ".zip",
                ".jsonl", ".log", ".cdf.png", ".npy", ".npz", ".pt", ".nsys-rep", ".sqlite")
RAW_FOLDERS = {"logs"}


def tracked_files() -> list[Path]:
    """The files under benchmarks/results that git tracks (those present in the working tree);
    every file there when this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None:
        paths = [ROOT / os.fsdecode(p) for p in out.split(b"\0") if p]
        return [p for p in paths if p.is_file()]
    return [p for p in RESULTS.rglob("*") if p.is_file()]


FILES = tracked_files()


def run_folders() -> dict[Path, list[Path]]:
    runs: dict[Path, list[Path]] = {}
    for path in FILES:
        parts = path.relative_to(RESULTS).parts
        if len(parts) >= 3:
            runs.setdefault(RESULTS / parts[0] / parts[1], []).append(path)
    return runs


RUNS = run_folders()


def test_there_are_recorded_runs():
    assert RESULTS.is_dir() and RUNS, f"no run folders found under {RESULTS}"


def test_no_raw_archive_trace_or_log_is_tracked():
    raw = [str(p.relative_to(ROOT)) for p in FILES
           if p.name.endswith(RAW_SUFFIXES) or RAW_FOLDERS & set(p.relative_to(RESULTS).parts[:-1])]
    assert not raw, ("raw data tracked under benchmarks/results (keep a README and small summaries, "
                     f"name the commit where the raw data can be read): {raw[:20]}")


def test_every_run_folder_is_at_most_1_mib():
    big = {str(folder.relative_to(ROOT)): total for folder, files in RUNS.items()
           if (total := sum(p.stat().st_size for p in files)) > RUN_LIMIT_BYTES}
    assert not big, f"run folders over {RUN_LIMIT_BYTES} bytes of tracked files: {big}"


def test_files_beside_the_run_folders_are_small():
    loose = {str(p.relative_to(ROOT)): p.stat().st_size for p in FILES
             if len(p.relative_to(RESULTS).parts) <= 2 and p.stat().st_size > LOOSE_LIMIT_BYTES}
    assert not loose, f"files outside a run folder over {LOOSE_LIMIT_BYTES} bytes: {loose}"


def named_in(readme: Path, run: str) -> bool:
    if not readme.is_file():
        return False
    return re.search(rf"(?<![\w.-]){re.escape(run)}(?![\w-])", readme.read_text()) is not None


def test_every_run_folder_has_a_readme():
    missing = [str(folder.relative_to(ROOT)) for folder in RUNS
               if not (folder / "README.md").is_file()
               and not named_in(folder.parent / "README.md", folder.name)]
    assert not missing, ("run folders with no README.md, and not described in their kind's "
                         f"README.md: {missing}")
