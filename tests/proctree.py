"""The processes a command starts, for tests that check it leaves none behind."""
import os
import subprocess
import threading
from pathlib import Path


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def tree(pid: int) -> set[int]:
    """Every descendant of ``pid`` alive now (services, instances, nats-server)."""
    seen, todo = set(), [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by a parent that may itself be
    gone) runs nothing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (see :func:`running`)."""
    return [p for p in pids if running(p)]


class OutputLines:
    """A process's output read line by line on a thread, so a test can wait for a line (e.g. the
    replay's progress) while the process runs. ``text``: all lines so far."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def seen(self, part: str) -> bool:
        """Whether a line so far contains ``part``."""
        return any(part in line for line in self.lines)

    def close(self, timeout_s: float = 10.0) -> str:
        """Wait for the output to end (the process has exited); all of it."""
        self._thread.join(timeout_s)
        return "".join(self.lines)

    @property
    def text(self) -> str:
        return "".join(self.lines)
