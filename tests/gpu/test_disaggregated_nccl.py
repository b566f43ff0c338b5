"""One prefill and one decode engine over NCCL serve what one colocated engine serves, token for token,
and the decode engine pulls the prompts' KV (2 GPUs)."""

import pytest

from gpu_deploy import gpu_host, serve, token_prompts

pytestmark = pytest.mark.gpu

# Prefixes of one prompt whose lengths straddle the GPU block size (16 tokens): a partial last block,
# an exact block, one token over; later prompts find part of themselves in the prefix cache.
LENGTHS = [1, 15, 16, 17, 100, 1000, 2048]
MAX_TOKENS = 32


def test_1p1d_over_nccl_equals_colocated_token_for_token(tmp_path, record_property):
    model_dir = gpu_host(2)
    base = token_prompts(1, max(LENGTHS), max(LENGTHS), seed=0)[0]
    prompts = [base[:n] for n in LENGTHS]
    colocated, _ = serve(model_dir, ["--mode", "colocated", "--replicas", "1"], prompts, MAX_TOKENS,
                         tmp_path / "colocated.log")
    disaggregated, kv = serve(model_dir, ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                                          "--transport", "nccl"], prompts, MAX_TOKENS, tmp_path / "1p1d.log",
                              min_pulls=1)
    for name, value in (("kv_pulls", kv.pulls), ("kv_bytes", kv.bytes), ("kv_seconds", kv.seconds),
                        ("kv_failures", kv.failures)):
        record_property(name, value)
    record_property("seconds_colocated", [round(c.seconds, 3) for c in colocated])
    record_property("seconds_1p1d", [round(c.seconds, 3) for c in disaggregated])
    assert [c.tokens for c in colocated + disaggregated] == [MAX_TOKENS] * 2 * len(LENGTHS)
    differ = [n for n, c, d in zip(LENGTHS, colocated, disaggregated, strict=True) if c.text != d.text]
    assert not differ, f"1P1D's output differs from colocated's for prompts of {differ} tokens"
    assert kv.pulls and kv.pulls >= 1 and kv.bytes and kv.bytes > 0, f"no KV pulled over NCCL: {kv}"
    assert not kv.failures, f"failed KV pulls: {kv}"
