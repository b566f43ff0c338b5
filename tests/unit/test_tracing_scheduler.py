"""The tracing scheduler (pdserve.engine.tracing_scheduler) over a stand-in for vLLM's scheduler:
what a step records, its timing under async scheduling, and which vLLM class it extends. The
real one runs in tests/integration/test_serve_vllm.py (a CPU vLLM engine with the trace on)."""

from types import SimpleNamespace

import pytest

from pdserve.engine import tracing_scheduler
from pdserve.engine.step_trace import Step, StepTraceWriter
from pdserve.engine.tracing_scheduler import (
    TRACE_ENV, make_traced_scheduler, step_shape, trace_environment, traced, vllm_scheduler_cls,
)
from pdserve.sim.calibration.trace_reader import read_steps

pytestmark = pytest.mark.unit


class FakeRequest:
    def __init__(self, prompt: int, computed: int = 0, request_id: str = "") -> None:
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed
        self.request_id = request_id


class FakeScheduler:
    """vLLM's scheduler as the traced one sees it: `schedule` advances the computed tokens of
    what it schedules; `update_from_output` drops finished requests."""

    def __init__(self, *args, **kwargs) -> None:
        self.requests: dict[str, FakeRequest] = {}
        self.running: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.plan: list[dict[str, int]] = []  # what each schedule() call schedules
        self.finish: list[list[str]] = []  # what each update_from_output() call finishes
        self.closed = False

    def add(self, req_id: str, request: FakeRequest) -> None:
        self.requests[req_id] = request
        self.running.append(request)

    def add_request(self, request: FakeRequest) -> None:  # vLLM's entry for a new request
        self.add(request.request_id, request)

    def schedule(self, throttle_prefills: bool = False):
        tokens = self.plan.pop(0)
        for req_id, n in tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return SimpleNamespace(num_scheduled_tokens=tokens,
                               total_num_scheduled_tokens=sum(tokens.values()))

    def update_from_output(self, scheduler_output, model_runner_output):
        for req_id in self.finish.pop(0):
            self.running.remove(self.requests.pop(req_id))
        return {0: "outputs"}

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tracing_scheduler.time, "monotonic", lambda: now[0])
    return now


def test_a_step_records_its_prefills_decodes_and_the_kv_it_leaves(tmp_path, clock):
    scheduler = traced(FakeScheduler)()
    scheduler.start_trace(StepTraceWriter(tmp_path, "e"))
    scheduler.add("a", FakeRequest(prompt=100, computed=100))  # decoding
    scheduler.add("b", FakeRequest(prompt=300))  # a prompt in two chunks
    scheduler.plan = [{"a": 1, "b": 200}, {"a": 1, "b": 100}, {"a": 1, "b": 1}]
    scheduler.finish = [[], [], ["a"]]
    for busy in (0.05, 0.04, 0.01):
        out = scheduler.schedule()
        clock[0] += busy
        assert scheduler.update_from_output(out, None) == {0: "outputs"}
        clock[0] += 0.002  # between steps: output processing, the next schedule
    scheduler.shutdown()
    assert scheduler.closed
    steps = read_steps(tmp_path)["e"]
    # The context is what the running requests hold once the step is done; the last step's
    # includes "a", which finished in it.
    # Each step was scheduled after the one before came back: none ahead.
    assert steps == [
        Step(100.05, 200, 1, 1, busy_s=0.05, pending=2, context_tokens=101 + 200, ahead=False),
        Step(pytest.approx(100.092), 100, 1, 1, busy_s=0.04, pending=2, context_tokens=102 + 300,
             ahead=False),
        Step(pytest.approx(100.104), 0, 0, 2, busy_s=0.01, pending=1, context_tokens=103 + 301,
             ahead=False),
    ]


def test_under_async_scheduling_a_step_is_timed_from_the_end_of_the_one_before(tmp_path, clock):
    """vLLM's async scheduling schedules step n+1 before step n's outputs are processed: the
    engine's time for step n+1 starts when step n ends, not when n+1 was scheduled."""
    scheduler = traced(FakeScheduler)()
    scheduler.start_trace(StepTraceWriter(tmp_path, "e"))
    scheduler.add("a", FakeRequest(prompt=10, computed=10))
    scheduler.plan = [{"a": 1}, {"a": 1}, {}]
    scheduler.finish = [[], [], []]
    first = scheduler.schedule()  # t=100
    clock[0] += 0.001
    second = scheduler.schedule()  # t=100.001, while the first runs
    clock[0] += 0.029
    scheduler.update_from_output(first, None)  # t=100.030
    clock[0] += 0.020
    scheduler.update_from_output(second, None)  # t=100.050
    empty = scheduler.schedule()  # nothing scheduled: no step
    scheduler.update_from_output(empty, None)
    steps = read_steps(tmp_path)["e"]
    assert [s.busy_s for s in steps] == [0.03, 0.02]
    assert [s.ahead for s in steps] == [False, True]  # the second was scheduled ahead


def test_a_step_records_when_the_requests_it_started_reached_the_scheduler(tmp_path, clock):
    scheduler = traced(FakeScheduler)()
    scheduler.start_trace(StepTraceWriter(tmp_path, "e"))
    scheduler.add_request(FakeRequest(prompt=100, request_id="a"))  # t=100
    clock[0] += 0.010
    scheduler.add_request(FakeRequest(prompt=300, request_id="b"))  # t=100.01
    clock[0] += 0.005
    scheduler.plan = [{"a": 100, "b": 200}, {"a": 1, "b": 100}]
    scheduler.finish = [[], ["a", "b"]]
    for _ in range(2):
        out = scheduler.schedule()
        clock[0] += 0.05
        scheduler.update_from_output(out, None)
    steps = read_steps(tmp_path)["e"]
    # The first step started both (b's first chunk); the second started none.
    assert steps[0].arrived == [100.0, 100.01] and steps[1].arrived is None
    assert scheduler._arrived == {}


def test_step_shape_counts_a_request_as_prefilling_until_its_prompt_is_computed():
    requests = {"new": FakeRequest(64, computed=64), "chunk": FakeRequest(500, computed=500),
                "dec": FakeRequest(64, computed=80), "pulled": FakeRequest(64, computed=64)}
    scheduler = SimpleNamespace(requests=requests, running=list(requests.values()))
    # "pulled": a decode engine loaded 63 prompt tokens' KV and computes the last one.
    out = SimpleNamespace(num_scheduled_tokens={"new": 64, "chunk": 244, "dec": 1, "pulled": 1})
    assert step_shape(scheduler, out) == (64 + 244 + 1, 3, 1, 64 + 500 + 80 + 64)


def test_the_traced_scheduler_extends_the_class_vllm_would_build(tmp_path, monkeypatch):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    def config(async_scheduling):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    assert vllm_scheduler_cls(config(True)) is AsyncScheduler
    assert vllm_scheduler_cls(config(False)) is Scheduler
    assert issubclass(traced(AsyncScheduler), AsyncScheduler)
    assert traced(Scheduler) is traced(Scheduler)  # one class per base
    # Built without the environment entry, it says what is missing.
    monkeypatch.delenv(TRACE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TRACE_ENV):
        make_traced_scheduler(vllm_config=config(False))
    # With it, the scheduler vLLM would build, tracing to the named file.
    monkeypatch.setenv(TRACE_ENV, trace_environment(str(tmp_path), "prefill-3")[TRACE_ENV])
    monkeypatch.setattr(tracing_scheduler, "vllm_scheduler_cls", lambda cfg: FakeScheduler)
    scheduler = make_traced_scheduler(vllm_config=config(True))
    assert isinstance(scheduler, FakeScheduler)
    scheduler.shutdown()
    assert scheduler._trace.path == tmp_path / "prefill-3.steps.jsonl"
