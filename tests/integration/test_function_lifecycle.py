"""The services' side of deploying and undeploying a function (against a real nats-server):

- the scheduler's admission (``dilu.v1.scheduler.admit``) says whether some node could ever take
  an instance, and why not: no node, a node that cannot run the function's code, too little memory;
- a function's instances go only to nodes that can run it (user code never to an emulated node);
- FunctionUndeployed drains every instance of the function and the scheduler forgets it;
- the profiler honours an operator's profile, profiles a CPU-only cluster without trials, and
  refuses a function it has no way to profile, with the reason;
- the horizontal scaler keeps a FunctionState per function in KV and drops it on undeploy.
"""
from __future__ import annotations

import msgspec
import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    AdmitReply,
    AdmitRequest,
    FunctionDeployed,
    FunctionSpec,
    FunctionState,
    FunctionUndeployed,
    NodeInventory,
    Profile,
    ProfileReady,
    ProfileReply,
    ProfileRequest,
)
from nats.js.api import StorageType

from dilu.services.common.nodes import nodes_bucket
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.common.runner import running
from dilu.services.horizontal_scaler.service import HorizontalScaler
from dilu.services.profiler.policy import CPU_SHARE
from dilu.services.profiler.service import ProfilerService
from dilu.services.scheduler.service import SchedulerService
from scheduler_helpers import GiB, deploy, inventory, place, table, wait_for

pytestmark = pytest.mark.nats

USER = dict(entry="app:Model", handler="", memory_bytes=2 * GiB, slo_ms=100.0)


async def admit(nc, spec: FunctionSpec) -> AdmitReply:
    msg = await nc.request(subjects.SCHEDULER_ADMIT, encode(AdmitRequest(spec=spec)), timeout=10)
    return decode(msg.data, AdmitReply)


async def put_inventory(nc, inv: NodeInventory) -> None:
    kv = await nodes_bucket(nc.jetstream())
    await kv.put(subjects.token(inv.node), encode(inv))


async def test_admission_says_why_no_node_could_take_the_function(nats_url):
    nc = await nats.connect(nats_url)
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url):
        emulated_only = FunctionSpec(name="e", model="bert_base", memory_bytes=4 * GiB)
        r = await admit(nc, emulated_only)
        assert not r.ok and "no node has joined" in r.error
        await put_inventory(nc, inventory("gpu-a", gpus=2, memory=40 * GiB))
        await wait_for(lambda: "gpu-a" in svc.roster, "node joined")
        assert (await admit(nc, emulated_only)).ok
        huge = msgspec.structs.replace(emulated_only, memory_bytes=80 * GiB)
        r = await admit(nc, huge)
        assert not r.ok and str(80 * GiB) in r.error and str(40 * GiB) in r.error
        user_code = FunctionSpec(name="u", **USER)  # no surface: an emulated GPU cannot time it
        r = await admit(nc, user_code)
        assert not r.ok and "emulation" in r.error
        await put_inventory(nc, NodeInventory(node="cpu-b", device="cpu"))
        await wait_for(lambda: "cpu-b" in svc.roster, "CPU node joined")
        r = await admit(nc, user_code)
        assert r.ok and r.nodes == 1
    await nc.close()


async def test_instances_go_only_to_nodes_that_can_run_them(nats_url):
    nc = await nats.connect(nats_url)
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url):
        await put_inventory(nc, inventory("gpu-a", gpus=1))
        await put_inventory(nc, NodeInventory(node="cpu-b", device="cpu"))
        await wait_for(lambda: {"gpu-a", "cpu-b"} <= set(svc.cluster.node_index), "both nodes joined")
        spec = FunctionSpec(name="u", **USER)
        await nc.publish(subjects.function_deployed("u"), encode(FunctionDeployed(spec=spec)))
        await nc.publish(subjects.profile_ready("u"), encode(
            ProfileReady(
                profile=Profile(function="u", request_quota=0.25, limit_quota=0.25, batch_size=1))))
        await wait_for(lambda: "u" in svc.functions and "u" in svc.profiles, "scheduler learnt u")
        r = await place(nc, "u", count=4)
        assert r.ok and {p.node for p in r.placements} == {"cpu-b"}, "user code never lands on the emulated node"
        assert not (await place(nc, "u")).ok, "the CPU node is full and the GPU node cannot run it"
    await nc.close()


async def test_undeploy_drains_every_instance_and_forgets_the_function(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url):
        await put_inventory(nc, inventory("gpu-a", gpus=2))
        await wait_for(lambda: "gpu-a" in svc.cluster.node_index, "node joined")
        await deploy(nc, svc, "f", request=0.25, limit=0.25)
        await deploy(nc, svc, "g", request=0.25, limit=0.25)
        assert (await place(nc, "f", count=3)).ok and (await place(nc, "g")).ok
        await nc.publish(subjects.function_undeployed("f"), encode(FunctionUndeployed(name="f")))
        rows = await wait_for(
            lambda: _drained(js, "f"), "every instance of f draining")
        assert all(not p.draining for p in rows.values() if p.function == "g"), "g is untouched"
        assert "f" not in svc.functions
        r = await place(nc, "f")
        assert not r.ok and "not deployed" in r.error
    await nc.close()


async def _drained(js, fn):
    rows = await table(js)
    mine = [p for p in rows.values() if p.function == fn]
    return rows if len(mine) == 3 and all(p.draining for p in mine) else None


async def profile(nc, spec: FunctionSpec) -> ProfileReply:
    msg = await nc.request(subjects.PROFILER_PROFILE, encode(ProfileRequest(spec=spec)), timeout=20)
    return decode(msg.data, ProfileReply)


async def test_profiler_uses_the_operators_profile_a_cpu_share_or_refuses_with_the_reason(nats_url):
    nc = await nats.connect(nats_url)
    svc = ProfilerService()
    async with running(svc, nats_url):
        given = Profile(function="ignored", request_quota=0.2, limit_quota=0.1, batch_size=16)
        spec = FunctionSpec(name="op", max_batch=4, profile=given, **USER)
        r = await profile(nc, spec)
        assert r.ok and r.profile.backend == "operator" and r.profile.function == "op"
        assert (r.profile.request_quota, r.profile.limit_quota, r.profile.batch_size) == (0.2, 0.2, 4)
        stored = await (await nc.jetstream().key_value(subjects.PROFILES_BUCKET)).get("op")
        assert msgspec.json.decode(stored.value, type=Profile).backend == "operator"

        r = await profile(nc, FunctionSpec(name="nothing", **USER))
        assert not r.ok and "[profile]" in r.error, "no surface, no GPU node, no operator profile"

        await put_inventory(nc, NodeInventory(node="cpu-b", device="cpu"))
        r = await profile(nc, FunctionSpec(name="cpu", **USER))
        assert r.ok and r.profile.backend == "cpu" and r.profile.request_quota == CPU_SHARE
        assert svc.trials == 0
    await nc.close()


async def test_a_profiler_named_to_a_cpu_node_gives_the_cpu_share(nats_url):
    """`dilu up --gpus cpu` runs the profiler with --node <the CPU node>, beside GPU nodes or not."""
    nc = await nats.connect(nats_url)
    await put_inventory(nc, NodeInventory(node="cpu-b", device="cpu"))
    await put_inventory(nc, inventory("gpu-a", gpus=1))
    async with running(ProfilerService(node="cpu-b"), nats_url):
        r = await profile(nc, FunctionSpec(name="u", **USER))
        assert r.ok and r.profile.backend == "cpu", r.error
    await nc.close()


async def test_scaler_keeps_each_functions_state_in_kv_and_drops_it_on_undeploy(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    hs = HorizontalScaler(tick_s=0.1)
    async with running(hs, nats_url):
        await ensure_stream(js, storage=StorageType.MEMORY)  # what dilu deploy creates first
        await ensure_consumer(js, "f")
        spec = FunctionSpec(name="f", model="bert_base", memory_bytes=GiB, slo_ms=80, initial_scale=2)
        await nc.publish(subjects.function_deployed("f"), encode(FunctionDeployed(spec=spec)))
        await nc.publish(subjects.profile_ready("f"), encode(
            ProfileReady(
                profile=Profile(function="f", request_quota=0.5, limit_quota=0.5, batch_size=2))))
        kv = await js.key_value(subjects.FUNCTION_STATE_BUCKET)

        async def state():
            try:
                return msgspec.json.decode((await kv.get("f")).value, type=FunctionState)
            except nats.js.errors.KeyNotFoundError:
                return None

        # no scheduler answers: the initial scale of 2 (the spec's) is wanted and not placeable
        st = await wait_for(lambda: _when(state(), lambda s: s and not s.placeable), "state says not placeable")
        assert st.desired == 2 and st.instances == 0 and st.reason
        await nc.publish(subjects.function_undeployed("f"), encode(FunctionUndeployed(name="f")))
        await wait_for(lambda: _when(state(), lambda s: s is None, found="deleted"), "state deleted")
        assert "f" not in hs.policy.functions()
    await nc.close()


async def _when(coro, pred, found=None):
    """``coro``'s value (or ``found``) when ``pred`` holds for it, else None (keep waiting)."""
    value = await coro
    return (found or value) if pred(value) else None
