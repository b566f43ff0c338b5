"""The simulator and the Ray backend drive the request ledger with the same lifecycle events.

The same request (20 prompt tokens, 4 output tokens, greedy) goes once through the simulator
(virtual engines) and once through `RayBackend` over mock engine actors on a local Ray: both
1P1D, both forced onto the remote path. Each ledger's observer records what it was told; the
sequences of (event, leg, pool) must be equal, so the simulator's routing sees the very books
the production path keeps.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.config.loader import load_config
from pdserve.engine.types import GenerateRequest, SamplingOptions
from pdserve.models.embedded import ResolvedModel
from pdserve.scheduler.ledger import Admitted, LedgerEvent, RequestFinished
from pdserve.scheduler.perf_model import PerfModel
from pdserve.scheduler.routing import RoutingPolicy
from pdserve.serving.ray_backend import RayBackend
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.runner import SimConfig, Simulation, Topology
from pdserve.sim.workload import Workload
from pdserve.testing import save_tiny_model

pytestmark = pytest.mark.integration

PROMPT, OUTPUT = 20, 4


def shape(events: list[LedgerEvent]) -> list[tuple]:
    """Each event without its ids and times: what happened, to which leg, in which pool."""
    out = []
    for e in events:
        if isinstance(e, Admitted):
            out.append(("Admitted", e.placement.reason))
        elif isinstance(e, RequestFinished):
            out.append(("RequestFinished", e.finish_reason, e.output_tokens))
        else:
            out.append((type(e).__name__, e.leg.value, e.pool))
    return out


def simulated_events() -> list[LedgerEvent]:
    perf = PerfModel(prefill_tokens_per_s=1000.0, decode_step_s=0.01, kv_bytes_per_token=1000,
                     transfer_bytes_per_s=1e6)
    profile = EngineProfile(perf, block_size=16, num_kv_blocks=1000, max_num_seqs=64,
                            max_num_batched_tokens=512, startup_s=30.0, name="hand")
    config = SimConfig(profile, Topology.disaggregated(1, 1),
                       routing=RoutingPolicy(local_prefill_max_tokens=0))
    events: list[LedgerEvent] = []
    Simulation(config, observer=events.append).run(
        Workload(np.array([0.0]), np.array([PROMPT]), np.array([OUTPUT])))
    return events


async def test_the_simulator_and_the_ray_backend_send_the_ledger_the_same_events(local_ray, tmp_path):
    config = load_config(overrides={
        "mode": "disaggregated", "engine.kind": "mock",
        "pools.prefill.replicas": 1, "pools.decode.replicas": 1,
        "pools.prefill.num_cpus": 0.5, "pools.decode.num_cpus": 0.5,
        "engine.mock.decode_step_s": 0.01, "scheduler.local_prefill_max_tokens": 0})
    model = ResolvedModel(str(save_tiny_model(tmp_path / "tiny")), "tiny")
    events: list[LedgerEvent] = []
    backend = await RayBackend.launch(config, model, observer=events.append)
    try:
        request = GenerateRequest("r", tuple(range(1, PROMPT + 1)),
                                  SamplingOptions(max_tokens=OUTPUT, temperature=0.0))
        deltas = [d async for d in backend.generate(request)]
        assert sum(len(d.token_ids) for d in deltas) == OUTPUT
        assert deltas[-1].finish_reason == "length"
        assert all(record.idle for record in backend.ledger.engines)  # nothing left booked
    finally:
        await backend.shutdown()
    expected = [
        ("Admitted", "remote"),
        ("LegStarted", "prefill", "prefill"), ("FirstOutput", "prefill", "prefill"),
        ("LegFinished", "prefill", "prefill"),
        ("LegStarted", "decode", "decode"), ("FirstOutput", "decode", "decode"),
        ("LegFinished", "decode", "decode"),
        ("RequestFinished", "length", OUTPUT),
    ]
    assert shape(events) == expected
    assert shape(simulated_events()) == expected
