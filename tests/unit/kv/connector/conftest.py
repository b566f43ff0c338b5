"""Fixtures shared by the connector tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from connector_fakes import FakeTransports


@pytest.fixture
def transports() -> Iterator[FakeTransports]:
    """In-memory transports; every endpoint a test opened is closed after it."""
    fakes = FakeTransports()
    yield fakes
    for endpoint in [*fakes.sinks, *fakes.sources]:
        endpoint.close()
