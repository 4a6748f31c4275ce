"""Three nats-servers on loopback, the invocation stream on 3 replicas, callers and a puller under
load; the server leading DILU_INVOKE is SIGKILLed mid-run (issue 13 item 2). Every request offered
is answered exactly once (a duplicate reply after a redelivery is ignored by its caller and
counted) and nothing is lost: offered = answered + failed + timed out + dropped, with lost 0.
Figures (offered / answered / lost / recovery s) are printed as one JSON line (run with -s)."""
from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from dilu.contracts import subjects as subj
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsconn import NatsOptions
from dilu.services.common.runner import running
from dilu.services.common.workqueue import BatchPuller, consumer_name, ensure_consumer, ensure_stream
from dilu.services.scheduler.service import SchedulerService
from natscluster import NatsCluster

pytestmark = pytest.mark.nats

FN = "echo"
RATE_RPS = 40.0  # offered load, all callers together (a shared 2-core CI host runs this)
RUN_S = 9.0  # load duration; the leader is killed KILL_AT_S into it
KILL_AT_S = 3.0
CALL_TIMEOUT_S = 30.0  # generous: a call must outlive a leader election and a redelivery


async def connect(urls: list[str], name: str):
    """A connection knowing every server, reconnecting quickly and for ever."""
    return await nats.connect(servers=urls, name=name, reconnect_time_wait=0.2, max_reconnect_attempts=-1,
                              connect_timeout=2)


async def echo(requests):
    return [r.payload for r in requests]


async def test_killing_the_invoke_stream_leader_loses_nothing():
    with NatsCluster(3) as cluster:
        await cluster.wait_ready()
        admin = await connect(cluster.urls, "admin")
        js = admin.jetstream(timeout=10)
        assert await ensure_stream(js, replicas=3) == []  # created with 3 replicas: nothing differs
        await ensure_consumer(js, FN, ack_wait_s=3)  # short: a delivery lost in the failover comes back soon
        info = await js.stream_info(subj.INVOKE_STREAM)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
        cinfo = await js.consumer_info(subj.INVOKE_STREAM, consumer_name(FN))
        assert len(cinfo.cluster.replicas or []) == 2  # the consumer follows the stream's replicas
        # a service started with --replicas 3 creates its buckets on 3 servers
        async with running(SchedulerService(), NatsOptions(servers=tuple(cluster.urls), replicas=3)):
            pass
        for bucket in (subj.PLACEMENT_BUCKET, subj.PROFILES_BUCKET, subj.NODES_BUCKET):
            assert (await js.stream_info(f"KV_{bucket}")).config.num_replicas == 3, bucket

        stop = asyncio.Event()
        pullers, tasks, conns = [], [], [admin]
        for i in range(2):  # two instances, on whichever servers they land
            nc = await connect(cluster.urls, f"instance-{i}")
            conns.append(nc)
            puller = BatchPuller(nc, nc.jetstream(timeout=5), FN, instance_id=f"i{i}", max_batch=8,
                                 ready_ns=time.time_ns(), fetch_timeout_s=0.5)
            pullers.append(puller)
            tasks.append(asyncio.create_task(puller.run(echo, stop)))
        clients = []
        for i in range(2):
            nc = await connect(cluster.urls, f"caller-{i}")
            conns.append(nc)
            client = InvokeClient(nc, nc.jetstream(timeout=5), publish_timeout_s=20)
            await client.start(ensure=False)
            clients.append(client)

        sent_at: dict[str, float] = {}
        sent_ns: dict[str, int] = {}
        calls = []
        start = time.monotonic()
        killed_at, killed_ns, leader = None, 0, None
        n = 0
        while (now := time.monotonic()) - start < RUN_S:
            if killed_at is None and now - start >= KILL_AT_S:
                leader = (await js.stream_info(subj.INVOKE_STREAM)).cluster.leader
                cluster.kill(leader)
                killed_at, killed_ns = time.monotonic(), time.time_ns()
            rid = f"r{n}"
            sent_at[rid], sent_ns[rid] = time.monotonic(), time.time_ns()
            calls.append(asyncio.create_task(clients[n % 2].invoke(
                FN, rid.encode(), request_id=rid, scheduled_ns=time.time_ns(), timeout_s=CALL_TIMEOUT_S)))
            n += 1
            await asyncio.sleep(max(0.0, start + n / RATE_RPS - time.monotonic()))
        results = await asyncio.gather(*calls)

        answered = sum(r.status == "ok" for r in results)
        failed = sum(r.status == "error" for r in results)
        timed_out = sum(r.status == "timeout" for r in results)
        dropped = sum(r.status == "dropped" for r in results)
        offered = len(calls)
        lost = offered - answered - failed - timed_out - dropped
        # recovery: the first answer, after the kill, to a request sent after the kill
        after = [r for r in results if r.status == "ok" and sent_at[r.request_id] >= killed_at]
        first_ok_ns = min(r.done_ns for r in after)
        recovery_s = (first_ok_ns - killed_ns) / 1e9
        stats = [c.stats for c in clients]
        figures = {
            "offered": offered, "answered": answered, "failed": failed, "timed_out": timed_out,
            "dropped": dropped, "lost": lost, "killed": leader,
            "recovery_s": round(recovery_s, 3),
            "first_answer_after_kill_s": round((min(r.done_ns for r in results if r.done_ns >= killed_ns)
                                                - killed_ns) / 1e9, 3),
            "max_latency_s": round(max(r.done_ns - sent_ns[r.request_id] for r in results) / 1e9, 3),
            "new_leader": (await js.stream_info(subj.INVOKE_STREAM)).cluster.leader,
            "duplicate_replies": sum(s.duplicate_replies for s in stats),
            "redelivered": sum(p.redelivered for p in pullers),
            "handled": sum(p.handled for p in pullers),
        }
        print("\nfailover " + json.dumps(figures))

        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            await c.close()
        for nc in conns:
            await nc.close()

        assert len({r.request_id for r in results}) == offered  # one result per request
        assert lost == 0 and answered == offered, figures  # nothing lost, nothing failed
        assert all(r.payload == r.request_id.encode() for r in results)  # each its own answer
        assert figures["new_leader"] not in (None, leader)
