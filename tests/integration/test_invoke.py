"""The caller side of the data plane against a real nats-server: every call ends in exactly one
result (ok, error, timeout or dropped), duplicates and stragglers are counted, nothing is lost."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest

from dilu.contracts import subjects as subj
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.workqueue import BatchPuller, consumer_name, ensure_consumer, ensure_stream
from dilu.services.common.bus import settle

pytestmark = pytest.mark.nats

FN = "bert"


@pytest.fixture
async def js(nc):
    js = nc.jetstream()
    await ensure_stream(js)
    await ensure_consumer(js, FN, ack_wait_s=5)
    return js


def invoke(client: InvokeClient, rid: str, timeout_s: float = 10.0, fn: str = FN):
    return client.invoke(fn, b"in", request_id=rid, scheduled_ns=time.time_ns(), timeout_s=timeout_s)


def balanced(client: InvokeClient) -> bool:
    s = client.stats
    return s.sent == s.ok + s.error + s.timeout + s.dropped + client.outstanding


async def take_one(js) -> nats.aio.msg.Msg:
    """Act as a hand-written instance: pull one request off the function's queue."""
    psub = await js.pull_subscribe_bind(durable=consumer_name(FN), stream=subj.INVOKE_STREAM)
    [msg] = await psub.fetch(1, timeout=5)
    return msg


async def test_invoke_before_start_is_a_clear_error(nc, js):
    with pytest.raises(RuntimeError, match="start"):
        await invoke(InvokeClient(nc, js), "r1")


async def test_publish_without_a_stream_is_dropped_with_its_reason(nc):
    client = InvokeClient(nc, nc.jetstream(), publish_timeout_s=1)
    await client.start(ensure=False)  # no stream on this server: nothing stores the request
    result = await invoke(client, "r1")
    assert result.status == "dropped" and "publish failed" in result.error
    assert client.stats.dropped == 1 and balanced(client)
    await client.close()


async def test_a_lost_store_acknowledgement_is_retried_and_the_request_stored_once(nc, js):
    """The server stores the request but its acknowledgement is lost (as when nats-server dies
    right after storing): the client publishes again with the same Nats-Msg-Id, JetStream keeps
    one copy, and the call is not dropped."""
    client = InvokeClient(nc, js)
    await client.start()
    real_publish, attempts = js.publish, []

    async def lossy_publish(subject, payload, **kw):
        attempts.append(kw["headers"]["Nats-Msg-Id"])
        ack = await real_publish(subject, payload, **kw)
        if len(attempts) == 1:
            raise nats.errors.TimeoutError
        return ack

    js.publish = lossy_publish
    call = asyncio.create_task(invoke(client, "r1"))
    msg = await take_one(js)
    await nc.publish(msg.headers[subj.H_REPLY_TO], b"ok", headers={subj.H_REQUEST_ID: "r1", subj.H_STATUS: "ok"})
    await msg.ack()
    result = await call
    assert result.status == "ok" and len(attempts) == 2 and attempts[0] == attempts[1]
    info = await js.consumer_info(subj.INVOKE_STREAM, consumer_name(FN))
    assert info.num_pending == 0 and info.delivered.stream_seq == 1  # one copy stored, one delivered
    await client.close()


async def test_ok_reply_carries_payload_instance_and_the_platforms_times(nc, js):
    client = InvokeClient(nc, js)
    await client.start()
    stop = asyncio.Event()

    async def echo(batch):
        await asyncio.sleep(0.02)  # a service the times must bracket
        return [b"out:" + r.payload for r in batch]

    puller = BatchPuller(nc, js, FN, instance_id="inst-7", max_batch=4, ready_ns=0, fetch_timeout_s=0.2)
    run = asyncio.create_task(puller.run(echo, stop))
    before = time.time_ns()
    result = await invoke(client, "r1")
    stop.set()
    await run
    assert result.status == "ok" and result.payload == b"out:in" and result.instance == "inst-7"
    assert before <= result.enqueued_ns <= result.started_ns and not result.cold_start
    # the instance's own times: its batch began, then (after the 20 ms service) it replied
    assert result.started_ns + 20_000_000 <= result.replied_ns <= result.done_ns and result.batch == 1
    assert client.stats.ok == 1 and balanced(client)
    await client.close()


async def test_timeout_then_late_reply_is_counted_not_delivered(nc, js):
    client = InvokeClient(nc, js)
    await client.start()
    result = await invoke(client, "r1", timeout_s=0.3)  # no instance yet
    assert result.status == "timeout" and "0.3" in result.error
    msg = await take_one(js)  # an instance appears and answers anyway
    await nc.publish(msg.headers[subj.H_REPLY_TO], b"late", headers={subj.H_REQUEST_ID: "r1", subj.H_STATUS: "ok"})
    await msg.ack()
    await settle(nc)
    await asyncio.sleep(0.1)
    assert client.stats.late_replies == 1 and client.stats.timeout == 1 and client.stats.ok == 0
    assert balanced(client)
    await client.close()


async def test_duplicate_and_unknown_replies_are_ignored_and_counted(nc, js):
    client = InvokeClient(nc, js)
    await client.start()
    task = asyncio.create_task(invoke(client, "r1"))
    msg = await take_one(js)
    reply_to = msg.headers[subj.H_REPLY_TO]
    assert reply_to.startswith(client.inbox_prefix + ".")
    for body in (b"first", b"second"):  # e.g. an instance died between reply and ack
        await nc.publish(reply_to, body, headers={subj.H_REQUEST_ID: "r1", subj.H_STATUS: "ok"})
    await nc.publish(reply_to, b"?", headers={subj.H_REQUEST_ID: "never-sent", subj.H_STATUS: "ok"})
    await msg.ack()
    result = await task
    await settle(nc)
    await asyncio.sleep(0.1)
    assert result.payload == b"first"
    assert client.stats.ok == 1 and client.stats.duplicate_replies == 1 and client.stats.unknown_replies == 1
    await client.close()


async def test_error_reply_without_reason_still_reads_as_error(nc, js):
    client = InvokeClient(nc, js)
    await client.start()
    task = asyncio.create_task(invoke(client, "r1"))
    msg = await take_one(js)
    await nc.publish(msg.headers[subj.H_REPLY_TO], b"", headers={subj.H_REQUEST_ID: "r1", subj.H_STATUS: "boom"})
    await msg.ack()
    result = await task
    assert result.status == "error" and result.error and client.stats.error == 1
    await client.close()


async def test_repeated_request_id_in_flight_is_dropped(nc, js):
    client = InvokeClient(nc, js)
    await client.start()
    first = asyncio.create_task(invoke(client, "r1"))
    await asyncio.sleep(0.1)
    second = await invoke(client, "r1")
    assert second.status == "dropped" and "already in flight" in second.error
    assert client.outstanding == 1
    await client.close()
    assert (await first).status == "timeout"


async def test_close_counts_every_outstanding_request(nc, js):
    client = InvokeClient(nc, js)
    await client.start()
    tasks = [asyncio.create_task(invoke(client, f"r{i}", timeout_s=30)) for i in range(3)]

    async def all_stored():
        return (await js.consumer_info(subj.INVOKE_STREAM, consumer_name(FN))).num_pending == 3

    deadline = time.monotonic() + 5
    while not await all_stored() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert client.outstanding == 3
    assert await client.close() == 3
    results = await asyncio.gather(*tasks)
    assert [r.status for r in results] == ["timeout"] * 3
    assert all("closed" in r.error for r in results)
    assert client.stats.closed_outstanding == 3 and client.outstanding == 0 and balanced(client)


async def pending(js) -> int:
    return (await js.consumer_info(subj.INVOKE_STREAM, consumer_name(FN))).num_pending


async def test_a_cancelled_call_is_withdrawn_and_its_queued_request_never_runs(nc, js):
    """A caller cancels while its request waits behind another: the instance skips it unanswered."""
    client = InvokeClient(nc, js)
    await client.start()
    stop, release, ran = asyncio.Event(), asyncio.Event(), []

    async def slow(batch):
        ran.extend(r.request_id for r in batch)
        await release.wait()
        return [b"done"] * len(batch)

    puller = BatchPuller(nc, js, FN, instance_id="i1", max_batch=1, ready_ns=0, fetch_timeout_s=0.2)
    run = asyncio.create_task(puller.run(slow, stop))
    first = asyncio.create_task(invoke(client, "a"))
    while ran != ["a"]:
        await asyncio.sleep(0.01)
    second = asyncio.create_task(invoke(client, "b"))
    while await pending(js) != 1:  # stored, queued behind "a"
        await asyncio.sleep(0.01)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await settle(nc)
    release.set()
    assert (await first).status == "ok"
    while await pending(js) or puller.cancelled == 0:
        await asyncio.sleep(0.01)
    for junk in (b"", b"two words"):  # no reply subject: counted, withdraws nothing
        await nc.publish(subj.cancel(FN), junk)
    await settle(nc)
    stop.set()
    await run
    assert ran == ["a"] and puller.cancelled == 1 and puller.handled == 1 and puller.malformed == 2
    assert client.stats.withdrawn == 1 and client.stats.cancelled == 1 and client.stats.late_replies == 0
    await client.close()


async def test_a_withdrawal_of_a_running_request_stops_its_chunks_and_its_reply(nc, js):
    """The caller gives up (its timeout) while its request runs: no more chunks, no reply."""
    client = InvokeClient(nc, js)
    await client.start()
    stop, sent = asyncio.Event(), []
    puller = BatchPuller(nc, js, FN, instance_id="i1", max_batch=1, ready_ns=0, fetch_timeout_s=0.2, stream=True)

    async def stream(batch):
        (req,) = batch
        for i in range(40):  # 2 s of chunks; the caller waits 0.5 s
            await puller.send_chunk(req, b"t%d " % i)
            sent.append(puller.withdrawn(req))
            await asyncio.sleep(0.05)
        return [b"all"]

    run = asyncio.create_task(puller.run(stream, stop))
    result = await invoke(client, "r1", timeout_s=0.5)
    assert result.status == "timeout" and 0 < result.chunks < 40
    while len(sent) < 40:
        await asyncio.sleep(0.05)
    stop.set()
    await run
    assert sent[0] is False and sent[-1] is True  # heard while it ran
    assert puller.cancelled == 1 and puller.handled == 0
    await settle(nc)
    assert client.stats.late_replies == 0  # no reply after the caller gave up
    # only chunks already on their way when the puller heard of it (at most one past the last it
    # sent unaware) reach the caller after its timeout: none is sent after (on a loaded machine
    # the withdrawal takes longer to arrive, and one chunk more can be in flight)
    assert client.stats.ignored_chunks <= sent.count(False) + 1 - result.chunks
    await client.close()
