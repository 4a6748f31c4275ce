"""The node agent's handling of an instance's end, without NATS or processes: an instance it
drained is never taken for a crash, a crashed one is launched again only while its placement is
live on this node, one drained while launching is stopped, failures are retired with the error."""
from __future__ import annotations

import asyncio
import sys

import pytest

from dilu.contracts import events as ev
from dilu.services.node_agent import service
from dilu.services.node_agent.service import ManagedInstance, NodeAgent


def placement(iid="i1", *, node="n1", draining=False) -> ev.Placement:
    return ev.Placement(instance_id=iid, function="f", node=node, gpu=0, request_quota=0.3, limit_quota=0.6,
                        width=0.6, memory_bytes=1, draining=draining)


@pytest.fixture
def agent(monkeypatch):
    monkeypatch.setattr(service, "RESTART_DELAY_S", 0.0)
    a = NodeAgent(node="n1", gpus=0)
    a.launched, a.published = [], []

    async def launch(p):
        a.launched.append(p)

    async def publish(state, event):
        a.published.append(event)

    a._launch = launch
    a._publish_instance = publish
    return a


def managed(agent, p, state) -> ManagedInstance:
    inst = ManagedInstance(placement=p, state=state)
    agent.instances[p.instance_id] = inst
    agent._placements[p.instance_id] = p
    return inst


@pytest.mark.parametrize("state", ["draining", "gone"])
async def test_an_instance_the_agent_ended_is_no_crash(agent, state):
    # "gone": _retire finished it (InstanceRetired published) before the reader saw the exit
    inst = managed(agent, placement(), state)
    await agent._exited(inst, 0, "", ready=True)
    assert agent.launched == [] and agent.published == []


async def test_a_crash_is_relaunched_only_while_its_placement_is_live(agent):
    p = placement()
    await agent._exited(managed(agent, p, "ready"), 1, "", ready=True)
    assert [e.reason for e in agent.published] == ["crashed"] and agent.launched == [p]
    for now in (placement(draining=True), placement(node="n2"), None):  # drained, moved, deleted
        agent.launched.clear()
        agent._restarts.clear()  # within the restart budget: only the placement decides
        inst = managed(agent, p, "ready")
        if now is None:
            del agent._placements[p.instance_id]
        else:
            agent._placements[p.instance_id] = now
        await agent._exited(inst, 1, "", ready=True)
        assert agent.launched == [] and agent.published[-1].reason == "crashed", now


async def test_a_load_failure_is_retired_at_once_with_its_error(agent):
    inst = managed(agent, placement(), "launching")
    await agent._exited(inst, 1, "importing 'app' failed: ModuleNotFoundError", ready=False)
    (retired,) = agent.published
    assert (retired.reason, retired.error, retired.exit_code) == (ev.LOAD_FAILED, "importing 'app' failed: ModuleNotFoundError", 1)
    assert agent.launched == [] and not agent.instances


async def test_after_max_restarts_the_agent_gives_up_with_the_last_error(agent):
    p = placement()
    for _ in range(service.MAX_RESTARTS + 1):
        await agent._exited(managed(agent, p, "ready"), 7, "", ready=True)
    *crashes, last = agent.published
    assert [c.reason for c in crashes] == ["crashed"] * service.MAX_RESTARTS
    assert (last.reason, last.error) == (ev.GAVE_UP, "exit code 7")
    assert len(agent.launched) == service.MAX_RESTARTS


async def test_an_instance_drained_while_launching_is_stopped(monkeypatch):
    a = NodeAgent(node="n1", gpus=0)
    procs = []

    async def start(inst):  # the placement is drained before the process has started
        await a._retire(inst, "drained by scheduler")
        inst.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        procs.append(inst.proc)

    monkeypatch.setattr(a, "_start_process", start)
    await a._launch(placement())
    assert procs[0].returncode is not None and not a.instances


async def test_the_puller_answers_a_result_that_is_not_bytes_with_an_error():
    from dilu.contracts import subjects
    from dilu.services.common.workqueue import BatchPuller, Request

    sent, acked = [], []

    class Conn:
        async def publish(self, subject, data, headers):
            sent.append((subject, data, headers))

    class Msg:
        async def ack(self):
            acked.append(True)

    puller = BatchPuller(Conn(), None, "f", instance_id="i1", max_batch=1, ready_ns=0)
    req = Request(request_id="r1", scheduled_ns=0, enqueued_ns=0, payload=b"", reply_to="inbox")
    await puller._answer(req, Msg(), "text")
    (subject, data, headers), = sent
    assert subject == "inbox" and data == b"" and acked == [True]
    assert headers[subjects.H_STATUS] == "error" and "str for request r1; expected bytes" in headers[subjects.H_ERROR]


async def test_a_removed_placement_drains_beside_the_entries_after_it(agent):
    """Deleting a placement drains its instance (up to DRAIN_TIMEOUT_S); the table's next entries,
    a launch among them, are applied meanwhile, and stop waits for the drain."""
    from types import SimpleNamespace

    from dilu.contracts import encode
    from dilu.services.node_agent import devices

    released, drained = asyncio.Event(), []

    async def slow_retire(inst, reason):
        await released.wait()
        drained.append((inst.placement.instance_id, reason))

    agent._retire = slow_retire
    agent.gpus = [devices.Gpu(0, "GPU-0", "emulated", 40 << 30, 108)]
    managed(agent, placement("old"), "ready")
    await asyncio.wait_for(agent._on_entry(SimpleNamespace(key="old", operation="DEL", value=b"")), 1)
    new = placement("new")
    await asyncio.wait_for(agent._on_entry(SimpleNamespace(key="new", operation=None, value=encode(new))), 1)
    assert agent.launched == [new] and drained == []  # launched while the old one drains
    stopping = asyncio.create_task(agent.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # stop waits for the drain in progress
    released.set()
    await asyncio.wait_for(stopping, 5)
    assert ("old", "placement removed") in drained
