"""Run one benchmark: warm up, send a workload on its arrival schedule under a concurrency cap, measure.

Lifecycle of `run_benchmark`:
1. compute the whole arrival schedule from the seed (arrivals.py);
2. open one client session; send `num_warmups` copies of the first request (concurrency-capped, as vllm
   bench does) and discard them, so connection setup, CUDA graphs and compile caches are not measured;
3. start the clock, give every request a task that sleeps until its arrival offset, then waits on the
   max-concurrency semaphore, then streams; the wait on the semaphore is recorded as `queued_s`;
4. stop the clock when the last request ends, close the session, compute metrics.

A `TaskGroup` owns the request tasks, so an interrupted run cancels every in-flight request instead of
leaving streams open.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

import numpy as np
from tqdm.auto import tqdm

from pdserve.bench.arrivals import ArrivalSpec, schedule
from pdserve.bench.client import EndpointConfig, OpenAIStreamClient, RequestOutcome
from pdserve.bench.metrics import BenchmarkMetrics, compute_metrics
from pdserve.slo import SloTargets
from pdserve.bench.workloads import BenchRequest
from pdserve.errors import PdserveError


class BenchmarkError(PdserveError):
    """The benchmark could not run (endpoint unusable, empty workload); the message says why."""


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One benchmark run. `label`, `dataset_name` and `tokenizer_id` only describe it in results."""

    endpoint: EndpointConfig
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    # The arrival schedule's seed where it differs from the prompts' (`--arrival-seed`).
    arrival_seed: int | None = None
    percentiles: tuple[float, ...] = (90.0, 99.0)
    slo: SloTargets = field(default_factory=SloTargets)
    disable_tqdm: bool = False
    label: str | None = None
    dataset_name: str = "random"
    tokenizer_id: str | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max concurrency must be positive, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"number of warm-ups must be >= 0, got {self.num_warmups}")

    @property
    def backend(self) -> str:
        """vllm bench's name for the request protocol: openai (completions) or openai-chat."""
        return "openai-chat" if self.endpoint.is_chat else "openai"

    def at_rate(self, request_rate: float) -> RunConfig:
        """The same run at another request rate (sweeps); trace replays switch to rate-driven arrivals."""
        arrivals = replace(self.arrivals, request_rate=request_rate, use_trace_timestamps=False)
        return replace(self, arrivals=arrivals)


@dataclass(frozen=True, slots=True)
class BenchmarkResult:
    """A finished run: what was sent, when, what came back, and the metrics over it."""

    config: RunConfig
    requests: tuple[BenchRequest, ...]
    outcomes: tuple[RequestOutcome, ...]
    arrival_offsets_s: tuple[float, ...]
    duration_s: float
    metrics: BenchmarkMetrics
    date: str
    run_start_s: float


async def run_benchmark(
    config: RunConfig,
    requests: Sequence[BenchRequest],
    count_tokens: Callable[[str], int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> BenchmarkResult:
    """Run `requests` against the endpoint as `config` says and return the measured result."""
    if not requests:
        raise BenchmarkError("the workload has no requests")
    rng = np.random.default_rng(config.seed if config.arrival_seed is None else config.arrival_seed)
    offsets = schedule(config.arrivals, len(requests), rng, [r.arrival_s for r in requests])
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    client = OpenAIStreamClient(config.endpoint, max_connections=config.max_concurrency, clock=clock)
    async with client:
        await _warm_up(client, requests[0], config)
        run_start = clock()
        outcomes = await _send_all(client, requests, offsets, config, clock, run_start)
        duration = clock() - run_start
    metrics = compute_metrics(outcomes, duration, config.percentiles, config.slo, count_tokens)
    return BenchmarkResult(
        config=config,
        requests=tuple(requests),
        outcomes=tuple(outcomes),
        arrival_offsets_s=tuple(float(o) for o in offsets),
        duration_s=duration,
        metrics=metrics,
        date=date,
        run_start_s=run_start,
    )


def _limiter(max_concurrency: int | None) -> contextlib.AbstractAsyncContextManager:
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


async def _warm_up(client: OpenAIStreamClient, request: BenchRequest, config: RunConfig) -> None:
    """Send `num_warmups` copies of the first request; fail fast if the endpoint serves none of them."""
    if config.num_warmups == 0:
        return
    limiter = _limiter(config.max_concurrency)
    bar = tqdm(total=config.num_warmups, desc="warm-up", disable=config.disable_tqdm)

    async def one() -> RequestOutcome:
        async with limiter:
            outcome = await client.send(request)
        bar.update(1)
        return outcome

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one()) for _ in range(config.num_warmups)]
    finally:
        bar.close()
    outcomes = [task.result() for task in tasks]
    if not any(outcome.success for outcome in outcomes):
        raise BenchmarkError(
            f"all {len(outcomes)} warm-up requests to {config.endpoint.url} failed; "
            f"first error: {outcomes[0].error}"
        )


async def _send_all(
    client: OpenAIStreamClient,
    requests: Sequence[BenchRequest],
    offsets: np.ndarray,
    config: RunConfig,
    clock: Callable[[], float],
    run_start: float,
) -> list[RequestOutcome]:
    limiter = _limiter(config.max_concurrency)
    bar = tqdm(total=len(requests), desc="requests", disable=config.disable_tqdm)

    async def one(request: BenchRequest, offset: float) -> RequestOutcome:
        delay = run_start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        arrived = clock()
        async with limiter:
            outcome = await client.send(request, queued_s=clock() - arrived)
        bar.update(1)
        return outcome

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(r, float(o))) for r, o in zip(requests, offsets, strict=True)]
    finally:
        bar.close()
    return [task.result() for task in tasks]


def describe_rate(request_rate: float) -> float | str:
    """The request rate as vllm writes it in results: a number, or "inf"."""
    return "inf" if math.isinf(request_rate) else request_rate
