"""Reading recorded step and request traces (the format: pdserve.engine.step_trace).

A trace is a directory of `{replica_id}.steps.jsonl` files (and, from 2026-11-28 on, the engine
actors' `{replica_id}.requests.jsonl`), or such a directory packed as proof.sh leaves it
(`unpack_trace`). Readers return plain values keyed by replica id.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from pdserve.engine.step_trace import REQUESTS_SUFFIX, SUFFIX, Step

__all__ = ["read_request_spans", "read_requests", "read_steps", "unpack_trace"]


def unpack_trace(path: str | Path, into: str | Path) -> tuple[Path, Path]:
    """A recorded trace as (its root, the folder that holds its step traces): a directory as it
    is, a packed one (proof.sh's `ARM-raw.tar.xz`, `profile-steps.tar.xz`) unpacked into `into`."""
    root = Path(path)
    if root.is_file():
        with tarfile.open(root) as tar:
            tar.extractall(into, filter="data")
        root = Path(into)
    found = next(root.rglob(f"*{SUFFIX}"), None)
    if found is None:
        raise FileNotFoundError(f"no *{SUFFIX} step traces in {path}")
    return root, found.parent


def _request_rows(path: str | Path) -> dict[str, list[dict]]:
    out = {}
    for file in sorted(Path(path).glob(f"*{REQUESTS_SUFFIX}")):
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        out[file.name[: -len(REQUESTS_SUFFIX)]] = sorted(rows, key=lambda r: r["submitted"])
    return out


def read_requests(path: str | Path) -> dict[str, list[tuple[float, float]]]:
    """replica id -> its actor's (submitted, first) per request in the order submitted, from a
    trace directory (empty for traces recorded before the actors wrote them)."""
    return {replica: [(r["submitted"], r["first"]) for r in rows]
            for replica, rows in _request_rows(path).items()}


def read_request_spans(path: str | Path) -> dict[str, list[tuple[float, float, float, int]]]:
    """replica id -> its actor's (submitted, first, last, outputs) per request in the order
    submitted, for the requests whose trace line has them (written since 2026-11-29)."""
    return {replica: [(r["submitted"], r["first"], r["last"], r["outputs"]) for r in rows
                      if "last" in r]
            for replica, rows in _request_rows(path).items()}


def read_steps(path: str | Path, since: float = 0.0) -> dict[str, list[Step]]:
    """replica id -> its steps at or after monotonic time `since` (a reader on the engines'
    host), from one trace file or every trace file of a directory; replicas without such steps
    are left out."""
    path = Path(path)
    files = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *{SUFFIX} step traces in {path}")
    traces = {}
    for file in files:
        steps = [Step(**json.loads(line)) for line in file.read_text().splitlines() if line.strip()]
        recent = [s for s in steps if s.t >= since]
        if recent:
            traces[file.name.removesuffix(SUFFIX)] = recent
    return traces
