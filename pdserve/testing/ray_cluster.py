"""A multi-node Ray cluster on this machine, for tests: `ray start --head` plus `ray start
--address` per extra node, each a raylet of its own on its own loopback address (127.0.0.2,
127.0.0.3, ...: its own node id, IP, resources and object store), as a cluster of several
machines behaves; and a stop that ends only this cluster's processes (`ray stop` would end
every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from pdserve.testing.processes import kill_processes


def ray_env(**extra: str) -> dict[str, str]:
    """The environment `ray start` and the cluster's drivers run with (token auth on)."""
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"), **extra}


@dataclass
class LocalCluster:
    address: str  # ip:port of the head's GCS
    port: int

    def stop(self) -> None:
        stop_cluster(self.port)


def start_cluster(port: int, nodes: Sequence[Mapping[str, float]], num_cpus: int = 2,
                  object_store_bytes: int = 100_000_000, env: Mapping[str, str] | None = None,
                  head_args: Sequence[str] = ()) -> LocalCluster:
    """A head node and one more node per entry after the first of `nodes` (each entry: the
    custom resources of that node), node i on 127.0.0.(2 + i)."""
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts", "start"]
    common = [f"--num-cpus={num_cpus}", f"--object-store-memory={object_store_bytes}"]
    environment = dict(env or ray_env())
    address = f"127.0.0.2:{port}"
    for i, resources in enumerate(nodes):
        where = ["--head", f"--port={port}", "--include-dashboard=false", *head_args] if i == 0 \
            else [f"--address={address}"]
        done = subprocess.run([*ray_cli, *where, *common, f"--node-ip-address=127.0.0.{2 + i}",
                               f"--resources={json.dumps(dict(resources))}"],
                              capture_output=True, text=True, timeout=180, env=environment)
        if done.returncode != 0:
            stop_cluster(port)
            raise RuntimeError(f"ray start failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return LocalCluster(address, port)


def cluster_processes(port: int) -> list[psutil.Process]:
    """Every process of the cluster whose GCS listens on `port` (and nothing else's): those
    that name it, and their descendants (the raylets' agents and workers name only their
    role: `ray::DashboardAgent`, and would outlive their raylet)."""
    marks = (f":{port}", f"--gcs_server_port={port}", f"--gcs-server-port={port}")
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if any(m in cmd for m in marks):
            found[p.pid] = p
            try:
                found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                pass
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_cluster(port: int) -> None:
    """Kill this cluster's processes; forget it as the machine's default cluster."""
    for _ in range(3):
        procs = cluster_processes(port)
        if not procs:
            break
        kill_processes(procs)
    # `ray start` recorded this cluster as the machine's default for ray.init(); forget it.
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if current.exists() and current.read_text().strip().endswith(f":{port}"):
        current.unlink()
