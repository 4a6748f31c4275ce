"""The scheduler service against a real nats-server: the placement table in KV, concurrent
placements (issue 6 case 3), retirement through draining, rebuilding state on restart. The
cluster is the node inventories in KV ``dilu-nodes``: each test puts one first, as an agent would
(nodes joining, leaving and going stale: test_scheduler_nodes.py)."""
from __future__ import annotations

import asyncio
import collections

import msgspec
import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    InstanceReady,
    InstanceRetired,
    Placement,
    Profile,
    RetireReply,
    RetireRequest,
)
from dilu.services.common.nodes import nodes_bucket
from dilu.services.common.runner import running
from dilu.services.scheduler.service import SchedulerService
from scheduler_helpers import GiB, deploy, inventory, place, table, wait_for

pytestmark = pytest.mark.nats
# These tests are not about liveness: a TTL far beyond their run time, so one put of the inventory
# keeps the node (test_scheduler_nodes.py heartbeats and lets nodes go stale).
LONG_TTL_S = 3600.0


def scheduler(**kw) -> SchedulerService:
    return SchedulerService(node_ttl_s=LONG_TTL_S, **kw)


async def join(nc, svc, node="node0", gpus=4, memory=40 * GiB):
    """Put ``node``'s inventory into dilu-nodes (as its agent would) and wait until the scheduler has it."""
    kv = await nodes_bucket(nc.jetstream())
    await kv.put(subjects.token(node), encode(inventory(node, gpus, memory)))
    await wait_for(lambda: node in svc.cluster.node_index, f"scheduler saw node {node} join")


async def retire(nc, fn, instance_id="") -> RetireReply:
    msg = await nc.request(subjects.SCHEDULER_RETIRE, encode(RetireRequest(function=fn, instance_id=instance_id)), timeout=10)
    return decode(msg.data, RetireReply)


async def retired(nc, p: Placement):
    ev = InstanceRetired(instance_id=p.instance_id, function=p.function, node=p.node, gpu=p.gpu)
    await nc.publish(subjects.instance_state("retired", p.node), encode(ev))


async def ready(nc, p: Placement):
    ev = InstanceReady(instance_id=p.instance_id, function=p.function, node=p.node, gpu=p.gpu)
    await nc.publish(subjects.instance_state("ready", p.node), encode(ev))


async def wait_empty(js, timeout_s: float = 30.0):
    """Until the table is empty; generous, since a loaded 2-core CI host delays the deletes."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await table(js):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"placement table not emptied within {timeout_s} s")
        await asyncio.sleep(0.05)


async def test_concurrent_placements_never_over_pack(nats_url):
    """Issue 6 case 3: 8 GPUs, 16 requests of request quota 0.5 at once, 20 trials: two per GPU."""
    nc = await nats.connect(nats_url)
    senders = [await nats.connect(nats_url) for _ in range(4)]  # requests arrive on several connections
    svc = scheduler()
    async with running(svc, nats_url):
        js = nc.jetstream()
        await join(nc, svc, "node0")
        await join(nc, svc, "node1")
        await deploy(nc, svc, "half", request=0.5, limit=0.5)
        for trial in range(20):
            replies = await asyncio.gather(*(place(senders[k % 4], "half") for k in range(16)))
            assert all(r.ok for r in replies), [r.error for r in replies if not r.ok]
            rows = await table(js)
            assert len(rows) == 16
            per_gpu = collections.Counter((p.node, p.gpu) for p in rows.values())
            assert sorted(per_gpu.values()) == [2] * 8, f"trial {trial}: {per_gpu}"
            load = collections.defaultdict(float)
            for p in rows.values():
                load[(p.node, p.gpu)] += p.request_quota
                assert p.width == p.limit_quota
            assert max(load.values()) <= 1.0 + 1e-9
            extra = await place(nc, "half")
            assert not extra.ok and "no GPU" in extra.error
            # retire them all: draining first, deleted when the node agent reports them retired
            for iid, p in rows.items():
                assert (await retire(nc, "half", iid)).ok
            rows = await table(js)
            assert len(rows) == 16 and all(p.draining for p in rows.values())
            for p in rows.values():
                await retired(nc, p)
            await wait_empty(js)
    for s in senders:
        await s.close()
    await nc.close()


async def test_refusals_are_clear_and_victim_choice_is_served(nats_url):
    nc = await nats.connect(nats_url)
    svc = scheduler()
    async with running(svc, nats_url):
        r = await place(nc, "ghost")
        assert not r.ok and r.error == "no nodes: no node agent has published an inventory to dilu-nodes"
        await join(nc, svc, "node0", gpus=2)
        r = await place(nc, "ghost")
        assert not r.ok and "not deployed" in r.error
        await deploy(nc, svc, "fresh", profile=False)
        r = await place(nc, "fresh")
        assert not r.ok and "no profile yet" in r.error
        msg = await nc.request(subjects.SCHEDULER_PLACE, b'{"function": 5}', timeout=5)
        assert b"false" in msg.data
        r = await place(nc, "fresh", count=0)
        assert not r.ok and "count" in r.error
        # the profile may also come from the dilu-profiles bucket (the profiler stores it there)
        kv_prof = await nc.jetstream().key_value(subjects.PROFILES_BUCKET)
        await kv_prof.put("fresh", msgspec.json.encode(Profile(function="fresh", request_quota=0.3, limit_quota=0.6, batch_size=2)))
        r = await place(nc, "fresh", count=2)
        assert r.ok and len(r.placements) == 2
        assert {p.request_quota for p in r.placements} == {0.3} and r.placements[0].batch_size == 2
        rr = await retire(nc, "fresh")
        assert rr.ok and rr.instance_id in {p.instance_id for p in r.placements}
        assert (await retire(nc, "fresh", "nope")).ok is False
    await nc.close()


async def test_state_is_rebuilt_from_the_table_on_restart(nats_url):
    nc = await nats.connect(nats_url)
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        await deploy(nc, svc, "f", request=0.5, limit=0.7)
        r = await place(nc, "f", count=2)
        assert r.ok
    svc2 = scheduler()
    async with running(svc2, nats_url):  # the inventory and the table are read back on start
        assert svc2.cluster.nodes == ["node0"] and not svc2.orphans
        assert len(svc2.placements) == 2 and svc2.cluster.active == 1
        await deploy(nc, svc2, "f", request=0.5, limit=0.7)
        r = await place(nc, "f")
        assert not r.ok, "the GPU is full with the two placements made before the restart"
        # retire one; its capacity stays reserved while it drains, and is free once it retired
        victim = (await retire(nc, "f")).instance_id
        assert not (await place(nc, "f")).ok
        kv = await nc.jetstream().key_value(subjects.PLACEMENT_BUCKET)
        await retired(nc, msgspec.json.decode((await kv.get(victim)).value, type=Placement))
        for _ in range(1500):  # up to 30 s on a loaded host; leaves as soon as it holds
            if victim not in svc2.placements:
                break
            await asyncio.sleep(0.02)
        assert (await place(nc, "f")).ok
    await nc.close()


async def one_instance_on_each_of_two_gpus(nc, svc) -> list[Placement]:
    """Join node0, deploy ``f`` (request 0.5), place four (two GPUs of two), retire one on each
    GPU: the two placements left, each alone on its GPU, still starting (no InstanceReady yet)."""
    js = nc.jetstream()
    await join(nc, svc, "node0")
    await deploy(nc, svc, "f", request=0.5, limit=0.5)
    by_gpu = collections.defaultdict(list)
    for p in (await place(nc, "f", count=4)).placements:
        by_gpu[p.gpu].append(p)
    assert sorted(len(v) for v in by_gpu.values()) == [2, 2]
    for group in by_gpu.values():
        assert (await retire(nc, "f", group[0].instance_id)).ok
        await retired(nc, group[0])
    await wait_for(lambda: len(svc.placements) == 2, "the two retired placements deleted")

    async def two_rows():
        return len(await table(js)) == 2

    await wait_for(two_rows, "the table down to two rows")
    assert svc.cluster.active == 2
    return [group[1] for group in by_gpu.values()]


def spy_on_plans(svc) -> list[tuple[set[str], set[str]]]:
    """The ``leaving`` and ``starting`` sets each later defragmentation round hands the placement
    policy: a GPU holding only such instances takes no one."""
    seen: list[tuple[set[str], set[str]]] = []
    plan = svc.cluster.plan_defrag

    def spy(*args, leaving=(), starting=(), **kw):
        seen.append((set(leaving), set(starting)))
        return plan(*args, leaving=leaving, starting=starting, **kw)

    svc.cluster.plan_defrag = spy
    return seen


async def test_defragmentation_relaunches_then_drains_to_free_a_gpu(nats_url):
    """Make before break: the replacement is placed with ``replaces`` while the old instance
    still serves; only the replacement's InstanceReady drains the old one. Instances that are not
    ready yet are not moved."""
    nc = await nats.connect(nats_url)
    svc = scheduler()
    async with running(svc, nats_url):
        kept = await one_instance_on_each_of_two_gpus(nc, svc)
        js = nc.jetstream()
        assert svc.cluster.active == 2
        assert await svc.defragment() == 0, "instances still starting are not moved"
        for p in kept:
            await ready(nc, p)
        await wait_for(lambda: all(p.instance_id in svc.warm for p in kept), "scheduler saw both ready")
        assert await svc.defragment() == 1
        rows = await table(js)
        assert len(rows) == 3 and not any(p.draining for p in rows.values()), "the old one serves on"
        (new,) = [p for p in rows.values() if p.replaces]
        assert new.replaces in {p.instance_id for p in kept}
        assert len({(p.node, p.gpu) for p in rows.values()}) == 1 + 1
        plans = spy_on_plans(svc)
        assert await svc.defragment() == 0, "an instance being replaced is not moved again"
        assert plans[-1] == ({new.replaces}, {new.instance_id}), "the old one leaves, its replacement starts"
        await ready(nc, new)
        for _ in range(1500):
            rows = await table(js)
            if rows[new.replaces].draining:
                break
            await asyncio.sleep(0.02)
        assert rows[new.replaces].draining and not rows[new.instance_id].draining
        await svc.defragment()
        assert plans[-1] == ({new.replaces}, set()), "a draining instance is leaving until it is retired"
        live = [p for p in rows.values() if not p.draining]
        assert len({(p.node, p.gpu) for p in live}) == 1, "both live instances now share one GPU"
        await retired(nc, rows[new.replaces])
        for _ in range(1500):  # up to 30 s on a loaded host; leaves as soon as it holds
            if svc.cluster.active == 1:
                break
            await asyncio.sleep(0.02)
        assert svc.cluster.active == 1 and svc.cluster.violations() == []
        assert await svc.defragment() == 0, "nothing left to gain"
    await nc.close()


async def test_a_migration_interrupted_by_a_restart_still_drains_the_old_instance(nats_url):
    """The replacement's InstanceReady may come while the scheduler is down: the restarted
    scheduler drains the old instance anyway, so it is not left placed for good (the horizontal
    scaler counts it as draining once the replacement is ready and would never retire it)."""
    nc = await nats.connect(nats_url)
    svc = scheduler()
    async with running(svc, nats_url):
        kept = await one_instance_on_each_of_two_gpus(nc, svc)
        js = nc.jetstream()
        for p in kept:
            await ready(nc, p)
        await wait_for(lambda: {p.instance_id for p in kept} <= svc.warm, "scheduler saw both ready")
        assert await svc.defragment() == 1
    (new,) = [p for p in (await table(js)).values() if p.replaces]
    svc2 = scheduler()
    async with running(svc2, nats_url):
        rows = await table(js)
        assert rows[new.replaces].draining and not rows[new.instance_id].draining
    await nc.close()


async def test_a_retirement_to_make_room_picks_a_victim_that_does_or_none(nats_url):
    """RetireRequest.room_for: the victim must free room for that function's first instance;
    a retirement that would free nothing it can use is refused, not done."""
    nc = await nats.connect(nats_url)
    svc = scheduler()
    async with running(svc, nats_url):
        await join(nc, svc, "node0", gpus=1)
        await deploy(nc, svc, "big", request=0.6, limit=0.6)
        await deploy(nc, svc, "small", request=0.2, limit=0.2)
        await deploy(nc, svc, "new", request=0.5, limit=0.5)
        assert (await place(nc, "big")).ok and (await place(nc, "small")).ok
        assert not (await place(nc, "new")).ok
        msg = await nc.request(subjects.SCHEDULER_RETIRE, encode(RetireRequest(function="small", room_for="new")), timeout=10)
        r = decode(msg.data, RetireReply)
        assert not r.ok and "frees room" in r.error
        assert all(not p.draining for p in (await table(nc.jetstream())).values())  # nothing was drained
        msg = await nc.request(subjects.SCHEDULER_RETIRE, encode(RetireRequest(function="big", room_for="new")), timeout=10)
        assert decode(msg.data, RetireReply).ok
    await nc.close()
