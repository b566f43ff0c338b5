"""Autoscaling on real local Ray with the mock engine: a burst of long prompts grows the
prefill pool (and only it), the service meets its SLO again once the pool has grown, and the
pool shrinks back after the burst without failing a request."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.testing.burst import Phase, run_phases
from pdserve.testing.server import start_mock_server

pytestmark = pytest.mark.integration

TTFT_S, TPOT_S = 1.5, 0.3
# Mock timings: 1000-token prompts take 200 ms to prefill (5 req/s per prefill engine);
# decode steps take 30 ms + 0.5 ms per running request, 10x inside the TPOT target (a loaded
# 2-core machine adds its own delays to every token). Conditional disaggregation is off
# (local_prefill_max_tokens=0): with it, the decode engine prefills part of the burst itself,
# the prefill pool's load sits near the scale-up threshold and whether it grows is chance.
SERVE_ARGS = [
    "--served-model-name", "tiny", "--mode", "disaggregated",
    "--prefill", "1", "--decode", "1", "--autoscale", "--ttft-ms", "1500", "--tpot-ms", "300",
    "--min-prefill", "1", "--max-prefill", "3", "--min-decode", "1", "--max-decode", "3",
    "--set", "engine.mock.prefill_tokens_per_s=5000", "--set", "engine.mock.decode_step_s=0.03",
    "--set", "engine.mock.decode_step_per_seq_s=0.0005", "--set", "engine.mock.max_model_len=4096",
    "--set", "pools.prefill.num_cpus=0.1", "--set", "pools.decode.num_cpus=0.1",
    "--set", "autoscale.interval_s=1", "--set", "autoscale.upscale_intervals=2",
    "--set", "autoscale.downscale_intervals=3", "--set", "autoscale.upscale_cooldown_s=5",
    "--set", "autoscale.downscale_cooldown_s=5", "--set", "scheduler.window_s=5",
    "--set", "scheduler.admit_ttft_factor=30", "--set", "scheduler.local_prefill_max_tokens=0",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_mock_server(SERVE_ARGS, tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


def test_a_burst_grows_prefill_only_and_it_shrinks_after(server, tmp_path):
    phases = [Phase(2, 6, "before"), Phase(8, 10, "burst"), Phase(8, 15, "burst_sustained"),
              Phase(1, 35, "after")]
    run = asyncio.run(run_phases(server.base_url, "tiny", phases, prompt_tokens=1000,
                                 output_tokens=16, pools=("prefill", "decode"), settle_s=5))
    (tmp_path / "burst.json").write_text(run.to_json())
    failed = [o for o in run.outcomes if o.status != 200 or o.output_tokens != 16]
    assert not failed, (failed[:5], server.log_tail())

    def sizes(pool, since=0.0, until=1e9):
        return [row[pool] for row in run.pools if since <= row["t"] <= until and row[pool] is not None]

    burst_end = 6 + 10 + 15
    assert max(sizes("prefill", 6, burst_end)) >= 2, run.pools
    assert max(sizes("decode")) == 1, run.pools  # decode was never the bottleneck
    assert sizes("prefill")[-1] == 1, run.pools  # shrunk back after the burst
    # Once the pool has grown, the burst meets the SLO again; before and after it always does.
    assert run.attainment(TTFT_S, TPOT_S, "burst_sustained") >= 0.9
    assert run.attainment(TTFT_S, TPOT_S, "after") >= 0.9
    reasons = {(d["pool"], d["direction"], d["reason"]) for d in run.decisions}
    assert ("prefill", "up", "ttft_breach") in reasons or ("prefill", "up", "prefill_load") in reasons
    assert ("prefill", "down", "idle") in reasons
