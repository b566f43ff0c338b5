"""Pins and leases of a source's blocks."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.kv.transport.leases import PinTable, ReleaseReason

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ReleaseReason]] = []
        self.event = threading.Event()

    def __call__(self, request_id: str, reason: ReleaseReason) -> None:
        self.calls.append((request_id, reason))
        self.event.set()


def test_a_lease_that_expires_during_a_read_waits_for_the_read():
    recorder = Recorder()
    pins = PinTable(recorder)
    pins.pin("req", [1, 2], lease_s=0.05)
    pins.acquire("req", [1])
    time.sleep(0.2)
    assert recorder.calls == []  # still being read
    assert pins.blocks("req") is None  # but no new reader may start

    pins.finish_read("req")

    assert recorder.calls == [("req", ReleaseReason.LEASE_EXPIRED)]
    pins.close()


def test_repinning_renews_the_lease():
    recorder = Recorder()
    pins = PinTable(recorder)
    pins.pin("req", [1], lease_s=0.15)
    time.sleep(0.1)
    pins.pin("req", [1, 3], lease_s=0.3)
    time.sleep(0.1)
    assert recorder.calls == [] and pins.blocks("req") == (1, 3)
    assert recorder.event.wait(5)
    pins.close()


def test_each_pin_ends_exactly_once():
    recorder = Recorder()
    pins = PinTable(recorder)
    pins.pin("req", [1], lease_s=0.05)
    assert pins.release("req", ReleaseReason.LOCAL)
    time.sleep(0.15)
    assert not pins.release("req", ReleaseReason.REMOTE)
    assert recorder.calls == [("req", ReleaseReason.LOCAL)]
    pins.close()


def test_a_failing_callback_does_not_stop_the_reaper():
    calls: list[str] = []

    def flaky(request_id: str, reason: ReleaseReason) -> None:
        calls.append(request_id)
        raise RuntimeError("engine bug")

    pins = PinTable(flaky)
    pins.pin("a", [1], lease_s=0.01)
    pins.pin("b", [2], lease_s=0.05)
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(calls) == ["a", "b"]
    pins.close()


def test_once_read_a_pin_is_released_only_by_the_sessions_that_read_it():
    recorder = Recorder()
    pins = PinTable(recorder)
    pins.pin("req", [1, 2], lease_s=30)
    pins.acquire("req", [1, 2], reader="session-a")
    pins.finish_read("req")
    pins.acquire("req", [1], reader="session-b")  # another decode rank reads its share
    pins.finish_read("req")
    both = frozenset({0, 1})

    with pytest.raises(PermissionError, match="another session"):
        pins.release_share("req", ReleaseReason.REMOTE, 0, both, releaser="intruder")
    assert pins.release_share("req", ReleaseReason.REMOTE, 0, both, releaser="session-a")
    assert pins.release_share("req", ReleaseReason.REMOTE, 1, both, releaser="session-b")
    assert recorder.calls == [("req", ReleaseReason.REMOTE)]
    pins.close()


def test_renew_extends_a_live_pin_and_refuses_an_ended_one():
    recorder = Recorder()
    pins = PinTable(recorder)
    pins.pin("req", [1, 2], lease_s=0.2)
    for _ in range(4):  # renewed past its first lease three times over
        time.sleep(0.1)
        assert pins.renew("req", 0.2)
    assert recorder.calls == [] and pins.blocks("req") == (1, 2)
    assert recorder.event.wait(2)  # left alone, it expires
    assert recorder.calls == [("req", ReleaseReason.LEASE_EXPIRED)]
    assert not pins.renew("req", 0.2)  # nothing to renew once it ended
    assert not pins.renew("never", 0.2)
    pins.close()
