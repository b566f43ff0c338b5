"""The connector's scheduler side with fake vLLM requests: what it reports to vLLM's scheduler,
and what it plans for the worker side."""

from __future__ import annotations

import pytest
from connector_fakes import BLOCK, FakeRequest, Status, remote_params, scheduler_side

from pdserve.kv.connector.compat import ScheduledRequest
from pdserve.kv.connector.metadata import KVPin, RemotePrefill
from pdserve.kv.connector.scheduler_side import SchedulerSide

pytestmark = pytest.mark.unit


def blocks(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def decode_request(num_prompt_tokens: int, request_id: str = "d-1") -> FakeRequest:
    """A decode request: prompt + first token, with the prefill engine's params."""
    return FakeRequest(request_id, num_prompt_tokens + 1, remote_params(num_prompt_tokens))


# ---- decode side: how many tokens come from the prefill engine ---------------------------------


@pytest.mark.parametrize(
    ("prompt", "local_hit", "expected_tokens", "pulled"),
    [
        (1, 0, 1, [0]),  # a one-token prompt still moves its (partial) block
        (127, 0, 127, [0]),
        (128, 0, 128, [0]),  # exactly one block
        (129, 0, 129, [0, 1]),  # one token into a second block
        (300, 0, 300, [0, 1, 2]),  # not a multiple of the block size
        (300, 128, 172, [1, 2]),  # first block cached locally: pull the rest
        (300, 256, 44, [2]),
    ],
)
def test_decode_request_loads_the_uncached_prompt_asynchronously(
    prompt: int, local_hit: int, expected_tokens: int, pulled: list[int]
) -> None:
    side = scheduler_side()
    request = decode_request(prompt)

    assert side.get_num_new_matched_tokens(request, local_hit) == (expected_tokens, True)
    assert side.get_num_new_matched_tokens(request, local_hit) == (expected_tokens, True)  # no side effect
    local_blocks = blocks(-(-(local_hit + expected_tokens) // BLOCK))
    side.update_state_after_alloc(request, local_blocks, expected_tokens)
    (pull,) = side.build_step_plan([], 0).pulls

    remote = remote_params(prompt)["remote_block_ids"]
    assert pull.request_id == "d-1"
    assert list(pull.src_block_ids) == [remote[i] for i in pulled]
    assert list(pull.dst_block_ids) == [local_blocks[i] for i in pulled]
    assert pull.remote.remote_request_id == "p-1" and pull.remote.remote_address == "10.0.0.1:5000"


def test_fully_cached_prompt_pulls_nothing_and_releases_the_remote_pin() -> None:
    side = scheduler_side()
    request = decode_request(256)
    assert side.get_num_new_matched_tokens(request, 256) == (0, False)
    side.update_state_after_alloc(request, blocks(3), 0)

    plan = side.build_step_plan([], 0)
    assert not plan.pulls
    assert [r.remote.remote_request_id for r in plan.releases] == ["p-1"]
    assert side.request_finished(request, blocks(3)) == (False, None)
    assert not side.build_step_plan([], 0).releases  # released once
    assert side.num_tracked == 0


def test_unaligned_local_hit_is_computed_locally() -> None:
    side = scheduler_side()
    assert side.get_num_new_matched_tokens(decode_request(300), 64) == (0, False)


def test_prompt_without_the_first_token_still_leaves_one_token_to_compute() -> None:
    side = scheduler_side()
    request = FakeRequest("d-1", 300, remote_params(300))  # frontend forgot the first token
    assert side.get_num_new_matched_tokens(request, 0) == (299, True)


def test_plain_and_prefill_requests_load_nothing() -> None:
    side = scheduler_side()
    assert side.get_num_new_matched_tokens(FakeRequest("x", 50), 0) == (0, False)
    prefill = FakeRequest("p", 50, {"do_remote_decode": True})
    assert side.get_num_new_matched_tokens(prefill, 0) == (0, False)


def test_prefill_only_engine_ignores_decode_requests() -> None:
    side = scheduler_side("kv_producer")
    assert side.get_num_new_matched_tokens(decode_request(200), 0) == (0, False)


@pytest.mark.parametrize(
    "bad",
    [{"remote_block_ids": "1,2"}, {"num_prompt_tokens": 0}, {"remote_address": None}, {"wire_version": 99}],
)
def test_malformed_params_are_computed_locally(bad: dict) -> None:
    side = scheduler_side()
    request = FakeRequest("d-1", 201, {**remote_params(200), **bad})
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, blocks(2), 0)
    assert side.build_step_plan([], 0).is_empty  # nothing to release: the params are unusable
    assert side.request_finished(request, blocks(2)) == (False, None)
    assert side.num_tracked == 0


def test_decode_aborted_before_allocation_releases_the_remote_pin() -> None:
    side = scheduler_side()
    request = decode_request(200)
    side.get_num_new_matched_tokens(request, 0)
    request.status = Status.FINISHED_ABORTED

    assert side.request_finished(request, []) == (False, None)
    (release,) = side.build_step_plan([], 0).releases
    assert release.remote.remote_request_id == "p-1"
    assert side.num_tracked == 0


def test_decode_aborted_before_the_scheduler_saw_it_releases_too() -> None:
    side = scheduler_side()
    request = decode_request(200)
    request.status = Status.FINISHED_ABORTED
    side.request_finished(request, [])
    assert len(side.build_step_plan([], 0).releases) == 1


def test_decode_aborted_mid_pull_leaves_the_pull_to_finish() -> None:
    side = scheduler_side()
    request = decode_request(200)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks(2), 200)
    assert len(side.build_step_plan([], 0).pulls) == 1
    request.status = Status.FINISHED_ABORTED

    # The worker reports the pull finished (it releases the remote pin itself); no release here.
    assert side.request_finished(request, blocks(2)) == (False, None)
    assert side.build_step_plan([], 0).is_empty
    assert side.num_tracked == 0


def test_preempted_decode_request_does_not_pull_twice() -> None:
    side = scheduler_side()
    request = decode_request(200)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, blocks(2), 200)
    side.build_step_plan([], 0)
    # Preempted later and rescheduled: its KV is recomputed locally.
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, blocks(3), 0)
    assert side.build_step_plan([], 0).is_empty


# ---- prefill side: pin, confirm or drop ----------------------------------------------------


def run_prefill(
    side: SchedulerSide, prompt: int, chunks: list[int] | None = None
) -> tuple[FakeRequest, list]:
    """Allocates and schedules a prefill request in `chunks`; returns it and each step's pins."""
    request = FakeRequest("p-1", prompt, {"do_remote_decode": True})
    side.update_state_after_alloc(request, blocks(-(-prompt // BLOCK)), 0)
    pins, done = [], 0
    for i, chunk in enumerate(chunks or [prompt]):
        end = -(-(done + chunk) // BLOCK)
        new = blocks(end) if i == 0 else blocks(end - (-(-done // BLOCK)), 100 + (-(-done // BLOCK)))
        scheduled = ScheduledRequest("p-1", tuple(new), i == 0, done, chunk)
        pins.append(side.build_step_plan([scheduled], chunk).pins)
        done += chunk
    request.num_computed_tokens = prompt
    return request, pins


@pytest.mark.parametrize("prompt", [1, 127, 128, 129, 700])
def test_prefill_pins_its_prompt_blocks_when_the_prompt_completes(prompt: int) -> None:
    side = scheduler_side()
    _, pins = run_prefill(side, prompt)
    assert pins == [(KVPin("p-1", tuple(blocks(-(-prompt // BLOCK)))),)]


def test_chunked_prefill_pins_once_at_the_last_chunk() -> None:
    side = scheduler_side()
    _, pins = run_prefill(side, 600, chunks=[256, 256, 88])
    assert pins[:2] == [(), ()]
    assert pins[2] == (KVPin("p-1", tuple(blocks(5))),)


def test_finished_prefill_keeps_its_blocks_and_returns_transfer_params() -> None:
    side = scheduler_side()
    request, _ = run_prefill(side, 300)
    request.status = Status.FINISHED_LENGTH_CAPPED

    # vLLM 0.24 passes every allocated block (here one more for the sampled token).
    keep, params = side.request_finished(request, blocks(4))

    assert keep is True
    assert (
        params == RemotePrefill("engine-p", "p-1", "10.0.0.1:5000", (100, 101, 102), 300, "grpc").to_params()
    )
    assert side.build_step_plan([], 0).confirms == (KVPin("p-1", (100, 101, 102)),)
    assert side.num_tracked == 0


@pytest.mark.parametrize("status", [Status.FINISHED_ABORTED, Status.FINISHED_ERROR, Status.FINISHED_STOPPED])
def test_prefill_that_will_not_be_decoded_frees_at_once(status: Status) -> None:
    side = scheduler_side()
    request, _ = run_prefill(side, 300)
    request.status = status

    assert side.request_finished(request, blocks(3)) == (False, None)
    plan = side.build_step_plan([], 0)
    assert plan.drops == ("p-1",) and not plan.confirms


def test_prefill_aborted_before_its_last_chunk_has_no_pin_to_drop() -> None:
    side = scheduler_side()
    request = FakeRequest("p-1", 600, {"do_remote_decode": True}, num_computed_tokens=256)
    side.update_state_after_alloc(request, blocks(2), 0)
    side.build_step_plan([ScheduledRequest("p-1", tuple(blocks(2)), True, 0, 256)], 256)
    request.status = Status.FINISHED_ABORTED

    assert side.request_finished(request, blocks(2)) == (False, None)
    assert side.build_step_plan([], 0).is_empty


def test_prefill_preempted_after_its_pin_drops_the_stale_pin() -> None:
    side = scheduler_side()
    request, _ = run_prefill(side, 300)
    side.update_state_after_alloc(request, blocks(3, first=200), 0)  # rescheduled into new blocks
    plan = side.build_step_plan([ScheduledRequest("p-1", tuple(blocks(3, first=200)), True, 0, 300)], 300)
    assert plan.drops == ("p-1",)
    assert plan.pins == (KVPin("p-1", (200, 201, 202)),)


def test_prefill_without_a_source_address_frees_at_once() -> None:
    side = SchedulerSide(scheduler_side().config, engine_id="engine-p", block_size=BLOCK)  # no endpoints
    request, _ = run_prefill(side, 300)
    request.status = Status.FINISHED_LENGTH_CAPPED
    assert side.request_finished(request, blocks(3)) == (False, None)


def test_prefill_with_tensor_parallel_workers_names_every_rank() -> None:
    side = scheduler_side(tp_addresses=("h:1", "h:2"))
    request, _ = run_prefill(side, 130)
    request.status = Status.FINISHED_LENGTH_CAPPED
    _, params = side.request_finished(request, blocks(2))
    assert params["remote_address"] == "h:1" and params["remote_tp_addresses"] == ["h:1", "h:2"]
    assert RemotePrefill.from_params(params).source_addresses[1] == "h:2"


def test_decode_only_engine_frees_prefill_requests_at_once() -> None:
    side = scheduler_side("kv_consumer")
    request = FakeRequest("p-1", 300, {"do_remote_decode": True}, 300, Status.FINISHED_LENGTH_CAPPED)
    side.update_state_after_alloc(request, blocks(3), 0)
    assert side.request_finished(request, blocks(3)) == (False, None)
    assert side.build_step_plan([], 0).is_empty


def test_a_step_plan_without_tracked_prefills_does_not_walk_the_scheduled_requests() -> None:
    """A decode engine's plan is built every step over its whole batch; with no prefill to pin
    it must not touch the (lazily built) list of scheduled requests."""
    side = scheduler_side()

    def scheduled():
        raise AssertionError("walked the scheduled requests")
        yield  # pragma: no cover

    assert side.build_step_plan(scheduled(), 100).num_scheduled_tokens == 100
