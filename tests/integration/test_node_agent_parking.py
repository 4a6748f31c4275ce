"""Parking on an emulated node against a real nats-server: the placement table's ``parked`` flag
has the agent park the instance (InstanceParked; no telemetry, no GPU time, no requests served)
and resume it (InstanceReady ``resumed``); a parked process that dies is launched afresh on the
resume."""
import asyncio
import time

import msgspec
import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import models
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.runner import serve
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.node_agent.service import NodeAgent

pytestmark = [pytest.mark.nats, pytest.mark.native]

NODE, FN = "n1", "f1"
EVENTS = {"ready": ev.InstanceReady, "retired": ev.InstanceRetired, "parked": ev.InstanceParked}


class Harness:
    def __init__(self, url: str):
        self.url = url
        self.agent = NodeAgent(node=NODE, gpus=1, device="emulated", nats=url, telemetry_ms=200)
        self.shutdown = asyncio.Event()
        self.events: dict[str, list] = {k: [] for k in (*EVENTS, "telemetry")}

    async def __aenter__(self):
        self.task = asyncio.create_task(serve(self.agent, self.url, shutdown=self.shutdown, install_signals=False))
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await ensure_stream(self.js)
        for state, kind in EVENTS.items():
            await self.nc.subscribe(subjects.instance_state(state, NODE), cb=self._collector(state, kind))
        await self.nc.subscribe(f"dilu.v1.telemetry.gpu.{NODE}.*", cb=self._collector("telemetry", ev.GpuTelemetry))
        while not self.agent.ready():
            await asyncio.sleep(0.05)
        self.kv = await self.js.key_value(subjects.PLACEMENT_BUCKET)
        return self

    def _collector(self, key, kind):
        async def cb(msg):
            self.events[key].append(decode(msg.data, kind))
        return cb

    async def wait_for(self, key, n=1, timeout=30.0):
        deadline = time.monotonic() + timeout
        while len(self.events[key]) < n:
            assert time.monotonic() < deadline, f"no {key} event within {timeout} s"
            await asyncio.sleep(0.05)

    async def until(self, pred, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, "condition not met"
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc):
        self.shutdown.set()
        await asyncio.wait_for(self.task, 40)
        await self.nc.drain()


def placement(iid: str, **kw) -> ev.Placement:
    model = "bert_base"
    return ev.Placement(instance_id=iid, function=FN, node=NODE, gpu=0, request_quota=0.3, limit_quota=1.0,
                        width=1.0, memory_bytes=models.memory_bytes(model), batch_size=4, model=model,
                        slo_ms=models.default_slo_ms(model), **kw)


def invoke(client, rid):
    return asyncio.create_task(client.invoke(FN, b"x", request_id=rid, scheduled_ns=time.time_ns(), timeout_s=60))


async def test_a_parked_instance_serves_nothing_holds_no_gpu_time_and_resumes(nats_url):
    async with Harness(nats_url) as h:
        await ensure_consumer(h.js, FN)
        client = InvokeClient(h.nc, h.js)
        await client.start()
        await h.kv.put("i1", encode(placement("i1")))
        await h.wait_for("ready")
        assert h.events["ready"][0].parkable and not h.events["ready"][0].resumed  # the emulated handler parks
        assert (await invoke(client, "warm")).status == "ok"

        await h.kv.put("i1", encode(placement("i1", parked=True)))
        await h.wait_for("parked")
        assert h.agent.instances["i1"].state == "parked"
        windows = len(h.events["telemetry"])
        active = h.agent.cost.active_gpu_seconds
        waiting = invoke(client, "while-parked")
        await asyncio.sleep(1.0)  # five telemetry windows
        assert not waiting.done()  # nobody pulls it
        assert not any(i.instance_id == "i1" for t in h.events["telemetry"][windows:] for i in t.instances)
        assert h.agent.cost.active_gpu_seconds == active  # a GPU holding only a parked instance is not active

        await h.kv.put("i1", encode(placement("i1", parked=False)))
        await h.wait_for("ready", 2)
        back = h.events["ready"][1]
        assert back.resumed and back.instance_id == "i1" and back.cold_start_ms > 0
        assert (await waiting).status == "ok"
        assert h.agent.instances["i1"].state == "ready" and h.events["retired"] == []
        await client.close()


async def test_a_parked_process_that_dies_is_launched_afresh_when_resumed(nats_url):
    async with Harness(nats_url) as h:
        await ensure_consumer(h.js, FN)
        await h.kv.put("i1", encode(placement("i1")))
        await h.wait_for("ready")
        await h.kv.put("i1", encode(placement("i1", parked=True)))
        await h.wait_for("parked")
        pid = h.agent.instances["i1"].proc.pid
        h.agent.instances["i1"].proc.kill()
        await h.until(lambda: "i1" not in h.agent.instances)
        await asyncio.sleep(1.5)  # past the agent's relaunch delay: a parked one is not relaunched
        assert "i1" not in h.agent.instances and h.events["retired"] == []  # its placement stays parked

        await h.kv.put("i1", encode(placement("i1", parked=False)))
        await h.wait_for("ready", 2)
        again = h.events["ready"][1]
        assert not again.resumed and h.agent.instances["i1"].proc.pid != pid  # a fresh process, a cold start
        await h.kv.delete("i1")
        await h.wait_for("retired")


async def test_a_retired_parked_instance_ends_at_once(nats_url):
    async with Harness(nats_url) as h:
        await ensure_consumer(h.js, FN)
        await h.kv.put("i1", encode(placement("i1")))
        await h.wait_for("ready")
        await h.kv.put("i1", encode(placement("i1", parked=True)))
        await h.wait_for("parked")
        t0 = time.monotonic()
        await h.kv.put("i1", encode(placement("i1", parked=True, draining=True)))
        await h.wait_for("retired")
        assert h.events["retired"][0].reason == "drained by scheduler" and h.events["retired"][0].exit_code == 0
        assert time.monotonic() - t0 < 10.0  # far below the drain timeout: nothing was in hand


async def test_an_agent_restarted_with_a_parked_instance_keeps_it_parked_and_launches_it_on_resume(nats_url):
    async with Harness(nats_url) as h:
        await ensure_consumer(h.js, FN)
        await h.kv.put("i1", encode(placement("i1")))
        await h.wait_for("ready")
        await h.kv.put("i1", encode(placement("i1", parked=True)))
        await h.wait_for("parked")
        pid = h.agent.instances["i1"].proc.pid
    # stopped: the parked process ended, but no retirement was reported (the placement stays parked)
    assert h.events["retired"] == []
    nc = await nats.connect(nats_url)  # the node's name is free again (this test's agents share one pid)
    await (await nc.jetstream().key_value(subjects.NODES_BUCKET)).delete(NODE)
    await nc.close()
    async with Harness(nats_url) as h2:
        await asyncio.sleep(1.0)
        assert "i1" not in h2.agent.instances  # parked: nothing to launch yet
        await h2.kv.put("i1", encode(placement("i1", parked=False)))
        await h2.wait_for("ready")
        assert h2.agent.instances["i1"].proc.pid != pid
