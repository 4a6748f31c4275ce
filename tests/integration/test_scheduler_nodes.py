"""The scheduler's cluster is the node inventories in KV ``dilu-nodes`` (against a real
nats-server): nodes join by putting their inventory, a place request lands on a joined node's
GPU, a second node takes placements once the first is full, a node whose inventory goes stale (or
is deleted) has its instances placed again on the others, an unhealthy GPU takes nothing new,
placements on nodes that never show up are placed again, and a restart rebuilds it all.

The tests put the inventories themselves, as node agents would, and re-put them every
``HEARTBEAT_S`` from a background task (:class:`Agents`); the scheduler runs with a short TTL so a
stale node is noticed within seconds. Every wait polls for up to 30 s and leaves as soon as the
condition holds.
"""
from __future__ import annotations

import asyncio
import collections
import time

import msgspec
import nats
import pytest
from structlog.testing import capture_logs

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    GpuInfo,
    NodeInventory,
    Placement,
    PlacementDecided,
)
from dilu.services.common.nodes import NODES_KV_CONFIG, nodes_bucket
from dilu.services.common.runner import running
from dilu.services.scheduler.policy import Slot
from dilu.services.scheduler.service import NO_NODES, SchedulerService
from scheduler_helpers import GiB, deploy, inventory, place, table, wait_for

pytestmark = pytest.mark.nats

HEARTBEAT_S = 0.25
SHORT_TTL_S = 3.0  # the scheduler's liveness TTL in the stale-node tests (15 s in production)


class Agents:
    """Node agents as the scheduler sees them: each live inventory re-put into dilu-nodes every
    ``HEARTBEAT_S`` (with a fresh ``ts_ns``), until :meth:`silence` (stop heartbeating) or
    :meth:`delete` (remove the entry, as an agent that shuts down cleanly would)."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.live: dict[str, NodeInventory] = {}
        self.kv = None
        self.task: asyncio.Task | None = None
        self.beating = asyncio.Lock()  # held through a heartbeat round

    async def __aenter__(self) -> "Agents":
        self.kv = await nodes_bucket(self.nc.jetstream())
        self.task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def put(self, inv: NodeInventory, *, heartbeat: bool = True, ts_ns: int | None = None) -> None:
        if heartbeat:
            self.live[inv.node] = inv
        stamped = msgspec.structs.replace(inv, ts_ns=ts_ns if ts_ns is not None else time.time_ns())
        await self.kv.put(subjects.token(inv.node), encode(stamped))

    async def silence(self, node: str) -> None:
        """Stop heartbeating ``node``, after any round in flight (whose put would otherwise
        land after the silence and bring the node back)."""
        async with self.beating:
            self.live.pop(node, None)

    async def delete(self, node: str) -> None:
        self.live.pop(node, None)
        await self.kv.delete(subjects.token(node))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            async with self.beating:
                for inv in list(self.live.values()):
                    await self.put(inv)


async def join(agents: Agents, svc: SchedulerService, inv: NodeInventory) -> None:
    await agents.put(inv)
    await wait_for(lambda: inv.node in svc.cluster.node_index, f"node {inv.node} joined")


async def test_places_on_joined_nodes_and_a_second_node_takes_over_when_the_first_is_full(nats_url):
    nc = await nats.connect(nats_url)
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url), Agents(nc) as agents:
        await deploy(nc, svc, "f", request=0.5, limit=0.5)
        r = await place(nc, "f")
        assert not r.ok and r.error == NO_NODES
        # the bucket the scheduler made has the agents' configuration (creating it again is a no-op)
        await nc.jetstream().create_key_value(NODES_KV_CONFIG)
        await join(agents, svc, inventory("node-a", gpus=1, first_index=2))
        r = await place(nc, "f", count=2)
        assert r.ok and {(p.node, p.gpu) for p in r.placements} == {("node-a", 2)}, "the GPU index the agent named"
        full = await place(nc, "f")
        assert not full.ok and "no GPU" in full.error
        await join(agents, svc, inventory("gpu-node-7.dc1", gpus=1, memory=80 * GiB))
        r = await place(nc, "f", count=2)
        assert r.ok and {(p.node, p.gpu) for p in r.placements} == {("gpu-node-7.dc1", 0)}
        rows = await table(nc.jetstream())
        assert collections.Counter(p.node for p in rows.values()) == {"node-a": 2, "gpu-node-7.dc1": 2}
        assert svc.cluster.capacity(Slot("gpu-node-7.dc1", 0)).memory_bytes == 80 * GiB
    await nc.close()


async def test_an_unhealthy_gpu_gets_no_new_placement(nats_url):
    nc = await nats.connect(nats_url)
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url), Agents(nc) as agents:
        await deploy(nc, svc, "f", request=0.25, limit=0.25)
        sick = NodeInventory(node="n", agent_id="a", gpus=[
            GpuInfo(index=0, uuid="GPU-0", name="A100", memory_bytes=40 * GiB, sms=108, healthy=False,
                    health_reason="Xid 79: GPU has fallen off the bus"),
            GpuInfo(index=1, uuid="GPU-1", name="A100", memory_bytes=40 * GiB, sms=108)])
        await join(agents, svc, sick)
        r = await place(nc, "f", count=4)
        assert r.ok and {p.gpu for p in r.placements} == {1}
        assert not (await place(nc, "f")).ok, "GPU 0 is unhealthy, GPU 1 full"
        # GPU 0 recovers, GPU 1 fails: its residents stay (nothing is moved), new ones go to GPU 0
        swapped = msgspec.structs.replace(sick, gpus=[
            msgspec.structs.replace(sick.gpus[0], healthy=True, health_reason=""),
            msgspec.structs.replace(sick.gpus[1], healthy=False, health_reason="ECC uncorrectable")])
        await agents.put(swapped)
        await wait_for(lambda: not svc.cluster.capacity(Slot("n", 1)).healthy, "GPU 1 marked unhealthy")
        r = await place(nc, "f")
        assert r.ok and r.placements[0].gpu == 0
        rows = await table(nc.jetstream())
        assert collections.Counter(p.gpu for p in rows.values()) == {1: 4, 0: 1}
    await nc.close()


async def test_a_stale_node_has_its_instances_placed_again_on_the_others(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    migrations: list[Placement] = []

    async def on_decided(msg):
        ev = decode(msg.data, PlacementDecided)
        if ev.action == "migrate":
            migrations.append(ev.placement)

    await nc.subscribe(f"{subjects.PREFIX}.placement.decided.*", cb=on_decided)
    svc = SchedulerService(node_ttl_s=SHORT_TTL_S, sweep_interval_s=0.2)
    async with running(svc, nats_url), Agents(nc) as agents:
        await deploy(nc, svc, "f", request=0.5, limit=0.5)
        await join(agents, svc, inventory("node-a"))
        old = (await place(nc, "f", count=2)).placements
        assert {p.node for p in old} == {"node-a"}
        await join(agents, svc, inventory("gpu-node-7.dc1"))
        await agents.silence("node-a")  # its agent stops heartbeating; its KV entry stays (bucket TTL 60 s)

        async def moved():
            rows = await table(js)
            return rows if set(rows).isdisjoint(p.instance_id for p in old) and len(rows) == 2 else None

        rows = await wait_for(moved, "node-a's instances placed again")
        assert all(p.node == "gpu-node-7.dc1" and p.gpu == 0 and p.function == "f" for p in rows.values())
        assert all(p.request_quota == 0.5 and p.batch_size == old[0].batch_size and not p.draining for p in rows.values())
        assert svc.cluster.nodes == ["gpu-node-7.dc1"] and svc.cluster.violations() == []
        await wait_for(lambda: len(migrations) == 2, "two PlacementDecided migrate events")
        assert {p.instance_id for p in migrations} == set(rows)
        # it comes back: it joins again, empty
        await join(agents, svc, inventory("node-a"))
        assert (await place(nc, "f", count=2)).ok
    await nc.close()


async def test_a_deleted_inventory_is_a_leave_and_what_does_not_fit_is_dropped(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url), Agents(nc) as agents:
        await deploy(nc, svc, "f", request=0.5, limit=0.5)
        await join(agents, svc, inventory("node-a"))
        await join(agents, svc, inventory("node-b", memory=16 * GiB))
        await deploy(nc, svc, "big", request=0.5, limit=0.5, memory=30 * GiB)
        assert (await place(nc, "big")).placements[0].node == "node-a"
        assert (await place(nc, "f")).placements[0].node == "node-a"
        await agents.delete("node-a")  # a clean shutdown: no waiting for the TTL

        async def settled():
            rows = await table(js)
            return rows if all(p.node == "node-b" for p in rows.values()) else None

        rows = await wait_for(settled, "node-a's placements handled")
        # f fits on node-b's 16 GiB GPU; big (30 GiB) fits nowhere: dropped, left to the horizontal scaler
        assert [p.function for p in rows.values()] == ["f"]
        assert svc.cluster.nodes == ["node-b"]
        await agents.delete("node-b")
        await wait_for(lambda: not svc.cluster.nodes, "node-b left")
        r = await place(nc, "f")
        assert not r.ok and r.error == NO_NODES
    await nc.close()


async def test_restart_rebuilds_inventory_and_table_and_orphans_wait_then_move(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    async with Agents(nc) as agents:
        svc = SchedulerService(node_ttl_s=600)
        async with running(svc, nats_url):
            await deploy(nc, svc, "f", request=0.5, limit=0.5)
            await join(agents, svc, inventory("node-a", gpus=2))
            await join(agents, svc, inventory("gpu-node-7.dc1", gpus=2))
            first = (await place(nc, "f", count=5)).placements
        assert len(first) == 5
        # while it is down, the table gains placements on a node that never publishes an inventory,
        # on one that joins late, and on one whose inventory is older than the TTL at start
        kv = await js.key_value(subjects.PLACEMENT_BUCKET)
        strays = {name: msgspec.structs.replace(first[0], instance_id=f"f-{name}", node=name, gpu=0)
                  for name in ("ghost", "late", "stale")}
        for p in strays.values():
            await kv.create(p.instance_id, msgspec.json.encode(p))
        ttl_s = 4.0
        put_at = time.time()
        await agents.put(inventory("stale"), heartbeat=False)
        # its age counts from when the KV store took it, so let it age past the TTL
        await wait_for(lambda: time.time() - put_at > ttl_s + 0.5, "the stale inventory aged")

        svc2 = SchedulerService(node_ttl_s=ttl_s, sweep_interval_s=0.2)
        async with running(svc2, nats_url):
            assert {"node-a", "gpu-node-7.dc1"} <= set(svc2.cluster.nodes)
            # read back as last seen when the store took it (gone already, or about to be)
            assert "stale" not in svc2.roster or svc2.roster.last_seen["stale"] < svc2.clock() - ttl_s
            assert all(p.instance_id in svc2.cluster.instances for p in first), "the table, seated again"
            assert {"f-ghost", "f-late"} <= set(svc2.orphans), "kept, reserved nowhere, while their nodes may come"
            with capture_logs() as logs:
                await join(agents, svc2, inventory("late"))
                await asyncio.sleep(0.2)  # the watch would fail right after the join
            assert "f-late" not in svc2.orphans and svc2.cluster.residents(Slot("late", 0)) == ["f-late"]
            assert not [e for e in logs if e.get("event") in ("watching a bucket failed; watching again",
                                                              "bucket entry failed")], \
                "seating an orphan broke the watch"

            async def settled():
                rows = await table(js)
                return rows if not {"f-ghost", "f-stale"} & set(rows) and len(rows) == 8 else None

            rows = await wait_for(settled, "the ghost's and the stale node's placements placed again")
            assert {p.instance_id for p in first} | {"f-late"} <= set(rows)
            assert all(p.node not in ("ghost", "stale") and p.function == "f" for p in rows.values())
            assert "stale" not in svc2.cluster.nodes and not svc2.orphans
            assert svc2.cluster.violations() == []
    await nc.close()


async def test_malformed_inventories_are_rejected_and_counted(nats_url):
    from dilu.services.common.metrics import MALFORMED

    def rejected():
        return MALFORMED.labels("scheduler", f"kv:{subjects.NODES_BUCKET}")._value.get()

    nc = await nats.connect(nats_url)
    svc = SchedulerService(node_ttl_s=600)
    async with running(svc, nats_url), Agents(nc) as agents:
        before = rejected()
        dup = inventory("dup", gpus=2)
        dup.gpus[1].index = 0  # one GPU index twice
        negative = b'{"node": "neg", "gpus": [{"index": 0, "uuid": "u", "name": "x", "memory_bytes": -5, "sms": 1}]}'
        for key, bad in (("bad", b"{not json"), ("neg", negative), ("dup", encode(dup))):
            await agents.kv.put(key, bad)
        await wait_for(lambda: rejected() - before >= 3, "three malformed inventories counted")
        assert not svc.cluster.node_index  # none of them joined
        await join(agents, svc, inventory("fine"))  # and the scheduler carries on
    await nc.close()


async def test_a_nats_restart_does_not_make_live_nodes_leave():
    """The scheduler's watch of dilu-nodes dies with a restarting nats-server; nats-py's ordered
    consumer would notice only after missed idle heartbeats (about 15 s in a chaos run), longer
    than the TTL, and every node looked silent and left. The scheduler watches again as soon as
    it has reconnected, so a node whose agent kept beating never leaves."""
    from dilu.services.common.natsserver import EmbeddedNats
    from ports import ports_outside_ephemeral_range

    ttl_s = 6.0
    # a port no other test's server can draw while this one is down (free_port draws from the
    # ephemeral range): the scheduler must reconnect to this server, not to another test's
    with EmbeddedNats(port=ports_outside_ephemeral_range(1)[0]) as server:
        nc = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        svc = SchedulerService(node_ttl_s=ttl_s)
        kv = await nodes_bucket(nc.jetstream())
        inv = inventory("node-a", gpus=1)

        async def beat() -> None:  # an agent riding out the outage, as the node agent's heartbeat does
            while True:
                try:
                    await kv.put(subjects.token(inv.node), encode(msgspec.structs.replace(inv, ts_ns=time.time_ns())))
                except Exception:
                    pass
                await asyncio.sleep(HEARTBEAT_S)

        async with running(svc, server.url, ready_timeout_s=15):
            beating = asyncio.create_task(beat())
            try:
                await wait_for(lambda: "node-a" in svc.cluster.node_index, "node-a joined")
                server.kill()
                await asyncio.sleep(0.5)
                server.start()
                watched_until = asyncio.get_running_loop().time() + 1.5 * ttl_s
                while asyncio.get_running_loop().time() < watched_until:
                    assert "node-a" in svc.cluster.node_index, "a live node left over the NATS restart"
                    await asyncio.sleep(0.1)
            finally:
                beating.cancel()
                await asyncio.gather(beating, return_exceptions=True)
        await nc.close()
