"""Ctrl-C and SIGTERM for a command that must clean up before it exits (the ``dilu bench`` ones).

Python's defaults do not do it: SIGTERM ends the process at once (``finally`` blocks and context
managers never run, so a nats-server started in its own session is left running with its
store), and click answers a KeyboardInterrupt with "Aborted!" and status 1, after whatever
tracebacks the interrupted event loop printed. :class:`SignalExit` turns the first SIGINT or
SIGTERM into a stop that runs every cleanup, then ends the process with one line
("interrupted") and the status a shell gives a process killed by that signal: 128 + its number
(130 for SIGINT, 143 for SIGTERM)::

    with SignalExit() as stop:
        ...                                  # plain code: the signal raises KeyboardInterrupt
        uvloop.run(stop.cancelling(main()))  # async code: the signal cancels the main task
"""
from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Awaitable
from typing import TypeVar

import click

SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


class Interrupt(KeyboardInterrupt):
    """The KeyboardInterrupt a signal handler of ours raises (``except KeyboardInterrupt`` catches
    it). Never a plain KeyboardInterrupt: CPython (3.11) remembers one that leaves code run by
    ``exec`` (a dataclass's generated methods, typing, any import in progress) even when it is
    caught later, and then ends the process by SIGINT, whatever status ``sys.exit`` gave: a
    signal in the first second of a command exited -2 instead of 143 at random. The check is on
    the exact type (``Python/pythonrun.c``, ``run_eval_code_obj``), so a subclass is not remembered."""


class SignalExit:
    """Context manager: the first SIGINT or SIGTERM inside the block raises KeyboardInterrupt
    (or, under :meth:`cancelling`, cancels the event loop's main task), and the block then ends
    the process with ``line`` ("interrupted" unless the block says more) on stderr and exit
    status 128 + the signal's number, whatever the block raised while stopping (a lost
    connection, a click error). Later signals are ignored: they would cut the cleanup short, and
    that cleanup is what stops the nats-server (at most 10 s, then SIGKILL). A stop lost in an
    object's finaliser is not printed as "Exception ignored" (:func:`raise_if_stopped` raises it
    again). ``signum`` is the signal that stopped it (None: none did)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.line = "interrupted"
        self._previous: dict[int, object] = {}
        self._unraisable = None

    def __enter__(self) -> "SignalExit":
        if _main_thread():  # only there can Python handle signals (a command run by a test's thread)
            self._previous = {sig: signal.signal(sig, self._raise) for sig in SIGNALS}
            self._unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable_hook
        return self

    def _unraisable_hook(self, unraisable) -> None:
        """Our Interrupt raised where Python cannot raise it (an object's finaliser) is not
        printed as "Exception ignored in ...": the stop goes on (:func:`raise_if_stopped`) and
        its one line says it. Anything else goes to the hook we replaced."""
        if not isinstance(unraisable.exc_value, Interrupt):
            self._unraisable(unraisable)

    def _raise(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            _stopping.append(signum)
            raise Interrupt

    def __exit__(self, exc_type, exc, tb) -> bool:
        _stopping.clear()
        try:
            if self.signum is None and exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                # raised by someone else's handler, or by the block itself to stop
                self.signum = signal.SIGINT
            if self.signum is None:
                return False
            # whatever the block raised while it stopped (CancelledError, KeyboardInterrupt, a
            # connection closed under a request) is the signal's doing: one line, no traceback
            click.echo(self.line, err=True)
        finally:  # after the line: a second Ctrl-C must not turn it into click's "Aborted!"
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            if self._unraisable is not None:
                sys.unraisablehook = self._unraisable
        sys.exit(128 + self.signum)

    async def cancelling(self, main: Awaitable[T]) -> T:
        """Await ``main`` in the running loop's current (main) task, which SIGINT and SIGTERM
        cancel: ``main``'s ``finally`` blocks and ``async with`` exits then run as for any
        cancellation, instead of a KeyboardInterrupt raised in whatever callback the loop was
        running (which leaves tasks failing on closed connections, with their tracebacks)."""
        if not _main_thread():
            return await main
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal(signum: int) -> None:
            if self.signum is None:
                self.signum = signum
                task.cancel()

        for sig in SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await main
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)  # leaves the default handler ...
                signal.signal(sig, self._raise)  # ... so put ours back until the block ends


_stopping: list[int] = []  # the signal a SignalExit block was stopped by, until the block ends


def raise_if_stopped() -> None:
    """Raise :class:`Interrupt` again when a signal stopped the enclosing :class:`SignalExit` block
    but the block runs on: its KeyboardInterrupt was lost where the handler happened to run (C
    code that clears errors, an object's finaliser). For the loops of long computations (the
    simulator's events), which no stop unwinds through; a no-op otherwise."""
    if _stopping:
        raise Interrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
