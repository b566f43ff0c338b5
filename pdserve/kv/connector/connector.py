"""`PdserveConnector`: the class vLLM loads (`kv_connector_module_path="pdserve.kv.connector"`).

A thin facade over vLLM's KVConnectorBase_V1 contract. vLLM builds it twice per engine: once
with role SCHEDULER in the EngineCore process (-> `SchedulerSide`) and once per worker with role
WORKER (-> `WorkerSide`). Every method forwards to the side that exists; the two sides talk only
through `PdserveConnectorMetadata` (scheduler -> worker, each step), `get_finished` and the load
error set (worker -> scheduler, each step), and the handshake metadata (worker -> scheduler,
once at start: where the worker's KV source listens). Version differences: see compat.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdserve.kv.connector import compat
from pdserve.kv.connector.config import ConnectorConfig
from pdserve.kv.connector.metadata import StepPlan, WorkerEndpoint
from pdserve.kv.connector.scheduler_side import SchedulerSide
from pdserve.kv.connector.stats import PdserveKVStats
from pdserve.kv.connector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["PdserveConnector", "PdserveConnectorMetadata", "PdserveHandshake"]


class PdserveConnectorMetadata(KVConnectorMetadata):
    """One step's `StepPlan`, in the wrapper type vLLM's contract names."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class PdserveHandshake(KVConnectorHandshakeMetadata):
    """One worker's `WorkerEndpoint`, in the wrapper type vLLM's contract names."""

    def __init__(self, endpoint: WorkerEndpoint):
        self.endpoint = endpoint


class PdserveConnector(KVConnectorBase_V1):
    """pdserve's disaggregated prefill/decode KV connector (pull-based, gRPC or NCCL)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_vllm(transfer)
        engine_id = str(transfer.engine_id)
        block_size = int(vllm_config.cache_config.block_size)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.config, engine_id=engine_id, block_size=block_size)
        else:
            self.worker_side = WorkerSide(
                self.config,
                engine_id=engine_id,
                block_size=block_size,
                num_blocks=compat.kv_num_blocks(kv_cache_config),
                model_id=self.config.model_id or compat.model_id_of(vllm_config),
            )

    # ---- scheduler side: EngineCore process, scheduler thread, never blocks ---------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, per scheduling attempt of a waiting request: prompt tokens the prefill
        engine holds beyond the local cache hit, loaded asynchronously."""
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler, once per allocation of a waiting request: plan its pull (or release)."""
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(
            request, compat.block_ids_of(blocks), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler, once per step: the worker side's plan for this step."""
        assert self.scheduler_side is not None
        scheduled = compat.iter_scheduled(scheduler_output)
        total = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        return PdserveConnectorMetadata(self.scheduler_side.build_step_plan(scheduled, total))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, exactly once per request: keep its blocks for a decode engine?"""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler, once at engine start: each TP rank's KV source address."""
        assert self.scheduler_side is not None
        self.scheduler_side.set_endpoints(
            {rank: m.endpoint for rank, m in metadata.items() if isinstance(m, PdserveHandshake)}
        )

    # ---- worker side: worker process, engine thread -----------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start: register the KV tensors; a prefill engine starts serving."""
        assert self.worker_side is not None
        tp_rank, tp_size = compat.tp_rank_and_size(self._vllm_config)
        self.worker_side.register_kv_caches(
            kv_caches, tp_rank=tp_rank, tp_size=tp_size, heads=compat.kv_heads_of(self._vllm_config)
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker, once at start (after register_kv_caches): where this worker serves KV."""
        assert self.worker_side is not None
        return PdserveHandshake(self.worker_side.endpoint())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, every step before the forward: open the step's window (step_window), then
        carry out the step's plan at once."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.begin_step()
        self._apply()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker, every step (before or after the forward, by version): the plan is applied
        here if bind did not; pulls are asynchronous, so nothing waits."""
        self._apply()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per attention layer: nothing to wait for (loads finish before scheduling)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Worker, per attention layer: nothing to save (decode engines pull)."""

    def wait_for_save(self) -> None:
        """Worker, every step after the forward: nothing to wait for."""
        self._apply()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step: (requests whose blocks may be freed, requests whose load ended).
        Waits for pulls in flight while the GPU still runs the step before, and sleeps ~2 ms on
        idle steps with transfers outstanding (see WorkerSide.get_finished)."""
        assert self.worker_side is not None
        self._apply()
        sending, recving = self.worker_side.get_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step right after get_finished: blocks of pulls that failed."""
        assert self.worker_side is not None
        return self.worker_side.take_load_errors()

    def get_kv_connector_stats(self) -> PdserveKVStats | None:
        """Worker, every step: the pulls that finished since the last call (None if none)."""
        if self.worker_side is None:
            return None
        records = self.worker_side.take_pull_records()
        return PdserveKVStats.of_pulls(records) if records else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdserveKVStats:
        """vLLM, in the stat-logging process: rebuild stats from their `data` dict."""
        return PdserveKVStats(data=data) if data is not None else PdserveKVStats()

    def shutdown(self) -> None:
        """Either side, once at shutdown: stop serving and pulling."""
        if self.worker_side is not None:
            self.worker_side.shutdown()

    def _apply(self) -> None:
        metadata = self._connector_metadata
        if self.worker_side is not None and isinstance(metadata, PdserveConnectorMetadata):
            self.worker_side.apply(metadata.plan)
