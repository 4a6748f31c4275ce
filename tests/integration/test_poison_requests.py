"""A request that kills its instance (poison) against a real nats-server: it ends as an error
naming why after MAX_DELIVERIES deliveries, its batch-mates are answered ok, nothing times out.

Instances are subprocesses running a BatchPuller whose handler os._exit()s on the poison payload;
a crashed instance is replaced at once, as the node agent would."""
from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from dilu.contracts import subjects as subj
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.workqueue import (
    MAX_DELIVER_BACKSTOP,
    MAX_DELIVERIES,
    backlog,
    consumer_name,
    ensure_consumer,
    ensure_stream,
)

pytestmark = pytest.mark.nats

FN = "poisoned"
INSTANCE = textwrap.dedent('''
    import asyncio, os, sys
    import nats
    from dilu.services.common.workqueue import BatchPuller

    async def handle(batch):
        if any(r.payload == b"poison" for r in batch):
            os._exit(3)  # the model crashed the process, as a segfault would
        return [b"ok:" + r.payload for r in batch]

    async def main(url, iid):
        nc = await nats.connect(url)
        p = BatchPuller(nc, nc.jetstream(), "poisoned", instance_id=iid, max_batch=8, ready_ns=0,
                        fetch_timeout_s=0.1)
        print("READY", flush=True)
        await p.run(handle, asyncio.Event())

    asyncio.run(main(sys.argv[1], sys.argv[2]))
''')


async def launch(url: str, iid: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", INSTANCE, url, iid,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"READY\n"
    return proc


async def test_a_poison_request_fails_alone_after_the_bound(nats_url, nc):
    js = nc.jetstream()
    await ensure_stream(js)
    await ensure_consumer(js, FN, ack_wait_s=0.5)  # short: each crash costs one ack wait
    info = await js.consumer_info(subj.INVOKE_STREAM, consumer_name(FN))
    assert info.config.max_deliver == MAX_DELIVER_BACKSTOP > MAX_DELIVERIES
    client = InvokeClient(nc, js)
    await client.start()
    payloads = [b"g0", b"g1", b"poison", b"g2", b"g3"]
    now = time.time_ns()
    tasks = [asyncio.create_task(client.invoke(FN, p, request_id=p.decode(), scheduled_ns=now, timeout_s=30))
             for p in payloads]
    while await backlog(js, FN) < len(payloads):  # all queued: the first instance batches them
        await asyncio.sleep(0.02)

    crashes, procs = 0, []
    try:
        procs.append(await launch(nats_url, "i0"))
        while not all(t.done() for t in tasks):
            if procs[-1].returncode is not None:  # crashed: replace it, as the node agent does
                assert procs[-1].returncode == 3
                crashes += 1
                assert crashes < MAX_DELIVERIES + 2, "the poison request keeps killing instances"
                procs.append(await launch(nats_url, f"i{len(procs)}"))
            await asyncio.sleep(0.02)
        results = {r.request_id: r for r in await asyncio.gather(*tasks)}
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        await client.close()

    assert {i: r.status for i, r in results.items()} == {"g0": "ok", "g1": "ok", "poison": "error", "g2": "ok",
                                                        "g3": "ok"}
    assert all(results[f"g{k}"].payload == f"ok:g{k}".encode() for k in range(4))
    assert f"delivered {MAX_DELIVERIES} times" in results["poison"].error
    assert "instance ended before answering" in results["poison"].error
    assert crashes == MAX_DELIVERIES - 1  # a batch crash, then one running alone; never run again
    assert await backlog(js, FN) == 0  # terminated, not left for redelivery
