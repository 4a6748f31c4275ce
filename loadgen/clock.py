"""Clocks for the load generator: the real monotonic clock and a virtual-time event loop.

The generator reads time and sleeps only through a :class:`Clock`, so tests and the simulator can
run it in virtual time. :class:`VirtualTimeEventLoop` is an asyncio event loop whose clock
jumps straight to the next timer whenever nothing is ready to run: every ``asyncio.sleep``,
``wait_for`` and ``call_later`` in the program (the generator's and a fake server's alike) then
takes no wall time, and results depend only on computed time, never on CPU speed.
"""
from __future__ import annotations

import asyncio
import math
import selectors
import time
from typing import Protocol


class Clock(Protocol):
    """Time source of the generator: ``now_ns`` monotonic ns; ``sleep_until`` returns at or
    after ``deadline_ns`` (same time base as ``now_ns``) and returns at once if it is past."""

    def now_ns(self) -> int: ...

    async def sleep_until(self, deadline_ns: int) -> None: ...


class MonotonicClock:
    """Real time: ``time.monotonic_ns`` (ns resolution, unlike uvloop's cached ms ``loop.time``)
    and ``asyncio.sleep``."""

    def now_ns(self) -> int:
        return time.monotonic_ns()

    async def sleep_until(self, deadline_ns: int) -> None:
        # The loop's timers run on its own clock, which uvloop caches at ms resolution, so one
        # sleep may end up to about a millisecond before the deadline on this clock: sleep the
        # rest again (a send must never leave before its scheduled time).
        while (delay := deadline_ns - time.monotonic_ns()) > 0:
            await asyncio.sleep(delay / 1e9)


class LoopClock:
    """The running event loop's own clock (``loop.time()``); with a
    :class:`VirtualTimeEventLoop` this is virtual time."""

    def now_ns(self) -> int:
        return round(asyncio.get_running_loop().time() * 1e9)

    async def sleep_until(self, deadline_ns: int) -> None:
        delay = deadline_ns - self.now_ns()
        if delay > 0:
            await asyncio.sleep(delay / 1e9)


class _VirtualSelector(selectors.BaseSelector):
    """Wraps a real selector; instead of blocking for ``timeout`` it advances virtual time."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.loop: VirtualTimeEventLoop | None = None

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout=None):
        ready = self._real.select(0)
        if ready or timeout is None:
            # Real I/O is ready, or nothing is scheduled at all: only real I/O can wake us.
            return ready or self._real.select(None)
        if timeout > 0 and self.loop is not None:
            self.loop.advance(timeout)
        return []


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time starting at ``start_s``: when no callback is ready it
    jumps to the next timer instead of waiting. ``advance(s)`` moves time forward by hand, which
    models a stall that blocks the whole process (timers fall due but nothing runs meanwhile).

    Use: ``loop = VirtualTimeEventLoop(); loop.run_until_complete(main()); loop.close()``.
    Real I/O still works but happens at virtual instants; keep it to in-process fakes.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._virtual_ns = round(start_s * 1e9)
        selector = _VirtualSelector()
        super().__init__(selector=selector)
        selector.loop = self

    def time(self) -> float:
        return self._virtual_ns / 1e9

    def advance(self, seconds: float) -> None:
        """Move virtual time forward by ``seconds`` (>= 0), rounded up to whole ns so a timer
        due at the new time is never missed by float rounding."""
        if seconds < 0:
            raise ValueError("virtual time only moves forward")
        self._virtual_ns += math.ceil(seconds * 1e9)
