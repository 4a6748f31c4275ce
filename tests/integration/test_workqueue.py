"""The invocation work queue against a real nats-server: stream, consumers, backlog, batch puller.

Issue 6 cases 6, 7 and 8 (NATS layer), scaled down in time with their ratios kept.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time

import nats
import nats.js.errors
import pytest

from dilu.contracts import subjects as subj
from dilu.services.common.invoke import InvokeClient, InvokeResult
from dilu.services.common.workqueue import (
    BatchPuller,
    ConsumerMissing,
    Request,
    backlog,
    consumer_name,
    ensure_consumer,
    ensure_stream,
)

pytestmark = pytest.mark.nats

FN = "resnet.152"  # a dot on purpose: the subject token must sanitise it


@pytest.fixture
async def js(nc):
    js = nc.jetstream()
    await ensure_stream(js)
    return js


@pytest.fixture
async def client(nc, js):
    c = InvokeClient(nc, js)
    await c.start()
    yield c
    await c.close()


async def eventually(pred, timeout_s: float = 10.0, what: str = "condition"):
    """Poll an async predicate until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def submit(client: InvokeClient, n: int, *, fn: str = FN, timeout_s: float = 30.0, prefix: str = "r"):
    """Start ``n`` invocations as tasks; returns them (results come when they finish)."""
    now = time.time_ns()
    return [
        asyncio.create_task(
            client.invoke(fn, f"p{i}".encode(), request_id=f"{prefix}{i}", scheduled_ns=now, timeout_s=timeout_s)
        )
        for i in range(n)
    ]


async def queued(js, n: int, fn: str = FN):
    async def pred():
        return await backlog(js, fn) == n

    await eventually(pred, what=f"backlog == {n}")


async def consumer_settles(js, ack_pending: int, pending: int, fn: str = FN):
    """The server applies acks asynchronously (a flush returns before its JetStream consumer has
    processed them), so read the consumer until it shows the counts. The 2 s bound is well inside
    the 5 s ack wait: a request still held by a drained instance cannot settle by redelivery."""

    async def pred():
        info = await js.consumer_info(subj.INVOKE_STREAM, consumer_name(fn))
        return (info.num_ack_pending, info.num_pending) == (ack_pending, pending)

    await eventually(pred, timeout_s=2.0, what=f"ack pending {ack_pending}, pending {pending}")


class Handler:
    """A sequential test handler: ``seconds`` per request; counts runs per request id."""

    def __init__(self, seconds: float = 0.0, fail: set[str] = frozenset()) -> None:
        self.seconds = seconds
        self.fail = fail
        self.runs: collections.Counter[str] = collections.Counter()
        self.started = asyncio.Event()
        self.finished = asyncio.Event()

    async def __call__(self, batch: list[Request]) -> list[bytes | Exception]:
        self.started.set()
        out: list[bytes | Exception] = []
        for req in batch:
            self.runs[req.request_id] += 1
            await asyncio.sleep(self.seconds)
            out.append(ValueError(f"bad input {req.request_id}") if req.request_id in self.fail else b"done:" + req.payload)
        self.finished.set()
        return out


def puller(nc, js, instance: str, *, max_batch: int, ready_ns: int = 0, **kw) -> BatchPuller:
    return BatchPuller(nc, js, FN, instance_id=instance, max_batch=max_batch, ready_ns=ready_ns, fetch_timeout_s=0.2, **kw)


# ----------------------------------------------------------------------------- stream and consumer


async def test_stream_and_consumer_are_idempotent(js):
    await ensure_stream(js)  # a second time: no error, same stream
    info = await js.stream_info(subj.INVOKE_STREAM)
    assert info.config.retention == "workqueue"
    assert info.config.subjects == [subj.INVOKE_SUBJECTS]

    name = await ensure_consumer(js, FN, ack_wait_s=2)
    assert name == consumer_name(FN) == "fn-resnet_152"
    assert await ensure_consumer(js, FN, ack_wait_s=3) == name  # create-or-update
    cinfo = await js.consumer_info(subj.INVOKE_STREAM, name)
    assert cinfo.config.filter_subject == "dilu.v1.invoke.resnet_152"
    assert cinfo.config.ack_wait == pytest.approx(3)


async def test_stream_with_other_settings_is_bound_as_it_is_and_warned_about(nc):
    js = nc.jetstream()
    await js.add_stream(name=subj.INVOKE_STREAM, subjects=[subj.INVOKE_SUBJECTS], retention="workqueue", max_age=5)
    found = await ensure_stream(js, max_age_s=60)
    assert (await js.stream_info(subj.INVOKE_STREAM)).config.max_age == pytest.approx(5)  # never reset
    assert [(m.setting, m.wanted, m.found) for m in found if m.setting == "max_age_s"] == [("max_age_s", 60.0, 5.0)]
    await js.delete_stream(subj.INVOKE_STREAM)
    # in memory: re-creating a just-deleted file store can race the server's removal of its directory
    await js.add_stream(name=subj.INVOKE_STREAM, subjects=[subj.INVOKE_SUBJECTS], retention="limits",
                        storage="memory")
    found = await ensure_stream(js)  # no failed start: bound, and the other retention warned about
    assert ("retention", "workqueue", "limits") in [(m.setting, m.wanted, m.found) for m in found]
    assert (await js.stream_info(subj.INVOKE_STREAM)).config.retention == "limits"


async def test_backlog_of_missing_or_misnamed_consumer_raises(nc):
    js = nc.jetstream()
    with pytest.raises(ConsumerMissing, match="fn-f1"):
        await backlog(js, "f1")  # no stream at all
    await ensure_stream(js)
    await ensure_consumer(js, "f1")
    assert await backlog(js, "f1") == 0
    with pytest.raises(ConsumerMissing, match="fn-f2"):
        await backlog(js, "f2")  # stream there, consumer misnamed / never created


# ----------------------------------------------------------------------------- issue 6, case 6


async def test_backlog_counts_the_request_in_flight(nc, js, client):
    """Case 6 scaled 20x down: a 3 s request, ack wait 0.5 s (the handler outlives it 6x)."""
    await ensure_consumer(js, FN, ack_wait_s=0.5)
    handler = Handler(seconds=3.0)
    [task] = submit(client, 1)
    await queued(js, 1)
    stop = asyncio.Event()
    p = puller(nc, js, "i1", max_batch=4)
    run = asyncio.create_task(p.run(handler, stop))
    await handler.started.wait()
    readings = []
    while not handler.finished.is_set():  # the whole time the request is in the handler
        readings.append(await backlog(js, FN))
        await asyncio.sleep(0.1)
    result = await task
    stop.set()
    await run
    assert result.status == "ok", result
    assert len(readings) >= 10  # sampled across the whole request
    assert set(readings) == {1}, readings
    assert await backlog(js, FN) == 0
    assert handler.runs == {"r0": 1} and p.redelivered == 0


async def test_request_of_a_dead_instance_is_redelivered_to_the_next(nats_url, nc, js, client):
    """An instance takes a request and dies without acknowledging it: the backlog still reads 1
    (the scaler sees work with no instance left), and after the ack wait the next instance gets it."""
    await ensure_consumer(js, FN, ack_wait_s=0.5)
    [task] = submit(client, 1, timeout_s=20)
    await queued(js, 1)

    doomed = await nats.connect(nats_url)
    psub = await doomed.jetstream().pull_subscribe_bind(durable=consumer_name(FN), stream=subj.INVOKE_STREAM)
    [taken] = await psub.fetch(1, timeout=2)
    assert taken.headers[subj.H_REQUEST_ID] == "r0"
    await doomed.close()  # dies holding it, no ack

    assert await backlog(js, FN) == 1
    seen: list[Request] = []
    stop = asyncio.Event()
    p = puller(nc, js, "i2", max_batch=1, on_done=lambda req, done_ns: seen.append(req))
    run = asyncio.create_task(p.run(Handler(), stop))
    result = await task
    stop.set()
    await run
    assert result.status == "ok" and result.instance == "i2" and result.payload == b"done:p0"
    assert [r.delivered for r in seen] == [2] and p.redelivered == 1
    assert await backlog(js, FN) == 0


# ----------------------------------------------------------------------------- issue 6, case 7


@pytest.mark.parametrize("max_batch", [10, 1])
async def test_long_handler_causes_no_redelivery(nc, js, client, max_batch):
    """Case 7 scaled 5x down: ack wait 1 s, handler 0.8 s, 10 queued, 2 instances."""
    await ensure_consumer(js, FN, ack_wait_s=1.0)
    tasks = submit(client, 10)
    await queued(js, 10)
    handler = Handler(seconds=0.8)  # one handler shared by both instances counts every run
    stop = asyncio.Event()
    pullers = [puller(nc, js, f"i{k}", max_batch=max_batch) for k in range(2)]
    runs = [asyncio.create_task(p.run(handler, stop)) for p in pullers]
    results: list[InvokeResult] = await asyncio.gather(*tasks)
    await asyncio.sleep(1.2)  # longer than the ack wait: a redelivery would show up now
    stop.set()
    await asyncio.gather(*runs)

    assert sum(handler.runs.values()) == 10 and set(handler.runs.values()) == {1}
    assert sum(p.redelivered for p in pullers) == 0
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(10))
    assert all(r.status == "ok" for r in results)
    assert client.stats.ok == 10 and client.stats.duplicate_replies == 0
    assert await backlog(js, FN) == 0


async def test_caller_sees_one_result_even_when_a_redelivery_happens(nc, js, client):
    """Without in-progress acks the same handler is redelivered: two replies, one result."""
    await ensure_consumer(js, FN, ack_wait_s=0.3)
    [task] = submit(client, 1)
    await queued(js, 1)
    handler = Handler(seconds=0.8)
    stop = asyncio.Event()
    pullers = [puller(nc, js, f"i{k}", max_batch=1, progress_interval_s=3600) for k in range(2)]
    runs = [asyncio.create_task(p.run(handler, stop)) for p in pullers]
    result = await task

    async def second_reply():
        return client.stats.duplicate_replies >= 1

    await eventually(second_reply, what="the redelivered request's reply")
    stop.set()
    await asyncio.gather(*runs)
    assert result.status == "ok"
    assert handler.runs["r0"] >= 2 and sum(p.redelivered for p in pullers) >= 1
    assert client.stats.ok == 1  # one result for the request id, whatever the duplicates


# ----------------------------------------------------------------------------- issue 6, case 8


async def test_drain_finishes_the_batch_in_hand(nc, js, client):
    """Case 8: 10 queued on an instance being retired, 100 ms handler, drain."""
    await ensure_consumer(js, FN, ack_wait_s=5)
    tasks = submit(client, 10)
    await queued(js, 10)
    handler = Handler(seconds=0.1)
    stop = asyncio.Event()
    p = puller(nc, js, "i1", max_batch=10)
    run = asyncio.create_task(p.run(handler, stop))
    await handler.started.wait()
    stop.set()  # retire while the batch is in hand
    await run
    await consumer_settles(js, ack_pending=0, pending=0)
    results = await asyncio.gather(*tasks)
    assert p.handled == 10 and sum(handler.runs.values()) == 10
    assert [r.status for r in results] == ["ok"] * 10


async def test_drain_fetches_nothing_more_and_leaves_the_rest_to_others(nc, js, client):
    """Retired mid-queue: the instance finishes its batch of 4; the other 6 wait unclaimed
    (none held by the retired instance) and the next instance serves them."""
    await ensure_consumer(js, FN, ack_wait_s=5)
    tasks = submit(client, 10)
    await queued(js, 10)
    handler = Handler(seconds=0.1)
    stop = asyncio.Event()
    retiring = puller(nc, js, "old", max_batch=4)
    run = asyncio.create_task(retiring.run(handler, stop))
    await handler.started.wait()
    stop.set()
    await run
    assert retiring.handled == 4
    await consumer_settles(js, ack_pending=0, pending=6)

    stop2 = asyncio.Event()
    run2 = asyncio.create_task(puller(nc, js, "new", max_batch=4).run(handler, stop2))
    results = await asyncio.gather(*tasks)
    stop2.set()
    await run2
    assert collections.Counter(r.instance for r in results) == {"old": 4, "new": 6}
    assert set(handler.runs.values()) == {1} and len(handler.runs) == 10


async def test_drain_serves_what_reached_it_after_its_last_fetch_without_a_redelivery(nc, js, client):
    """Requests the server delivered after the instance's last fetch (a pull request answered as
    the fetch timed out) are the instance's already: JetStream counted the delivery. Handed back,
    each would come again as a redelivery (run alone, and given up unrun after a third such
    hand-back); the drain answers them instead."""
    await ensure_consumer(js, FN, ack_wait_s=5)
    tasks = submit(client, 10)
    await queued(js, 10)
    handler = Handler(seconds=0.3)
    stop = asyncio.Event()
    retiring = puller(nc, js, "old", max_batch=2)
    bound = retiring._bind
    subs = []

    async def bind():
        subs.append(await bound())
        return subs[-1]

    retiring._bind = bind
    run = asyncio.create_task(retiring.run(handler, stop))
    await handler.started.wait()
    # while the first batch runs: 3 more arrive on the instance's inbox outside any fetch
    psub = subs[0]
    await nc.publish(psub._nms, json.dumps({"batch": 3}).encode(), reply=psub._deliver)
    await eventually(lambda: _queued_locally(psub, 3), what="3 late deliveries")
    stop.set()
    await run
    assert retiring.handled == 5 and retiring.redelivered == 0
    await consumer_settles(js, ack_pending=0, pending=5)

    stop2 = asyncio.Event()
    successor = puller(nc, js, "new", max_batch=5)
    run2 = asyncio.create_task(successor.run(handler, stop2))
    results = await asyncio.gather(*tasks)
    stop2.set()
    await run2
    assert successor.redelivered == 0
    assert collections.Counter(r.instance for r in results) == {"old": 5, "new": 5}
    assert set(handler.runs.values()) == {1} and len(handler.runs) == 10


async def _queued_locally(psub, n: int) -> bool:
    return psub._sub._pending_queue.qsize() >= n


# ----------------------------------------------------------------------------- errors and flags


async def test_failed_handler_gets_an_error_reply_and_is_acked(nc, js, client):
    await ensure_consumer(js, FN)
    tasks = submit(client, 3)
    await queued(js, 3)
    stop = asyncio.Event()
    p = puller(nc, js, "i1", max_batch=3)
    run = asyncio.create_task(p.run(Handler(fail={"r1"}), stop))
    results = {r.request_id: r for r in await asyncio.gather(*tasks)}
    stop.set()
    await run
    assert results["r0"].status == results["r2"].status == "ok"
    assert results["r1"].status == "error" and "bad input r1" in results["r1"].error
    assert p.errors == 1 and p.handled == 3
    assert await backlog(js, FN) == 0


@pytest.mark.parametrize(
    "broken, reason",
    [("raises", "model crashed"), ("short", "1 results for 3"), ("hangs", "handler ran over 0.3 s")],
)
async def test_broken_batch_handler_answers_every_request(nc, js, client, broken, reason):
    async def handler(batch):
        if broken == "raises":
            raise RuntimeError("model crashed")
        if broken == "hangs":
            await asyncio.Event().wait()
        return [b"only one"]

    await ensure_consumer(js, FN)
    tasks = submit(client, 3)
    await queued(js, 3)
    stop = asyncio.Event()
    p = puller(nc, js, "i1", max_batch=3, handler_timeout_s=0.3)
    run = asyncio.create_task(p.run(handler, stop))
    results = await asyncio.gather(*tasks)
    stop.set()
    await run
    assert [r.status for r in results] == ["error"] * 3
    assert all(reason in r.error for r in results), [r.error for r in results]
    assert await backlog(js, FN) == 0


async def test_malformed_request_is_answered_terminated_and_counted(nc, js, client):
    await ensure_consumer(js, FN)
    replies: asyncio.Queue = asyncio.Queue()
    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=replies.put)
    subject = subj.invoke(FN)
    await js.publish(subject, b"x", headers={subj.H_REPLY_TO: inbox, subj.H_REQUEST_ID: "m1"})  # no time
    await js.publish(subject, b"x")  # no headers at all: nobody to answer
    await js.publish(
        subject, b"x", headers={subj.H_REPLY_TO: inbox, subj.H_REQUEST_ID: "m2", subj.H_SCHEDULED_NS: "soon"}
    )
    [valid] = submit(client, 1)
    await queued(js, 4)
    stop = asyncio.Event()
    p = puller(nc, js, "i1", max_batch=10)
    run = asyncio.create_task(p.run(Handler(), stop))
    result = await valid
    errors = [await asyncio.wait_for(replies.get(), 5) for _ in range(2)]
    stop.set()
    await run
    assert result.status == "ok"  # the service kept working
    assert p.malformed == 3 and p.handled == 1
    by_id = {m.headers[subj.H_REQUEST_ID]: m.headers for m in errors}
    assert by_id["m1"][subj.H_STATUS] == "error" and subj.H_SCHEDULED_NS in by_id["m1"][subj.H_ERROR]
    assert "not an integer" in by_id["m2"][subj.H_ERROR]
    assert await backlog(js, FN) == 0  # terminated, never redelivered


async def test_a_request_its_caller_gave_up_on_is_skipped_not_run(nc, js, client):
    """A request fetched after its caller's timeout (Dilu-Deadline-Ns) is acknowledged without
    running: the caller already reported a timeout and reads no reply. One still in time runs.
    A deadline that is not an integer is a malformed request."""
    await ensure_consumer(js, FN)
    [gone] = submit(client, 1, timeout_s=0.2, prefix="gone")
    assert (await gone).status == "timeout"  # no instance yet: the caller gives up
    [kept] = submit(client, 1, prefix="kept")
    inbox = nc.new_inbox()
    replies: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(inbox, cb=replies.put)
    await js.publish(subj.invoke(FN), b"x", headers={
        subj.H_REPLY_TO: inbox, subj.H_REQUEST_ID: "bad", subj.H_SCHEDULED_NS: str(time.time_ns()),
        subj.H_DEADLINE_NS: "later"})
    await queued(js, 3)
    stop, handler = asyncio.Event(), Handler()
    p = puller(nc, js, "i1", max_batch=10)
    run = asyncio.create_task(p.run(handler, stop))
    assert (await kept).status == "ok"
    bad = await asyncio.wait_for(replies.get(), 5)
    stop.set()
    await run
    assert handler.runs == {"kept0": 1} and (p.expired, p.handled, p.malformed) == (1, 1, 1)
    assert "Dilu-Deadline-Ns is not an integer" in bad.headers[subj.H_ERROR]
    await consumer_settles(js, ack_pending=0, pending=0)  # the expired one is acknowledged, not left


async def test_cold_start_flag_and_latency_hook(nc, js, client):
    await ensure_consumer(js, FN)
    [early] = submit(client, 1, prefix="early")
    await queued(js, 1)
    ready_ns = time.time_ns()
    done: list[tuple[Request, int]] = []
    stop = asyncio.Event()
    p = puller(nc, js, "i1", max_batch=2, ready_ns=ready_ns, on_done=lambda r, t: done.append((r, t)))
    run = asyncio.create_task(p.run(Handler(), stop))
    cold = await early
    [late] = submit(client, 1, prefix="late")
    warm = await late
    stop.set()
    await run
    assert cold.cold_start and cold.enqueued_ns < ready_ns
    assert not warm.cold_start and warm.enqueued_ns >= ready_ns
    assert [(r.request_id, r.status) for r, _ in done] == [("early0", "ok"), ("late0", "ok")]
    assert all(t >= r.enqueued_ns > 0 for r, t in done)
