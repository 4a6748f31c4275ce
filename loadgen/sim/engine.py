"""The simulator's event loop: a binary heap of ``(time_ms, seq, callback, argument)``.

Written here rather than taken from SimPy: the speed goal (``dilu bench sim``: 1000 nodes x 4 GPUs
x 8 hours of the Azure 2019 trace in under 5 minutes on 2 cores) means hundreds of thousands of
requests and millions of control ticks, and SimPy's generator processes cost a generator resume,
an Event object and its callback list per step, several times the cost of one heap push/pop and
a plain call. Ties at the same instant run in the order they were scheduled (``seq``), so a run
is deterministic. Time is ms on the simulated clock; nothing here reads a real clock.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable


# events between two calls of run's poll. At cluster scale an event costs up to 0.25 ms (1000 nodes:
# a horizontal tick or a placement scans thousands of functions or GPUs; 65,536 events took 15 s in
# ``dilu bench sim``), so 256 keep a lost stop within about 0.1 s; a poll costs one call.
POLL_EVERY = 1 << 8


class EventLoop:
    """``at(t_ms, fn, arg)`` schedules ``fn(arg)`` at simulated time ``t_ms``; :meth:`run` pops
    events in (time, scheduling order) until none is left or the next is after ``until_ms``.
    ``now`` is the time of the event being run (ms); ``processed`` counts the events run.
    Events cannot be cancelled: a callback checks whether what it was scheduled for still holds."""

    __slots__ = ("now", "processed", "_heap", "_seq")

    def __init__(self, start_ms: float = 0.0) -> None:
        self.now = start_ms
        self.processed = 0
        self._heap: list = []
        self._seq = 0

    def at(self, t_ms: float, fn: Callable, arg=None) -> None:
        """Run ``fn(arg)`` at ``t_ms`` (ms; a time in the past runs at once, after what is due).
        Raises ValueError for a time that is not a finite number."""
        if not math.isfinite(t_ms):
            raise ValueError(f"event time must be finite, got {t_ms}")
        self._seq += 1
        heapq.heappush(self._heap, (t_ms if t_ms > self.now else self.now, self._seq, fn, arg))

    def run(self, until_ms: float = math.inf, poll: Callable[[], None] | None = None) -> None:
        """Run events up to and including ``until_ms``; ``now`` ends at ``until_ms`` when finite.
        ``poll`` (e.g. :func:`interrupt.raise_if_stopped`) is called every :data:`POLL_EVERY`
        events; what it raises ends the run there."""
        heap, pop = self._heap, heapq.heappop
        n = 0
        while heap and heap[0][0] <= until_ms:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            n += 1
            if not n % POLL_EVERY and poll is not None:
                self.processed += n
                n = 0
                poll()
        self.processed += n
        if math.isfinite(until_ms):
            self.now = max(self.now, until_ms)

    def __len__(self) -> int:
        return len(self._heap)
