"""One engine's requests, as its engine actor took them, replayed through one simulated engine.

An engine actor's request trace (`{replica}.requests.jsonl`: when the actor took each request and
when its first output left the engine) gives submission times; `compare` feeds them, run by run
(`runs_of`: runs are split where submissions pause), to a `SimEngine` on a profile and compares the
time to the first output, measured at the actor against simulated: the engine model alone, without
the frontend, Ray or the routing. With the engine's step trace (`step_starts`) the means split too.
A colocated engine's request is a full leg; a disaggregated prefill engine's a prefill leg that its
decode engine pulls at once. `benchmarks/research/actor_replay.py` reads the traces and prints the table.
"""

from __future__ import annotations

import numpy as np

from pdserve.sim.engine import SimEngine, SimRequest
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.events import EventQueue

GAP_S = 2.0  # a pause this long between submissions separates two runs (rates) of the arm
STATS = {"mean": np.mean, "p50": np.median, "p90": lambda x: np.percentile(x, 90)}


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
