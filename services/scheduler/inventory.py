"""The scheduler's view of the node inventories (DESIGN.md section 4.0): pure, no I/O, no clock.

Node agents keep a :class:`~dilu.contracts.events.NodeInventory` in KV ``dilu-nodes`` and re-put
it every ``NODE_HEARTBEAT_S``. This module turns inventories into GPU capacities for the placement
policy (:func:`gpu_capacities`), decides liveness on the scheduler's own clock (:func:`stale_nodes`:
an inventory not refreshed within the TTL means the node is gone), and keeps a :class:`Roster` that
says, once per change and with reasons, when a node joined, changed (health, limits, GPUs) or left.
Times are plain seconds of one monotonic clock that the caller reads and passes in.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from dilu.contracts.events import FunctionSpec, GpuInfo, NodeInventory
from dilu.services.common.functions import runs_on

from .policy import GpuCapacity


# A CPU node (``device`` "cpu", no GPU listed) is one slot, index 0, that its instances share by
# quota like a GPU (the operator's profile divides the node). Host memory is not in the inventory:
# the slot's memory is not what limits it.
CPU_SLOT_MEMORY_BYTES = 2**40


def gpu_capacities(inv: NodeInventory) -> list[GpuCapacity]:
    """What each GPU of ``inv`` offers the placement policy.

    ``memory_bytes`` as the inventory reports it (bytes, from NVML); ``max_instances`` = the MPS
    client limit when it is > 0 (else no limit); ``healthy`` as reported, with its reason. Not
    placeable (healthy False, with the reason), whatever the agent says:

    - MIG enabled: the GPU is split into MIG instances, each with its own UUID and memory, which the
      inventory does not list yet; placing on the whole GPU would be wrong, so it takes nothing
      until the inventory lists MIG instances as GPUs of their own;
    - compute mode ``prohibited`` (no CUDA context can be created);
    - no memory reported.

    GPUs with a negative or repeated index are left out (the first of an index is kept).

    A GPU in ``exclusive-process`` compute mode without MPS takes one instance at most (one CUDA
    process at a time; under MPS the MPS server is that one process and the clients share it).
    A CPU node without GPUs gets one slot (:data:`CPU_SLOT_MEMORY_BYTES`).
    """
    if inv.device == "cpu" and not inv.gpus:
        return [GpuCapacity(memory_bytes=CPU_SLOT_MEMORY_BYTES, index=0)]
    out = []
    seen: set[int] = set()
    for g in inv.gpus:
        if g.index < 0 or g.index in seen:  # a malformed inventory: keep the first GPU of an index
            continue
        seen.add(g.index)
        healthy, reason = g.healthy, g.health_reason
        limit = g.mps_client_limit if g.mps_client_limit > 0 else 0
        if g.mig:
            healthy, reason = False, "MIG enabled: MIG instances are not placeable yet"
        elif _mode(g) == "prohibited":
            healthy, reason = False, "compute mode prohibited"
        elif g.memory_bytes <= 0:
            healthy, reason = False, "no memory reported"
        if _mode(g) == "exclusive-process" and inv.mps != "on":
            limit = 1
        if not healthy and not reason:
            reason = "reported unhealthy"
        out.append(GpuCapacity(memory_bytes=max(0, g.memory_bytes), max_instances=limit, healthy=healthy,
                               reason=reason if not healthy else "", index=g.index))
    return out


def _mode(g: GpuInfo) -> str:
    return g.compute_mode.strip().lower().replace("_", "-")


def stale_nodes(last_seen: Mapping[str, float], now_s: float, ttl_s: float) -> list[str]:
    """Nodes whose inventory was last received more than ``ttl_s`` before ``now_s`` (gone), by name."""
    return sorted(n for n, t in last_seen.items() if now_s - t > ttl_s)


def inventory_age_s(wall_now_s: float, stored_s: float | None, ts_ns: int = 0) -> float:
    """How old an inventory read at start is: from the time the KV store took it (``stored_s``,
    Unix s, the NATS server's clock), else from its publisher's ``ts_ns`` (Unix ns); 0 when neither
    is known or it lies in the future (clock skew). Hosts are assumed NTP-synchronised: a skew near
    the TTL would make a live node look gone until its next heartbeat."""
    if stored_s is not None:
        return max(0.0, wall_now_s - stored_s)
    if ts_ns > 0:
        return max(0.0, wall_now_s - ts_ns / 1e9)
    return 0.0


def orphans_due(started_s: float, now_s: float, ttl_s: float) -> bool:
    """Whether placements naming a node that has published no inventory are to be placed again:
    once the scheduler has waited a whole TTL since its start (every live agent heartbeats well
    within it), a node still absent is gone."""
    return now_s - started_s >= ttl_s


@dataclass(frozen=True)
class NodeChange:
    """One change of the cluster's membership: ``join`` (with its GPUs), ``update`` (GPUs changed;
    the new list), ``leave`` (no GPUs). ``reasons``: what happened, for the log."""

    action: Literal["join", "update", "leave"]
    node: str
    gpus: tuple[GpuCapacity, ...] = ()
    reasons: tuple[str, ...] = ()


class Roster:
    """The nodes the scheduler knows: their latest inventory, capacities and when each was last
    received (``last_seen``, seconds on the caller's monotonic clock).

    :meth:`observe` an inventory when it arrives, :meth:`forget` a node whose entry was deleted,
    :meth:`expire` on a timer; each returns the changes to apply to the cluster, once each.
    """

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.inventories: dict[str, NodeInventory] = {}
        self.capacities: dict[str, tuple[GpuCapacity, ...]] = {}
        self.last_seen: dict[str, float] = {}

    def __contains__(self, node: str) -> bool:
        return node in self.inventories

    def __len__(self) -> int:
        return len(self.inventories)

    def observe(self, inv: NodeInventory, seen_s: float) -> NodeChange | None:
        """``inv`` was received at ``seen_s`` (for an entry read at start: ``now - its age``).
        Returns a join for a new node, an update when its GPUs' capacities changed (or its agent
        restarted), else None. Last-seen times never go backwards."""
        caps = tuple(gpu_capacities(inv))
        old = self.inventories.get(inv.node)
        self.inventories[inv.node] = inv
        self.last_seen[inv.node] = max(seen_s, self.last_seen.get(inv.node, seen_s))
        if old is None:
            self.capacities[inv.node] = caps
            return NodeChange("join", inv.node, caps, (_summary(inv, caps), *_unplaceable(caps)))
        before = self.capacities[inv.node]
        self.capacities[inv.node] = caps
        reasons = list(_differences(before, caps))
        if old.agent_id and inv.agent_id and old.agent_id != inv.agent_id:
            reasons.insert(0, f"agent restarted ({old.agent_id} -> {inv.agent_id})")
        return NodeChange("update", inv.node, caps, tuple(reasons)) if reasons else None

    def forget(self, node: str, reason: str) -> NodeChange | None:
        """``node``'s inventory went away (deleted or purged). None if it was not known."""
        if node not in self.inventories:
            return None
        del self.inventories[node], self.capacities[node], self.last_seen[node]
        return NodeChange("leave", node, (), (reason,))

    def expire(self, now_s: float) -> list[NodeChange]:
        """Nodes not heard from within the TTL leave (by name)."""
        out = []
        for node in stale_nodes(self.last_seen, now_s, self.ttl_s):
            age = now_s - self.last_seen[node]
            change = self.forget(node, f"no inventory for {age:.1f} s (TTL {self.ttl_s:g} s)")
            if change:
                out.append(change)
        return out


def _summary(inv: NodeInventory, caps: Sequence[GpuCapacity]) -> str:
    names = sorted({g.name for g in inv.gpus})
    mem = sorted({c.memory_bytes for c in caps})
    return (f"{len(caps)} GPUs ({', '.join(names) or 'none'}; memory {', '.join(str(m) for m in mem) or '-'} B), "
            f"device {inv.device}, MPS {inv.mps}, agent {inv.agent_id or '?'}")


def _unplaceable(caps: Sequence[GpuCapacity]) -> list[str]:
    return [f"GPU {c.index} takes nothing new: {c.reason}" for c in caps if not c.healthy]


def _differences(before: Sequence[GpuCapacity], after: Sequence[GpuCapacity]) -> list[str]:
    old = {c.index: c for c in before}
    new = {c.index: c for c in after}
    out = []
    for i in sorted(old.keys() - new.keys()):
        out.append(f"GPU {i} gone from the inventory")
    for i in sorted(new.keys() - old.keys()):
        out.append(f"GPU {i} added ({new[i].memory_bytes} B)")
    for i in sorted(old.keys() & new.keys()):
        a, b = old[i], new[i]
        if a.healthy and not b.healthy:
            out.append(f"GPU {i} unhealthy: {b.reason}")
        elif not a.healthy and b.healthy:
            out.append(f"GPU {i} healthy again")
        elif not b.healthy and a.reason != b.reason:
            out.append(f"GPU {i} still unhealthy: {b.reason}")
        if a.memory_bytes != b.memory_bytes:
            out.append(f"GPU {i} memory {a.memory_bytes} -> {b.memory_bytes} B")
        if a.max_instances != b.max_instances:
            out.append(f"GPU {i} instance limit {a.max_instances or 'none'} -> {b.max_instances or 'none'}")
    return out


def admission(spec: FunctionSpec, inventories: Mapping[str, NodeInventory]) -> tuple[list[str], str]:
    """Could one instance of ``spec`` ever be placed? Returns ``(nodes, reason)``: the nodes that
    can run it (a device that runs it, per :func:`~dilu.services.common.functions.runs_on`, and a
    placeable GPU with at least ``spec.memory_bytes``) and, when there is none, why, in one line
    (the first node's reason, or a summary). Ignores what is placed now: a full cluster frees up,
    a cluster without a node that fits never does."""
    if not inventories:
        return [], "no node has joined the cluster (no inventory in dilu-nodes)"
    fits, reasons = [], []
    for name in sorted(inventories):
        inv = inventories[name]
        why = runs_on(spec, inv.device)
        if why is None:
            caps = [c for c in gpu_capacities(inv) if c.healthy]
            largest = max((c.memory_bytes for c in caps), default=0)
            if not caps:
                why = f"node {name} has no placeable GPU"
            elif largest < spec.memory_bytes:
                why = f"node {name}: {spec.memory_bytes} bytes needed, its largest GPU has {largest}"
        if why is None:
            fits.append(name)
        else:
            reasons.append(why)
    if fits:
        return fits, ""
    return [], reasons[0] + (f" (and {len(reasons) - 1} more nodes refuse it)" if len(reasons) > 1 else "")
