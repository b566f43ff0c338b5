"""The connector across TP sizes: a prefill engine of TP P and a decode engine of TP D, each
worker a `WorkerSide` of its rank over the fake transport, driven by real scheduler plans. Each
decode rank ends with its KV heads; both engines report the request exactly once."""

from __future__ import annotations


import pytest
import torch
from connector_fakes import BLOCK, FakeRequest, FakeTransports, Status, Stepping, config

from pdserve.kv.connector.compat import KVHeads, ScheduledRequest, heads_axis
from pdserve.kv.connector.scheduler_side import SchedulerSide
from pdserve.kv.connector.worker_side import WorkerSide

pytestmark = pytest.mark.unit

NUM_BLOCKS = 16
TOTAL_HEADS = 2
HEAD_SIZE = 4
LAYERS = 2


class TPEngine(Stepping):
    """One engine: its scheduler side and one worker side per TP rank (vLLM 0.32-shaped caches:
    [blocks, kv_heads, block_size, 2*head_size] per layer)."""

    def __init__(self, role: str, tp_size: int, transports: FakeTransports, *, seed: int):
        self.scheduler = SchedulerSide(config(role), engine_id=f"{role}-tp{tp_size}", block_size=BLOCK)
        local = TOTAL_HEADS // tp_size
        generator = torch.Generator().manual_seed(seed)
        self.caches, self.workers = [], []
        for rank in range(tp_size):
            buffer = torch.randn(LAYERS, NUM_BLOCKS, local, BLOCK, 2 * HEAD_SIZE, generator=generator)
            caches = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}
            worker = WorkerSide(
                config(role),
                engine_id=f"{role}-tp{tp_size}",
                block_size=BLOCK,
                num_blocks=NUM_BLOCKS,
                model_id="m",
                transports=transports,
            )
            heads = KVHeads(TOTAL_HEADS, local, HEAD_SIZE)
            worker.register_kv_caches(caches, tp_rank=rank, tp_size=tp_size, heads=heads)
            self.caches.append(caches)
            self.workers.append(worker)
        self.scheduler.set_endpoints({rank: w.endpoint() for rank, w in enumerate(self.workers)})
        self.sent = [[] for _ in self.workers]
        self.received = [[] for _ in self.workers]
        self.load_errors: set[int] = set()

    def step(self, scheduled: list[ScheduledRequest] | None = None, tokens: int = 0) -> None:
        plan = self.scheduler.build_step_plan(scheduled or [], tokens)
        for rank, worker in enumerate(self.workers):
            worker.apply(plan)
            sending, recving = worker.get_finished()
            self.sent[rank] += sorted(sending)
            self.received[rank] += sorted(recving)
            self.load_errors |= worker.take_load_errors()

    def heads_of_block(self, block: int) -> torch.Tensor:
        """Every layer's block `block` with all ranks' heads side by side: [layers, heads, ...]."""
        return torch.stack(
            [torch.cat([c[name][block] for c in self.caches]) for name in self.caches[0]]
        )


def hand_off(p: TPEngine, d: TPEngine, prompt: int) -> tuple[bool, dict, list[int]]:
    """Prefills `prompt` tokens on p and admits its decode on d: (keep, params, decode blocks)."""
    request = FakeRequest("p-1", prompt, {"do_remote_decode": True})
    n = -(-prompt // BLOCK)
    p.scheduler.update_state_after_alloc(request, list(range(n)), 0)
    p.step([ScheduledRequest("p-1", tuple(range(n)), True, 0, prompt)], prompt)
    request.num_computed_tokens, request.status = prompt, Status.FINISHED_LENGTH_CAPPED
    keep, params = p.scheduler.request_finished(request, list(range(n + 1)))
    p.step()  # confirm
    decode = FakeRequest("d-1", prompt + 1, params)
    count, _ = d.scheduler.get_num_new_matched_tokens(decode, 0)
    dst = list(range(8, 8 + n))
    d.scheduler.update_state_after_alloc(decode, dst, count)
    return keep, params, dst


def run_request(p: TPEngine, d: TPEngine, prompt: int = 300) -> tuple[dict, list[int]]:
    keep, params, dst = hand_off(p, d, prompt)
    assert keep and params is not None
    d.step_until(lambda: all(d.received), "every decode rank's pull")
    p.step_until(lambda: all(p.sent), "every prefill rank's release")
    return params, dst


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_every_decode_rank_gets_its_heads_and_both_engines_report_once(
    transports: FakeTransports, prefill_tp: int, decode_tp: int
) -> None:
    p = TPEngine("kv_producer", prefill_tp, transports, seed=1)
    d = TPEngine("kv_consumer", decode_tp, transports, seed=2)

    params, dst = run_request(p, d)

    for src_block, dst_block in zip(params["remote_block_ids"], dst, strict=True):
        assert torch.equal(p.heads_of_block(src_block), d.heads_of_block(dst_block))
    for _ in range(3):
        p.step(), d.step()
    assert d.received == [["d-1"]] * decode_tp and p.sent == [["p-1"]] * prefill_tp  # exactly once
    assert not d.load_errors
    assert all(w.num_outstanding == 0 for w in p.workers + d.workers)


def test_a_failed_part_fails_the_request_with_every_destination_block(transports: FakeTransports) -> None:
    p = TPEngine("kv_producer", 2, transports, seed=1)
    d = TPEngine("kv_consumer", 1, transports, seed=2)
    transports.fabric.kill(p.workers[1].source.address)  # prefill rank 1 is gone

    params, dst = run_request_expecting_failure(p, d)

    assert d.load_errors == set(dst)
    (record,) = d.workers[0].history
    assert record.error is not None and p.workers[1].source is not None
    assert params["remote_tp_addresses"][1] in record.error


def run_request_expecting_failure(p: TPEngine, d: TPEngine, prompt: int = 300) -> tuple[dict, list[int]]:
    _, params, dst = hand_off(p, d, prompt)
    d.step_until(lambda: all(d.received), "the failed pull")
    p.step_until(lambda: p.sent[0], "prefill rank 0's release after the failure")
    return params, dst


def test_heads_axis_of_each_vllm_layout():
    heads = KVHeads(total=8, local=4, head_size=128)
    assert heads_axis((100, 4, 16, 256), heads, bhnc=True) == 1  # 0.32: [B, H, N, C]
    assert heads_axis((2, 100, 16, 4, 128), heads, bhnc=False) == 3  # 0.24 FlashAttention
    assert heads_axis((100, 2, 16, 4, 128), heads, bhnc=False) == 3  # 0.24 FlashInfer
    assert heads_axis((100, 16, 576), heads, bhnc=False) is None  # MLA: no heads axis
    assert heads_axis((100, 2, 16, 4, 128), heads, bhnc=True) is None  # not the 0.32 shape
