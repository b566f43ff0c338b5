"""A profile's step model refitted on a chosen window of step trace, and a prefill engine's handoff.

A profile keeps the step model (`step_fit`) its recording code fitted. These redo it with today's
fit code on a window of the engines' step traces:

- `refit`: a recorded profile on its own trace, from its recorded `since` (or a given window);
- `refitted_profile`: the profile's own steps, those before the first measured run;
- `fitted_on_runs`: the steps recorded during some measured runs (a step model fitted under load),
  placed on the trace's clock by `run_windows`;
- `handoff_of`: what a disaggregated prefill engine's step costs per request it hands over, fitted
  on other recorded 1P1D runs' prefill engines.

Each refitted profile keeps the fit it replaced under `recorded_fit`. The programs are
`benchmarks/research/sim_refit_profile.py` and `sim_validate.py` (`--refit-trace`, `--fit-trace`).
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path

from pdserve.sim.calibration.step_fit import fit_handoff, fit_replicas
from pdserve.sim.calibration.trace_reader import read_steps, unpack_trace
from pdserve.sim.profile import step_fit_of


def run_windows(traces: dict[str, list], runs: list[dict]) -> list[tuple[float, float]]:
    """(start, end) in trace time of each run. Trace time is monotonic and runs carry their
    wall-clock start (`date`, to the second) and duration: the last run ends at the trace's last
    busy stretch, and every run sits where its wall-clock start says, relative to it."""
    times = sorted(s.t for steps in traces.values() for s in steps)
    # A stray step after the last run (a late abort) does not end it.
    end = next(times[i] for i in range(len(times) - 1, 0, -1) if times[i] - times[i - 10] < 10)
    starts = [datetime.datetime.strptime(r["date"], "%Y%m%d-%H%M%S").timestamp() for r in runs]
    last_end = max(start + r["duration"] for start, r in zip(starts, runs, strict=True))
    return [(end - (last_end - start) - 1, end - (last_end - start) + r["duration"] + 1)
            for start, r in zip(starts, runs, strict=True)]


def fitted_on_runs(profile: dict, traces: dict[str, list], windows: list[tuple[float, float]]
                   ) -> dict:
    """The profile with its step_fit refitted on the steps inside `windows`."""
    inside = {r: [s for s in steps if any(a <= s.t <= b for a, b in windows)]
              for r, steps in traces.items()}
    return {**profile, "step_fit": {**fit_replicas(inside).to_json(),
                                    "windows": [list(w) for w in windows]}}


def refitted_profile(profile: dict, traces: dict[str, list], runs: list[dict]) -> dict:
    """The profile with its step_fit redone by today's fit on the profile's own steps: from its
    recorded `since` (else the trace's first step) to the first measured run's start."""
    first_run = min(start for start, _ in run_windows(traces, runs))
    since = (profile.get("step_fit") or {}).get("since")
    since = min(s.t for steps in traces.values() for s in steps) if since is None else since
    return {**profile, "step_fit": {**step_fit_of(traces, since, first_run),
                                    "recorded_fit": profile.get("step_fit")}}


def refit(profile: dict, trace: Path, since: float | None = None,
          until: float | None = None) -> dict:
    """The profile with its step_fit redone on its trace (a folder, or a .tar.xz of one) from
    `since` (default: the profile's recorded `since`, else the trace's start) to `until`."""
    old = profile.get("step_fit") or {}
    since = old.get("since", 0.0) if since is None else since
    with tempfile.TemporaryDirectory() as tmp:
        traces = read_steps(unpack_trace(trace, tmp)[1], since)
    return {**profile, "step_fit": {**step_fit_of(traces, since, until), "recorded_fit": old}}


def handoff_of(traces: list[Path]) -> float:
    """`fit_handoff` over the prefill engines (`prefill-N`) of the recorded runs."""
    prefill = []
    for i, path in enumerate(traces):
        with tempfile.TemporaryDirectory() as tmp:
            steps = read_steps(unpack_trace(path, Path(tmp) / str(i))[1])
        prefill += [s for replica, s in steps.items() if replica.startswith("prefill-")]
    if not prefill:
        raise ValueError(f"no prefill engine's trace in {', '.join(map(str, traces))}")
    handoff = fit_handoff(prefill)
    if handoff is None:
        raise ValueError("too few prefill steps after a prefill to fit the handoff")
    return handoff
