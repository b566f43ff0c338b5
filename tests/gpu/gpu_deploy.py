"""What the GPU tests share: the host check, seeded prompts, a greedy client, one deployment served.

The GPU tests serve real vLLM engines on CUDA GPUs with pdserve; each skips without them.

One command runs them on a lent GPU host: `tests/gpu/run.sh` (it unpacks the vLLM bundle, sets the
NCCL environment and finds the model directory). By hand, with vLLM importable:

    PDSERVE_GPU_MODEL=gpumodel8b python -m pytest -m gpu tests/gpu -v

The model directory is a Llama-3.1-8B-shaped config.json and tokenizer without weights
(benchmarks/gpu/make_model8b.py): vLLM's `dummy` weights are random but seeded alike in every engine,
so two deployments of the same model give the same greedy tokens and nothing is downloaded.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.testing.server import metric_value, start_server, wait_for_metrics

REPO = Path(__file__).resolve().parents[2]
# Every test deployment: dummy weights seeded alike in every engine, eager mode (a start without
# CUDA graph capture is quicker), half of each GPU.
ENGINE_FLAGS = ["--load-format", "dummy", "--max-model-len", "4096", "--served-model-name", "m",
                "--set", "engine.enforce_eager=true", "--set", "engine.gpu_memory_utilization=0.5"]
START_TIMEOUT_S = 900  # an engine of the 8B shape has started in 60-150 s on H100s and H200s
KV_METRICS = ("pdserve_kv_transfer_seconds_count", "pdserve_kv_transfer_bytes_total",
              "pdserve_kv_transfer_seconds_sum", "pdserve_kv_transfer_failures_total")


def gpu_host(gpus: int) -> Path:
    """Skip unless this host has `gpus` CUDA GPUs, vLLM and the model directory ($PDSERVE_GPU_MODEL,
    else gpumodel8b/ at the repository's root); returns the model directory."""
    torch = pytest.importorskip("torch")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, {visible} visible")
    pytest.importorskip("vllm")
    model = Path(os.environ.get("PDSERVE_GPU_MODEL") or REPO / "gpumodel8b")
    if not (model / "config.json").is_file():
        pytest.skip(f"no model directory at {model} (benchmarks/gpu/make_model8b.py makes one)")
    return model


def token_prompts(count: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    """Seeded random token-id prompts (ids that any Llama-3 or SmolLM2 vocabulary holds)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(rng.randint(shortest, longest))]
            for _ in range(count)]


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    tokens: int
    seconds: float


def greedy(base_url: str, prompt: list[int], max_tokens: int) -> Completion:
    """One greedy completion of exactly `max_tokens` tokens (ignore_eos)."""
    started = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    response.raise_for_status()
    body = response.json()
    return Completion(body["choices"][0]["text"], body["usage"]["completion_tokens"],
                      time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class KvPulls:
    """The service's KV transfer counters over NCCL (None: no such sample)."""

    pulls: float | None
    bytes: float | None
    seconds: float | None
    failures: float | None


def kv_pulls(metrics_text: str) -> KvPulls:
    return KvPulls(*(metric_value(metrics_text, name, transport="nccl") for name in KV_METRICS))


def serve(model_dir: Path, deployment: list[str], prompts: list[list[int]], max_tokens: int, log: Path,
          min_pulls: int = 0) -> tuple[list[Completion], KvPulls]:
    """Starts `pdserve serve` with `deployment`'s flags, sends the prompts one at a time, reads the KV
    counters (waiting up to 15 s for `min_pulls`: the engines' counters refresh about once a second)
    and stops the service, also when something failed."""
    server = start_server(["--model", str(model_dir), *ENGINE_FLAGS, *deployment], log, START_TIMEOUT_S)
    try:
        completions = [greedy(server.base_url, p, max_tokens) for p in prompts]
        text = wait_for_metrics(server.base_url, lambda t: (kv_pulls(t).pulls or 0) >= min_pulls, 15)
    finally:
        server.stop(timeout_s=90)
    return completions, kv_pulls(text)
