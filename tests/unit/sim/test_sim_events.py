import math

import pytest

from pdserve.sim.events import EventQueue

pytestmark = pytest.mark.unit


def test_events_run_in_time_order_and_the_clock_follows():
    q = EventQueue()
    seen = []
    for t in (5.0, 1.0, 3.0):
        q.schedule(t, lambda arg: seen.append((q.now, arg)), t)
    q.run()
    assert seen == [(1.0, 1.0), (3.0, 3.0), (5.0, 5.0)]
    assert q.now == 5.0 and q.processed == 3


def test_ties_keep_scheduling_order():
    q = EventQueue()
    seen = []
    for name in "abc":
        q.schedule(2.0, seen.append, name)
    q.run()
    assert seen == ["a", "b", "c"]


def test_callbacks_schedule_more_events_relative_to_now():
    q = EventQueue()
    seen = []

    def tick(n):
        seen.append(q.now)
        if n:
            q.after(0.5, tick, n - 1)

    q.schedule(1.0, tick, 3)
    q.run()
    assert seen == [1.0, 1.5, 2.0, 2.5]


def test_run_until_stops_and_resumes():
    q = EventQueue()
    seen = []
    for t in (1.0, 2.0, 3.0):
        q.schedule(t, seen.append, t)
    q.run(until=2.0)
    assert seen == [1.0, 2.0] and len(q) == 1 and q.peek_time() == 3.0
    q.run()
    assert seen == [1.0, 2.0, 3.0] and q.peek_time() == math.inf


def test_the_past_and_nan_are_refused():
    q = EventQueue()
    q.schedule(2.0, lambda _: None)
    q.run()
    with pytest.raises(ValueError):
        q.schedule(1.0, lambda _: None)
    with pytest.raises(ValueError):
        q.schedule(math.nan, lambda _: None)
