"""Shared test configuration. Markers are defined once, in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedded_checkpoint() -> Path:
    """The embedded model, converted once per session into the user cache (a fresh machine
    converts it here; later runs reuse it)."""
    from pdserve.models import ensure_embedded_model

    return ensure_embedded_model()
