"""The processes a command starts, for tests that check it leaves none behind."""
import os
import subprocess


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


def alive(pids) -> list[int]:
    """Those of ``pids`` still running."""
    out = []
    for p in pids:
        try:
            os.kill(p, 0)
            out.append(p)
        except ProcessLookupError:
            pass
    return out
