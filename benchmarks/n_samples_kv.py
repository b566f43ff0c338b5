"""What n > 1 costs across the prefill/decode split: KV bytes pulled and wall time of one request
with n=1 and n=4, on a 1P1D CPU service (every prompt prefilled remotely, prefix-aware routing
off), each repeat with a fresh prompt prefix so no earlier request's cache helps.

    .venv/bin/python benchmarks/n_samples_kv.py OUT_DIR [--reps 3] [--prompt-tokens 400]

Writes OUT_DIR/summary.json and prints a table. pdserve runs n as n engine requests (seed + i,
as vLLM); the prefill engine's prefix cache computes the prompt once, and the decode engine's
serves the full blocks the first sample pulled to the others, so only each sample's last
partial block moves again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from pdserve.testing.server import start_server

MODEL = "SmolLM2-135M-Instruct"


def pulled_bytes(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_kv_transfer_bytes_total{"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_server([
        "--model", "embedded", "--mode", "disaggregated", "--prefill", "1", "--decode", "1",
        "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5",
        "--set", "scheduler.local_prefill_max_tokens=0", "--set", "scheduler.prefix_aware=false",
        "--kv-cache-memory-bytes", str(512 * 1024**2)], args.out / "server.log", 900)
    try:
        from transformers import AutoTokenizer

        from pdserve.models import ensure_embedded_model

        tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
        text = "The history of the city begins with a small fishing village on the river. " * 60
        base = tokenizer.encode(text)[:args.prompt_tokens]
        rows = []
        for rep in range(args.reps):
            for n in (1, 4):
                # A fresh first two tokens: nothing of an earlier prompt is cached anywhere.
                prompt = [100 + (rep * 31 + n * 7 + i) % 40000 for i in range(2)] + base[2:]
                before = pulled_bytes(server.base_url)
                start = time.monotonic()
                r = httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.8,
                    "seed": 1, "n": n})
                wall = time.monotonic() - start
                r.raise_for_status()
                time.sleep(2.5)  # the stats poll carries the pulls into /metrics
                rows.append({"rep": rep, "n": n, "wall_s": round(wall, 3),
                             "kv_bytes_pulled": pulled_bytes(server.base_url) - before,
                             "choices": len(r.json()["choices"])})
                print(rows[-1], flush=True)
    finally:
        server.stop()
    one = [r for r in rows if r["n"] == 1]
    four = [r for r in rows if r["n"] == 4]
    summary = {
        "prompt_tokens": args.prompt_tokens, "max_tokens": 8, "reps": args.reps, "rows": rows,
        "kv_bytes_ratio_n4_over_n1": [f["kv_bytes_pulled"] / o["kv_bytes_pulled"]
                                      for o, f in zip(one, four)],
        "wall_ratio_n4_over_n1": [round(f["wall_s"] / o["wall_s"], 3) for o, f in zip(one, four)],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"KV bytes n=4 / n=1: {summary['kv_bytes_ratio_n4_over_n1']}")
    print(f"wall n=4 / n=1: {summary['wall_ratio_n4_over_n1']} "
          f"(median {statistics.median(summary['wall_ratio_n4_over_n1'])})")


if __name__ == "__main__":
    main()
