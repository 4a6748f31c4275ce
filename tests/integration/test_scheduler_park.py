"""Parking through the scheduler, against a real nats-server (``dilu.v1.scheduler.park``): a
parked instance stays in the placement table with ``parked`` set but its demand is off its GPU,
so other functions fit there; a resume re-seats it on that GPU when it still fits, else places a
new instance elsewhere (``relaunched``) and retires the parked one, else is refused and leaves it
parked. A restarted scheduler keeps parked placements off the GPUs, defragmentation never moves
one, and a parked instance on a node that left is relaunched elsewhere on resume.

Functions of request quota 0.6 are used throughout: two never share a GPU (Σ request ≤ 1), so
whether a second one is placed shows whether the first one's demand is counted.
"""
from __future__ import annotations

import asyncio
import collections

import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    FunctionDeployed,
    FunctionSpec,
    FunctionUndeployed,
    InstanceReady,
    InstanceRetired,
    ParkReply,
    ParkRequest,
    Placement,
    PlacementDecided,
    Profile,
    ProfileReady,
    RetireReply,
    RetireRequest,
)
from dilu.services.common.bus import settle
from dilu.services.common.nodes import nodes_bucket
from dilu.services.common.runner import running
from dilu.services.scheduler.policy import Slot
from dilu.services.scheduler.service import SchedulerService
from scheduler_helpers import GiB, deploy, inventory, place, table, wait_for

pytestmark = pytest.mark.nats
LONG_TTL_S = 3600.0  # not about liveness: one put of an inventory keeps its node


def scheduler(**kw) -> SchedulerService:
    return SchedulerService(node_ttl_s=kw.pop("node_ttl_s", LONG_TTL_S), **kw)


async def join(nc, svc, node="node0", gpus=1):
    """Put ``node``'s inventory into dilu-nodes (as its agent would) and wait until the scheduler has it."""
    kv = await nodes_bucket(nc.jetstream())
    await kv.put(subjects.token(node), encode(inventory(node, gpus)))
    await wait_for(lambda: node in svc.cluster.node_index, f"scheduler saw node {node} join")


async def leave(nc, svc, node):
    """Delete ``node``'s inventory (an agent shutting down) and wait until the scheduler saw it go."""
    kv = await nodes_bucket(nc.jetstream())
    await kv.delete(subjects.token(node))
    await wait_for(lambda: node not in svc.cluster.node_index, f"scheduler saw node {node} leave")


async def park(nc, p: Placement, resume: bool = False, function: str = "") -> ParkReply:
    req = ParkRequest(function=function or p.function, instance_id=p.instance_id, resume=resume)
    msg = await nc.request(subjects.SCHEDULER_PARK, encode(req), timeout=10)
    return decode(msg.data, ParkReply)


async def retire(nc, fn, instance_id="") -> RetireReply:
    msg = await nc.request(subjects.SCHEDULER_RETIRE, encode(RetireRequest(function=fn, instance_id=instance_id)),
                           timeout=10)
    return decode(msg.data, RetireReply)


async def ready(nc, p: Placement):
    ev = InstanceReady(instance_id=p.instance_id, function=p.function, node=p.node, gpu=p.gpu)
    await nc.publish(subjects.instance_state("ready", p.node), encode(ev))


async def retired(nc, p: Placement):
    ev = InstanceRetired(instance_id=p.instance_id, function=p.function, node=p.node, gpu=p.gpu)
    await nc.publish(subjects.instance_state("retired", p.node), encode(ev))


async def row(js, iid) -> Placement | None:
    return (await table(js)).get(iid)


async def place_one(nc, fn) -> Placement:
    r = await place(nc, fn)
    assert r.ok, r.error
    (p,) = r.placements
    return p


async def two_functions(nc, svc) -> Placement:
    """Deploy ``a`` and ``b`` (request 0.6 each: never on one GPU together) and place one ``a``."""
    await deploy(nc, svc, "a", request=0.6, limit=0.6)
    await deploy(nc, svc, "b", request=0.6, limit=0.6)
    return await place_one(nc, "a")


async def test_parking_frees_the_gpu_and_resuming_takes_it_back(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    decided: list[PlacementDecided] = []

    async def on_decided(m):
        decided.append(decode(m.data, PlacementDecided))

    await nc.subscribe(f"{subjects.PREFIX}.placement.decided.*", cb=on_decided)
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        a = await two_functions(nc, svc)
        assert not (await place(nc, "b")).ok, "the GPU holds a: b does not fit beside it"
        await ready(nc, a)
        await wait_for(lambda: a.instance_id in svc.warm, "scheduler saw a ready")

        r = await park(nc, a)
        assert r.ok and r.relaunched is None, r.error
        stored = await row(js, a.instance_id)
        assert stored.parked and not stored.draining and (stored.node, stored.gpu) == (a.node, a.gpu)
        assert a.instance_id not in svc.cluster.instances and a.instance_id not in svc.warm
        assert a.instance_id not in svc.orphans
        assert svc.cluster.slot(svc.cluster.parked[a.instance_id]) == Slot(a.node, a.gpu)  # its CUDA context stays
        assert (await park(nc, a)).ok, "parking again is harmless"

        # b fits where a was, and is the only demand there; then a cannot come back there
        b = await place_one(nc, "b")
        assert (b.node, b.gpu) == (a.node, a.gpu)
        assert svc.cluster.residents(Slot(a.node, a.gpu)) == [b.instance_id]
        assert (await retire(nc, "b", b.instance_id)).ok
        await retired(nc, await row(js, b.instance_id))
        await wait_for(lambda: b.instance_id not in svc.placements, "b deleted once retired")

        r = await park(nc, a, resume=True)
        assert r.ok and r.relaunched is None, r.error
        stored = await row(js, a.instance_id)
        assert not stored.parked and not stored.draining and (stored.node, stored.gpu) == (a.node, a.gpu)
        assert svc.cluster.residents(Slot(a.node, a.gpu)) == [a.instance_id]
        assert svc.cluster.request_sum(Slot(a.node, a.gpu)) == pytest.approx(0.6)
        assert svc.cluster.parked == {} and svc.cluster.violations() == []
        assert not (await place(nc, "b")).ok, "a's demand is back on the GPU"
        assert (await park(nc, a, resume=True)).ok, "resuming a live instance is harmless"
        await settle(nc)
        await wait_for(lambda: [d.action for d in decided if d.placement.instance_id == a.instance_id]
                       == ["place", "park", "resume"], "PlacementDecided place, park, resume for a")
    await nc.close()


async def test_a_resume_that_no_longer_fits_relaunches_elsewhere_and_drains_the_parked_one(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        a = await two_functions(nc, svc)
        assert (await park(nc, a)).ok
        b = await place_one(nc, "b")
        assert (b.node, b.gpu) == ("node0", 0), "b took the GPU a left"

        # no room anywhere: refused, a stays parked and holds nothing
        r = await park(nc, a, resume=True)
        assert not r.ok and r.relaunched is None
        assert "cannot resume" in r.error and "\n" not in r.error
        assert (await row(js, a.instance_id)).parked
        assert a.instance_id not in svc.cluster.instances

        # a second node: the resume relaunches a there, and a drains on node0
        await join(nc, svc, "node1", gpus=1)
        r = await park(nc, a, resume=True)
        assert r.ok and r.relaunched is not None, r.error
        new = r.relaunched
        assert (new.node, new.gpu) == ("node1", 0) and new.instance_id != a.instance_id
        assert new.function == "a" and not new.parked and not new.draining and not new.replaces
        assert new.request_quota == a.request_quota and new.batch_size == a.batch_size
        rows = await table(js)
        assert rows[new.instance_id] == new
        assert rows[a.instance_id].draining and rows[a.instance_id].parked
        assert svc.cluster.residents(Slot("node1", 0)) == [new.instance_id]
        r = await park(nc, a, resume=True)
        assert not r.ok and "draining" in r.error, "a draining instance does not resume"

        # the agent ends the parked process: its entry goes
        await retired(nc, rows[a.instance_id])
        await wait_for(lambda: a.instance_id not in svc.placements, "the parked one deleted once retired")
        assert a.instance_id not in await table(js)
        assert svc.cluster.violations() == [] and svc.cluster.parked == {}, "its process's memory freed"
    await nc.close()


async def test_a_parked_instance_whose_node_left_is_relaunched_and_its_entry_deleted(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        a = await two_functions(nc, svc)
        assert (await park(nc, a)).ok
        await join(nc, svc, "node1", gpus=1)
        await leave(nc, svc, "node0")
        await svc.sweep()
        stored = await row(js, a.instance_id)
        assert stored.parked and not stored.draining, "a parked instance of a gone node waits for its resume"
        r = await park(nc, a, resume=True)
        assert r.ok and r.relaunched is not None and r.relaunched.node == "node1", r.error
        assert a.instance_id not in await table(js), "no agent will report it retired: deleted at once"
        assert a.instance_id not in svc.placements
    await nc.close()


async def test_a_node_that_comes_back_still_holds_its_parked_processes_memory(nats_url):
    """Its agent restarted and kept the parked process: the memory it keeps counts on its GPU again."""
    nc = await nats.connect(nats_url)
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        a = await two_functions(nc, svc)
        assert (await park(nc, a)).ok and a.instance_id in svc.cluster.parked
        await leave(nc, svc, "node0")
        assert svc.cluster.parked == {}, "its GPU went with the node"
        await join(nc, svc, "node0", gpus=1)
        assert svc.cluster.slot(svc.cluster.parked[a.instance_id]) == Slot("node0", 0)
        assert svc.cluster.violations() == []
    await nc.close()


async def test_a_draining_parked_instance_on_a_gone_node_is_dropped_by_the_sweep(nats_url):
    """Retiring a parked instance marks it draining; if its node is gone for good nobody reports
    it retired, so the sweep deletes it (only once the scheduler waited its TTL since start)."""
    now = [0.0]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler(node_ttl_s=30.0, sweep_interval_s=3600.0, clock=lambda: now[0])
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        a = await two_functions(nc, svc)
        assert (await park(nc, a)).ok
        await leave(nc, svc, "node0")
        r = await retire(nc, "a", a.instance_id)
        assert r.ok and r.instance_id == a.instance_id
        assert (await row(js, a.instance_id)).draining
        await svc.sweep()
        assert a.instance_id in await table(js), "within the TTL of the start the node may still come"
        now[0] += 31.0
        await svc.sweep()
        assert a.instance_id not in await table(js) and a.instance_id not in svc.placements
    await nc.close()


async def test_park_refusals_are_one_line(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=2)
        await deploy(nc, svc, "a", request=0.3, limit=0.3)
        spec = FunctionSpec(name="train", model="bert_base", kind="training", priority="training", memory_bytes=4 * GiB)
        await nc.publish(subjects.function_deployed("train"), encode(FunctionDeployed(spec=spec)))
        profile = Profile(function="train", request_quota=0.3, limit_quota=0.3, batch_size=1)
        await nc.publish(subjects.profile_ready("train"), encode(ProfileReady(profile=profile)))
        await wait_for(lambda: "train" in svc.profiles and svc.functions.get("train") == spec, "scheduler learnt train")
        job = await place_one(nc, "train")
        a = await place_one(nc, "a")

        def refused(r: ParkReply, *words):
            assert not r.ok and r.relaunched is None and all(w in r.error for w in words), r.error
            assert "\n" not in r.error

        refused(await park(nc, job), "training")
        assert not (await row(js, job.instance_id)).parked
        ghost = Placement(instance_id="a-nope", function="a", node="node0", gpu=0, request_quota=0.3,
                          limit_quota=0.3, width=0.3, memory_bytes=GiB)
        refused(await park(nc, ghost), "no instance", "a-nope")
        refused(await park(nc, ghost, resume=True), "no instance")
        refused(await park(nc, a, function="train"), "no instance", "train")

        # a migration's pair: neither parks while both are placed
        await ready(nc, a)
        await wait_for(lambda: a.instance_id in svc.warm, "scheduler saw a ready")
        async with svc.lock:  # a replacement of a, as defragmentation writes it
            new = Placement(instance_id="a-repl", function="a", node="node0", gpu=1, request_quota=0.3,
                            limit_quota=0.3, width=0.3, memory_bytes=4 * GiB, replaces=a.instance_id)
            await svc._create(new, svc._demand(svc.functions["a"], svc.profiles["a"]))
        refused(await park(nc, a), "migrat", "a-repl")
        refused(await park(nc, new), "migrat", a.instance_id)

        # a draining one neither parks nor resumes
        assert (await retire(nc, "a", new.instance_id)).ok
        assert (await retire(nc, "a", a.instance_id)).ok
        refused(await park(nc, a), "draining")
    await nc.close()


async def test_retiring_never_picks_a_parked_instance_but_can_name_one(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=2)
        await deploy(nc, svc, "a", request=0.3, limit=0.3)
        a1, a2 = await place_one(nc, "a"), await place_one(nc, "a")
        assert (await park(nc, a1)).ok and (await park(nc, a2)).ok
        r = await retire(nc, "a")
        assert not r.ok and "no live instance" in r.error
        r = await retire(nc, "a", a1.instance_id)
        assert r.ok and r.instance_id == a1.instance_id
        assert (await row(js, a1.instance_id)).draining
        await retired(nc, await row(js, a1.instance_id))
        await wait_for(lambda: a1.instance_id not in svc.placements, "a parked draining one deleted once retired")
        assert svc.cluster.violations() == []
    await nc.close()


async def test_a_restarted_scheduler_keeps_parked_demand_off_the_gpu_and_can_resume_it(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        a = await two_functions(nc, svc)
        assert (await park(nc, a)).ok
    svc2 = scheduler()
    async with running(svc2, nats_url):
        assert svc2.placements[a.instance_id][0].parked
        assert a.instance_id not in svc2.cluster.instances and a.instance_id not in svc2.orphans
        assert svc2.cluster.active == 0 and a.instance_id in svc2.cluster.parked  # its process's memory
        await deploy(nc, svc2, "a", request=0.6, limit=0.6)
        await deploy(nc, svc2, "b", request=0.6, limit=0.6)
        b = await place_one(nc, "b")
        assert (b.node, b.gpu) == (a.node, a.gpu)
        assert not (await park(nc, a, resume=True)).ok, "b holds the GPU: no room to resume or relaunch"
        assert (await retire(nc, "b", b.instance_id)).ok
        await retired(nc, await row(js, b.instance_id))
        await wait_for(lambda: b.instance_id not in svc2.placements, "b deleted once retired")
        r = await park(nc, a, resume=True)
        assert r.ok and r.relaunched is None, r.error
        assert not (await row(js, a.instance_id)).parked
        assert svc2.cluster.residents(Slot(a.node, a.gpu)) == [a.instance_id]
    await nc.close()


async def test_defragmentation_never_moves_a_parked_instance(nats_url):
    """Two instances alone on two GPUs: defragmentation would put them on one (see
    test_scheduler_service). With one parked, only one GPU is active and nothing moves, before
    and after a restart, even when the parked one is (wrongly) reported ready again."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=2)
        await deploy(nc, svc, "f", request=0.5, limit=0.5)
        by_gpu = collections.defaultdict(list)
        for p in (await place(nc, "f", count=4)).placements:
            by_gpu[p.gpu].append(p)
        assert sorted(len(v) for v in by_gpu.values()) == [2, 2]
        for group in by_gpu.values():
            assert (await retire(nc, "f", group[0].instance_id)).ok
            await retired(nc, group[0])
        await wait_for(lambda: len(svc.placements) == 2, "one instance left on each GPU")
        kept = [group[1] for group in by_gpu.values()]
        parked, live = kept
        assert (await park(nc, parked)).ok
        for p in kept:
            await ready(nc, p)
        await wait_for(lambda: {p.instance_id for p in kept} <= svc.warm, "scheduler saw both ready")
        assert svc.cluster.active == 1
        assert await svc.defragment() == 0
        assert len(await table(js)) == 2
    svc2 = scheduler()
    async with running(svc2, nats_url):
        for p in kept:
            await ready(nc, p)
        await wait_for(lambda: {p.instance_id for p in kept} <= svc2.warm, "restarted scheduler saw both ready")
        assert await svc2.defragment() == 0
        rows = await table(js)
        assert len(rows) == 2 and rows[parked.instance_id].parked and not any(p.replaces for p in rows.values())
    await nc.close()


async def test_undeploying_drains_parked_instances_too(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        await deploy(nc, svc, "a", request=0.3, limit=0.3)
        a = await place_one(nc, "a")
        assert (await park(nc, a)).ok
        await nc.publish(subjects.function_undeployed("a"), encode(FunctionUndeployed(name="a")))

        async def drained():
            stored = await row(js, a.instance_id)
            return stored is not None and stored.draining

        await wait_for(drained, "the parked instance marked draining")
    await nc.close()
