"""Record an engine profile from a live OpenAI-compatible endpoint (`pdserve sim profile`).

The profile is the JSON the simulator (and `PerfModel.from_calibration`) reads, with the keys of
../shared/calibration/h200-vllm0.24-llama8b.json:

- `ttft_single_ms`: prompt length -> median TTFT of one request alone (max_tokens=1);
- `prefill_tokens_per_s`: {"ttft_slope": 1 / slope of the least-squares line through
  `ttft_single_ms`}: the engine's prefill rate as the simulator's step model uses it (a lone
  request's TTFT = fixed cost + tokens / rate);
- `prefill_batch_tokens_per_s`: "isl{L}_batch{B}" -> prompt tokens per second when B prompts of
  L tokens arrive together (median of `--repeats` after one warm-up batch; informational: on
  the CPU engine the first batch of a new shape was 5-10x slower than later ones);
- `tpot_ms_by_batch`: batch -> median TPOT when B requests decode together (short prompts,
  `--output-len` tokens, ignore_eos): the decode step time at that batch. Each request's TPOT is
  (E2EL - TTFT) / (output tokens - 1), not its chunk gaps: pdserve's frontend may carry several
  tokens in one chunk when steps are a few milliseconds (on an H200 at batch 8, two);
- `decode_ctx_s_per_token` (with `--context-len L`): `--repeats` back-to-back pairs of the
  largest batch, with short and with L-token prompts (`tpot_ms_by_batch_ctx`); the median pair's
  extra step time, per request and per extra context token, is what attention over the context
  adds to a decode step (pairs, because a shared machine's load drifts between two
  measurements taken minutes apart: one unpaired measurement moved it 4x). The long
  prompts are prefilled once first (one output token), so the timed requests find them in the
  prefix cache and decode together from their first step: otherwise the largest batch's
  prefill chunks share their steps (an H200 profile so measured read 203 ms per token at
  128 x 2048 tokens, 30x the attention's real cost);
- with `--step-trace DIR` (the service runs with `engine.step_trace_dir=DIR` on this host): a
  mixed phase of `--mixed-requests` Poisson arrivals of the profile's prompt lengths, then
  `step_fit`, the step model fitted to the engines' own step traces of this run
  (pdserve.sim.calibration.step_fit). `PerfModel.from_calibration` prefers it to the client-timed
  lines above: it times engine steps, including steps that prefill while others decode;
- `kv_bytes_per_token` (from the model's config.json: 2 x layers x KV heads x head dim x dtype
  bytes), `block_size`, `num_kv_blocks`, `startup_s` (what the caller measured, e.g. from
  `pdserve serve`'s "started in" line), and `transfer` {bytes_per_s, overhead_s} from the
  service's /metrics KV-transfer counters when it has done pulls.

Measurements go through the benchmark harness's client (`pdserve.bench.client`), so they time
exactly what `pdserve bench serve` times. Prompts are random token ids (no tokenizer needed).

    python -m pdserve.sim.profile --base-url http://127.0.0.1:8000 --model-dir DIR \
        --num-kv-blocks 182 --block-size 128 --startup-s 66 --out profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.client import EndpointConfig, OpenAIStreamClient, RequestOutcome, fetch_first_model
from pdserve.bench.workloads import BenchRequest

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
SHORT_PROMPT = 16  # prompt tokens of the decode-batch measurements


def kv_bytes_per_token(config: dict[str, Any], dtype: str | None = None) -> int:
    """KV cache bytes one token takes in every layer (K and V), from a HF config.json."""
    layers = config["num_hidden_layers"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = _DTYPE_BYTES[dtype or config.get("dtype") or config.get("torch_dtype") or "float16"]
    return 2 * layers * heads * head_dim * width


def _prompt(rng: np.random.Generator, length: int, vocab: int) -> BenchRequest:
    # Ids from 100 up: low ids are special tokens in most vocabularies.
    ids = tuple(int(i) for i in rng.integers(100, vocab, size=length))
    return BenchRequest(prompt=ids, prompt_len=length, output_len=1)


async def _together(client: OpenAIStreamClient, requests: Sequence[BenchRequest]
                    ) -> tuple[list[RequestOutcome], float]:
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(client.send(r) for r in requests))
    failed = [o.error for o in outcomes if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} profile request(s) failed: {failed[0]}")
    return list(outcomes), time.perf_counter() - started


async def measure(endpoint: EndpointConfig, prompt_lens: Sequence[int], batches: Sequence[int],
                  prefill_batch: int, prefill_len: int, output_len: int, repeats: int,
                  vocab: int, seed: int = 0, mixed_requests: int = 0,
                  mixed_rate: float = 1.0, context_len: int = 0) -> dict[str, Any]:
    """The timing part of a profile (see the module docstring)."""
    rng = np.random.default_rng(seed)
    raw: dict[str, Any] = {"ttft_s": {}, "prefill_wall_s": None, "tpot_s": {}}
    async with OpenAIStreamClient(endpoint, max_connections=max(max(batches), prefill_batch)) as c:
        await _together(c, [_prompt(rng, 16, vocab)] * 2)  # warm-up: first requests are slow
        singles = {}
        for length in prompt_lens:
            times = []
            for _ in range(repeats):
                outcomes, _ = await _together(c, [_prompt(rng, length, vocab)])
                times.append(outcomes[0].ttft_s)
            raw["ttft_s"][str(length)] = times
            singles[str(length)] = round(statistics.median(times) * 1000, 2)
        walls = []
        for _ in range(repeats + 1):  # the first batch of this shape warms up
            _, wall = await _together(c, [_prompt(rng, prefill_len, vocab)
                                          for _ in range(prefill_batch)])
            walls.append(wall)
        raw["prefill_wall_s"] = walls
        batch_rate = {f"isl{prefill_len}_batch{prefill_batch}":
                      round(prefill_len * prefill_batch / statistics.median(walls[1:]), 1)}
        tpot = {}
        for batch in batches:
            tpots = await _decode_tpots(c, rng, batch, SHORT_PROMPT, output_len, vocab)
            raw["tpot_s"][str(batch)] = [round(t, 5) for t in tpots]
            tpot[str(batch)] = round(statistics.median(tpots) * 1000, 2)
        context: dict[str, Any] = {}
        if context_len:
            context = await _context_cost(c, rng, max(batches), context_len, output_len, vocab,
                                          repeats, raw)
        if mixed_requests:
            await _mixed(c, rng, prompt_lens, output_len, mixed_requests, mixed_rate, vocab)
    return {"ttft_single_ms": singles, "prefill_tokens_per_s": slope_rate(singles),
            "prefill_batch_tokens_per_s": batch_rate, "tpot_ms_by_batch": tpot, **context,
            "raw": raw}


async def _context_cost(client: OpenAIStreamClient, rng: np.random.Generator, batch: int,
                        context_len: int, output_len: int, vocab: int, pairs: int,
                        raw: dict[str, Any]) -> dict[str, Any]:
    """The decode step's cost per context token, from `pairs` back-to-back pairs of batches:
    `batch` requests with SHORT_PROMPT-token prompts, then `batch` with `context_len`-token
    ones. Each pair's difference is taken between neighbours in time, so the drift of a shared
    machine's load between the two halves mostly cancels; the median over pairs is kept (one
    pair on two shared cores moved the cost by 4x between sessions)."""
    costs, longs, shorts = [], [], []
    for _ in range(max(pairs, 1)):
        short = await _decode_tpots(client, rng, batch, SHORT_PROMPT, output_len, vocab)
        long = await _decode_tpots(client, rng, batch, context_len, output_len, vocab)
        shorts.append([round(t, 5) for t in short])
        longs.append([round(t, 5) for t in long])
        short_ms, long_ms = statistics.median(short) * 1000, statistics.median(long) * 1000
        costs.append(context_cost(short_ms, long_ms, batch, context_len))
    raw["tpot_s"][f"{batch}@{SHORT_PROMPT}-paired"] = shorts
    raw["tpot_s"][f"{batch}@{context_len}"] = longs
    raw["decode_ctx_s_per_token_pairs"] = costs
    long_ms = statistics.median(statistics.median(t) for t in longs) * 1000
    return {"tpot_ms_by_batch_ctx": {f"{batch}@{context_len}": round(long_ms, 2)},
            "decode_ctx_s_per_token": statistics.median(costs)}


def context_cost(short_ms: float, long_ms: float, batch: int, context_len: int) -> float:
    """Seconds per context token per decode step: the step at `batch` with `context_len`-token
    prompts against `SHORT_PROMPT`-token ones (never negative: noise, not a discount)."""
    if context_len <= SHORT_PROMPT:
        raise ValueError(f"--context-len must exceed {SHORT_PROMPT}")
    return max((long_ms - short_ms) / 1000 / (batch * (context_len - SHORT_PROMPT)), 0.0)


def request_tpots(outcomes: Sequence[RequestOutcome]) -> list[float]:
    """Seconds per output token after the first, per request: (E2EL - TTFT) / (tokens - 1),
    right however many tokens each stream chunk carried (requests of one token are left out)."""
    tpots = []
    for o in outcomes:
        tokens = o.output_tokens or o.chunk_count
        if tokens > 1:
            tpots.append((o.e2el_s - o.ttft_s) / (tokens - 1))
    return tpots


async def _decode_tpots(client: OpenAIStreamClient, rng: np.random.Generator, batch: int,
                        prompt_len: int, output_len: int, vocab: int) -> list[float]:
    """TPOT of each of `batch` requests decoding together. Prompts longer than SHORT_PROMPT are
    sent once first for one token, so the timed requests find them in the prefix cache and no
    prefill chunk shares their decode steps."""
    prompts = [_prompt(rng, prompt_len, vocab).prompt for _ in range(batch)]
    if prompt_len > SHORT_PROMPT:
        await _together(client, [BenchRequest(p, prompt_len, 1) for p in prompts])
    outcomes, _ = await _together(client, [BenchRequest(p, prompt_len, output_len) for p in prompts])
    return request_tpots(outcomes)


async def _mixed(client: OpenAIStreamClient, rng: np.random.Generator, prompt_lens: Sequence[int],
                 output_len: int, count: int, rate: float, vocab: int) -> None:
    """Poisson arrivals of the profile's prompt lengths: steps that prefill while others decode."""
    tasks = []
    for i in range(count):
        await asyncio.sleep(float(rng.exponential(1 / rate)))
        prompt = _prompt(rng, prompt_lens[i % len(prompt_lens)], vocab)
        request = BenchRequest(prompt.prompt, prompt.prompt_len, output_len)
        tasks.append(asyncio.ensure_future(_together(client, [request])))
    await asyncio.gather(*tasks)


def step_fit(trace_dir: Path, since: float) -> dict[str, Any]:
    """`step_fit` of the profile: the step model of every trace in `trace_dir` since `since`
    (the decode engines of a disaggregated service count with their decode-only steps). `since`
    (the engines' monotonic clock) is kept, so the fit can be redone on the same steps."""
    from pdserve.sim.calibration.trace_reader import read_steps

    return step_fit_of(read_steps(trace_dir, since), since)


def step_fit_of(traces: dict[str, list], since: float, until: float | None = None
                ) -> dict[str, Any]:
    """`step_fit` from read traces (replica id -> steps), on the steps from `since` to `until`
    (the engines' monotonic clock; None: the trace's end); both are kept in the section, with
    the replicas that had steps there."""
    from pdserve.sim.calibration.step_fit import fit_replicas

    inside = {r: [s for s in steps if since <= s.t and (until is None or s.t <= until)]
              for r, steps in traces.items()}
    inside = {r: steps for r, steps in inside.items() if steps}
    return {**fit_replicas(inside).to_json(), "replicas": sorted(inside), "since": since,
            **({"until": until} if until is not None else {})}


def slope_rate(singles_ms: dict[str, float]) -> dict[str, float]:
    """{"ttft_slope": tokens/s} from lone-request TTFTs at several prompt lengths."""
    from pdserve.scheduler.perf_model import fit_line

    points = [(float(n), ms / 1000) for n, ms in singles_ms.items()]
    if len(points) < 2:
        raise ValueError("need TTFTs at two or more prompt lengths for the prefill rate")
    _, slope = fit_line(points)
    if slope <= 0:
        raise ValueError(f"TTFT does not grow with prompt length ({singles_ms}); measure again")
    return {"ttft_slope": round(1 / slope, 1)}


def transfer_from_metrics(text: str) -> dict[str, float] | None:
    """{bytes_per_s, overhead_s} from pdserve's KV-transfer counters (None without pulls)."""
    def total(name: str) -> float:
        pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))
    moved = total("pdserve_kv_transfer_bytes_total")
    seconds = total("pdserve_kv_transfer_seconds_sum")
    pulls = total("pdserve_kv_transfer_seconds_count")
    if moved <= 0 or seconds <= 0:
        return None
    # One number per pull is all the counters give: the whole time is charged to bandwidth.
    return {"bytes_per_s": moved / seconds, "overhead_s": 0.0, "pulls": pulls}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m pdserve.sim.profile",
                                               description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--model-dir", type=Path, help="HF checkpoint dir: kv_bytes_per_token from its config.json")
    parser.add_argument("--dtype", help="KV dtype (default: the config's)")
    parser.add_argument("--kv-bytes-per-token", type=int, help="instead of --model-dir")
    parser.add_argument("--num-kv-blocks", type=int, required=True, help="KV blocks per engine (engine log)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per KV block (CPU vLLM: 128)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True,
                        help="the engine's own (vLLM logs it at start: 'Chunked prefill is enabled "
                        "with max_num_batched_tokens=N'); the simulator batches prompts up to it")
    parser.add_argument("--startup-s", type=float, required=True, help="engine start to ready, measured")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128, 256, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context-len", type=int, default=0, help="also time the largest batch "
                        "with prompts of this many tokens: the decode step's context cost")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--step-trace", type=Path, help="the service's engine.step_trace_dir (same "
                        "host): add a mixed phase and fit the step model to the engines' traces")
    parser.add_argument("--mixed-requests", type=int, default=32, help="requests of the mixed phase")
    parser.add_argument("--mixed-rate", type=float, default=1.0, help="req/s of the mixed phase")
    parser.add_argument("--note", default="", help="free text stored in the profile (machine, load)")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.kv_bytes_per_token is None and args.model_dir is None:
        raise SystemExit("give --model-dir or --kv-bytes-per-token")
    if args.context_len and args.context_len <= SHORT_PROMPT:
        raise SystemExit(f"--context-len must exceed {SHORT_PROMPT} (the short prompts' length)")
    kv = args.kv_bytes_per_token or kv_bytes_per_token(
        json.loads((args.model_dir / "config.json").read_text()), args.dtype)
    model = args.model or asyncio.run(fetch_first_model(args.base_url))
    endpoint = EndpointConfig(base_url=args.base_url, model=model, ignore_eos=True, temperature=0.0)
    since = time.monotonic()
    mixed = args.mixed_requests if args.step_trace else 0
    timings = asyncio.run(measure(endpoint, args.prompt_lens, args.batches, args.prefill_batch,
                                  args.prefill_len, args.output_len, args.repeats, args.vocab_size,
                                  mixed_requests=mixed, mixed_rate=args.mixed_rate,
                                  context_len=args.context_len))
    profile: dict[str, Any] = {
        "engine": f"endpoint {args.base_url}", "model": model, "note": args.note,
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "startup_s": args.startup_s, **timings, "kv_bytes_per_token": kv,
        "block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.step_trace:
        try:
            profile["step_fit"] = step_fit(args.step_trace, since)
        except (OSError, ValueError) as e:  # the client-timed profile stands without it
            print(f"no step_fit: {e}", file=sys.stderr)
    try:
        import httpx
        transfer = transfer_from_metrics(httpx.get(f"{args.base_url}/metrics", timeout=5).text)
        if transfer:
            profile["transfer"] = transfer
    except Exception as e:  # a plain vLLM server has other metrics; the profile stands without
        print(f"no KV-transfer metrics: {e!r}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps({k: v for k, v in profile.items() if k != "raw"}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
