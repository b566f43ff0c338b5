"""deploy/onprem with the real engine, disaggregated: `ray up` on loopback, one prefill vLLM
engine (CPU build) on the head, one decode engine on the worker, KV blocks between the two nodes
over gRPC and then over the NCCL transport (gloo between CPU engines), Ray with token
authentication.

The mock-engine test's path (see test_ray_up_loopback.py) with what a real deployment adds:
the nodes install vLLM and prepare the embedded model with the setup commands of
deploy/onprem/cluster.yaml (the CPU build instead of the GPU extra); the service starts from
deploy/onprem/app.yaml switched to disaggregated mode, each pool pinned to its node by a custom
resource (the local provider has one node type, so here the head advertises the prefill slot;
the shipped files keep engines off the head). The decode engine pulls the prompt's KV blocks
from the prefill engine's gRPC port on the other node address, proving the cluster token there.

Slow (3.3 minutes on 2 cores with uv's cache warm, several more cold: a 3.5 GB venv, model
conversion, two engine starts, removing it all) and memory hungry (two engines): run it
deliberately with `scripts/test.sh -m slow tests/e2e`.
"""

from __future__ import annotations

import time

import httpx
import pytest
from e2e_loopback import (
    RAY,
    REFUSED,
    STOP_SERVICE,
    cpu_vllm_setup,
    free_port,
    from_outside,
    serve_command,
    wait_for_no_processes,
    wait_for_resource,
    wait_healthy,
)

from pdserve.testing.server import metric_value, wait_for_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ray_up_serves_disaggregated_vllm_with_kv_over_grpc_and_nccl_between_the_nodes(site, make_cluster):
    started = time.monotonic()
    # 2 CPUs per node: an engine actor takes 1, vLLM's engine core process the rest.
    cluster = make_cluster(cpu_vllm_setup, head_cpus=2, worker_cpus=2,
                           head_resources={"pdserve_prefill": 1},
                           worker_resources={"pdserve_decode": 1})
    cluster.start(timeout_s=1500)
    up_s = time.monotonic() - started

    status = [RAY, "status", f"--address={cluster.gcs_address}"]
    refused = from_outside(cluster, None, *status)
    assert refused.returncode != 0 and REFUSED in refused.stderr, refused.stdout + refused.stderr
    # The prefill engine's node (the head) is ready now; the decode engine's joins after its
    # setup, which on loopback rewrites the venv the head's engine would import.
    wait_for_resource(cluster, site.ray_token, "pdserve_decode", timeout_s=900)

    replies = {}
    # KV over gRPC, then over the NCCL transport (gloo between CPU engines), same two nodes.
    for transport in ("grpc", "nccl"):
        replies[transport] = _serve_and_pull(cluster, site, transport)
    serving_s = time.monotonic() - started
    assert replies["grpc"] == replies["nccl"], replies  # greedy: the same text either way

    cluster.down()
    assert not wait_for_no_processes(site.user), "ray down left processes of the cluster running"
    print(f"\nloopback ray up (vLLM 1P1D) {up_s:.0f} s, both transports served by {serving_s:.0f} s, "
          f"down at {time.monotonic() - started:.0f} s: {replies['grpc']!r}")


def _serve_and_pull(cluster, site, transport: str) -> str:
    """Start the 1P1D service with `transport`, serve one completion whose KV is pulled across
    the nodes, check the pull in /metrics, stop the service; the completion's text."""
    port = free_port(site.head_ip)
    cluster.exec(serve_command(
        site, port, f"--mode disaggregated --prefill 1 --decode 1 --transport {transport}",
        "--set 'pools.prefill.resources={pdserve_prefill: 1}'",
        "--set 'pools.decode.resources={pdserve_decode: 1}'",
        "--set pools.prefill.num_gpus=0 --set pools.decode.num_gpus=0",
        # Two engines on this machine's cores: one core each.
        "--set pools.prefill.cpu_threads=0 --set pools.decode.cpu_threads=1",
        f"--kv-cache-memory-bytes {512 * 1024**2}",
        "--device cpu --max-model-len 2048"))
    base_url = f"http://{site.head_ip}:{port}"
    wait_healthy(base_url, site, timeout_s=900)

    # Longer than one KV block (128 tokens on CPU), so there are whole blocks to pull.
    prompt = "The capital of France is Paris. " * 40 + "The capital of France is"
    reply = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    assert text.strip()

    def pulled(text: str) -> float:
        return metric_value(text, "pdserve_kv_transfer_bytes_total", transport=transport) or 0

    # Engine stats reach /metrics about once a second.
    metrics = wait_for_metrics(base_url, lambda text: pulled(text) > 0, timeout_s=30)
    assert metric_value(metrics, "pdserve_engine_info", pool="prefill", node=site.head_ip) == 1, metrics
    assert metric_value(metrics, "pdserve_engine_info", pool="decode", node=site.worker_ip) == 1, metrics
    assert pulled(metrics) > 0, metrics
    assert (metric_value(metrics, "pdserve_kv_transfer_failures_total", transport=transport) or 0) == 0
    cluster.exec(STOP_SERVICE, timeout_s=120)
    return text
