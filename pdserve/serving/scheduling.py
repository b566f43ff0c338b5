"""The global scheduler a backend starts with, built from the config (no Ray, no I/O).

`build_scheduler` sets up the routing policy, SLO targets and prefix awareness; `seed_model` picks
the performance model its predictions start from, which the online fit then refines.
"""

from __future__ import annotations

from pdserve.config.schema import PdserveConfig
from pdserve.engine.types import EngineInfo
from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.routing import RoutingPolicy, SloTargets
from pdserve.scheduler.scheduler import GlobalScheduler


def build_scheduler(config: PdserveConfig, pools: list[str], info: EngineInfo) -> GlobalScheduler:
    slo = None
    if config.slo.defined:
        slo = SloTargets(config.slo.ttft_ms / 1000, config.slo.tpot_ms / 1000,
                         config.slo.percentile)
    policy = RoutingPolicy(local_prefill_max_tokens=config.scheduler.local_prefill_max_tokens,
                           admit_ttft_factor=config.scheduler.admit_ttft_factor)
    return GlobalScheduler(pools, seed_model(config), slo, policy, config.scheduler.window_s,
                           config.scheduler.prefix_aware, max(info.block_size, 1))


def seed_model(config: PdserveConfig) -> PerfModel:
    """The performance model to start from: a profile, the mock's settings, or a guess."""
    if config.scheduler.profile is not None:
        return PerfModel.load(config.scheduler.profile)
    if config.engine.kind == "mock":
        m = config.engine.mock
        return PerfModel(prefill_tokens_per_s=m.prefill_tokens_per_s, decode_step_s=m.decode_step_s,
                         decode_step_per_seq_s=m.decode_step_per_seq_s,
                         kv_bytes_per_token=m.kv_bytes_per_token,
                         transfer_bytes_per_s=m.transfer_bytes_per_s)
    # No profile: a deliberately modest guess; the online fit replaces it within a few dozen
    # requests.
    return PerfModel(prefill_tokens_per_s=2000.0, decode_step_s=0.02, decode_step_per_seq_s=1e-4,
                     prefill_overhead_s=0.01, transfer_bytes_per_s=1e9)
