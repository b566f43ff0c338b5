"""Why 1P1D's decode TPOT p90 sits above a standalone engine's at the same batch (issue 31).

Reads the recorded GPU runs (vLLM 0.24, Llama-3.1-8B shape, dummy weights) out of git history into a
temporary folder (never into the tree), and prints the tables of
benchmarks/results/gpu/decode-gap/README.md:

    .venv/bin/python benchmarks/research/decode_gap.py            # every host below
    .venv/bin/python benchmarks/research/decode_gap.py --host h100-s14
    .venv/bin/python benchmarks/research/decode_gap.py --local OUT          # a fresh run's folder
    .venv/bin/python benchmarks/research/decode_gap.py --compare OUT_A OUT_B  # two runs, paired

Method, per host (one GPU host, one quarter hour):
- The reference: a standalone engine's decode step, `period = a + b * batch + c * context`, fitted by
  least squares to the clean decode steps of the host's standalone engines (the colocated arm's two
  engines and the profile's one): steps that only decoded, between steps that only decoded, with
  no request reaching the scheduler during them. A period is the time between two steps' outputs
  (vLLM's async scheduling: the engine's cadence, what a token waits).
- The 1P1D decode engine's steps are each given that reference's time at their own batch and
  context, and classed by what else happened in them: `admit` (the step also computed the first
  token of requests whose KV had just arrived), `arrival` (a request reached the scheduler: vLLM's
  add_request, the block allocation and the pull's start), `pull` (a pull in flight: from an
  arrival to its mean pull time later), `report` (a pull done, its report still on the way to the
  scheduler: to the admitting step's start), `plain` (none of these).
- Each request is rebuilt from the trace: it joins at the step that admits it and is in the next
  254 steps (exact on every trace here: the rebuilt batch equals the traced one). Its TPOT as the
  client timed it, (last - first) / 255, is split into the handoff (the client's gap from token 1,
  which the prefill engine sent, to token 2, the decode engine's first) and the decode engine's
  steps. The same request on a standalone engine at the same batch: one reference step from token
  1 to 2, then the reference's time for each step it was in. The gap is the difference; at the p90
  it is read off the requests ranked 85th to 95th by TPOT, whose components add up to their gap.
- Where the engine actors wrote their side (`*.requests.jsonl`), the handoff is split at each
  process: the prefill actor's first output -> the decode actor (`hop`) -> vLLM's scheduler
  (`actor in`) -> the admitting step's start (`to admit`: the pull, then its report) -> that step's
  end (`admit`) -> the decode actor's first output (`out`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.engine.step_trace import Step  # noqa: E402
from pdserve.sim.calibration.trace_reader import read_requests, read_steps  # noqa: E402

# The commit before the raw data left the tree (8f98e443ea44d6685c243af37e39a2ad25149b1b).
RAW_COMMIT = "4ca96b659f8913be73c9de3750d7e62eb442dc3f"
GPU = "benchmarks/results/gpu"
OUTPUT_STEPS = 255  # 256 output tokens: the decode engine computes tokens 2..256, one per step
IDLE_S = 1.5  # a gap between admissions this long separates two bench runs (Poisson 8 req/s: e^-12)
CLASSES = ("admit", "arrival", "pull", "report", "plain")


@dataclass(frozen=True)
class Host:
    """One GPU host's recorded arms: 1P1D runs (each an `ARM-raw.tar.xz` beside its `ARM.json`),
    the standalone engines' traces for the reference (colocated arms, profiles), all under
    `folder`: benchmarks/results/gpu/FOLDER at RAW_COMMIT, or a folder on disk (`local`)."""

    label: str
    folder: str
    disagg: tuple[str, ...]
    standalone: tuple[str, ...]
    note: str = ""
    local: bool = False

    def path(self, name: str) -> str:
        return f"{self.folder}/{name}" if self.local else f"{GPU}/{self.folder}/{name}"


HOSTS = (
    Host("h100-s14", "2026-11-28-h100-x2-s14", ("disagg-raw.tar.xz", "repeat-2/disagg-raw.tar.xz"),
         ("colocated-raw.tar.xz", "profile-1/profile-steps.tar.xz")),
    Host("h100-s13", "2026-11-27-h100-x2-s13",
         ("disagg-raw.tar.xz", "repeat-2/disagg-raw.tar.xz", "repeat-3/disagg-raw.tar.xz"),
         ("colocated-raw.tar.xz", "profile-1/profile-steps.tar.xz"),
         "repeat-3 ran later on a fresh machine; its reference is the first host's"),
    Host("h100-s12", "2026-11-27-h100-x2-s12", ("disagg-raw.tar.xz", "repeat-2/disagg-raw.tar.xz"),
         ("colocated-raw.tar.xz", "repeat-2/colocated-raw.tar.xz", "profile-1/profile-steps.tar.xz"),
         "traces without `arrived`: arrivals and pulls cannot be told from plain steps"),
    Host("h200-s10", "2026-11-27-h200-x2", ("disagg-raw.tar.xz",),
         ("colocated-raw.tar.xz", "profile-1/profile-steps.tar.xz"),
         "traces from vLLM's stat loggers (no busy_s, no arrivals, context estimated from KV usage)"),
)


# ---- reading ------------------------------------------------------------------------------------


def read_bytes(host: Host, name: str) -> bytes:
    """A recorded file: from disk for a local host, else as RAW_COMMIT holds it."""
    if host.local:
        return Path(host.path(name)).read_bytes()
    return subprocess.run(["git", "show", f"{RAW_COMMIT}:{host.path(name)}"], cwd=ROOT,
                          capture_output=True, check=True).stdout


def fetch(host: Host, name: str, into: Path) -> Path:
    """A recorded archive unpacked into a fresh folder under `into` (never into the tree)."""
    target = into / f"{host.label}__{name.replace('/', '__')}"
    target.mkdir(parents=True)
    archive = target / "archive.tar.xz"
    archive.write_bytes(read_bytes(host, name))
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()
    return target


def steps_dir(root: Path) -> Path:
    return next(root.rglob("*.steps.jsonl")).parent


# ---- the reference: a standalone engine's decode step -------------------------------------------


def arrivals_of(steps: list[Step]) -> list[float]:
    return sorted(a for s in steps for a in s.arrived or ())


def reached(arrivals: list[float], start: float, end: float) -> int:
    """Requests that reached the scheduler in (start, end]."""
    return bisect_right(arrivals, end) - bisect_right(arrivals, start)


def clean_decode_rows(steps: list[Step]) -> list[tuple[float, float, float]]:
    """(batch, context read, period) of the steps that only decoded, between steps that only
    decoded, with no request reaching the scheduler meanwhile (where the trace says)."""
    arrivals = arrivals_of(steps)
    rows = []
    for before, step, after in zip(steps, steps[1:], [*steps[2:], None], strict=False):
        if (step.prefill_tokens or before.prefill_tokens or not before.pending or not step.decode_reqs
                or step.t <= before.t or (after is not None and after.prefill_tokens)
                or reached(arrivals, before.t, step.t) or before.context_tokens is None):
            continue
        rows.append((step.decode_reqs, before.context_tokens, step.t - before.t))
    return rows


@dataclass(frozen=True)
class Reference:
    """A standalone engine's decode period: base + per_request * batch + per_token * context."""

    base: float
    per_request: float
    per_token: float
    steps: int
    dropped: int

    def period(self, batch: np.ndarray, context: np.ndarray) -> np.ndarray:
        return self.base + self.per_request * batch + self.per_token * context


def fit_reference(traces: list[list[Step]]) -> Reference:
    """Least squares on every clean decode step of `traces`, once more without the stalls (more
    than 10 median absolute deviations off), then shifted by the stalls' share, so that its mean
    over all those steps, stalls included, is theirs: a standalone engine stalls too."""
    data = np.array([row for steps in traces for row in clean_decode_rows(steps)], float)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    coef = np.linalg.lstsq(x, data[:, 2], rcond=None)[0]
    residual = np.abs(data[:, 2] - x @ coef)
    keep = residual <= 10 * max(float(np.median(residual)), 1e-6)
    coef = np.linalg.lstsq(x[keep], data[keep, 2], rcond=None)[0]
    coef[0] += float(np.mean(data[:, 2] - x @ coef))
    return Reference(*(float(c) for c in coef), int(keep.sum()), int((~keep).sum()))


# ---- the 1P1D decode engine, step by step -------------------------------------------------------


@dataclass
class DecodeTrace:
    """The decode engine's steps as arrays, with each step's reference time and class."""

    steps: list[Step]
    t: np.ndarray
    period: np.ndarray  # since the step before's outputs (nan for the first)
    batch: np.ndarray
    alone: np.ndarray  # the reference's period at this step's batch and context
    kind: np.ndarray  # one of CLASSES
    admits: list[tuple[int, float | None]]  # (admitting step, arrival at the scheduler), in order
    reference: Reference

    @property
    def excess(self) -> np.ndarray:
        return self.period - self.alone


def decode_trace(steps: list[Step], ref: Reference) -> DecodeTrace:
    """The decode engine's steps with the reference's time for each; classes come later
    (`classify`: they need each run's mean pull time)."""
    t = np.array([s.t for s in steps])
    batch = np.array([s.decode_reqs + s.prefill_reqs for s in steps], float)
    context = np.array([np.nan] + [b.context_tokens or 0 for b in steps[:-1]], float)
    alone = np.r_[np.nan, ref.period(batch[1:], context[1:])]
    kind = np.full(len(steps), "plain", dtype=object)
    return DecodeTrace(steps, t, np.r_[np.nan, np.diff(t)], batch, alone, kind, admissions(steps), ref)


def classify(trace: DecodeTrace, pull_s: dict[int, float]) -> None:
    """Sets each step's class (module docstring); `pull_s`: admission -> its run's mean pull time.
    A step's period starts at the step before's outputs."""
    steps, t = trace.steps, trace.t
    arrivals = arrivals_of(steps)
    for i in range(1, len(steps)):
        if steps[i].prefill_reqs:
            trace.kind[i] = "admit"
        elif reached(arrivals, t[i - 1], t[i]):
            trace.kind[i] = "arrival"
    for k, (index, arrived) in enumerate(trace.admits):
        if arrived is None:
            continue
        first = int(np.searchsorted(t, arrived, side="right")) + 1  # after the arrival's step
        for i in range(first, index):
            pulling = t[i - 1] < arrived + pull_s.get(k, 0.0)
            if trace.kind[i] == "plain" or (trace.kind[i] == "report" and pulling):
                trace.kind[i] = "pull" if pulling else "report"


def admissions(steps: list[Step]) -> list[tuple[int, float | None]]:
    """(admitting step, arrival at the scheduler or None) of every request, in admission order.
    A step admits `prefill_reqs` requests: their last prompt token (the first output token, which
    the prefill engine sampled) is computed there and token 2 sampled."""
    out = []
    for i, step in enumerate(steps):
        arrived = sorted(step.arrived or ())
        for k in range(step.prefill_reqs):
            out.append((i, arrived[k] if k < len(arrived) else None))
    return out


def check_rebuild(trace: DecodeTrace) -> int:
    """Steps whose traced batch differs from the batch rebuilt from the admissions (each request
    in OUTPUT_STEPS steps from the one admitting it)."""
    rebuilt = np.zeros(len(trace.steps) + OUTPUT_STEPS)
    for index, _ in trace.admits:
        rebuilt[index:index + OUTPUT_STEPS] += 1
    return int((rebuilt[:len(trace.steps)] != trace.batch).sum())


def split_runs(trace: DecodeTrace) -> list[list[int]]:
    """Indexes into `trace.admits`, one list per bench run (admissions IDLE_S apart or more)."""
    runs: list[list[int]] = [[]]
    for k, (index, _) in enumerate(trace.admits):
        if runs[-1] and trace.t[index] - trace.t[trace.admits[runs[-1][-1]][0]] > IDLE_S:
            runs.append([])
        runs[-1].append(k)
    return runs


# ---- requests ------------------------------------------------------------------------------------


@dataclass
class RunGap:
    """One bench run's requests: measured TPOT, the same on a standalone engine, the parts."""

    rate: float
    tpot: np.ndarray  # the client's, ms
    engine_tpot: np.ndarray  # rebuilt from the trace (client's token 1), ms
    alone: np.ndarray  # a standalone engine at the same batch, ms
    parts: dict[str, np.ndarray]  # ms of TPOT per request: handoff, jitter and each step class
    batch: np.ndarray  # the mean batch over each request's steps
    time_batch: float  # the run's mean batch over time
    handoff_ms: np.ndarray  # the client's token 1 -> 2
    period_ms: float  # the run's median step period
    lag: np.ndarray  # steps from the one a request reached the scheduler in to its admission (-1: unknown)
    earlier: np.ndarray  # the client's TPOT had the request been admitted a step earlier, ms
    alone_at_mean: float  # the reference's period at the run's mean batch and context, ms


def run_gap(trace: DecodeTrace, members: list[int], bench: dict) -> RunGap:
    """Matches the run's client requests to its admissions (both by token 2's time: the client's
    token 1 + first gap, the admitting step's end) and splits each request's TPOT."""
    n = OUTPUT_STEPS
    first = np.asarray(bench["start_times"]) + np.asarray(bench["ttfts"])
    gap1 = np.array([itl[0] for itl in bench["itls"]])
    last = np.asarray(bench["start_times"]) + np.asarray(bench["latencies"])
    order = np.argsort(first + gap1, kind="stable")
    admit = np.array([trace.admits[k][0] for k in members])  # already in time order
    tpot = (last - first)[order] / n * 1e3
    handoff = gap1[order]
    span_client = (last - first)[order] - handoff
    parts = {c: np.zeros(len(admit)) for c in CLASSES}
    alone, batch, span_engine = np.zeros(len(admit)), np.zeros(len(admit)), np.zeros(len(admit))
    for r, i in enumerate(admit):
        js = np.arange(i + 1, i + n)
        excess = trace.excess[js]
        for c in CLASSES:
            parts[c][r] = excess[trace.kind[js] == c].sum()
        alone[r] = trace.alone[i] + trace.alone[js].sum()
        batch[r] = trace.batch[js].mean()
        span_engine[r] = trace.t[i + n - 1] - trace.t[i]
    out = {"handoff": handoff - trace.alone[admit], "jitter": span_client - span_engine}
    out.update(parts)
    lag = np.array([lag_of(trace, k) for k in members])
    # One step earlier: the same steps, shifted; the request's last token comes a period sooner.
    last_period = trace.period[admit + n - 1]
    earlier = tpot - np.where(lag != 0, last_period, 0.0) / n * 1e3
    window = slice(admit[0], admit[-1] + n)
    busy = trace.period[window][1:]
    time_batch = float(np.average(trace.batch[window][1:], weights=busy))
    context = np.array([s.context_tokens or 0 for s in trace.steps[window]], float)[:-1]
    at_mean = ref_at(trace, time_batch, float(np.average(context, weights=busy)))
    return RunGap(float(bench["request_rate"]), tpot, (handoff + span_engine) / n * 1e3,
                  alone / n * 1e3, {k: v / n * 1e3 for k, v in out.items()}, batch, time_batch,
                  handoff * 1e3, float(np.median(busy)) * 1e3, lag, earlier, at_mean * 1e3)


def lag_of(trace: DecodeTrace, k: int) -> int:
    """Steps from the one in whose period admission `k`'s request reached the scheduler to the
    one admitting it; -1 where the trace does not say when it arrived, 0 after an idle spell."""
    index, arrived = trace.admits[k]
    if arrived is None:
        return -1
    return index - int(np.searchsorted(trace.t, arrived, side="right"))


def ref_at(trace: DecodeTrace, batch: float, context: float) -> float:
    """The reference's period at `batch` and `context` (read back from the trace's own model)."""
    return float(trace.reference.period(np.array([batch]), np.array([context]))[0])


def p90_band(values: np.ndarray) -> np.ndarray:
    """The requests ranked 85th to 95th percentile by `values`: the ones around the p90."""
    lo, hi = np.percentile(values, [85, 95])
    return (values >= lo) & (values <= hi)


# ---- the handoff at each process (traces with the actors' side) ---------------------------------


HANDOFF_PARTS = ("hop", "actor in", "to admit", "admit", "out")


def handoff_split(trace: DecodeTrace, requests: dict[str, list[tuple[float, float]]],
                  members: list[int]) -> dict[str, float] | None:
    """Mean ms per part of HANDOFF_PARTS over the run's requests, or None without the actors'
    side. The prefill actor's rows (submitted, first) by first output, the decode actor's by
    submission and the admissions by arrival at the scheduler follow one another in order."""
    prefill, decode = requests.get("prefill-0"), requests.get("decode-0")
    if not prefill or not decode or len(decode) != len(trace.admits):
        return None
    prefill = sorted(prefill, key=lambda row: row[1])
    by_arrival = sorted(range(len(trace.admits)), key=lambda k: trace.admits[k][1] or 0.0)
    mine = set(members)
    sums = dict.fromkeys(HANDOFF_PARTS, 0.0)
    count = 0
    for (submitted, first_out), (_, token1), k in zip(sorted(decode), prefill, by_arrival, strict=True):
        if k not in mine:
            continue
        index, arrived = trace.admits[k]
        if arrived is None:
            return None
        end = trace.t[index]
        busy = trace.steps[index].busy_s
        start = end - busy if busy is not None else trace.t[index - 1]  # idle before it: busy_s
        for part, ms in zip(HANDOFF_PARTS, (submitted - token1, arrived - submitted, start - arrived,
                                            end - start, first_out - end), strict=True):
            sums[part] += ms * 1e3
        count += 1
    return {part: value / count for part, value in sums.items()} if count else None


# ---- tables --------------------------------------------------------------------------------------


def row(*cells: object) -> str:
    return "| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells) + " |"


def header(*names: str) -> str:
    return row(*names) + "\n" + "|---" * len(names) + "|"


@dataclass
class ArmResult:
    host: Host
    arm: str
    trace: DecodeTrace
    runs: list[RunGap]
    handoffs: list[dict[str, float] | None]
    pull_ms: list[float]
    mismatched: int


def analyse_arm(host: Host, arm: str, tmp: Path, ref: Reference) -> ArmResult:
    root = fetch(host, arm, tmp)
    folder = steps_dir(root)
    steps = read_steps(folder)["decode-0"]
    requests = read_requests(folder)
    arm_json = json.loads(read_bytes(host, arm.replace("-raw.tar.xz", ".json")))
    pulls = {float(r["rate"]): 1e3 * r["kv"]["seconds"] / r["kv"]["pulls"]  # the mean pull, ms
             for r in arm_json["rates"] if r.get("kv", {}).get("pulls")}
    trace = decode_trace(steps, ref)
    benches = sorted(root.rglob("rate-*.json"), key=lambda p: float(p.stem.split("-", 1)[1]))
    runs = split_runs(trace)[-len(benches):]
    rates = [float(json.loads(p.read_text())["request_rate"]) for p in benches]
    classify(trace, {k: pulls.get(rate, 0.0) / 1e3 for members, rate in zip(runs, rates, strict=True)
                     for k in members})
    gaps, handoffs, pull_ms = [], [], []
    for members, path in zip(runs, benches, strict=True):
        bench = json.loads(path.read_text())
        if len(members) != len(bench["ttfts"]):
            print(f"  {host.label} {arm} {path.name}: {len(members)} admissions for "
                  f"{len(bench['ttfts'])} requests; skipped")
            continue
        gaps.append(run_gap(trace, members, bench))
        handoffs.append(handoff_split(trace, requests, members))
        pull_ms.append(pulls.get(float(bench["request_rate"]), float("nan")))
    return ArmResult(host, arm, trace, gaps, handoffs, pull_ms, check_rebuild(trace))


def print_reference(host: Host, ref: Reference, standalone: dict[str, list[list[Step]]],
                    arms: list[ArmResult]) -> None:
    print(f"\n### {host.label} ({host.path('')[:-1]})" + (f": {host.note}" if host.note else ""))
    print(f"\nreference decode period = {ref.base * 1e3:.3f} ms + {ref.per_request * 1e6:.1f} us x batch"
          f" + {ref.per_token * 1e9:.1f} ns x context token (fitted on {ref.steps} clean steps, then "
          f"shifted by {ref.dropped} stalls' share)\n")
    print(header("engine", "clean decode steps", "mean batch", "mean excess ms", "median excess ms"))
    sources = [(name, traces) for name, traces in standalone.items()]
    sources += [(f"1P1D {a.arm.split('/')[0]}", [a.trace.steps]) for a in arms]
    for name, traces in sources:
        data = np.array([r for steps in traces for r in clean_decode_rows(steps)], float)
        excess = (data[:, 2] - ref.period(data[:, 0], data[:, 1])) * 1e3
        print(row(name, len(data), float(data[:, 0].mean()), float(excess.mean()),
                  float(np.median(excess))))


def print_steps(arms: list[ArmResult]) -> None:
    print("\nThe decode engine's steps by class (all runs of the arm; excess over the reference):\n")
    print(header("arm", "class", "steps", "share of steps", "mean excess ms", "median excess ms",
                 "p90 excess ms"))
    for arm in arms:
        valid = ~np.isnan(arm.trace.excess)
        busy = np.r_[False, [s.pending > 0 for s in arm.trace.steps[:-1]]] & valid
        for c in CLASSES:
            sel = busy & (arm.trace.kind == c)
            if not sel.any():
                continue
            e = arm.trace.excess[sel] * 1e3
            print(row(arm.arm.split("/")[0], c, int(sel.sum()), float(sel.sum() / busy.sum()),
                      float(e.mean()), float(np.median(e)), float(np.percentile(e, 90))))


def print_gaps(arms: list[ArmResult]) -> None:
    print("\nTPOT p90: measured (the client's), rebuilt from the trace, a standalone engine at the same"
          " batch, the gap, its parts at the p90 (ms of TPOT, mean over the requests ranked 85th-95th;"
          " they add up to `band gap`), and the p90 had every request been admitted a step earlier:\n")
    names = ("handoff", *CLASSES, "jitter")
    print(header("arm", "rate", "TPOT p90", "rebuilt p90", "alone p90", "gap p90", "band gap", *names,
                 "handoff share", "a step earlier p90", "of the gap"))
    for arm in arms:
        for gap in arm.runs:
            band = p90_band(gap.tpot)
            parts = [float(gap.parts[k][band].mean()) for k in names]
            p90, alone = np.percentile(gap.tpot, 90), np.percentile(gap.alone, 90)
            earlier, band_gap = np.percentile(gap.earlier, 90), float((gap.tpot - gap.alone)[band].mean())
            big = p90 - alone > 0.1  # shares of a gap within the reference's error say nothing
            print(row(arm.arm.split("/")[0], gap.rate, float(p90), float(np.percentile(gap.engine_tpot, 90)),
                      float(alone), float(p90 - alone), band_gap, *parts,
                      f"{parts[0] / band_gap:.0%}" if big else "-", float(earlier),
                      f"{(p90 - earlier) / (p90 - alone):.0%}" if big else "-"))


def print_batches(arms: list[ArmResult]) -> None:
    print("\nThe batch over time, as requests see it (their steps' mean) and at the p90; a standalone"
          " engine at the same batches; the step at the mean batch, and the TPOT p90 above it:\n")
    print(header("arm", "rate", "mean batch (time)", "mean batch (requests)", "batch at p90",
                 "alone TPOT p50", "alone TPOT p90", "alone step at mean batch", "TPOT p90 above it"))
    for arm in arms:
        for gap in arm.runs:
            band = p90_band(gap.tpot)
            print(row(arm.arm.split("/")[0], gap.rate, gap.time_batch, float(gap.batch.mean()),
                      float(gap.batch[band].mean()), float(np.median(gap.alone)),
                      float(np.percentile(gap.alone, 90)), gap.alone_at_mean,
                      float(np.percentile(gap.tpot, 90)) - gap.alone_at_mean))


def print_lags(arms: list[ArmResult]) -> None:
    rows = [(arm, gap) for arm in arms for gap in arm.runs if (gap.lag >= 0).all()]
    if not rows:
        return
    print("\nSteps from the one a request reached the decode engine's scheduler in to the one admitting"
          " it (share of requests; 0: it came while the engine idled):\n")
    print(header("arm", "rate", "0", "1-2", "3", "4", "5", "6+", "client's token 1 -> 2 p50 ms",
                 "p90 ms"))
    for arm, gap in rows:
        shares = [float(np.mean(sel)) for sel in (gap.lag == 0, (gap.lag >= 1) & (gap.lag <= 2),
                                                  gap.lag == 3, gap.lag == 4, gap.lag == 5, gap.lag >= 6)]
        print(row(arm.arm.split("/")[0], gap.rate, *shares, float(np.median(gap.handoff_ms)),
                  float(np.percentile(gap.handoff_ms, 90))))


def print_handoffs(arms: list[ArmResult]) -> None:
    rows = [(arm, gap, split, pull) for arm in arms
            for gap, split, pull in zip(arm.runs, arm.handoffs, arm.pull_ms, strict=True) if split]
    if not rows:
        return
    print("\nToken 1 -> token 2 at each process (mean ms; `to admit` = the pull, then its report; "
          "periods: what `to admit` holds beyond the mean pull, in the decode engine's mean periods):\n")
    print(header("arm", "rate", *HANDOFF_PARTS, "sum", "mean pull", "period", "periods after the pull"))
    for arm, gap, split, pull in rows:
        print(row(arm.arm.split("/")[0], gap.rate, *(split[p] for p in HANDOFF_PARTS),
                  sum(split.values()), pull, gap.period_ms, (split["to admit"] - pull) / gap.period_ms))


def local_host(folder: Path) -> Host:
    """A fresh run's folder as benchmarks/gpu/proof.sh and x4.sh leave it (PROOF_STEP_TRACE set):
    disagg-raw.tar.xz and disagg.json (1P1D), colocated-raw.tar.xz, profile-1/profile-steps.tar.xz."""
    standalone = tuple(name for name in ("colocated-raw.tar.xz", "profile-1/profile-steps.tar.xz")
                       if (folder / name).exists())
    return Host(folder.name, str(folder), ("disagg-raw.tar.xz",), standalone, local=True)


def client_runs(host: Host, tmp: Path) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """rate -> (TPOT, token 1 -> 2) per request in send order, ms, from a run's 1P1D bench results."""
    out = {}
    for path in fetch(host, "disagg-raw.tar.xz", tmp).rglob("rate-*.json"):
        bench = json.loads(path.read_text())
        order = np.argsort(bench["start_times"], kind="stable")
        first, latency = np.asarray(bench["ttfts"]), np.asarray(bench["latencies"])
        gap1 = np.array([itl[0] for itl in bench["itls"]])
        out[float(bench["request_rate"])] = ((latency - first)[order] / OUTPUT_STEPS * 1e3, gap1[order] * 1e3)
    return out


def compare(before: Path, after: Path, tmp: Path) -> None:
    """Two runs of one arrival schedule (same seeds), request by request: the TPOT change is read
    paired, as its run-to-run spread (up to 0.24 ms at p90) exceeds what one step is worth."""
    runs = [client_runs(local_host(folder), tmp) for folder in (before, after)]
    print(f"\n{after.name} against {before.name}, requests paired in send order:\n")
    print(header("rate", "requests", "TPOT p90 before", "after", "TPOT change, mean", "its s.e.",
                 "token 1 -> 2 p50 before", "after"))
    for rate in sorted(set(runs[0]) & set(runs[1])):
        (tpot0, gap0), (tpot1, gap1) = runs[0][rate], runs[1][rate]
        if len(tpot0) != len(tpot1):
            print(f"rate {rate}: {len(tpot0)} against {len(tpot1)} requests; not the same schedule")
            continue
        change = tpot1 - tpot0
        print(row(rate, len(change), float(np.percentile(tpot0, 90)), float(np.percentile(tpot1, 90)),
                  float(change.mean()), float(change.std(ddof=1) / np.sqrt(len(change))),
                  float(np.median(gap0)), float(np.median(gap1))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", choices=[h.label for h in HOSTS], action="append",
                        help="only these recorded hosts (default: all)")
    parser.add_argument("--local", type=Path, action="append", default=[],
                        help="a fresh run's folder instead (see local_host)")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="two fresh runs' folders, the same schedule: paired TPOT change")
    args = parser.parse_args()
    if args.compare:
        with tempfile.TemporaryDirectory(prefix="decode-gap-") as tmp:
            compare(*args.compare, Path(tmp))
        return 0
    hosts = [local_host(folder) for folder in args.local]
    if not hosts:
        hosts = [h for h in HOSTS if not args.host or h.label in args.host]
    with tempfile.TemporaryDirectory(prefix="decode-gap-") as tmp:
        for host in hosts:
            if not host.standalone:
                print(f"{host.folder}: no standalone engine's trace (colocated arm or profile) to compare with")
                continue
            standalone = {}
            for path in host.standalone:
                folder = steps_dir(fetch(host, path, Path(tmp)))
                standalone[path.split("/")[0].replace("-raw.tar.xz", "")] = list(read_steps(folder).values())
            ref = fit_reference([s for traces in standalone.values() for s in traces])
            arms = [analyse_arm(host, arm, Path(tmp), ref) for arm in host.disagg]
            print_reference(host, ref, standalone, arms)
            for arm in arms:
                if arm.mismatched:
                    print(f"note: {arm.arm}: {arm.mismatched} steps' batch differs from the rebuilt one")
            print_steps(arms)
            print_gaps(arms)
            print_batches(arms)
            print_lags(arms)
            print_handoffs(arms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
