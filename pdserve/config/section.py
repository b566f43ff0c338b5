"""The base of every section of the configuration tree, and the mock engine's section (kept
here, apart from `schema.py`: it is tests' and benchmarks' knob set, not a deployment's)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class MockEngineConfig(Section):
    """Timings of the model-free mock engine (pdserve.engine.mock_engine), a simple latency model."""

    prefill_tokens_per_s: float = Field(4000.0, gt=0, description="Prompt tokens prefilled per second.")
    decode_step_s: float = Field(0.01, ge=0, description="Time of one decode step at batch size 1.")
    decode_step_per_seq_s: float = Field(
        0.0002, ge=0, description="Extra decode step time per running request (batch cost)."
    )
    max_model_len: int = Field(2048, ge=16, description="Context length the mock reports.")
    block_size: int = Field(16, ge=1, description="KV block size in tokens.")
    num_kv_blocks: int = Field(4096, ge=1, description="KV blocks per mock engine.")
    kv_bytes_per_token: int = Field(131072, ge=1, description="KV per prompt token (Llama-3.1-8B: 128 KiB).")
    transfer_bytes_per_s: float = Field(50e9, gt=0, description="Simulated KV pull bandwidth of decode legs.")
