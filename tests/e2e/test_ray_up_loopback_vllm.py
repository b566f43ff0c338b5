"""deploy/onprem with the real engine: `ray up` on loopback, vLLM (CPU build) on the worker.

The mock-engine test's path (see test_ray_up_loopback.py) with what a real deployment adds:
the nodes install vLLM and prepare the embedded model with the setup commands of
deploy/onprem/cluster.yaml (the CPU build instead of the GPU extra), and the worker's engine
loads SmolLM2-135M and answers greedily.

Slow (4-7 minutes on 2 cores: a 3.5 GB venv, model conversion, engine start, removing
it all) and memory hungry (~4 GB): run it deliberately with `scripts/test.sh -m slow tests/e2e`.
"""

from __future__ import annotations

import time

import httpx
import pytest
from e2e_loopback import (
    STOP_SERVICE,
    cpu_vllm_setup,
    free_port,
    serve_command,
    wait_for_no_processes,
    wait_healthy,
)

from pdserve.testing.server import metric_value

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ray_up_serves_the_embedded_model_with_vllm_on_the_worker(site, make_cluster):
    started = time.monotonic()
    # 2 CPUs on the worker: the engine actor takes 1, vLLM's engine core process the rest.
    cluster = make_cluster(cpu_vllm_setup, worker_cpus=2)
    cluster.start(timeout_s=1500)
    up_s = time.monotonic() - started

    port = free_port(site.head_ip)
    cluster.exec(serve_command(site, port, "--replicas 1", "--set pools.colocated.num_gpus=0",
                               "--device cpu", "--max-model-len 2048"))
    base_url = f"http://{site.head_ip}:{port}"
    wait_healthy(base_url, site, timeout_s=600)
    serving_s = time.monotonic() - started

    reply = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"].strip()

    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert metric_value(metrics, "pdserve_engine_info", pool="colocated",
                        node=site.worker_ip) == 1, metrics

    cluster.exec(STOP_SERVICE, timeout_s=120)
    cluster.down()
    assert not wait_for_no_processes(site.user), "ray down left processes of the cluster running"
    print(f"\nloopback ray up (vLLM) {up_s:.0f} s, serving at {serving_s:.0f} s, "
          f"down at {time.monotonic() - started:.0f} s: {reply.json()['choices'][0]['text']!r}")
