"""Who may run under a node name: the rule that keeps two node agents from claiming one node
(they would launch the same instances) while letting an agent restart at once. Pure: the
caller passes the time and how to ask whether a process lives."""
from __future__ import annotations

import os
import socket
from collections.abc import Callable

from dilu.contracts.events import NodeInventory


def host_identity() -> str:
    """This machine: its host name and the kernel's boot id (a reboot makes a new one, so a pid
    of an earlier boot is never mistaken for a live process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (a process of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_refusal(held: NodeInventory | None, *, agent_id: str, host: str, now_ns: int, ttl_s: float,
                  alive: Callable[[int], bool] = pid_alive) -> str | None:
    """Why an agent (``agent_id`` on ``host``) may not take the node name whose inventory is
    ``held``, or None when it may: nothing is held, the holder is this agent, its heartbeat is
    older than ``ttl_s`` (it is gone), or it ran on this same host and its process is dead (a
    restart, also after kill -9)."""
    if held is None or held.agent_id == agent_id:
        return None
    age_s = (now_ns - held.ts_ns) / 1e9
    if age_s >= ttl_s:
        return None
    if held.host and held.host == host and not alive(held.pid):
        return None
    where = "this host" if held.host == host else f"host {held.host.split('/')[0] or 'unknown'}"
    return (f"node name {held.node!r} is held by another live agent on {where} (pid {held.pid}, heartbeat "
            f"{age_s:.1f} s ago); give this node its own --node / DILU_NODE")
