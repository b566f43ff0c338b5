"""GPU check (issue 7): prefill and decode engines of different tensor-parallel sizes.

    python benchmarks/gpu/tp_check.py --model LLAMA_8B_DIR --out tp_check.json
    python benchmarks/gpu/tp_check.py --model LLAMA_8B_DIR --out tp_check.json --with-tp1
    python benchmarks/gpu/tp_check.py --model embedded --engine mock --out /tmp/tp.json  # CPU dry run

Serves, one after another (each stopped fully before the next starts), with vLLM dummy weights:
  colocated-tp2   1 colocated engine at TP 2                  (2 GPUs)
  p1-d2           1 prefill engine TP 1 + 1 decode TP 2, NCCL (3 GPUs)
  p2-d1           1 prefill engine TP 2 + 1 decode TP 1, NCCL (3 GPUs)
  colocated-tp1   1 colocated engine at TP 1                  (1 GPU; with --with-tp1)
and sends each the same greedy requests (random token-id prompts of 500-2000 tokens from a
fixed seed, 64 output tokens, ignore_eos). The API returns text, not token ids, so outputs are
compared as text: per request, equal or the first differing character. With random bf16
weights, TP 1 and TP 2 may legitimately diverge (different reduction order), so a disaggregated
arm is compared with the colocated arm of its decode TP (p1-d2 with colocated-tp2, p2-d1 with
colocated-tp1) and with every other arm. Then it sends WARM_REQUESTS more prompts one at a
time: their pulls run on pairs already set up, so they time the transfer itself (the first
pulls of an arm include NCCL pair set-up, ~200 ms). Reads the KV pulls of both phases from
/metrics (pdserve_kv_transfer_seconds), and keeps any "pulled N blocks" lines the decode engine logged. Writes JSON
to --out and prints a table. About 60-90 s to start each arm; under 6 minutes for all.
`benchmarks/gpu/proof.sh MODEL tp` runs it; the pass/fail check that TP1 -> TP2 serves is
tests/gpu/test_mixed_tp.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.bench.arms import delta, metric_sum, pdserve_args, pulls_from_log  # noqa: E402
from pdserve.testing.server import free_port, start_process  # noqa: E402

NUM_REQUESTS = 16
MIN_PROMPT, MAX_PROMPT = 500, 2000
OUTPUT_TOKENS = 64
# Token ids drawn from here exist in any Llama-3 (128k) or small test vocabulary's middle.
TOKEN_RANGE = (1000, 30000)
CONCURRENCY = 4
# Warm requests, sent one at a time after the compared workload.
WARM_REQUESTS = 8

# name -> (GPUs, pdserve serve flags)
ARMS: dict[str, tuple[int, list[str]]] = {
    "colocated-tp2": (2, ["--mode", "colocated", "--replicas", "1", "--tensor-parallel-size", "2"]),
    "p1-d2": (3, ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                  "--prefill-tp", "1", "--decode-tp", "2", "--transport", "nccl"]),
    "p2-d1": (3, ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                  "--prefill-tp", "2", "--decode-tp", "1", "--transport", "nccl"]),
    "colocated-tp1": (1, ["--mode", "colocated", "--replicas", "1", "--tensor-parallel-size", "1"]),
}  # fmt: skip
# Which colocated arm a disaggregated arm should match token for token (same decode TP).
REFERENCE = {"p1-d2": "colocated-tp2", "p2-d1": "colocated-tp1"}


def prompts(seed: int) -> list[list[int]]:
    """The fixed workload: NUM_REQUESTS random token-id prompts."""
    rng = random.Random(seed)
    return [
        [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
        for _ in range(NUM_REQUESTS)
    ]


def complete(base_url: str, prompt: list[int]) -> dict:
    """One greedy completion; returns its text and token count (or the error)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    started = time.monotonic()
    try:
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
        response.raise_for_status()
        reply = response.json()
    except Exception as exc:  # noqa: BLE001 - recorded per request
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {
        "text": reply["choices"][0]["text"],
        "output_tokens": reply.get("usage", {}).get("completion_tokens"),
        "seconds": time.monotonic() - started,
    }


def run_arm(
    name: str, model: str, engine: str, out_dir: Path, workload: list[list[int]], warm_workload: list[list[int]]
) -> dict:
    """Starts one arm, sends the workload (compared across arms), then the warm workload one request
    at a time (pull times on set-up pairs), reads the KV pulls, stops it (always)."""
    gpus, mode = ARMS[name]
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port),
               *pdserve_args(model, engine == "mock"), *mode]  # fmt: skip
    log = out_dir / f"tp_check-{name}.log"
    started = time.monotonic()
    server = start_process(command, port, log, 900)
    try:
        start_s = time.monotonic() - started
        before = kv_counters_safe(server.base_url)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda p: complete(server.base_url, p), workload))
        after = kv_counters_safe(server.base_url)
        # Warm pulls: the pairs are set up now; one request at a time, so a pull's time is the
        # transfer and its hand-offs, not set-up or a queue behind other pulls.
        warm_results = [complete(server.base_url, p) for p in warm_workload]
        warm_after = kv_counters_safe(server.base_url)
    finally:
        server.stop(timeout_s=90)
    return {
        "gpus": gpus,
        "command": " ".join(command),
        "start_s": round(start_s, 1),
        "requests": results,
        "kv_metrics": delta(after, before),
        "warm_requests": warm_results,
        "warm_kv_metrics": delta(warm_after, after),
        "pulls_logged": pulls_from_log(log),  # [blocks, MiB, ms] per decode-rank pull log line
        "log": str(log),
    }


KV_METRICS = {
    "pulls": "pdserve_kv_transfer_seconds_count",
    "seconds": "pdserve_kv_transfer_seconds_sum",
    "bytes": "pdserve_kv_transfer_bytes_total",
    "failures": "pdserve_kv_transfer_failures_total",
}


def _pull_stats(metrics: dict | None) -> tuple[int, float, float]:
    """(pulls, mean ms, mean MiB) from a kv_counters_safe delta; NaNs where nothing was pulled."""
    pulls = int((metrics or {}).get("pulls") or 0)
    if not pulls:
        return 0, float("nan"), float("nan")
    return pulls, metrics["seconds"] / pulls * 1e3, (metrics.get("bytes") or 0) / pulls / 2**20


def kv_counters_safe(base_url: str) -> dict:
    """The KV transfer counters from /metrics (each summed over its labels), {} if unreachable."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {key: metric_sum(text, name) for key, name in KV_METRICS.items()}


def first_mismatch(a: dict, b: dict) -> int | None:
    """None if both texts are equal, else the first differing character (-1: a request failed)."""
    if "text" not in a or "text" not in b:
        return -1
    if a["text"] == b["text"]:
        return None
    common = min(len(a["text"]), len(b["text"]))
    return next((i for i in range(common) if a["text"][i] != b["text"][i]), common)


def compare(arms: dict[str, dict]) -> dict[str, dict]:
    """Every pair of arms: how many requests match and each one's first mismatch."""
    names = list(arms)
    pairs = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            mismatches = [first_mismatch(x, y) for x, y in zip(arms[a]["requests"], arms[b]["requests"], strict=True)]
            pairs[f"{a} vs {b}"] = {
                "equal": sum(m is None for m in mismatches),
                "of": len(mismatches),
                "first_mismatch_char": mismatches,
            }
    return pairs


def print_table(arms: dict[str, dict], pairs: dict[str, dict]) -> None:
    """Per arm: requests served, then the KV pulls from /metrics of the cold phase (the compared
    workload, pairs being set up) and the warm one (sequential, on set-up pairs): pulls (one per
    decode rank and request), mean ms and MiB per pull."""
    print(f"\n{'arm':<15} {'GPUs':>4} {'start s':>8} {'ok':>5} {'cold pulls':>10} {'mean ms':>8} "
          f"{'warm pulls':>10} {'mean ms':>8} {'MiB/pull':>9}")  # fmt: skip
    for name, arm in arms.items():
        ok = sum("text" in r for r in arm["requests"])
        cold, warm = _pull_stats(arm.get("kv_metrics")), _pull_stats(arm.get("warm_kv_metrics"))
        print(f"{name:<15} {arm['gpus']:>4} {str(arm['start_s']):>8} {ok:>2}/{len(arm['requests']):<2} "
              f"{cold[0]:>10} {cold[1]:>8.2f} {warm[0]:>10} {warm[1]:>8.2f} {warm[2]:>9.1f}")  # fmt: skip
    print()
    for pair, result in pairs.items():
        arm = pair.split(" vs ")
        marker = " <- same decode TP" if REFERENCE.get(arm[1]) == arm[0] or REFERENCE.get(arm[0]) == arm[1] else ""
        firsts = [m for m in result["first_mismatch_char"] if m is not None]
        print(f"{pair:<32} equal {result['equal']:>2}/{result['of']}  first mismatches {firsts}{marker}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model dir (config + tokenizer; weights: dummy)")
    parser.add_argument("--out", required=True, type=Path, help="JSON results file")
    parser.add_argument("--engine", choices=["vllm", "mock"], default="vllm", help="mock: CPU dry run")
    parser.add_argument("--arms", nargs="+", default=["colocated-tp2", "p1-d2", "p2-d1"], choices=list(ARMS))
    parser.add_argument("--with-tp1", action="store_true", help="also run colocated-tp1 (1 GPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [*args.arms, *(["colocated-tp1"] if args.with_tp1 and "colocated-tp1" not in args.arms else [])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workload = prompts(args.seed)
    warm = prompts(args.seed + 1)[:WARM_REQUESTS]
    arms: dict[str, dict] = {}
    for name in names:
        print(f"arm {name}: starting", flush=True)
        try:
            arms[name] = run_arm(name, args.model, args.engine, args.out.parent, workload, warm)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next arm
            print(f"arm {name} failed: {exc}", flush=True)
            arms[name] = {"gpus": ARMS[name][0], "start_s": None, "error": str(exc)[-4000:], "requests": [{}] * NUM_REQUESTS,
                          "pulls_logged": []}  # fmt: skip
        print(f"arm {name}: done", flush=True)
    pairs = compare(arms)
    record = {
        "engine": args.engine,
        "model": args.model,
        "workload": {"requests": NUM_REQUESTS, "prompt_tokens": [len(p) for p in workload],
                     "output_tokens": OUTPUT_TOKENS, "seed": args.seed,
                     "warm_prompt_tokens": [len(p) for p in warm]},  # fmt: skip
        "arms": arms,
        "comparisons": pairs,
        "references": REFERENCE,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print_table(arms, pairs)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
