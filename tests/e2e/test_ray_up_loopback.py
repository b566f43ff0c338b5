"""deploy/onprem on a real `ray up` cluster: from nothing to a served completion and back.

`ray up` with Ray's `local` provider brings up a head (127.0.0.2) and a worker (127.0.0.3) over
SSH on this machine (see e2e_loopback.py), installs pdserve on them with the setup commands of
deploy/onprem/cluster.yaml, and the service starts on the head with deploy/onprem/app.yaml, as
the deploy README does it. Its engine (the model-free mock engine) must land on the worker, the
only node with the `pdserve_colocated` resource; a completion must succeed through the head's
endpoint; `ray down` must leave nothing of the cluster running.

Ray runs with token authentication on both nodes, as the shipped file starts it: the service
(a driver on the head with the token) serves, and from "your machine" `ray status` and a driver
(`ray.init(address=...)`) are refused without the token and with a wrong one, and work with it.

Runs where it can (Linux, root, apt-get: CI's machines). Skip it with PDSERVE_SKIP_E2E=1.
About 3-4 minutes on 2 cores, most of it `ray up`; it needs PyPI (uv installs pdserve).
"""

from __future__ import annotations

import json
import secrets
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from e2e_loopback import (
    RAY,
    REFUSED,
    STOP_SERVICE,
    Cluster,
    LoopbackSite,
    free_port,
    from_outside,
    mock_engine_setup,
    serve_command,
    wait_for_no_processes,
    wait_healthy,
)

from pdserve.testing import tiny_tokenizer
from pdserve.testing.server import metric_value

pytestmark = pytest.mark.e2e


def tiny_model(site: LoopbackSite) -> Path:
    """A tokenizer-only checkpoint in the SSH user's home: the mock engine needs no weights."""
    with tempfile.TemporaryDirectory() as scratch:
        tiny_tokenizer().save_pretrained(scratch)
        for file in Path(scratch).iterdir():
            site.write_user_file(f"tiny-model/{file.name}", file.read_text())
    return site.write_user_file("tiny-model/config.json", json.dumps({"model_type": "llama"})).parent


def driver(address: str) -> list[str]:
    """A Ray job's driver: joins the cluster at `address` and runs a task there."""
    return [sys.executable, "-c", "import ray; ray.init(address=%r); "
            "print('task says', ray.get(ray.remote(num_cpus=0)(lambda: 6 * 7).remote()))" % address]


def check_ray_refuses_callers_without_the_token(cluster: Cluster, site: LoopbackSite) -> None:
    status = [RAY, "status", f"--address={cluster.gcs_address}"]
    for token in (None, secrets.token_hex(32)):  # no token; a wrong one
        done = from_outside(cluster, token, *status)
        assert done.returncode != 0 and REFUSED in done.stderr, done.stdout + done.stderr
    done = from_outside(cluster, site.ray_token, *status)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pdserve_colocated" in done.stdout, done.stdout  # the worker joined, with the token

    # A job's driver without the token: the GCS refuses it (ray.init retries for ~20 s).
    done = from_outside(cluster, None, *driver(cluster.gcs_address))
    assert done.returncode != 0 and REFUSED in done.stdout + done.stderr, done.stdout + done.stderr
    assert "task says" not in done.stdout
    # With the token (the nodes' ~/.ray/auth_token and RAY_AUTH_MODE=token from ~/.bashrc), a
    # driver on the head runs its task.
    on_head = shlex.join(["python", *driver(cluster.gcs_address)[1:]])
    done = cluster.exec(on_head)
    assert "task says 42" in done.stdout + done.stderr, done.stdout + done.stderr


def test_ray_up_serves_a_completion_from_a_worker_engine_and_ray_down_cleans_up(site, make_cluster):
    started = time.monotonic()
    cluster = make_cluster(mock_engine_setup)
    cluster.start()
    up_s = time.monotonic() - started

    port = free_port(site.head_ip)
    cluster.exec(serve_command(site, port, "--engine mock", f"--model {tiny_model(site)}",
                               "--served-model-name tiny --replicas 1",
                               "--set pools.colocated.num_gpus=0"))
    base_url = f"http://{site.head_ip}:{port}"
    wait_healthy(base_url, site, timeout_s=300)
    serving_s = time.monotonic() - started

    reply = httpx.post(f"{base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello world", "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"]
    assert reply.json()["usage"]["completion_tokens"] == 8

    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    # The engine runs on the worker: the only node advertising pdserve_colocated.
    assert metric_value(metrics, "pdserve_engine_info", pool="colocated",
                        node=site.worker_ip) == 1, metrics
    assert metric_value(metrics, "pdserve_requests_total", pool="colocated",
                        finish_reason="length") == 1

    check_ray_refuses_callers_without_the_token(cluster, site)

    cluster.exec(STOP_SERVICE, timeout_s=90)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/health", timeout=2)

    cluster.down()
    assert not wait_for_no_processes(site.user), "ray down left processes of the cluster running"
    print(f"\nloopback ray up {up_s:.0f} s, serving at {serving_s:.0f} s, "
          f"down at {time.monotonic() - started:.0f} s")
