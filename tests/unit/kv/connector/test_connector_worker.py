"""The connector's worker side over the fake transport, driven by real scheduler-side plans:
pins, leases, pulls, failures, exactly-once completion reports, and the step window (a pull
reported in its own step when it ends while the GPU still runs the step before)."""

from __future__ import annotations

import time

import pytest
import torch
from connector_fakes import BLOCK, WAIT_S, FakeRequest, FakeTransports, Status, Stepping, config, kv_caches

from pdserve.kv.connector import worker_side
from pdserve.kv.connector.compat import ScheduledRequest
from pdserve.kv.connector.metadata import StepPlan
from pdserve.kv.connector.scheduler_side import SchedulerSide
from pdserve.kv.connector.step_window import ClosedWindow, StepWindow
from pdserve.kv.connector.worker_side import WorkerSide

pytestmark = pytest.mark.unit

NUM_BLOCKS = 16


class Engine(Stepping):
    """One engine's two connector sides (scheduler + one worker) over shared fake transports."""

    def __init__(
        self,
        role: str,
        transports: FakeTransports,
        *,
        seed: int,
        window: StepWindow | None = None,
        **extra: object,
    ):
        self.config = config(role, **extra)
        self.scheduler = SchedulerSide(self.config, engine_id=f"{role}-engine", block_size=BLOCK)
        self.worker = WorkerSide(
            self.config,
            engine_id=f"{role}-engine",
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            model_id="m",
            transports=transports,
            window=window,
        )
        self.caches = kv_caches(NUM_BLOCKS, seed=seed)
        self.worker.register_kv_caches(self.caches, tp_rank=0, tp_size=1)
        self.scheduler.set_endpoints({0: self.worker.endpoint()})
        self.sent: list[str] = []
        self.received: list[str] = []
        self.load_errors: set[int] = set()

    def step(self, scheduled: list[ScheduledRequest] | None = None, tokens: int = 0) -> StepPlan:
        """One engine step as vLLM's hooks run it: plan, bind (the window opens, the plan is
        applied), forward, report."""
        plan = self.scheduler.build_step_plan(scheduled or [], tokens)
        self.worker.begin_step()
        self.worker.apply(plan)
        sending, recving = self.worker.get_finished()
        self.sent += sorted(sending)
        self.received += sorted(recving)
        self.load_errors |= self.worker.take_load_errors()
        return plan

    def block(self, block_id: int) -> torch.Tensor:
        return torch.stack([t[block_id] for t in self.caches.values()])


def prefill(engine: Engine, prompt: int, request_id: str = "p-1") -> tuple[FakeRequest, dict]:
    """Runs a prefill request through its one step and request_finished; returns its params."""
    request = FakeRequest(request_id, prompt, {"do_remote_decode": True})
    n = -(-prompt // BLOCK)
    engine.scheduler.update_state_after_alloc(request, list(range(n)), 0)
    engine.step([ScheduledRequest(request_id, tuple(range(n)), True, 0, prompt)], prompt)
    request.num_computed_tokens, request.status = prompt, Status.FINISHED_LENGTH_CAPPED
    keep, params = engine.scheduler.request_finished(request, list(range(n + 1)))
    assert keep is True and params is not None
    return request, params


def start_decode(engine: Engine, prompt: int, params: dict, request_id: str = "d-1") -> list[int]:
    """Admits a decode request into fresh blocks 8.. and plans its pull; returns those blocks."""
    request = FakeRequest(request_id, prompt + 1, params)
    count, is_async = engine.scheduler.get_num_new_matched_tokens(request, 0)
    assert (count, is_async) == (prompt, True)
    dst = list(range(8, 8 + -(-prompt // BLOCK)))
    engine.scheduler.update_state_after_alloc(request, dst, count)
    return dst


def test_decode_pulls_the_prompt_blocks_and_both_sides_report_once(transports: FakeTransports) -> None:
    p, d = Engine("kv_producer", transports, seed=1), Engine("kv_consumer", transports, seed=2)
    _, params = prefill(p, 300)
    p.step()  # confirm
    dst = start_decode(d, 300, params)

    d.step_until(lambda: d.received, "the pull")
    p.step_until(lambda: p.sent, "the prefill release")

    assert d.received == ["d-1"] and p.sent == ["p-1"] and not d.load_errors
    for src_block, dst_block in zip(params["remote_block_ids"], dst, strict=True):
        assert torch.equal(p.block(src_block), d.block(dst_block))
    for _ in range(3):
        p.step(), d.step()
    assert d.received == ["d-1"] and p.sent == ["p-1"]  # exactly once
    assert p.worker.num_outstanding == d.worker.num_outstanding == 0
    (record,) = d.worker.history
    assert record.nbytes == 3 * 3 * p.caches["model.layers.0.self_attn.attn"][0].numel() * 4


def test_pull_before_vllm_confirms_is_reported_at_the_confirm(transports: FakeTransports) -> None:
    p, d = Engine("kv_producer", transports, seed=1), Engine("kv_consumer", transports, seed=2)
    _, params = prefill(p, 200)  # pinned in its step; the confirm is still pending
    start_decode(d, 200, params)
    d.step_until(lambda: d.received, "the pull")
    assert not p.sent

    p.step()  # the confirm arrives after the pin already ended

    assert p.sent == ["p-1"]


def test_unpulled_pin_is_reported_when_its_lease_expires(transports: FakeTransports) -> None:
    transports.lease_s = 0.2
    p = Engine("kv_producer", transports, seed=1, lease_s=0.2)
    prefill(p, 200)
    p.step()

    p.step_until(lambda: p.sent, "lease expiry")
    assert p.sent == ["p-1"] and p.worker.num_outstanding == 0


def test_lease_that_expired_before_the_confirm_is_renewed(transports: FakeTransports) -> None:
    p = Engine("kv_producer", transports, seed=1, lease_s=0.2)
    _, params = prefill(p, 200)
    time.sleep(0.5)  # the pin made in the prefill step expired; the confirm comes late
    p.step()
    assert not p.sent
    assert transports.sources[0].pinned_blocks(params["remote_request_id"]) == (0, 1)


def test_dropped_prefill_is_never_reported(transports: FakeTransports) -> None:
    p = Engine("kv_producer", transports, seed=1)
    request = FakeRequest("p-1", 200, {"do_remote_decode": True})
    p.scheduler.update_state_after_alloc(request, [0, 1], 0)
    p.step([ScheduledRequest("p-1", (0, 1), True, 0, 200)], 200)
    assert transports.sources[0].pinned_blocks("p-1") == (0, 1)
    request.status = Status.FINISHED_ABORTED

    assert p.scheduler.request_finished(request, [0, 1]) == (False, None)
    p.step()

    assert transports.sources[0].pinned_blocks("p-1") is None
    assert not p.sent and p.worker.num_outstanding == 0


@pytest.mark.parametrize("trouble", ["fail", "kill"])
def test_failed_pull_reports_its_blocks_as_load_errors_with_the_request(
    transports: FakeTransports, trouble: str
) -> None:
    p, d = Engine("kv_producer", transports, seed=1), Engine("kv_consumer", transports, seed=2)
    _, params = prefill(p, 300)
    p.step()
    if trouble == "fail":
        transports.fabric.fail_with = "injected failure"
    else:
        transports.fabric.kill(params["remote_address"])
    dst = start_decode(d, 300, params)

    def reported() -> bool:
        d.step()
        return bool(d.received)

    deadline = time.monotonic() + WAIT_S
    while not reported():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # The errors arrive in the same step as the receiving report, as vLLM requires.
    assert d.received == ["d-1"] and d.load_errors == set(dst)
    assert d.worker.history[-1].error is not None
    if trouble == "fail":  # a reachable source was told to release: its engine frees the blocks
        p.step_until(lambda: p.sent, "the release after the failure")


def test_decode_aborted_mid_pull_is_reported_once_the_pull_ends(transports: FakeTransports) -> None:
    transports.fabric.delay_s = 0.05
    p, d = Engine("kv_producer", transports, seed=1), Engine("kv_consumer", transports, seed=2)
    _, params = prefill(p, 300)
    p.step()
    start_decode(d, 300, params)
    d.step()  # the pull starts
    aborted = FakeRequest("d-1", 301, params, status=Status.FINISHED_ABORTED)
    assert d.scheduler.request_finished(aborted, list(range(8, 11))) == (False, None)

    d.step_until(lambda: d.received, "the pull to end")
    p.step_until(lambda: p.sent, "the source pin to end")
    assert d.received == ["d-1"] and p.sent == ["p-1"]


def test_release_in_a_plan_ends_the_remote_pin(transports: FakeTransports) -> None:
    p, d = Engine("kv_producer", transports, seed=1), Engine("kv_consumer", transports, seed=2)
    _, params = prefill(p, 200)
    p.step()
    request = FakeRequest("d-1", 201, params, status=Status.FINISHED_ABORTED)
    d.scheduler.request_finished(request, [])  # aborted before the scheduler ever admitted it

    d.step()

    p.step_until(lambda: p.sent, "the remote release")
    assert not d.received


def test_a_plan_is_applied_once_however_many_hooks_pass_it(transports: FakeTransports) -> None:
    p, d = Engine("kv_producer", transports, seed=1), Engine("kv_consumer", transports, seed=2)
    _, params = prefill(p, 200)
    p.step()
    start_decode(d, 200, params)
    plan = d.scheduler.build_step_plan([], 0)
    for _ in range(3):  # bind_connector_metadata, start_load_kv, get_finished
        d.worker.apply(plan)
    assert len(d.worker._pulls) == 1


def test_idle_steps_with_outstanding_transfers_sleep(transports: FakeTransports, monkeypatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(worker_side.time, "sleep", sleeps.append)
    p = Engine("kv_producer", transports, seed=1)
    prefill(p, 200)

    p.step(tokens=0)  # confirm only: nothing scheduled, a pin outstanding
    p.step(tokens=5)  # a busy step never sleeps

    assert sleeps == [p.config.idle_sleep_s]


# ---- the step window: a pull reported in its own step ------------------------------------------


class BusyGpu:
    """A step window under the test's control: open from `open()` (the step's bind) for
    `checks` calls of `is_open` (None: until the step's report closes it), as if the GPU ran
    the step before that long."""

    def __init__(self, checks: int | None = None):
        self.checks = checks
        self.opened = 0
        self._left: int | None = None
        self._open = False

    def open(self) -> None:
        self.opened += 1
        self._open, self._left = True, self.checks

    def is_open(self) -> bool:
        if self._left is not None:
            self._left -= 1
            self._open = self._open and self._left >= 0
        return self._open

    def close(self) -> None:
        self._open = False


def test_pull_ending_while_the_gpu_runs_the_step_before_is_reported_in_its_own_step(
    transports: FakeTransports,
) -> None:
    # vLLM admits a request the second step after the one whose get_finished reported its pull:
    # reported in the step that started it, it decodes a step earlier than one step later.
    transports.fabric.delay_s = 0.005  # per piece: the pull still moves when get_finished comes
    p = Engine("kv_producer", transports, seed=1)
    d = Engine("kv_consumer", transports, seed=2, window=BusyGpu())
    _, params = prefill(p, 300)
    p.step()
    dst = start_decode(d, 300, params)

    d.step(tokens=7)  # bind starts the pull; get_finished waits while the GPU is busy

    assert d.received == ["d-1"] and not d.load_errors
    for src_block, dst_block in zip(params["remote_block_ids"], dst, strict=True):
        assert torch.equal(p.block(src_block), d.block(dst_block))
    assert d.worker.num_outstanding == 0


def test_the_wait_ends_with_the_step_before(transports: FakeTransports) -> None:
    transports.fabric.delay_s = 0.3
    p = Engine("kv_producer", transports, seed=1)
    gpu = BusyGpu(checks=3)
    d = Engine("kv_consumer", transports, seed=2, window=gpu)
    _, params = prefill(p, 300)
    p.step()
    start_decode(d, 300, params)

    d.step(tokens=7)  # the GPU finishes the step before long before the pull ends

    assert not d.received and d.worker.num_outstanding == 1 and gpu.opened == 1
    d.step_until(lambda: d.received, "the pull, reported in a later step")
    assert d.received == ["d-1"]


@pytest.mark.parametrize("case", ["unbound step", "no wait configured", "capped"])
def test_no_wait_without_an_open_window_or_past_the_cap(transports: FakeTransports, case: str) -> None:
    transports.fabric.delay_s = 0.3
    p = Engine("kv_producer", transports, seed=1)
    extra = {"step_wait_max_s": 0 if case == "no wait configured" else 0.02}
    d = Engine("kv_consumer", transports, seed=2, window=BusyGpu(), **extra)
    _, params = prefill(p, 300)
    p.step()
    start_decode(d, 300, params)
    plan = d.scheduler.build_step_plan([], 7)

    if case != "unbound step":
        d.worker.begin_step()
    d.worker.apply(plan)
    _, recving = d.worker.get_finished()

    assert not recving and d.worker.num_outstanding == 1
    assert not d.worker.window.is_open()  # the report closes the step's window


class BrokenGpu(BusyGpu):
    def is_open(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failing_window_is_dropped_and_the_step_still_reports(transports: FakeTransports) -> None:
    transports.fabric.delay_s = 0.3  # the pull is still running when the step asks the window
    p = Engine("kv_producer", transports, seed=1)
    d = Engine("kv_consumer", transports, seed=2, window=BrokenGpu())
    _, params = prefill(p, 300)
    p.step()
    start_decode(d, 300, params)

    d.step(tokens=7)

    assert isinstance(d.worker.window, ClosedWindow)
    d.step_until(lambda: d.received, "the pull, reported without the window")


def test_a_cpu_kv_cache_gets_no_window(transports: FakeTransports) -> None:
    d = Engine("kv_consumer", transports, seed=2)
    assert isinstance(d.worker.window, ClosedWindow)


def test_the_facade_opens_the_window_at_bind_so_get_finished_reports_the_pull(
    transports: FakeTransports,
) -> None:
    # vLLM's hook order in a step: bind_connector_metadata, start_load_kv, (forward),
    # wait_for_save, get_finished.
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdserve.kv.connector.config import kv_transfer_config
    from pdserve.kv.connector.connector import PdserveConnector, PdserveConnectorMetadata

    transports.fabric.delay_s = 0.005
    p = Engine("kv_producer", transports, seed=1)
    d = Engine("kv_consumer", transports, seed=2, window=BusyGpu())
    _, params = prefill(p, 300)
    p.step()
    start_decode(d, 300, params)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(**kv_transfer_config("decode", "grpc", "t", engine_id="d")),
        cache_config=SimpleNamespace(block_size=BLOCK),
        model_config=SimpleNamespace(served_model_name="m", model="m"),
    )
    facade = PdserveConnector(vllm_config, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))
    facade.worker_side = d.worker

    facade.bind_connector_metadata(PdserveConnectorMetadata(d.scheduler.build_step_plan([], 7)))
    facade.start_load_kv(None)
    facade.wait_for_save()
    sending, recving = facade.get_finished(set())

    assert recving == {"d-1"} and sending is None
    assert d.worker.window.opened == 1 and not d.worker.window.is_open()
