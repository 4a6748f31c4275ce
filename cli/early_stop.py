"""The stop of the ``dilu`` command line outside its command: while it imports the command (the
first fraction of a second, before the command can install a stop of its own) and once the
command has ended, while Python exits. Kept apart from ``dilu.cli.main`` so that it is in force
before that module's imports (NATS, numpy: about 0.1 s), and light (the standard library only)."""
from __future__ import annotations

import os
import signal
import sys
import threading


class OutsideCommand:
    """SIGINT and SIGTERM outside the command (see the module): nothing is under way, so the
    process ends at once with "interrupted" and 128 + the signal, as a stopped command does,
    where Python would print a traceback (SIGINT) or end without a word (SIGTERM). Installed
    only over Python's own handlers and in the main thread; the first 20-30 ms of Python's own
    start-up come before it."""

    previous: dict[int, object] = {}

    @classmethod
    def install(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        if all(signal.getsignal(sig) is handler for sig, handler in defaults.items()):
            cls.previous = {sig: signal.signal(sig, cls._stop) for sig in defaults}

    @classmethod
    def remove(cls) -> None:
        previous, cls.previous = cls.previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def _stop(signum: int, _frame) -> None:
        for stream in (sys.stdout, sys.stderr):  # what the command wrote is not lost
            try:
                stream.flush()
            except (OSError, RuntimeError, ValueError, AttributeError):  # closed, reentrant, none
                pass
        os.write(2, b"interrupted\n")
        os._exit(128 + signum)
