"""Node-agent invariants under faults, against a real nats-server:

- no instance keeps serving once its agent is gone for good, also when the agent dies while the
  instance is still starting (before it could ask for PR_SET_PDEATHSIG), and one whose agent
  dies after it is ready drains and exits (NATS still up); a drain that hangs ends at its bound;
- the quotas the agent writes into the control blocks of one GPU never sum above 1, whatever
  grants arrive and while new instances start; launching and draining instances are in the
  telemetry with their quotas."""
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from prometheus_client import REGISTRY

from dilu.contracts import encode, subjects
from dilu.contracts import events as ev
from dilu.services.node_agent.devices import Gpu
from dilu.services.node_agent.instance import AGENT_PID_ENV
from dilu.services.node_agent.service import ManagedInstance, NodeAgent
from dilu.services.common.bus import settle

from test_node_agent import Harness, placement

pytestmark = pytest.mark.nats

# an "agent": launches one instance as the node agent does (its pid in the environment, the
# instance's stdout inherited so READY reaches the test), prints the instance's pid, then waits
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    url = sys.argv[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "dilu.services.node_agent.instance", "--instance-id", "orphan1",
         "--function", "orphanfn", "--model", "none", "--handler", "echo_handler", "--device", "cpu",
         "--nats-url", url, "--node", "n1"],
        env=dict(os.environ, %s=str(os.getpid())))
    print(child.pid, flush=True)
    time.sleep(600)
""") % AGENT_PID_ENV
HANDLER = "def load(ctx):\n    return None\n\n\ndef predict(model, batch):\n    return list(batch)\n"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


@pytest.mark.parametrize("when", ["while starting", "once ready"])
def test_an_instance_does_not_outlive_its_agent(nats_url, when, tmp_path):
    (tmp_path / "echo_handler.py").write_text(HANDLER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    agent = subprocess.Popen([sys.executable, "-c", AGENT, nats_url], stdout=subprocess.PIPE, env=env)
    child = 0
    try:
        child = int(agent.stdout.readline())
        if when == "once ready":  # its READY comes on the same pipe
            assert agent.stdout.readline() == b"READY\n"
        agent.send_signal(signal.SIGKILL)  # the agent dies for good, NATS stays up
        agent.wait()
        assert wait_gone(child, 15.0), f"instance {child} still runs {when} its agent died"
    finally:
        agent.kill()
        agent.wait()
        if child and not gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.native
async def test_grants_never_oversubscribe_a_gpu(nats_url):
    async with Harness(nats_url) as h:
        agent = h.agent

        def quotas(gpu=0):
            return {i.placement.instance_id: i.quota for i in agent.instances.values()
                    if i.placement.gpu == gpu and i.cb is not None}

        def block_quotas(gpu=0):
            return {i.placement.instance_id: i.cb.snapshot().quota for i in agent.instances.values()
                    if i.placement.gpu == gpu and i.cb is not None}

        async def until(pred, what, timeout=30.0):
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline, f"{what}: {quotas()}"
                await asyncio.sleep(0.05)

        async def grant(iid, quota):
            await h.nc.publish(subjects.grant_issued("n1", 0), encode(ev.TokenGrant(node="n1", gpu=0, instance_id=iid,
                                                                                   quota=quota)))
            await settle(h.nc)

        for iid in ("a", "b"):
            await h.kv.put(iid, encode(placement(iid, "f1", request=0.3)))
        await until(lambda: set(quotas()) == {"a", "b"}, "a and b not launched")
        await grant("a", 0.7)
        await until(lambda: quotas()["a"] == pytest.approx(0.7), "grant of a not written")
        await grant("b", 0.7)  # would make 1.4: clamped to what a leaves
        await until(lambda: quotas()["b"] == pytest.approx(0.3), "grant of b not clamped")
        # a new instance starts at its request: a's excess above its request is taken back first
        await h.kv.put("c", encode(placement("c", "f1", request=0.4)))
        await until(lambda: "c" in quotas(), "c not launched")
        assert quotas() == {"a": pytest.approx(0.3), "b": pytest.approx(0.3), "c": pytest.approx(0.4)}
        assert block_quotas() == {"a": pytest.approx(0.3, abs=1e-5), "b": pytest.approx(0.3, abs=1e-5),
                                  "c": pytest.approx(0.4, abs=1e-5)}
        await grant("c", 1.0)  # nothing left for c to grow into
        await grant("b", 0.9)
        await asyncio.sleep(0.3)
        assert sum(quotas().values()) <= 1 + 1e-9
        assert agent.quota_sum_max[0] <= 1 + 1e-9
        assert REGISTRY.get_sample_value("dilu_gpu_quota_sum_max", {"gpu": "0"}) <= 1 + 1e-9
        assert REGISTRY.get_sample_value("dilu_gpu_quota_sum", {"gpu": "0"}) == pytest.approx(sum(quotas().values()))
        # telemetry lists every instance holding a quota on the GPU, whatever its state
        n = len(h.events["telemetry"])
        await h.wait_for("telemetry", n + 2)
        listed = {t.instance_id: t.quota for t in h.events["telemetry"][-1].instances}
        assert listed == pytest.approx(quotas())


class Published:
    """A stand-in bus that keeps what the agent publishes."""

    def __init__(self):
        self.events = []

    async def publish(self, subject, event):
        self.events.append(event)


async def test_launching_and_draining_instances_are_in_the_telemetry_with_their_quota():
    agent = NodeAgent(node="n1", gpus=1, device="emulated")
    agent.gpus, agent.cpu, agent.bus = [Gpu(0, "gpu0", "emulated", 0, 0)], True, Published()
    for iid, state, q in (("l", "launching", 0.4), ("d", "draining", 0.3), ("r", "ready", 0.3)):
        agent.instances[iid] = ManagedInstance(placement=placement(iid, "f1", request=q), state=state, cb=object(),
                                               quota=q)
    await agent._publish_window(0.25)
    (tel,) = agent.bus.events
    assert {t.instance_id: t.quota for t in tel.instances} == {"l": 0.4, "d": 0.3, "r": 0.3}


def test_a_drain_that_hangs_ends_the_process_after_its_bound():
    code = "from dilu.services.node_agent.instance import bound_drain; import time; bound_drain(0.2); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    try:
        assert proc.wait(timeout=20) == 1
        assert b"drain took more than 0.2 s" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
