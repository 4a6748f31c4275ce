"""Child processes that do not outlive the process that started them.

Linux sends a process the signal it asked for with ``PR_SET_PDEATHSIG`` when its parent ends, even
by SIGKILL, so nothing has to poll. Two uses: a Python child asks for itself
(:func:`signal_on_parent_death`, the node agent's instances), and a launcher asks on behalf of any
child, a Go binary included (:func:`tied_to_caller`, ``preexec_fn`` of ``subprocess.Popen``: the
services and the nats-server of ``dilu up``, the demo and ``dilu chaos``).

The kernel's "parent" is the *thread* that forked: a child started from a thread that ends while
the launcher runs is signalled then. Start children from the main thread, or from a thread of a
pool that lives as long as they do (``asyncio.to_thread``: the event loop's default executor keeps
its threads until the loop closes).
"""
from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHANED_EXIT = 3  # exit status of a child that found its launcher gone before it could ask


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def signal_on_parent_death(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends. Returns
    False where that cannot be asked (not Linux): the caller's own stop must then end it."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig)) == 0


def tied_to_caller(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child get ``sig`` when the calling
    thread ends (a ``kill -9`` of the launcher included). A launcher killed between the fork and
    the request would send nothing, so the child then checks its parent and exits at once with
    :data:`ORPHANED_EXIT` when the launcher is already gone. None where Linux's request is not
    available (Popen takes ``preexec_fn=None``). Between fork and exec it makes two system
    calls and imports nothing, so it takes no lock another thread of the launcher could hold."""
    prctl = _prctl()  # looked up before the fork
    if prctl is None:
        return None
    launcher = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != launcher:
            os._exit(ORPHANED_EXIT)

    return preexec
