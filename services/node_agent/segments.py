"""Names of the node agent's shared-memory segments, and the sweep of those a dead agent left.

A node agent killed with SIGKILL cannot remove what it created in /dev/shm: its emulated GPUs'
timelines (``dilu-gpu-...``, about 30 MB each, sparse) and its instances' control blocks
(``dilu-cb-...``). Each name carries the creating agent's pid right after its fixed prefix, so the
next agent to start on this host removes those whose creator is gone (whatever their node or
cluster), and never one of a live agent.
"""
from __future__ import annotations

import os
import re
import uuid

from dilu.contracts import subjects
from dilu.interceptor import timeline

SHM_DIR = timeline.SHM_DIR
_OWNED = re.compile(r"^dilu-(?:cb|gpu-dilu)-(\d+)-")


def control_block_path(node: str, instance_id: str, pid: int | None = None) -> str:
    """``/dev/shm/dilu-cb-<pid>-<node>-<instance>`` for an instance's control block."""
    return str(SHM_DIR / f"dilu-cb-{pid or os.getpid()}-{subjects.token(node)}-{subjects.token(instance_id)}")


def trial_block_path(node: str, pid: int | None = None) -> str:
    """A profiling trial's control block, unique per trial worker."""
    return control_block_path(node, f"trial-{uuid.uuid4().hex[:8]}", pid)


def timeline_name(node: str, run: str, index: int, pid: int | None = None) -> str:
    """The emulated GPU ``index`` of agent run ``run``: its segment is ``dilu-gpu-<this name>``."""
    return f"dilu-{pid or os.getpid()}-{subjects.token(node)}-{run}-g{index}"


def owner(name: str) -> int | None:
    """The pid that created the segment called ``name`` (a file name in SHM_DIR), or None when
    the name is not one of these."""
    m = _OWNED.match(name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_dead(shm_dir=SHM_DIR) -> list[str]:
    """Remove the segments whose creating agent is no longer running; returns their names."""
    removed = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return removed
    for entry in entries:
        pid = owner(entry.name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            try:
                entry.unlink()
                removed.append(entry.name)
            except OSError:  # removed meanwhile, or not ours to remove
                pass
    return removed
