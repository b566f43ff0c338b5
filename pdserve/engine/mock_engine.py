"""A model-free engine whose timings follow a simple latency model.

It implements the same `Engine` protocol as the vLLM adapter, so everything above the engine
(actors, routing, the HTTP API, scaling) can be exercised on any machine in milliseconds. It ships
as an engine kind of its own (`engine.kind: mock`, `--engine mock`): tests, benchmarks and the
simulator's checks run it.

Latency model: a request's prefill takes `prompt_tokens / prefill_tokens_per_s`; prefills run
one at a time (an engine step is compute-bound). Each decode step produces one token for every
running request and takes `decode_step_s + decode_step_per_seq_s * batch`. Output token ids are
a deterministic function of the prompt, so "greedy" output is reproducible. With a step trace
directory it writes its decode steps like a real engine (pdserve.engine.step_trace); its
prefills run beside them, outside the trace.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config.schema import MockEngineConfig
from pdserve.engine.spec import EngineSpec
from pdserve.engine.step_trace import Step, StepTraceWriter
from pdserve.engine.types import (
    EngineInfo, EngineStats, GenerateDelta, GenerateRequest, KVPull, Leg, PositionLogprobs,
    TokenLogprob,
)

# Token id the mock treats as end-of-sequence (never produced unless asked for).
_VOCAB_SIZE = 32000


@dataclass(slots=True)
class _Running:
    request: GenerateRequest
    queue: asyncio.Queue[GenerateDelta | None] = field(default_factory=asyncio.Queue)
    output: list[int] = field(default_factory=list)
    text: str = ""
    aborted: bool = False
    finished: bool = False
    pull: KVPull | None = None  # a decode leg's simulated pull, until its first delta


class MockEngine:
    def __init__(self, replica_id: str, pool: str, model: str, settings: MockEngineConfig,
                 step_trace_dir: Path | None = None) -> None:
        self._replica_id = replica_id
        self._pool = pool
        self._model = model
        self._settings = settings
        self._waiting: dict[str, _Running] = {}
        self._running: dict[str, _Running] = {}
        self._prefill_lock = asyncio.Lock()
        self._decode_task: asyncio.Task[None] | None = None
        self._aborted_total = 0
        self._finished_total = 0
        self._kv_bytes = 0
        self._kv_seconds: list[float] = []
        self._trace = StepTraceWriter(step_trace_dir, replica_id) if step_trace_dir else None

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> MockEngine:
        """The engine an engine actor builds for `engine.kind: mock` (registry.py)."""
        engine = spec.config.engine
        return cls(spec.replica_id, spec.pool, spec.served_name, engine.mock,
                   step_trace_dir=engine.step_trace_dir)

    async def start(self) -> EngineInfo:
        self._decode_task = asyncio.get_running_loop().create_task(self._decode_loop())
        return EngineInfo(
            replica_id=self._replica_id, pool=self._pool, model=self._model,
            max_model_len=self._settings.max_model_len, block_size=self._settings.block_size,
            num_kv_blocks=self._settings.num_kv_blocks,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        state = _Running(request)
        self._waiting[request.request_id] = state
        try:
            await self._prefill(state)
            while (delta := await state.queue.get()) is not None:
                yield delta
                if delta.finished:
                    return
        finally:
            self._forget(state)

    async def abort(self, request_id: str) -> None:
        state = self._running.get(request_id) or self._waiting.get(request_id)
        if state is None or state.aborted:
            return
        state.aborted = True
        self._running.pop(request_id, None)
        self._waiting.pop(request_id, None)
        state.queue.put_nowait(self._delta(state, (), "", "abort"))

    def stats(self) -> EngineStats:
        used = sum(self._blocks(s) for s in self._running.values())
        return EngineStats(
            replica_id=self._replica_id, pool=self._pool, num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=min(1.0, used / self._settings.num_kv_blocks),
            num_aborted_total=self._aborted_total, num_finished_total=self._finished_total,
            kv_transport="mock" if self._kv_bytes else "", kv_transfer_bytes_total=self._kv_bytes,
            kv_transfer_seconds=tuple(self._drain_transfer_seconds()),
        )

    @property
    def dead(self) -> bool:
        return False  # a mock engine dies only with its actor

    async def release_kv(self, kv_transfer_params: dict) -> None:
        pass  # the mock keeps no KV after a prefill leg ends

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        pass

    def _drain_transfer_seconds(self) -> list[float]:
        seconds, self._kv_seconds = self._kv_seconds, []
        return seconds

    async def shutdown(self) -> None:
        if self._decode_task is not None:
            self._decode_task.cancel()
            await asyncio.gather(self._decode_task, return_exceptions=True)
        if self._trace is not None:
            self._trace.close()

    async def _prefill(self, state: _Running) -> None:
        async with self._prefill_lock:
            if state.aborted:
                return
            # A decode leg whose KV arrives from a prefill engine pulls it, then computes one
            # token only.
            n = len(state.request.prompt_token_ids)
            if state.request.leg is Leg.DECODE:
                state.pull = await self._simulate_pull(n - 1)
                n = 1
            await asyncio.sleep(n / self._settings.prefill_tokens_per_s)
            if state.aborted:
                return
            self._waiting.pop(state.request.request_id, None)
            self._running[state.request.request_id] = state
            self._emit(state)  # the first token comes out of the prefill step

    async def _simulate_pull(self, prompt_tokens: int) -> KVPull:
        nbytes = prompt_tokens * self._settings.kv_bytes_per_token
        seconds = nbytes / self._settings.transfer_bytes_per_s
        await asyncio.sleep(seconds)
        self._kv_bytes += nbytes
        self._kv_seconds.append(seconds)
        return KVPull(nbytes, seconds)

    async def _decode_loop(self) -> None:
        while True:
            batch = [s for s in self._running.values() if not s.aborted]
            step = self._settings.decode_step_s + self._settings.decode_step_per_seq_s * len(batch)
            await asyncio.sleep(step if batch else 0.002)
            for state in batch:
                if not state.aborted and state.request.request_id in self._running:
                    self._emit(state)
            if batch and self._trace is not None:
                self._trace.record(Step(t=time.monotonic(), prefill_tokens=0, prefill_reqs=0,
                                        decode_reqs=len(batch), busy_s=step,
                                        pending=len(self._running)))

    def _emit(self, state: _Running) -> None:
        token = self._next_token(state)
        state.output.append(token)
        piece = f" t{token}"
        text_before = state.text
        state.text += piece
        finish = self._finish_reason(state)
        if finish == "stop":
            stop = next(s for s in state.request.sampling.stop if s in state.text)
            state.text = state.text[: state.text.index(stop)]
            piece = state.text[len(text_before):]
        state.queue.put_nowait(self._delta(state, (token,), piece, finish))
        if finish is not None:
            state.finished = True
            self._running.pop(state.request.request_id, None)
            self._finished_total += 1

    def _finish_reason(self, state: _Running) -> str | None:
        if any(s in state.text for s in state.request.sampling.stop):
            return "stop"
        if len(state.output) >= state.request.sampling.max_tokens:
            return "length"
        return None

    def _next_token(self, state: _Running) -> int:
        request = state.request
        replay = request.replay_output_tokens
        if len(state.output) < len(replay):
            return replay[len(state.output)]  # forced: the client has these already
        # A decode leg's prompt ends with the tokens the client already has (the first token):
        # counted as output, its continuation equals what a colocated run produces.
        prior = request.prior_output_tokens
        prompt = request.prompt_token_ids[:len(request.prompt_token_ids) - prior]
        position = len(state.output) + prior
        base = sum(prompt) + len(prompt) if prompt else 1
        return (base * 31 + position * 7) % _VOCAB_SIZE

    def _delta(self, state: _Running, ids: tuple[int, ...], text: str, finish: str | None) -> GenerateDelta:
        sampling = state.request.sampling
        first = len(state.output) == len(ids)
        return GenerateDelta(
            request_id=state.request.request_id, text=text, token_ids=ids,
            num_prompt_tokens=state.request.client_prompt_tokens,
            num_output_tokens=len(state.output) + state.request.prior_output_tokens,
            finish_reason=finish,
            kv_transfer_params=self._transfer_params(state) if finish else None,
            logprobs=(None if sampling.logprobs is None
                      else tuple(_mock_position(t, sampling.logprobs) for t in ids)),
            prompt_logprobs=(
                (None, *(_mock_position(t, sampling.prompt_logprobs)
                         for t in state.request.prompt_token_ids[1:]))
                if first and sampling.prompt_logprobs is not None else None),
            kv_pull=state.pull if first else None,
        )

    def _transfer_params(self, state: _Running) -> dict | None:
        """What a prefill leg hands to its decode leg (shape of the real connector's params)."""
        params = state.request.kv_transfer_params or {}
        if state.request.leg is not Leg.PREFILL or not params.get("do_remote_decode"):
            return None
        prompt = len(state.request.prompt_token_ids)
        blocks = math.ceil(prompt / self._settings.block_size)
        return {"remote_engine_id": self._replica_id, "remote_block_ids": list(range(blocks)),
                "remote_address": f"mock://{self._replica_id}", "num_prompt_tokens": prompt}

    def _blocks(self, state: _Running) -> int:
        tokens = len(state.request.prompt_token_ids) + len(state.output)
        return math.ceil(tokens / self._settings.block_size)

    def _forget(self, state: _Running) -> None:
        """The consumer is done with a request: whatever did not finish counts as aborted."""
        state.aborted = state.aborted or not state.finished
        self._running.pop(state.request.request_id, None)
        self._waiting.pop(state.request.request_id, None)
        if not state.finished:
            self._aborted_total += 1


def _mock_position(token: int, alternatives: int) -> PositionLogprobs:
    """Made-up logprobs of one position, a function of the token: the token itself, then
    `alternatives` others (vLLM's order). Only their shape means anything."""
    chosen = TokenLogprob(token, -0.25 - (token % 5) / 10, 1 + token % 3, f" t{token}")
    others = tuple(TokenLogprob((token + 1 + j) % _VOCAB_SIZE, -1.0 - j, 2 + j,
                                f" t{(token + 1 + j) % _VOCAB_SIZE}")
                   for j in range(max(alternatives, 0)))
    return (chosen, *others)
