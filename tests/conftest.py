"""Shared test configuration. Markers are defined once, in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A small local Ray instance for tests that drive a backend in this process."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 * 1024)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def embedded_checkpoint() -> Path:
    """The embedded model, converted once per session into the user cache (a fresh machine
    converts it here; later runs reuse it)."""
    from pdserve.models import ensure_embedded_model

    return ensure_embedded_model()
