"""GPU check of disaggregated serving on vLLM 0.24: pdserve 1 prefill + 1 decode over NCCL (one
engine per GPU) against pdserve colocated, token for token, plus the KV pulls' bytes and times.

Weights are vLLM's `dummy` (random, seeded identically in every engine) in the shape of the model
directory given (config + tokenizer only), so no weights travel. Prompt lengths straddle the GPU
block size (16 tokens). Run by benchmarks/gpu/disagg_check.sh on a 2-GPU host; prints a table
and writes result.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.testing.server import metric_value, start_server, wait_for_metrics  # noqa: E402

LENGTHS = [1, 15, 16, 17, 100, 1000, 2048]
MAX_TOKENS = 32
COMMON = ["--load-format", "dummy", "--max-model-len", "4096", "--served-model-name", "m",
          "--set", "engine.enforce_eager=true", "--set", "engine.gpu_memory_utilization=0.5"]


def greedy(base_url: str, prompt: list[int]) -> tuple[list[str], float]:
    start = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"], time.perf_counter() - start


def run_arm(name: str, args: list[str], model: Path, prompts: list[list[int]], out: Path) -> dict:
    started = time.perf_counter()
    server = start_server(["--model", str(model), *COMMON, *args], out / f"{name}.log", 900)
    start_s = time.perf_counter() - started
    try:
        texts, seconds = zip(*(greedy(server.base_url, p) for p in prompts), strict=True)
        text = wait_for_metrics(server.base_url, lambda t: "pdserve_kv_transfer" in t, 5)
        return {"start_s": start_s, "texts": list(texts), "seconds": list(seconds),
                "kv_bytes": metric_value(text, "pdserve_kv_transfer_bytes_total", transport="nccl"),
                "kv_pulls": metric_value(text, "pdserve_kv_transfer_seconds_count", transport="nccl"),
                "kv_seconds": metric_value(text, "pdserve_kv_transfer_seconds_sum", transport="nccl"),
                "kv_failures": metric_value(text, "pdserve_kv_transfer_failures_total", transport="nccl")}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    base = tok.encode("The history of the river city begins with traders who met each spring. " * 400)
    prompts = [base[:n] for n in LENGTHS]
    results = {
        "colocated": run_arm("colocated", ["--mode", "colocated", "--replicas", "1"], a.model, prompts, a.out),
        "disaggregated": run_arm("disaggregated", ["--mode", "disaggregated", "--prefill", "1",
                                                   "--decode", "1", "--transport", "nccl"],
                                 a.model, prompts, a.out),
    }
    (a.out / "result.json").write_text(json.dumps({"lengths": LENGTHS, **results}, indent=1))
    col, dis = results["colocated"], results["disaggregated"]
    print(f"engine start: colocated {col['start_s']:.0f} s, 1P1D {dis['start_s']:.0f} s")
    print("| prompt tokens | equal | colocated s | 1P1D s |")
    for n, c, d, cs, ds in zip(LENGTHS, col["texts"], dis["texts"], col["seconds"], dis["seconds"], strict=True):
        print(f"| {n} | {c == d} | {cs:.3f} | {ds:.3f} |")
    print(f"KV pulls: {dis['kv_pulls']} pulls, {dis['kv_bytes']} bytes, {dis['kv_seconds']} s, "
          f"{dis['kv_failures']} failures")
    if col["texts"] != dis["texts"]:
        sys.exit("disaggregated output differs from colocated")


if __name__ == "__main__":
    main()
