"""An engine killed while it drains (a scale-down in progress): real Ray, mock engine actors,
the backend driven in this process. The drained engine's requests continue on the engine that
stays, nothing replaces it (it was leaving anyway), and nothing stays booked."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pdserve.config.loader import load_config
from pdserve.config.schema import PoolRole
from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.types import GenerateRequest, SamplingOptions
from pdserve.models.embedded import ResolvedModel
from pdserve.serving.ray_backend import RayBackend
from pdserve.testing import save_tiny_model

pytestmark = pytest.mark.integration


def request(rid: str, first: int) -> GenerateRequest:
    # Distinct prompts: a cached prefix would draw both requests to one engine.
    return GenerateRequest(rid, tuple(range(first, first + 40)),
                           SamplingOptions(max_tokens=60, temperature=0))


async def test_an_engine_killed_while_draining_is_not_replaced_and_loses_no_request(local_ray,
                                                                                  tmp_path):
    config = load_config(overrides={
        "mode": "colocated", "engine.kind": "mock", "pools.colocated.replicas": 2,
        "pools.colocated.num_cpus": 0.5, "engine.mock.decode_step_s": 0.05,
        "serving.restart_backoff_s": 0.1})
    model = ResolvedModel(str(save_tiny_model(tmp_path / "tiny")), "tiny")
    backend = await RayBackend.launch(config, model)
    try:
        # What an undisturbed engine makes of each (the mock's output is a function of the
        # request alone).
        reference_engine = MockEngine("reference", "colocated", "tiny", config.engine.mock)
        await reference_engine.start()
        undisturbed = [[d async for d in reference_engine.generate(request(f"r{i}", 100 * i + 1))]
                       for i in range(2)]
        await reference_engine.shutdown()
        streams, got = [], []
        for i in range(2):  # one after the other: the second sees the first one decoding
            streams.append(backend.generate(request(f"r{i}", 100 * i + 1)))
            got.append([await anext(streams[-1])])
        placed = {stream.engines["decode"] for stream in streams}
        assert len(placed) == 2, placed  # one stream on each engine
        # A scale-down to one engine drains one of them; it waits for its stream to end.
        await backend.control.scale_to(PoolRole.COLOCATED, 1)
        await asyncio.sleep(0.2)
        draining = [r for r in backend.replicas(PoolRole.COLOCATED)
                    if backend.ledger.engine("colocated", r.replica_id).draining]
        assert len(draining) == 1
        victim = draining[0]
        os.kill(victim.info.pid, signal.SIGKILL)
        for i, stream in enumerate(streams):
            got[i] += [d async for d in stream]
        for deltas, reference in zip(got, undisturbed, strict=True):
            assert [t for d in deltas for t in d.token_ids] == [t for d in reference for t in d.token_ids]
            assert deltas[-1].finish_reason == "length"
        await asyncio.sleep(1.0)
        # Gone, not replaced: the pool is at the size the scale-down asked for.
        replicas = backend.replicas(PoolRole.COLOCATED)
        assert victim not in replicas and len(replicas) == 1
        health = backend.health()
        assert health["status"] == "ready" and health["pools"]["colocated"]["serving"] == 1, health
        assert backend.metrics.migrated.labels("colocated")._value.get() == 1
        assert all(record.idle for record in backend.ledger.engines)
    finally:
        await backend.shutdown()
