"""deploy/onprem on a real `ray up` cluster: from nothing to a served completion and back.

`ray up` with Ray's `local` provider brings up a head (127.0.0.2) and a worker (127.0.0.3) over
SSH on this machine (see e2e_loopback.py), installs pdserve on them with the setup commands of
deploy/onprem/cluster.yaml, and the service starts on the head with deploy/onprem/app.yaml, as
the deploy README does it. Its engine (the model-free mock engine) must land on the worker, the
only node with the `pdserve_colocated` resource; a completion must succeed through the head's
endpoint; `ray down` must leave nothing of the cluster running.

Runs where it can (Linux, root, apt-get: CI's machines). Skip it with PDSERVE_SKIP_E2E=1.
About 2-3 minutes on 2 cores, most of it `ray up`; it needs PyPI (uv installs pdserve).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from e2e_loopback import (
    LoopbackSite,
    free_port,
    install_system_packages,
    loopback_cluster_config,
    machine_lock,
    missing_prerequisites,
    run,
    user_pids,
)

from pdserve.testing import tiny_tokenizer
from pdserve.testing.server import metric_value

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


def _skip_reason() -> str | None:
    if os.environ.get("PDSERVE_SKIP_E2E") == "1":
        return "PDSERVE_SKIP_E2E=1"
    return missing_prerequisites()


@pytest.fixture(scope="module")
def site():
    if reason := _skip_reason():
        pytest.skip(f"loopback ray up: {reason}")
    with machine_lock():
        install_system_packages()
        workdir = Path(tempfile.mkdtemp(prefix="pdserve-e2e-"))
        try:
            loopback = LoopbackSite.open(workdir)
            try:
                yield loopback
            finally:
                loopback.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


class Cluster:
    """The `ray` CLI against one cluster YAML, as a user at their laptop would run it."""

    def __init__(self, config_path: Path, workdir: Path) -> None:
        self.config_path = config_path
        self.env = {
            **os.environ,
            # Ray 2.60: with autoscaler v2 the local provider never launched the worker.
            "RAY_UP_enable_autoscaler_v2": "0",
            # The local provider's state file, kept apart from the head's (same machine here).
            "RAY_TMPDIR": str(workdir / "cli"),
        }
        self.up = False

    def ray(self, *args: str, timeout_s: float = 120, check: bool = True):
        return run([RAY, *args], timeout_s, self.env, check=check)

    def exec(self, command: str, timeout_s: float = 120):
        return self.ray("exec", "--log-style", "record", str(self.config_path), command,
                        timeout_s=timeout_s)

    def start(self) -> None:
        self.up = True
        self.ray("up", "-y", "--no-config-cache", "--log-style", "record", str(self.config_path),
                 timeout_s=600)

    def down(self) -> None:
        self.ray("down", "-y", "--log-style", "record", str(self.config_path), timeout_s=180)
        self.up = False


@pytest.fixture(scope="module")
def cluster(site):
    onprem = yaml.safe_load((REPO_ROOT / "deploy/onprem/cluster.yaml").read_text())
    config = loopback_cluster_config(onprem, site, REPO_ROOT,
                                     cluster_name=f"pdserve-e2e-{uuid.uuid4().hex[:8]}",
                                     gcs_port=free_port(site.head_ip))
    path = site.workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cluster = Cluster(path, site.workdir)
    try:
        yield cluster
    finally:
        if cluster.up:
            cluster.ray("down", "-y", "--log-style", "record", str(path), timeout_s=180,
                        check=False)


def tiny_model(site: LoopbackSite) -> Path:
    """A tokenizer-only checkpoint in the SSH user's home: the mock engine needs no weights."""
    directory = site.home / "tiny-model"
    with tempfile.TemporaryDirectory() as scratch:
        tiny_tokenizer().save_pretrained(scratch)
        for file in Path(scratch).iterdir():
            site.write_user_file(f"tiny-model/{file.name}", file.read_text())
    site.write_user_file("tiny-model/config.json", json.dumps({"model_type": "llama"}))
    return directory


def serve_command(site: LoopbackSite, model: Path, port: int) -> str:
    """The README's `ray exec` start, with the mock engine on a CPU-only worker."""
    return (
        "nohup pdserve serve --config ~/pdserve/deploy/onprem/app.yaml "
        f"--engine mock --model {model} --served-model-name tiny --replicas 1 "
        f"--set pools.colocated.num_gpus=0 --host {site.head_ip} --port {port} "
        "> ~/pdserve.log 2>&1 < /dev/null & echo $! > ~/pdserve.pid"
    )


def wait_healthy(base_url: str, site: LoopbackSite, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"pdserve on the head was not healthy in {timeout_s} s:\n"
                         f"{diagnostics(site)}")


def diagnostics(site: LoopbackSite) -> str:
    """The service log and the head's autoscaler log (readable here: same machine)."""
    parts = []
    logs = Path(site.ray_tmpdir) / "ray" / "session_latest" / "logs"
    for path in (site.home / "pdserve.log", logs / "monitor.log", logs / "monitor.err"):
        if path.exists():
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-40:])
            parts.append(f"--- {path}\n{tail}")
    return "\n".join(parts) or "(no logs)"


def test_ray_up_serves_a_completion_from_a_worker_engine_and_ray_down_cleans_up(site, cluster):
    started = time.monotonic()
    cluster.start()

    port = free_port(site.head_ip)
    cluster.exec(serve_command(site, tiny_model(site), port))
    base_url = f"http://{site.head_ip}:{port}"
    wait_healthy(base_url, site)

    reply = httpx.post(f"{base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello world", "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] and reply.json()["usage"]["completion_tokens"] == 8

    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    # The engine runs on the worker: the only node advertising pdserve_colocated.
    assert metric_value(metrics, "pdserve_engine_info", pool="colocated",
                        node=site.worker_ip) == 1, metrics
    assert metric_value(metrics, "pdserve_requests_total", pool="colocated",
                        finish_reason="length") == 1

    cluster.exec("kill -INT $(cat ~/pdserve.pid); "
                 "while kill -0 $(cat ~/pdserve.pid) 2>/dev/null; do sleep 0.5; done",
                 timeout_s=90)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/health", timeout=2)

    cluster.down()
    deadline = time.monotonic() + 60
    while user_pids(site.user) and time.monotonic() < deadline:
        time.sleep(1)
    assert not user_pids(site.user), "ray down left processes of the cluster running"
    print(f"loopback ray up -> completion -> ray down: {time.monotonic() - started:.0f} s")
