"""A prefill engine of tensor-parallel size 1 hands its KV to a decode engine of size 2 over NCCL, and
the service serves every request in full (3 GPUs)."""

import pytest

from gpu_deploy import gpu_host, serve, token_prompts

pytestmark = pytest.mark.gpu

OUTPUT_TOKENS = 64


def test_prefill_tp1_to_decode_tp2_serves(tmp_path, record_property):
    model_dir = gpu_host(3)
    prompts = token_prompts(8, 500, 2000, seed=0)
    deployment = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--prefill-tp", "1",
                  "--decode-tp", "2", "--transport", "nccl"]
    completions, kv = serve(model_dir, deployment, prompts, OUTPUT_TOKENS, tmp_path / "p1-d2.log",
                            min_pulls=len(prompts))
    record_property("kv_pulls", kv.pulls)
    record_property("kv_bytes", kv.bytes)
    record_property("seconds", [round(c.seconds, 3) for c in completions])
    assert [c.tokens for c in completions] == [OUTPUT_TOKENS] * len(prompts)
    assert all(c.text for c in completions)
    # Each decode rank pulls its half of the KV heads: at least one pull per request.
    assert kv.pulls and kv.pulls >= len(prompts), f"too few KV pulls over NCCL: {kv}"
    assert not kv.failures, f"failed KV pulls: {kv}"
