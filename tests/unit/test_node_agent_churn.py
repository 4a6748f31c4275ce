"""Instance churn through the node agent's own placement path (put, READY, crash and relaunch,
drain, delete), processes faked: once an instance is retired and its placement deleted, the agent
holds nothing for it, in its tables, its tasks or the Prometheus registry (series labelled by an
instance id would grow with every launch)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import REGISTRY

from dilu.contracts import encode
from dilu.contracts import events as ev
from dilu.services.node_agent import devices, service
from dilu.services.node_agent.service import NodeAgent

CYCLES = 12


class FakeProc:
    """An instance process that prints READY, ends on SIGTERM or kill, or crashes when told."""

    _pids = iter(range(100_000, 200_000))

    def __init__(self) -> None:
        self.pid = next(self._pids)
        self.returncode: int | None = None
        self.stdout = asyncio.StreamReader()
        self.stdout.feed_data(b"READY\n")

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.stdout.feed_eof()

    def send_signal(self, _sig) -> None:
        self._end(0)

    def kill(self) -> None:
        self._end(-9)

    def crash(self) -> None:
        self._end(1)


def entry(p: ev.Placement | None, key: str):
    if p is None:
        return SimpleNamespace(key=key, operation="DEL", value=b"")
    return SimpleNamespace(key=key, operation="PUT", value=encode(p))


def placement(iid: str, *, draining: bool = False) -> ev.Placement:
    return ev.Placement(instance_id=iid, function="f", node="n1", gpu=0, request_quota=0.3,
                        limit_quota=0.6, width=0.6, memory_bytes=1, draining=draining)


async def until(cond, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def instance_labelled_series(ids: set[str]) -> list[str]:
    return [f"{m.name}{s.labels}" for m in REGISTRY.collect() for s in m.samples
            if any(v in ids or any(i in v for i in ids) for v in s.labels.values())]


async def test_nothing_is_kept_per_retired_instance(monkeypatch):
    monkeypatch.setattr(service, "RESTART_DELAY_S", 0.0)
    monkeypatch.setattr(service, "EXIT_POLL_S", 0.005)
    monkeypatch.setattr(service, "EXIT_READ_GRACE_S", 0.05)
    a = NodeAgent(node="n1", gpus=0)
    a.gpus = [devices.Gpu(0, "cpu", "cpu", 0, 0)]
    procs: list[FakeProc] = []
    retired: list[ev.InstanceRetired] = []

    async def start(inst):
        inst.quota = inst.placement.request_quota
        inst.proc = FakeProc()
        procs.append(inst.proc)

    async def publish(state, event):
        if state == "retired":
            retired.append(event)

    monkeypatch.setattr(a, "_start_process", start)
    monkeypatch.setattr(a, "_publish_instance", publish)
    ids = set()
    for c in range(CYCLES):
        iid = f"churn{c:03d}"
        ids.add(iid)
        await a._on_entry(entry(placement(iid), iid))
        await until(lambda: a.instances.get(iid) is not None and a.instances[iid].state == "ready")
        if c % 3 == 0:  # a crash first: relaunched under the same id, counted against its restarts
            first = procs[-1]
            first.crash()
            await until(lambda: procs[-1] is not first and a.instances.get(iid) is not None
                        and a.instances[iid].state == "ready")
            assert a._restarts.get(iid) == 1
        inst = a.instances[iid]
        await a._on_entry(entry(placement(iid, draining=True), iid))  # the scaler drains it
        await until(lambda: iid not in a.instances and all(t.done() for t in inst.tasks))
        await a._on_entry(entry(None, iid))  # then the scheduler deletes the placement
    assert len([r for r in retired if r.reason == "drained by scheduler"]) == CYCLES
    assert a.instances == {} and a._placements == {}
    assert a._restarts == {} and a._last_error == {}  # crashed-then-drained ones included
    assert all(p.returncode is not None for p in procs)
    assert instance_labelled_series(ids) == []
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert pending == [], pending
