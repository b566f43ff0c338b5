"""Adaptive disaggregation (`pdserve serve --adaptive`) on real local Ray with mock engines,
1 prefill + 1 decode: a burst of long prompts puts the prefill engine behind the TTFT target, and
the decode engine prefills the overflow itself, with the same outputs as anywhere else."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from pdserve.testing import save_tiny_model
from pdserve.testing.server import start_server
from tests.integration.test_serve_mock_disaggregated import expected_text

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    log = tmp_path_factory.mktemp("server") / "pdserve.log"
    # The mock prefills 4000 tokens/s: a 600-token prompt takes 0.15 s, so from the third of a
    # burst on, the prefill engine's queue predicts more than half the 400 ms TTFT target.
    running = start_server(
        ["--engine", "mock", "--model", str(model_dir), "--served-model-name", "tiny",
         "--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--adaptive",
         "--ttft-ms", "400", "--tpot-ms", "100",
         "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5",
         "--set", "engine.mock.decode_step_s=0.01", "--set", "engine.mock.prefill_tokens_per_s=4000"],
        log, start_timeout_s=180)
    yield running
    running.stop()


def test_a_prefill_backlog_overflows_to_the_decode_engine(server):
    prompts = [[10 + (i * 13 + j) % 500 for j in range(600)] for i in range(10)]

    def complete(prompt):
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.headers["x-pdserve-path"], r.json()["choices"][0]["text"]

    with cf.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(complete, prompts))
    paths = [path for path, _ in results]
    assert "remote" in paths and "overflow" in paths, paths
    for prompt, (_, text) in zip(prompts, results, strict=True):
        assert text == expected_text(prompt, 6)
