"""Drive a running service through load phases and record what its pools do.

Used by the autoscaling integration test and by `benchmarks/autoscale_burst.py`: Poisson
arrivals at each phase's rate (streamed completions of fixed prompt/output length, token-id
prompts so no tokenizer is needed), while a sampler reads `/metrics` for pool sizes. Returns
per-request outcomes (TTFT, TPOT, HTTP status) and the pool-size timeline.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from pdserve.testing.server import metric_value


@dataclass(frozen=True, slots=True)
class Phase:
    rate: float  # requests per second
    seconds: float
    name: str = ""


@dataclass(slots=True)
class Outcome:
    sent_s: float  # since the run started
    phase: str
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class BurstRun:
    outcomes: list[Outcome] = field(default_factory=list)
    pools: list[dict] = field(default_factory=list)  # {"t": s, "prefill": n, ...}
    decisions: list[dict] = field(default_factory=list)  # counter deltas seen by the sampler

    def attainment(self, ttft_s: float, tpot_s: float, phase: str | None = None) -> float:
        done = [o for o in self.outcomes if phase is None or o.phase == phase]
        ok = [o for o in done if o.status == 200 and o.ttft_s is not None and o.ttft_s <= ttft_s
              and (o.tpot_s is None or o.tpot_s <= tpot_s)]
        return len(ok) / len(done) if done else 0.0

    def to_json(self) -> str:
        return json.dumps({"outcomes": [asdict(o) for o in self.outcomes], "pools": self.pools,
                           "decisions": self.decisions}, indent=1)


async def run_phases(base_url: str, model: str, phases: list[Phase], prompt_tokens: int,
                     output_tokens: int, pools: tuple[str, ...], seed: int = 0,
                     sample_s: float = 0.5, settle_s: float = 0.0,
                     vocab_size: int = 500) -> BurstRun:
    """Run the phases back to back, then keep sampling `settle_s` more seconds."""
    rng = random.Random(seed)
    run = BurstRun()
    start = time.monotonic()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(client, pools, run, start, sample_s, stop))
        tasks = []
        for phase in phases:
            phase_end = time.monotonic() + phase.seconds
            while True:
                wait = rng.expovariate(phase.rate) if phase.rate > 0 else phase.seconds
                if time.monotonic() + wait > phase_end:
                    await asyncio.sleep(max(phase_end - time.monotonic(), 0))
                    break
                await asyncio.sleep(wait)
                prompt = [rng.randrange(10, vocab_size) for _ in range(prompt_tokens)]
                outcome = Outcome(time.monotonic() - start, phase.name)
                run.outcomes.append(outcome)
                tasks.append(asyncio.create_task(
                    _one(client, model, prompt, output_tokens, outcome)))
        await asyncio.gather(*tasks)
        await asyncio.sleep(settle_s)
        stop.set()
        await sampler
    return run


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
               outcome: Outcome) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first = last = None
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode()[:200]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome.status, outcome.error = 500, event["error"]["message"][:200]
                    return
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                # Any chunk with a choice carries tokens (their text can be empty: a partial
                # UTF-8 character, or a dummy model's id the tokenizer has no text for).
                if event.get("choices"):
                    last = time.monotonic()
                    first = first or last
                    outcome.output_tokens += 1
    except httpx.HTTPError as e:
        # Say how far the request got: no response at all, or a stream cut after its headers
        # (and how many tokens) tell a connection race from a service that dropped a request.
        got = f"HTTP {outcome.status}, {outcome.output_tokens} tokens" if outcome.status else "no response"
        outcome.status, outcome.error = -1, f"{e!r} ({got})"[:200]
        return
    if usage_tokens is not None:  # chunks can carry several tokens
        outcome.output_tokens = usage_tokens
    if first is not None:
        outcome.ttft_s = first - sent
        if outcome.output_tokens > 1:
            outcome.tpot_s = (last - first) / (outcome.output_tokens - 1)


async def _sample(client: httpx.AsyncClient, pools: tuple[str, ...], run: BurstRun,
                  start: float, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            text = (await client.get("/metrics")).text
        except httpx.HTTPError:
            text = ""
        if text:
            row: dict = {"t": round(time.monotonic() - start, 2)}
            for pool in pools:
                row[pool] = metric_value(text, "pdserve_pool_replicas", pool=pool)
                row[f"{pool}_starting"] = metric_value(
                    text, "pdserve_pool_replicas_changing", pool=pool, state="starting")
                row[f"{pool}_draining"] = metric_value(
                    text, "pdserve_pool_replicas_changing", pool=pool, state="draining")
            run.pools.append(row)
            run.decisions = _decisions(text)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


def _decisions(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        if line.startswith("pdserve_scaling_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            parts = dict(p.split("=", 1) for p in labels[labels.index("{") + 1:-1].split(","))
            rows.append({k: v.strip('"') for k, v in parts.items()} | {"count": float(value)})
    return rows
