"""The node agent's inventory on an emulated node, through the real pynvml over the fake NVML:
what it publishes to dilu-nodes, its heartbeat, the guard against two agents under one name, GPU
health from NVML faults, NVML telemetry, and memory isolation of an instance end to end."""
import os

import msgspec
import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import models
from dilu.services.common.runner import StartFailed, running
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.node_agent.service import NodeAgent
from scheduler_helpers import wait_for

pytestmark = [pytest.mark.nats, pytest.mark.native]


async def _inventory(js, node):
    kv = await js.key_value(subjects.NODES_BUCKET)
    return msgspec.json.decode((await kv.get(subjects.token(node))).value, type=ev.NodeInventory)


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """The fake NVML's fault file (interceptor/fake_nvml.c), empty to start with."""
    path = tmp_path / "nvml-faults"
    path.write_text("")
    monkeypatch.setenv("DILU_FAKE_NVML_FAULTS", str(path))
    return path


async def test_inventory_heartbeat_and_one_agent_per_name(nats_url, faults):
    agent = NodeAgent(node="gpu-node-7.dc1", gpus=3, device="emulated", emulated_model="h100-80gb",
                      nats=nats_url, heartbeat_s=0.3)
    async with running(agent, nats_url, ready_timeout_s=30):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        inv = await _inventory(js, "gpu-node-7.dc1")
        assert inv.node == "gpu-node-7.dc1" and inv.device == "emulated" and inv.agent_id == agent.agent_id
        assert [g.index for g in inv.gpus] == [0, 1, 2]
        assert {(g.name, g.memory_bytes, g.sms) for g in inv.gpus} == {("NVIDIA H100 80GB HBM3", 81559 * 2**20, 132)}
        assert len({g.uuid for g in inv.gpus}) == 3 and all(g.uuid.startswith("GPU-") for g in inv.gpus)
        assert inv.driver_version and inv.cuda_version == "12.8" and all(g.healthy for g in inv.gpus)

        # the heartbeat refreshes the entry
        first = inv.ts_ns
        await wait_for(lambda: _fresher(js, first), "a newer inventory")

        # a second agent under the same name refuses to start, with a reason
        twin = NodeAgent(node="gpu-node-7.dc1", gpus=1, device="emulated", nats=nats_url)
        with pytest.raises(StartFailed, match="held by another live agent"):
            async with running(twin, nats_url, ready_timeout_s=30):
                pass

        # NVML says GPU 1 fell off the bus and GPU 2 has an uncorrectable ECC error
        faults.write_text("1 lost\n2 ecc 3\n")

        async def unhealthy():
            gpus = (await _inventory(js, "gpu-node-7.dc1")).gpus
            return {g.index: g.health_reason for g in gpus if not g.healthy}
        bad = await wait_for(lambda: _settled(unhealthy, {1, 2}), "GPUs 1 and 2 unhealthy")
        assert "lost" in bad[1].lower() and "ecc" in bad[2].lower()
        assert agent.gpus[0].healthy
        await nc.drain()


async def _fresher(js, ts_ns):
    return (await _inventory(js, "gpu-node-7.dc1")).ts_ns > ts_ns


async def _settled(fetch, want):
    got = await fetch()
    return got if set(got) == want else None


async def test_placement_on_an_unhealthy_gpu_is_not_launched(nats_url, faults):
    faults.write_text("0 xid 79\n")
    agent = NodeAgent(node="n2", gpus=2, device="emulated", nats=nats_url, heartbeat_s=0.3)
    async with running(agent, nats_url, ready_timeout_s=30):
        await wait_for(lambda: not agent.gpus[0].healthy, "GPU 0 unhealthy after Xid 79")
        nc = await nats.connect(nats_url)
        kv = await nc.jetstream().key_value(subjects.PLACEMENT_BUCKET)
        p = ev.Placement(instance_id="x1", function="f", node="n2", gpu=0, request_quota=0.2, limit_quota=0.5,
                         width=0.5, memory_bytes=models.memory_bytes("bert_base"), model="bert_base")
        await kv.put("x1", encode(p))
        await kv.put("x2", encode(msgspec.structs.replace(p, instance_id="x2", gpu=1)))
        await wait_for(lambda: "x2" in agent.instances, "x2 launched on the healthy GPU")
        assert "x1" not in agent.instances
        await nc.drain()


async def test_memory_reservation_and_nvml_telemetry(nats_url):
    """An instance whose weights exceed its reservation fails to load (CUDA_ERROR_OUT_OF_MEMORY
    from the interceptor) while its neighbour serves; telemetry carries NVML's view and the
    instance's memory against its reservation."""
    agent = NodeAgent(node="n3", gpus=1, device="emulated", nats=nats_url, telemetry_ms=200)
    async with running(agent, nats_url, ready_timeout_s=30):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await ensure_stream(js)
        tel: list[ev.GpuTelemetry] = []
        retired: list[ev.InstanceRetired] = []

        async def on_tel(msg):
            tel.append(decode(msg.data, ev.GpuTelemetry))

        async def on_retired(msg):
            retired.append(decode(msg.data, ev.InstanceRetired))
        await nc.subscribe("dilu.v1.telemetry.gpu.n3.*", cb=on_tel)
        await nc.subscribe(subjects.instance_state("retired", "n3"), cb=on_retired)
        kv = await js.key_value(subjects.PLACEMENT_BUCKET)
        weights = models.weight_bytes("gpt2_large")
        for fn in ("ok", "greedy"):
            await ensure_consumer(js, fn)
        good = ev.Placement(instance_id="ok1", function="ok", node="n3", gpu=0, request_quota=0.3, limit_quota=0.5,
                            width=0.5, memory_bytes=models.memory_bytes("gpt2_large"), model="gpt2_large")
        greedy = msgspec.structs.replace(good, instance_id="greedy1", function="greedy", memory_bytes=weights // 2)
        await kv.put("ok1", encode(good))
        await kv.put("greedy1", encode(greedy))

        # the greedy one fails at load (its weights do not fit its reservation: the interceptor
        # refuses the allocation) and is not relaunched; the good one serves and shows its memory
        await wait_for(lambda: any(r.instance_id == "greedy1" and r.reason == ev.LOAD_FAILED and "cuMemAlloc" in r.error
                                   for r in retired), "the over-allocating instance failed to load")

        def memory():
            for t in tel:
                for i in t.instances:
                    if i.instance_id == "ok1" and i.memory_used_bytes:
                        return t, i
            return None
        t, i = await wait_for(lambda: memory(), "telemetry with the instance's memory")
        assert i.memory_used_bytes == weights and i.memory_limit_bytes == good.memory_bytes and i.oom_refusals == 0
        assert t.nvml is not None and t.nvml.memory_total_bytes == 40 * 2**30
        assert t.nvml.memory_used_bytes >= weights + models.CONTEXT_BYTES
        assert os.getpid() not in {p.pid for p in t.nvml.processes}
        # NVML sees the process hold its weights and its CUDA context, as on a real GPU
        held = {p.pid: p.used_bytes for p in t.nvml.processes}
        assert held[agent.instances["ok1"].proc.pid] == weights + models.CONTEXT_BYTES
        await nc.drain()


async def test_an_agent_whose_name_is_taken_later_stops(nats_url):
    """Two agents under one name would launch the same instances: the first one to see the other's
    inventory in its key stops."""
    agent = NodeAgent(node="n4", gpus=1, device="emulated", nats=nats_url, heartbeat_s=0.2)
    async with running(agent, nats_url, ready_timeout_s=30):
        nc = await nats.connect(nats_url)
        kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
        other = msgspec.structs.replace(agent.inventory(), agent_id="someone-else")
        await kv.put("n4", encode(other))
        await wait_for(lambda: not agent.ready(), "the agent stopping")
        await nc.drain()


async def test_a_restarted_agent_takes_its_name_back_at_once(nats_url, tmp_path):
    """Stopped (or killed) and started again on the same host, an agent is not its own twin."""
    import signal
    import subprocess
    import sys

    def start():
        log = open(tmp_path / "agent.log", "ab")
        return subprocess.Popen([sys.executable, "-m", "dilu.services.node_agent", "--node", "r1", "--gpus", "1",
                                 "--device", "emulated", "--metrics-port", "0", "--nats-url", nats_url],
                                stdout=log, stderr=subprocess.STDOUT)

    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def agent_pid():
        try:
            return (await _inventory(js, "r1")).pid
        except Exception:
            return 0

    for stop in (signal.SIGTERM, signal.SIGKILL):
        proc = start()
        try:
            await wait_for(lambda: _true_async(agent_pid(), proc.pid), "the agent's inventory")
        finally:
            proc.send_signal(stop)
            proc.wait(timeout=30)
    again = start()
    try:
        await wait_for(lambda: _true_async(agent_pid(), again.pid), "the restarted agent's inventory")
        assert again.poll() is None, (tmp_path / "agent.log").read_text()[-2000:]
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=30) == 0
    await nc.drain()


async def _true_async(awaitable, want):
    return (await awaitable) == want


async def test_bad_placements_are_rejected_and_counted_leaving_nothing(nats_url):
    from dilu.services.common.metrics import MALFORMED

    def rejected():
        return MALFORMED.labels("node_agent", f"kv:{subjects.PLACEMENT_BUCKET}")._value.get()

    agent = NodeAgent(node="n5", gpus=1, device="emulated", nats=nats_url)
    async with running(agent, nats_url, ready_timeout_s=30):
        nc = await nats.connect(nats_url)
        kv = await nc.jetstream().key_value(subjects.PLACEMENT_BUCKET)
        good = ev.Placement(instance_id="p1", function="f", node="n5", gpu=0, request_quota=0.2, limit_quota=0.5,
                            width=0.5, memory_bytes=2**30, model="bert_base")
        before = rejected()
        await kv.put("p1", encode(msgspec.structs.replace(good, request_quota=-1.0)))  # outside (0, 1]
        await kv.put("p2", encode(msgspec.structs.replace(good, instance_id="other")))  # key is not the id
        await kv.put("p3", encode(msgspec.structs.replace(good, instance_id="p3", gpu=7)))  # no GPU 7 here
        await wait_for(lambda: rejected() - before >= 3, "three rejections counted")
        assert not agent.instances
        await nc.drain()
