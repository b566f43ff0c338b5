"""Engine step traces as engines record them: one JSON line per engine step, and beside it one per
request.

With `engine.step_trace_dir` set, every engine appends its steps to
`{dir}/{replica_id}.steps.jsonl`, written by vLLM's scheduler in the engine core process
(pdserve.engine.tracing_scheduler; the mock engine writes its decode steps the same way): when the
step's outputs were processed (`t`, monotonic seconds, the same clock for every process of a
host), the prompt tokens it prefilled (`prefill_tokens`, over `prefill_reqs` requests), the
requests it decoded (`decode_reqs`), the requests still running or waiting after it (`pending`),
the engine's time for the step alone (`busy_s`), `context_tokens`, the tokens of KV its running
requests hold once it is done, and `ahead`, whether it was scheduled while the step before it
still ran (vLLM's async scheduling), and `arrived`, when the requests it started reached vLLM's
scheduler. The engine actor writes `{dir}/{replica_id}.requests.jsonl` beside it
(`RequestTraceWriter`).

This module is the record format and its writers only. Reading traces and fitting the
simulator's step model to them is the simulator's calibration (pdserve.sim.calibration:
`trace_reader`, `step_fit`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

SUFFIX = ".steps.jsonl"
REQUESTS_SUFFIX = ".requests.jsonl"


@dataclass(frozen=True, slots=True)
class Step:
    t: float
    prefill_tokens: int
    prefill_reqs: int
    decode_reqs: int
    busy_s: float | None = None
    pending: int | None = None  # requests running or waiting after the step; None: unknown
    context_tokens: int | None = None  # KV tokens held after the step; None: unknown
    # scheduled while the step before it was still running (vLLM's async scheduling); None:
    # unknown (traces before 2026-11-28)
    ahead: bool | None = None
    # monotonic times the requests this step started reached vLLM's scheduler; None: none
    # started, or unknown (traces before 2026-11-28)
    arrived: list[float] | None = None


class _LineWriter:
    """Appends JSON lines to one engine's file in a trace directory, a line at a time (readers
    see every finished line; one write per line is nothing next to what it records)."""

    def __init__(self, directory: str | Path, replica_id: str, suffix: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{replica_id}{suffix}"
        self._file: IO[str] | None = self.path.open("a", buffering=1)

    def _write(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StepTraceWriter(_LineWriter):
    """Appends steps to one engine's trace file."""

    def __init__(self, directory: str | Path, replica_id: str) -> None:
        super().__init__(directory, replica_id, SUFFIX)

    def record(self, step: Step) -> None:
        self._write(asdict(step))



class RequestTraceWriter(_LineWriter):
    """Beside an engine's step trace, its actor's side of each request: one JSON line per
    request that produced output, written when it ends, with `submitted` (the actor took it),
    `first` and `last` (its first and last outputs left the engine) and `outputs` (how many
    came), monotonic seconds on the same clock as the steps (pdserve.bench.ttft_breakdown
    sets them beside the steps' `arrived`). `last` - `first` is the engine's side of the
    request's decode, to hold against the client's (traces before 2026-11-29 end at `first`)."""

    def __init__(self, directory: str | Path, replica_id: str) -> None:
        super().__init__(directory, replica_id, REQUESTS_SUFFIX)

    def record(self, submitted: float, first: float, last: float, outputs: int) -> None:
        self._write({"submitted": round(submitted, 6), "first": round(first, 6),
                     "last": round(last, 6), "outputs": outputs})
