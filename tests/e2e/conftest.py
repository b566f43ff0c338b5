"""The loopback site (sshd, SSH user, client routing) the `ray up` tests share, and the way they
launch a cluster on it. See e2e_loopback.py."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_loopback import (
    Cluster,
    LoopbackSite,
    free_port,
    install_system_packages,
    loopback_cluster_config,
    machine_lock,
    missing_prerequisites,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _skip_reason() -> str | None:
    if os.environ.get("PDSERVE_SKIP_E2E") == "1":
        return "PDSERVE_SKIP_E2E=1"
    return missing_prerequisites()


@pytest.fixture(scope="module")
def site() -> Iterator[LoopbackSite]:
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


@pytest.fixture(scope="module")
def make_cluster(site: LoopbackSite) -> Iterator[Callable[..., Cluster]]:
    """Write the loopback variant of deploy/onprem/cluster.yaml; `ray down` whatever is left up."""
    clusters: list[Cluster] = []

    def make(adapt_setup: Callable[[list[str]], list[str]], **nodes: Any) -> Cluster:
        """`nodes`: loopback_cluster_config's worker_cpus, head_cpus, head_resources,
        worker_resources."""
        onprem = yaml.safe_load((REPO_ROOT / "deploy/onprem/cluster.yaml").read_text())
        gcs_port = free_port(site.head_ip)
        config = loopback_cluster_config(
            onprem, site, REPO_ROOT, cluster_name=f"pdserve-e2e-{uuid.uuid4().hex[:8]}",
            gcs_port=gcs_port, setup_commands=adapt_setup(onprem["setup_commands"]),
            **nodes)
        path = site.workdir / f"{config['cluster_name']}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        clusters.append(Cluster(path, site.workdir, gcs_address=f"{site.head_ip}:{gcs_port}"))
        return clusters[-1]

    yield make
    for cluster in clusters:
        if cluster.up:
            cluster.down(check=False)
