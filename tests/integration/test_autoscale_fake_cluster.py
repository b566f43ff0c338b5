"""A pool scale-up on a Ray autoscaling cluster brings up a node of the pool's type.

The cluster is Ray's fake multi-node autoscaler on this machine (`RAY_FAKE_CLUSTER=1 ray start
--head --autoscaling-config=autoscale/fake_cluster.yaml`): real autoscaler, real raylets, with
prefill and decode node types carrying the custom resources the pools ask for (one engine per
node). pdserve joins it with mock engines; its launch asks for the nodes of the initial pools,
and a burst of long prompts makes the autoscaling loop add a prefill engine, which cannot be
placed until the Ray autoscaler has started a second prefill node.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.testing import save_tiny_model
from pdserve.testing.burst import Phase, run_phases
from pdserve.testing.ray_cluster import stop_cluster
from pdserve.testing.server import free_port, start_server

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def _ray_env() -> dict[str, str]:
    return {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_enable_autoscaler_v2": "0",
            "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def _nodes(address: str) -> list[dict]:
    code = ("import json, ray; ray.init(address=%r, logging_level='ERROR');"
            "print('NODES=' + json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))"
            % address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=_ray_env())
    assert out.returncode == 0, out.stderr[-2000:]
    # Ray forwards autoscaler events to the driver's stdout too: take our line only.
    line = next(l for l in out.stdout.splitlines() if l.startswith("NODES="))
    return json.loads(line.removeprefix("NODES="))


def _count(nodes: list[dict], resource: str) -> int:
    return sum(1 for n in nodes if n.get(resource))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import yaml
    from ray._private.services import get_node_ip_address

    port = free_port()
    # Fake nodes join the GCS at provider.gcs_address (default port 6379): point it at ours.
    config = yaml.safe_load((HERE / "autoscale" / "fake_cluster.yaml").read_text())
    config["provider"]["gcs_address"] = f"{get_node_ip_address()}:{port}"
    config_path = tmp_path_factory.mktemp("fake-cluster") / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    head = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
         "--num-cpus=1", "--include-dashboard=false", "--object-store-memory=100000000",
         f"--autoscaling-config={config_path}"],
        capture_output=True, text=True, timeout=180, env=_ray_env())
    if head.returncode != 0:
        stop_cluster(port)
        pytest.fail(f"ray start failed:\n{head.stdout[-2000:]}\n{head.stderr[-2000:]}")
    address = f"127.0.0.1:{port}"
    try:
        yield address
    finally:
        stop_cluster(port)


def test_a_prefill_scale_up_brings_up_a_prefill_node(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", _ray_env()["RAY_AUTH_MODE"])  # the server joins it
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    assert _count(_nodes(cluster), "pdserve_prefill") == 0  # nothing until pdserve asks
    server = start_server(
        ["--engine", "mock", "--model", str(model_dir), "--served-model-name", "tiny",
         "--ray-address", cluster, "--mode", "disaggregated", "--prefill", "1", "--decode", "1",
         "--autoscale", "--ttft-ms", "1500", "--tpot-ms", "150", "--max-prefill", "2",
         "--max-decode", "1",
         "--set", "pools.prefill.num_cpus=0", "--set", "pools.decode.num_cpus=0",
         "--set", "pools.prefill.resources={pdserve_prefill: 1}",
         "--set", "pools.decode.resources={pdserve_decode: 1}",
         "--set", "engine.mock.prefill_tokens_per_s=5000", "--set", "engine.mock.decode_step_s=0.03",
         "--set", "engine.mock.max_model_len=4096",
         "--set", "autoscale.interval_s=1", "--set", "autoscale.upscale_cooldown_s=2",
         "--set", "scheduler.window_s=5", "--set", "scheduler.admit_ttft_factor=100"],
        tmp_path / "pdserve.log", start_timeout_s=300)
    try:
        nodes = _nodes(cluster)
        # The initial pools' engines each got a node of their type.
        assert (_count(nodes, "pdserve_prefill"), _count(nodes, "pdserve_decode")) == (1, 1), nodes
        # 1000-token prompts at 5000 tok/s: one prefill engine serves 5 req/s; send 8.
        phases = [Phase(8, 25, "burst"), Phase(1, 5, "after")]
        run = asyncio.run(run_phases(server.base_url, "tiny", phases, prompt_tokens=1000,
                                     output_tokens=8, pools=("prefill", "decode")))
        failed = [o for o in run.outcomes if o.status != 200]
        assert not failed, failed[:3]
        assert max(r["prefill"] or 0 for r in run.pools) == 2, run.pools
        deadline = time.monotonic() + 60
        while _count(nodes := _nodes(cluster), "pdserve_prefill") < 2 and time.monotonic() < deadline:
            time.sleep(2)
        assert _count(nodes, "pdserve_prefill") == 2, nodes
        assert _count(nodes, "pdserve_decode") == 1, nodes  # the decode pool did not grow
    finally:
        server.stop()
