"""Admission after a burst, on real local Ray with the mock engine: a burst that leaves the
decode engine's KV pulls far behind must not teach the router to refuse requests once it is over.

On 4 x H100 (benchmarks/results/gpu/2026-11-27-h100-x4/) the router once predicted a remote
request's TTFT as prefill plus "KV pull", fitted from decode legs that had waited seconds; an
idle 1P1D then predicted more than admit_ttft_factor x the target, every request was refused,
nothing ran to correct the fit, and the service refused everything until it was stopped. Here
the mock decode engine pulls KV at 0.3 GB/s, one pull at a time (0.44 s per 1000-token
prompt, ~2.3 requests/s), so a 4 req/s burst leaves its decode legs waiting many seconds.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.testing.burst import Phase, run_phases
from pdserve.testing.server import metric_value, start_mock_server

pytestmark = pytest.mark.integration

SERVE_ARGS = [
    "--served-model-name", "tiny", "--mode", "disaggregated",
    "--prefill", "1", "--decode", "1", "--ttft-ms", "1500", "--tpot-ms", "150",
    "--set", "engine.mock.prefill_tokens_per_s=5000", "--set", "engine.mock.decode_step_s=0.03",
    "--set", "engine.mock.transfer_bytes_per_s=3e8", "--set", "engine.mock.max_model_len=4096",
    "--set", "pools.prefill.num_cpus=0.1", "--set", "pools.decode.num_cpus=0.1",
    "--set", "scheduler.admit_ttft_factor=4", "--set", "scheduler.local_prefill_max_tokens=0",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_mock_server(SERVE_ARGS, tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


def test_a_burst_that_backs_up_kv_pulls_does_not_lock_admission_out(server, tmp_path):
    phases = [Phase(4, 25, "burst"), Phase(0.5, 25, "after")]
    run = asyncio.run(run_phases(server.base_url, "tiny", phases, prompt_tokens=1000,
                                 output_tokens=16, pools=("prefill", "decode")))
    (tmp_path / "burst.json").write_text(run.to_json())
    after = [o for o in run.outcomes if o.phase == "after"]
    assert after
    # Idle engines (0.5 req/s of 200 ms prefills) take every request once the burst is over.
    refused = [o for o in after if o.status != 200 or o.output_tokens != 16]
    assert not refused, (refused[:3], server.log_tail())
    # The burst itself is served too: its first tokens come from an unqueued prefill engine,
    # so nothing predicts a TTFT past the limit (its decode legs' wait shows in TPOT only).
    burst = [o for o in run.outcomes if o.phase == "burst"]
    assert burst and all(o.status == 200 and o.output_tokens == 16 for o in burst)
    # The model routing and admission use is on /metrics, so a surprise like the H100 one can
    # be read off a dashboard (pdserve_scheduler_model).
    text = httpx.get(f"{server.base_url}/metrics").text
    for pool, param in (("prefill", "prefill_tokens_per_s"), ("decode", "decode_step_seconds"),
                        ("decode", "pull_seconds_per_1k_tokens")):
        assert (metric_value(text, "pdserve_scheduler_model", pool=pool, param=param) or 0) > 0
