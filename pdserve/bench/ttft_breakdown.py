"""Where a served request's TTFT goes, from a GPU arm's step trace and its bench results.

For every rate of an arm (`benchmarks/gpu/proof.py`'s `ARM-raw.tar.xz`: `rate-R.json` bench
results and the engines' step traces, recorded with `PROOF_STEP_TRACE`), each request is matched
to the step that started it: the trace's `arrived` (when the request reached vLLM's scheduler)
sorted, against the client's sends sorted, FCFS (the engine takes prompts in arrival order).
The client's clock (`start_times`, from the run's start) and the engines' (monotonic) differ by
a constant, taken as the 1st percentile of `arrived - send`: the quickest way in. Then, in ms,
means over the rate's requests:

- `in`: from the client's send to vLLM's scheduler, above the quickest (the frontend, Ray, the
  engine actor, vLLM's input queue, and the engine core busy with a step: vLLM takes in new
  requests only between its own calls);
- `wait`: from there to the start of the step that prefilled it;
- `step`: that step;
- `out`: from that step's end to the client's first token (the response path, with the quickest
  way in counted here).

Where the engine actors wrote their side too (`*.requests.jsonl`, traces from 2026-11-27's
session 13 on: when the actor took each request and when its first output left the engine),
`in` and `out` are split at the actor, matched in the same order: `to actor` (above the
quickest), `actor in` (the actor to vLLM's scheduler: vLLM's input processing, its input
queue, and the engine core busy with a step), `actor out` (the step's end to the actor's first
output), `from actor` (to the client, with the quickest way to the actor).

A disaggregated arm's first token is the prefill engine's, so its prefill engine's trace is the
one read; a colocated arm's engines are read together.

A CPU profile's runs work too. There vLLM schedules synchronously: a request that comes during a
step waits in vLLM's input queue until the step ends, so the queue's wait shows under `in`, not
`wait`. `benchmarks/research/ttft_breakdown.py` reads an arm's traces and prints the table.
"""

from __future__ import annotations

import numpy as np

TOLERANCE_S = 0.005  # a window's median gap error allowed above 3x the best's (`match`)


def starts_of(traces: dict[str, list]) -> list[tuple[float, float, float]]:
    """(arrived, step start, step end) of every request a first-token engine started, by arrival.
    A disaggregated decode engine's requests come after their first token: left out."""
    rows = []
    for replica, steps in traces.items():
        if replica.startswith("decode-"):
            continue
        for step in steps:
            for arrived in step.arrived or ():
                rows.append((arrived, step.t - (step.busy_s or 0.0), step.t))
    return sorted(rows)


def match(arrived: np.ndarray, sends: np.ndarray, after: int = 0) -> int:
    """Where the run's requests begin among the trace's arrivals, at or after index `after`:
    the window whose gaps best follow the client's (other runs, warm-ups and profiles share
    the trace; repeats of one arrival schedule are told apart by taking the runs in order)."""
    n = len(sends)
    if len(arrived) - after < n:
        raise ValueError(f"the trace has {len(arrived) - after} arrivals left, the run {n} requests")
    gaps = np.diff(sends)
    scores = [float(np.median(np.abs(np.diff(arrived[i:i + n]) - gaps)))
              for i in range(after, len(arrived) - n + 1)]
    best = min(scores)
    # The first window about as good as the best: a later repeat of the same schedule fits as
    # well, give or take the machine's noise (a misaligned window is off by a typical gap).
    return after + next(i for i, v in enumerate(scores) if v <= 3 * best + TOLERANCE_S)


def actor_rows(requests: dict[str, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The first-token actors' (submitted, first) by submit time, like `starts_of`."""
    return sorted(r for replica, rows in requests.items() if not replica.startswith("decode-")
                  for r in rows)


def breakdown(run: dict, rows: list[tuple[float, float, float]], after: int = 0,
              actors: list[tuple[float, float]] | None = None) -> dict[str, float]:
    """The run's means (module docstring), its requests matched to the trace's arrivals at or
    after index `after`; `end` in the result is the index after its last. With the actors'
    rows (as many as the arrivals), `in` and `out` are also split at the actor."""
    sends = np.asarray(run["start_times"], float)
    order = np.argsort(sends, kind="stable")
    sends, ttfts = sends[order], np.asarray(run["ttfts"], float)[order]
    arrived = np.array([r[0] for r in rows])
    first = match(arrived, sends, after)
    mine = rows[first:first + len(sends)]
    arrived = arrived[first:first + len(sends)]
    start = np.array([r[1] for r in mine])
    end = np.array([r[2] for r in mine])
    offset = float(np.percentile(arrived - sends, 1))
    parts = {"in": arrived - offset - sends, "wait": start - arrived, "step": end - start,
             "out": sends + ttfts - (end - offset)}
    if actors is not None and len(actors) == len(rows):
        mine_actor = actors[first:first + len(sends)]
        submitted = np.array([r[0] for r in mine_actor])
        first_out = np.array([r[1] for r in mine_actor])
        to_actor = float(np.percentile(submitted - sends, 1))
        parts.update({"to actor": submitted - to_actor - sends, "actor in": arrived - submitted,
                      "actor out": first_out - end, "from actor": sends + ttfts - (first_out - to_actor)})
    out = {k: float(np.mean(v) * 1e3) for k, v in parts.items()}
    out["ttft"] = float(np.mean(ttfts) * 1e3)
    out["requests"] = len(sends)
    out["end"] = first + len(sends)
    return out
