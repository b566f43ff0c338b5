"""Fixtures of the KV transport tests: `kv_transport` runs a test once per transport kind."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from kv_helpers import TRANSPORTS, TransportFactory

from pdserve.kv.transport import blocks


@pytest.fixture(params=TRANSPORTS)
def kv_transport(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TransportFactory]:
    """A factory for one transport kind; the test runs once per kind."""
    factory = TransportFactory(request.param, monkeypatch)
    yield factory
    factory.close()


@pytest.fixture
def slow_gather(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Makes every transport's per-piece gather sleep first, so a test can act mid-pull."""

    def install(delay_s: float) -> None:
        for name in ("gather", "gather_bytes"):
            monkeypatch.setattr(blocks, name, _delayed(getattr(blocks, name), delay_s))

    return install


def _delayed(function: Callable[..., object], delay_s: float) -> Callable[..., object]:
    def slow(*args: object, **kwargs: object) -> object:
        threading.Event().wait(delay_s)
        return function(*args, **kwargs)

    return slow
