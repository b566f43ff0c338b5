"""The vLLM engine adapter: one AsyncLLM inside an engine actor.

Lifecycle: `start()` derives vLLM's engine arguments from the pdserve config, sets the few
environment variables vLLM's CPU backend reads (only in this actor's process), and builds the
AsyncLLM on a worker thread: its constructor blocks for the whole engine start (20-35 s on CPU,
~75 s on GPU) and must not stall the actor's event loop. Requests go in as token ids (the
frontend tokenized them) and come back as DELTA outputs. vLLM's scheduler stats (running,
waiting, KV usage) arrive through a stat logger that keeps only the latest values. With
`engine.step_trace_dir` set, vLLM's scheduler is pdserve's traced one
(pdserve.engine.tracing_scheduler), which writes every engine step to a step trace
(pdserve.engine.step_trace) from the engine core process.

vLLM is imported inside methods so that importing pdserve never requires vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine import decode_stream
from pdserve.engine.tracing_scheduler import QUALNAME as TRACING_SCHEDULER
from pdserve.engine.tracing_scheduler import trace_environment
from pdserve.engine.types import (
    EngineInfo, EngineStats, GenerateDelta, GenerateRequest, KVPull, Leg, PositionLogprobs,
    TokenLogprob,
)

if TYPE_CHECKING:
    from pdserve.engine.spec import EngineSpec

logger = logging.getLogger(__name__)

# Without an explicit size vLLM's CPU backend reserves most of the host's RAM for KV.
# 1 GiB holds ~23k tokens of SmolLM2-135M in fp32 (182 blocks of 128 tokens).
_DEFAULT_CPU_KV_BYTES = 1024**3


_TIMINGS = ("vllm_ttft_seconds", "queue_seconds", "prefill_seconds")


@dataclass(slots=True)
class _LatestSchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_transport: str = ""
    kv_bytes_total: int = 0
    kv_failures_total: int = 0
    kv_seconds: list[float] = field(default_factory=list)  # drained by each stats() call
    # Each request's pull until its leg takes it (`take_pull`), by the id pdserve submitted it
    # with.
    pulls: dict[str, KVPull] = field(default_factory=dict)
    # vLLM's own per-request timings (EngineStats.vllm_ttft_seconds, ...), drained by stats().
    timings: dict[str, deque[float]] = field(
        default_factory=lambda: {key: deque(maxlen=4096) for key in _TIMINGS})

    def add_iteration(self, iteration: Any) -> None:
        self.timings["vllm_ttft_seconds"].extend(iteration.time_to_first_tokens_iter)
        for finished in iteration.finished_requests:
            self.timings["queue_seconds"].append(finished.queued_time)
            self.timings["prefill_seconds"].append(finished.prefill_time)

    def take_timings(self) -> dict[str, tuple[float, ...]]:
        taken = {key: tuple(values) for key, values in self.timings.items()}
        for values in self.timings.values():
            values.clear()
        return taken

    def add_transfers(self, data: dict[str, Any]) -> None:
        """Fold in one interval of pdserve's connector stats (`pdserve.kv.connector.stats`):
        per-pull lists of bytes, seconds, a failed flag and the request's id."""
        failed = [int(f) for f in data.get("pull_failed", ())]
        nbytes = [int(b) for b in data.get("pull_bytes", ())]
        seconds = [float(x) for x in data.get("pull_seconds", ())]
        self.kv_bytes_total += sum(nbytes)
        self.kv_failures_total += sum(failed)
        done = [x for x, f in zip(seconds, failed, strict=False) if not f]
        # Bounded: a stats poll drains it every second; keep at most the latest 4096 pulls.
        self.kv_seconds = (self.kv_seconds + done)[-4096:]
        for rid, b, s, f in zip(data.get("pull_request_ids", ()), nbytes, seconds, failed,
                                strict=False):
            # vLLM >= 0.30 runs a request under its id + "-" + 8 characters; pdserve's own ids
            # never end that way (a uuid's hex, or a short "-p" / "-m1" / "-3" suffix).
            self.pulls[rid[:-9] if len(rid) > 9 and rid[-9] == "-" else rid] = \
                KVPull(b, s, bool(f))
        while len(self.pulls) > 8192:  # legs that never took theirs (aborted)
            del self.pulls[next(iter(self.pulls))]

    def take_pull(self, request_id: str) -> KVPull | None:
        return self.pulls.pop(request_id, None)


def _stat_logger_factory(sink: _LatestSchedulerStats):
    """vLLM stat logger that keeps the latest scheduler stats."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
            if iteration_stats is not None:
                sink.add_iteration(iteration_stats)
            if scheduler_stats is None:
                return
            sink.num_running = scheduler_stats.num_running_reqs
            sink.num_waiting = scheduler_stats.num_waiting_reqs
            sink.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            transfers = getattr(scheduler_stats, "kv_connector_stats", None)
            if isinstance(transfers, dict) and transfers:
                sink.add_transfers(transfers)

        def log_engine_initialized(self) -> None:
            pass

    return lambda vllm_config, engine_index=0: _Recorder(vllm_config, engine_index)


class VllmEngine:
    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self._llm: Any = None
        self._scheduler = _LatestSchedulerStats()
        if spec.pool in ("prefill", "decode"):
            self._scheduler.kv_transport = spec.config.kv.transport
        self._aborted_total = 0
        self._finished_total = 0

    async def start(self) -> EngineInfo:
        on_cpu = _on_cpu(self._spec)
        if on_cpu:
            _set_cpu_environment(self._spec)
        trace_dir = self._spec.config.engine.step_trace_dir
        if trace_dir is not None:
            # Read by the traced scheduler in the engine core process, which inherits it.
            os.environ.update(trace_environment(str(trace_dir), self._spec.replica_id))
        model_path = await asyncio.to_thread(_local_model_path, self._spec)
        args = _engine_args(self._spec, model_path, on_cpu)
        self._llm = await asyncio.to_thread(self._build, args)
        # The detokenizer decodes each prompt's tail, not all of it, before its first output.
        if (backend := getattr(self._llm.tokenizer, "_tokenizer", None)) is not None:
            decode_stream.install(backend)
        vllm_config = self._llm.vllm_config
        return EngineInfo(
            replica_id=self._spec.replica_id, pool=self._spec.pool,
            model=self._spec.served_name,
            max_model_len=vllm_config.model_config.max_model_len,
            block_size=vllm_config.cache_config.block_size,
            num_kv_blocks=vllm_config.cache_config.num_gpu_blocks or 0,
            extra={"device": "cpu" if on_cpu else "cuda"},
        )

    def _build(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._scheduler)])

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        produced = 0
        finish_reason = None
        pulling = request.leg is Leg.DECODE  # its pull's record comes with a later delta
        try:
            async for out in self._llm.generate(prompt, _sampling_params(request),
                                                request.request_id):
                completion = out.outputs[0]
                produced += len(completion.token_ids)
                if out.finished:
                    finish_reason = completion.finish_reason or "stop"
                pull = self._scheduler.take_pull(request.request_id) if pulling else None
                pulling = pulling and pull is None
                yield GenerateDelta(
                    request_id=request.request_id, text=completion.text,
                    token_ids=tuple(completion.token_ids),
                    num_prompt_tokens=request.client_prompt_tokens,
                    num_output_tokens=produced + request.prior_output_tokens,
                    finish_reason=finish_reason,
                    kv_transfer_params=getattr(out, "kv_transfer_params", None),
                    logprobs=_logprobs(completion.logprobs),
                    prompt_logprobs=_prompt_logprobs(out.prompt_logprobs),
                    stop_reason=completion.stop_reason, kv_pull=pull,
                )
        finally:
            # AsyncLLM aborts a request whose generator is closed early; an explicit abort
            # ends the stream with finish_reason "abort". Both count as aborted.
            if finish_reason in (None, "abort"):
                self._aborted_total += 1
            else:
                self._finished_total += 1

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def renew_kv(self, kv_transfer_params: dict) -> None:
        await self._pin_rpc("pdserve_renew_kv", kv_transfer_params)

    @property
    def dead(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    async def release_kv(self, kv_transfer_params: dict) -> None:
        await self._pin_rpc("pdserve_release_kv", kv_transfer_params)

    async def _pin_rpc(self, method: str, kv_transfer_params: dict) -> None:
        """Call `method` of pdserve's worker extension on every rank for the prefill pin these
        transfer parameters name: the pin lives in the connector's worker side, in vLLM's
        worker process(es)."""
        request_id = kv_transfer_params.get("remote_request_id")
        if self._llm is None or not request_id or self._spec.pool != "prefill":
            return
        done = await self._llm.collective_rpc(method, args=(request_id,))
        logger.debug("%s(%s): %s", method, request_id, done)

    def stats(self) -> EngineStats:
        s = self._scheduler
        seconds, s.kv_seconds = tuple(s.kv_seconds), []
        return EngineStats(
            replica_id=self._spec.replica_id, pool=self._spec.pool, num_running=s.num_running,
            num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            num_aborted_total=self._aborted_total, num_finished_total=self._finished_total,
            kv_transport=s.kv_transport, kv_transfer_bytes_total=s.kv_bytes_total,
            kv_transfer_failures_total=s.kv_failures_total, kv_transfer_seconds=seconds,
            **s.take_timings(),
        )

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def _on_cpu(spec: EngineSpec) -> bool:
    device = spec.config.engine.device
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _set_cpu_environment(spec: EngineSpec) -> None:
    """vLLM's CPU backend reads its thread binding from the environment; set it from config.

    Without a binding it runs on one core. This actor process hosts only this engine, and the
    EngineCore subprocess inherits the variable.
    """
    cores = spec.config.engine.cpu_threads or f"0-{(os.cpu_count() or 1) - 1}"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores


def _local_model_path(spec: EngineSpec) -> str:
    """The model on this engine's node: the frontend resolved it on its own node, which may be
    another machine; the embedded model is converted here too (idempotent) if missing."""
    from pdserve.models import resolve_model

    if spec.config.model.source == "embedded":
        return resolve_model("embedded", spec.config.model.cache_dir).path
    return spec.model_path


def _engine_args(spec: EngineSpec, model_path: str, on_cpu: bool) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    model, engine = spec.config.model, spec.config.engine
    dtype = model.dtype
    if dtype == "auto" and on_cpu:
        dtype = "float32"  # bf16 prefill was 5x slower than fp32 on the CPU backend
    kv_bytes = engine.kv_cache_memory_bytes or (_DEFAULT_CPU_KV_BYTES if on_cpu else None)
    kwargs: dict[str, Any] = dict(
        model=model_path, served_model_name=spec.served_name, dtype=dtype,
        max_model_len=model.max_model_len, load_format=model.load_format,
        trust_remote_code=model.trust_remote_code,
        enforce_eager=engine.enforce_eager if engine.enforce_eager is not None else on_cpu,
        max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
        enable_prefix_caching=engine.enable_prefix_caching,
        tensor_parallel_size=engine.tensor_parallel_size, seed=engine.seed,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_bytes,
        disable_log_stats=False,  # per-request timings and scheduler stats need it
    )
    from pdserve.engine import replay, worker_extension

    # Continued requests replay the outputs the client has (pdserve/engine/replay.py).
    kwargs["logits_processors"] = [replay.QUALNAME]
    if spec.pool in ("prefill", "decode"):
        kwargs["kv_transfer_config"] = _kv_transfer_config(spec)
        # The frontend releases prefill KV no decode leg will pull (worker_extension.py).
        kwargs["worker_extension_cls"] = worker_extension.QUALNAME
    if engine.step_trace_dir is not None:
        kwargs["scheduler_cls"] = TRACING_SCHEDULER
    kwargs.update(engine.extra_engine_args)
    return AsyncEngineArgs(**kwargs)


def _kv_transfer_config(spec: EngineSpec) -> dict[str, Any]:
    """pdserve's KV connector for an engine of the prefill or decode pool."""
    from pdserve.kv.connector.config import kv_transfer_config

    kv = spec.config.kv
    if not kv.cluster_token:
        raise ValueError("kv.cluster_token must be set before engines start")
    return kv_transfer_config(
        spec.pool, kv.transport, kv.cluster_token, lease_s=kv.lease_s,
        failure_policy=kv.failure_policy, host=kv.advertise_host or _node_ip(),
        model_id=spec.served_name, engine_id=spec.replica_id, nccl_api=kv.nccl_api,
        nccl_max_pairs=kv.nccl_max_pairs, nccl_max_pairs_per_session=kv.nccl_max_pairs_per_session,
        tls_certfile=_path(kv.tls_certfile), tls_keyfile=_path(kv.tls_keyfile),
        tls_ca_file=_path(kv.tls_ca_file), tls_client_auth=kv.tls_client_auth,
        tls_server_name=kv.tls_server_name,
    )


def _path(path: os.PathLike[str] | None) -> str | None:
    """A config path as the string the connector's JSON-able config holds."""
    return None if path is None else str(path)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _sampling_params(request: GenerateRequest) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    from pdserve.engine.replay import PRIOR_KEY, REPLAY_KEY

    s = request.sampling
    extra: dict[str, Any] = {}
    if request.kv_transfer_params:
        extra["kv_transfer_params"] = request.kv_transfer_params
    if request.replay_output_tokens:
        extra[REPLAY_KEY] = list(request.replay_output_tokens)
    if request.prior_output_tokens and (s.presence_penalty or s.frequency_penalty):
        # The penalties count output the client has that sits at the end of the prompt.
        extra[PRIOR_KEY] = list(request.prompt_token_ids[-request.prior_output_tokens:])
    structured = (StructuredOutputsParams(**s.structured_output)
                  if s.structured_output is not None else None)
    return SamplingParams(
        n=1, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        min_p=s.min_p, seed=s.seed, stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias) or None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        bad_words=list(s.bad_words) or None, ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs, structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA, extra_args=extra or None,
    )


def _position(candidates: Any) -> PositionLogprobs:
    """vLLM's {token id: Logprob} of one position, in its order (the chosen token first)."""
    return tuple(TokenLogprob(int(token_id), float(lp.logprob), lp.rank, lp.decoded_token or "")
                 for token_id, lp in candidates.items())


def _logprobs(positions: Any) -> tuple[PositionLogprobs, ...] | None:
    if positions is None:
        return None
    return tuple(_position(p) for p in positions)


def _prompt_logprobs(positions: Any) -> tuple[PositionLogprobs | None, ...] | None:
    if not positions:  # None, or already sent with an earlier delta
        return None
    return tuple(None if p is None else _position(p) for p in positions)
