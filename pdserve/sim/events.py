"""Virtual time: a clock that only moves when the next event is taken, and the event queue.

Lifecycle: the simulation `schedule`s callbacks at absolute virtual times; `run(until)` pops them
in time order (ties in the order they were scheduled, so a seeded run is deterministic), sets the
clock to each event's time and calls it; callbacks schedule further events. Nothing here reads
the wall clock, so a simulated day takes as long as its events take to process, not a day.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class EventQueue:
    """A min-heap of (time, sequence, callback, argument); the clock is the last popped time."""

    __slots__ = ("_heap", "_seq", "now", "processed")

    def __init__(self, start: float = 0.0) -> None:
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.now = start
        self.processed = 0

    def schedule(self, at: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        """Call `callback(arg)` at virtual time `at` (never earlier than now)."""
        if at < self.now:
            raise ValueError(f"cannot schedule in the past: {at} < now {self.now}")
        if math.isnan(at):
            raise ValueError("event time is NaN")
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, callback, arg))

    def after(self, delay: float, callback: Callable[[Any], None], arg: Any = None) -> None:
        self.schedule(self.now + delay, callback, arg)

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def run(self, until: float = math.inf) -> None:
        """Process events with time <= `until`; the clock ends at the last event processed."""
        heap, pop = self._heap, heapq.heappop
        count = 0
        while heap and heap[0][0] <= until:
            at, _, callback, arg = pop(heap)
            self.now = at
            callback(arg)
            count += 1
        self.processed += count
