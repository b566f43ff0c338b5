import json

import pytest

from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.profile import context_cost, kv_bytes_per_token, transfer_from_metrics

pytestmark = pytest.mark.unit

SMOLLM2 = {"num_hidden_layers": 30, "num_key_value_heads": 3, "num_attention_heads": 9,
           "head_dim": 64, "hidden_size": 576, "dtype": "float32"}


def test_kv_bytes_per_token_of_the_embedded_model():
    # 30 layers x 3 KV heads x 64 x (K and V) x 4 bytes: a 128-token block is 5.9 MB, as measured.
    assert kv_bytes_per_token(SMOLLM2) == 46080
    assert kv_bytes_per_token(SMOLLM2) * 128 == 5_898_240
    assert kv_bytes_per_token(SMOLLM2, "bfloat16") == 23040


def test_transfer_rate_from_pdserve_metrics():
    text = "\n".join([
        "# HELP pdserve_kv_transfer_bytes_total bytes",
        'pdserve_kv_transfer_bytes_total{transport="grpc"} 5.31e+07',
        'pdserve_kv_transfer_seconds_sum{transport="grpc"} 0.6',
        'pdserve_kv_transfer_seconds_count{transport="grpc"} 9.0',
    ])
    t = transfer_from_metrics(text)
    assert t["bytes_per_s"] == pytest.approx(5.31e7 / 0.6) and t["pulls"] == 9
    assert transfer_from_metrics("pdserve_requests_total 3\n") is None


def test_a_recorded_profile_loads_into_the_simulator(tmp_path):
    recorded = {"startup_s": 70.0, "ttft_single_ms": {"32": 300.0, "256": 860.0},
                "prefill_tokens_per_s": {"isl256_batch4": 400.0},
                "tpot_ms_by_batch": {"1": 100.0, "2": 110.0, "4": 130.0, "8": 170.0},
                "kv_bytes_per_token": 46080, "block_size": 128, "num_kv_blocks": 182,
                "max_num_seqs": 256, "max_num_batched_tokens": 4096,
                "transfer": {"bytes_per_s": 8.85e7, "overhead_s": 0.0}}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(recorded))
    p = EngineProfile.load(path)
    assert (p.block_size, p.num_kv_blocks, p.startup_s, p.name) == (128, 182, 70.0, "cpu")
    assert p.perf.prefill_tokens_per_s == 400.0
    assert p.perf.decode_step_s == pytest.approx(0.090) and p.perf.decode_step_per_seq_s == pytest.approx(0.010)
    # overhead = mean(0.300 - 32/400, 0.860 - 256/400) = mean(0.22, 0.22)
    assert p.perf.prefill_overhead_s == pytest.approx(0.22)
    assert p.response_s == pytest.approx(0.22 - 0.090)
    assert p.perf.transfer_s(128) == pytest.approx(128 * 46080 / 8.85e7)


def test_the_context_cost_of_a_decode_step():
    # Batch 8 steps took 144 ms with 16-token prompts and 263 ms with 512-token prompts: 119 ms
    # for 8 x 496 more context tokens.
    assert context_cost(144.0, 263.0, 8, 512) == pytest.approx(0.119 / (8 * 496))
    assert context_cost(144.0, 140.0, 8, 512) == 0.0
    with pytest.raises(ValueError, match="context-len"):
        context_cost(144.0, 263.0, 8, 16)
    # The simulator's step then charges it for every context token of the batch.
    p = EngineProfile.from_json({"prefill_tokens_per_s": 400.0, "tpot_ms_by_batch": {"1": 100.0},
                                 "decode_ctx_s_per_token": 3e-5})
    assert p.step_s(0, 8, context_tokens=8 * 300) == pytest.approx(0.100 + 3e-5 * 2400)


def test_a_step_fit_brings_its_own_context_term_in_place_of_the_measured_one():
    measured = {"prefill_tokens_per_s": 400.0, "tpot_ms_by_batch": {"1": 100.0},
                "decode_ctx_s_per_token": 3e-5}
    fit = {"decode_step_s": 0.07, "decode_step_per_seq_s": 0.004, "prefill_tokens_per_s": None}
    with_ctx = EngineProfile.from_json({**measured, "step_fit": {**fit, "decode_ctx_s_per_token": 1e-5}})
    assert with_ctx.step_s(0, 8, context_tokens=2400) == pytest.approx(0.07 + 0.032 + 0.024)
    # A fit that could not tell a context term: its slope carries the context already.
    without = EngineProfile.from_json({**measured, "step_fit": {**fit, "decode_ctx_s_per_token": None}})
    assert without.decode_ctx_s_per_token == 0.0
    assert EngineProfile.from_json({**measured, "step_fit": fit}).decode_ctx_s_per_token == 0.0
    # An explicit override still wins (what-if runs).
    assert EngineProfile.from_json({**measured, "step_fit": fit},
                                   decode_ctx_s_per_token=2e-5).decode_ctx_s_per_token == 2e-5


def test_the_context_cost_pairs_its_batches_so_a_drifting_machine_cancels_out(monkeypatch):
    import asyncio

    from pdserve.sim import profile

    # The machine slows by 10 ms per measurement; long (512-token) prompts add 40 ms a step.
    calls = []

    async def decode_tpots(client, rng, batch, prompt_len, output_len, vocab):
        calls.append(prompt_len)
        step = 0.100 + 0.010 * (len(calls) - 1) + (0.040 if prompt_len == 512 else 0.0)
        return [step] * batch

    monkeypatch.setattr(profile, "_decode_tpots", decode_tpots)
    raw = {"tpot_s": {}}
    out = asyncio.run(profile._context_cost(None, None, 8, 512, 32, 1000, 3, raw))
    assert calls == [profile.SHORT_PROMPT, 512] * 3  # short then long, three times
    # Each pair sees 40 ms plus one step of drift; an unpaired short batch measured before
    # the others (as profiles did until session 9) would also count the drift of the pairs.
    expected = context_cost(100.0, 150.0, 8, 512)
    assert out["decode_ctx_s_per_token"] == pytest.approx(expected)
    assert raw["decode_ctx_s_per_token_pairs"] == pytest.approx([expected] * 3)


def test_request_tpot_counts_tokens_not_stream_chunks():
    from pdserve.bench.client import RequestOutcome
    from pdserve.sim.profile import request_tpots

    # 9 tokens at 5 ms steps arriving two to a chunk: 5 chunks, gaps of 10 ms, TPOT 5 ms.
    paired = RequestOutcome(success=True, prompt_len=16, ttft_s=0.1, itls_s=(0.01,) * 4, e2el_s=0.14,
                            output_tokens=9, chunk_count=5)
    # No usage from the server: the chunk count is the fallback (one token per chunk here).
    plain = RequestOutcome(success=True, prompt_len=16, ttft_s=0.1, itls_s=(0.02,) * 3, e2el_s=0.16,
                           chunk_count=4)
    single = RequestOutcome(success=True, prompt_len=16, ttft_s=0.1, e2el_s=0.1, output_tokens=1, chunk_count=1)
    assert request_tpots([paired, plain, single]) == pytest.approx([0.005, 0.02])


def test_long_prompts_are_prefilled_once_before_their_decode_is_timed():
    import asyncio

    import numpy as np

    from pdserve.bench.client import RequestOutcome
    from pdserve.sim.profile import SHORT_PROMPT, _decode_tpots

    class Client:
        def __init__(self):
            self.sent = []

        async def send(self, request):
            self.sent.append(request)
            n = request.output_len
            return RequestOutcome(success=True, prompt_len=request.prompt_len, ttft_s=0.05,
                                  e2el_s=0.05 + 0.01 * (n - 1), output_tokens=n, chunk_count=n)

    client = Client()
    tpots = asyncio.run(_decode_tpots(client, np.random.default_rng(0), 3, 512, 8, 30000))
    assert tpots == pytest.approx([0.01] * 3)
    warm, timed = client.sent[:3], client.sent[3:]
    assert [r.output_len for r in warm] == [1] * 3 and [r.output_len for r in timed] == [8] * 3
    assert [r.prompt for r in timed] == [r.prompt for r in warm]  # the same prompts: cached
    assert len({r.prompt for r in timed}) == 3

    short = Client()
    asyncio.run(_decode_tpots(short, np.random.default_rng(0), 3, SHORT_PROMPT, 8, 30000))
    assert [r.output_len for r in short.sent] == [8] * 3  # one step prefills them all: no warm pass
