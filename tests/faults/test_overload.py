"""Overload: callers sending faster than the platform serves get timely answers or errors, never
a hang (issue 14, item 3).

A real nats-server, the real client library and the real HTTP gateway; the one instance of
``slow`` is a puller that serves one request at a time, 50 ms each (about 20 per second), and is
offered ten times that. Every call must end (ok, or the client's error) no later than its own
timeout plus :data:`MARGIN_S`, measured by the caller from its own start; the whole offered load
is wrapped in ``asyncio.wait_for`` so a hang fails the test instead of stalling it; the outcomes
add up to what was offered. ``idle`` is deployed with no instance at all; ``full`` has none and
the horizontal scaler says it cannot be placed. A caller that gives up (cancels) leaves nothing
behind in the client's bookkeeping.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import nats.errors
import pytest

from dilu.client.aio import AsyncClient
from dilu.client.sync import Client
from dilu.contracts import subjects as subj
from dilu.contracts.events import FunctionSpec
from dilu.services.common.invoke import InvokeClient, cancels_now
from dilu.services.common.runner import running
from dilu.services.common.workqueue import consumer_name, ensure_consumer
from dilu.services.gateway.app import Limits

from client_fakes import seed_functions
from dilu.services.gateway.service import CUT_GRACE_S, Gateway

# solo: each test makes its own tenfold overload of a 2-core host; another test's load beside it
# broke the gateway's drain timing (two connections closed unanswered)
pytestmark = [pytest.mark.nats, pytest.mark.solo]

SERVICE_S = 0.05  # the slow instance's time per request: it serves about 20 per second
OVERLOAD = 10  # offered rate = OVERLOAD x what the instance serves
MARGIN_S = 2.0  # how late past its own timeout a call may end (a fault test, not a speed test)
HANG_S = 30.0  # the whole offered load must be over by then, else it hung

SPECS = [FunctionSpec(name="slow", slo_ms=100.0), FunctionSpec(name="idle", slo_ms=100.0),
         FunctionSpec(name="full", slo_ms=100.0)]


class SlowInstance:
    """The one instance of ``slow``: takes one request at a time, answers ``ok`` (the payload)
    after :data:`SERVICE_S`, as the node agent would (headers of contracts/subjects.py)."""

    def __init__(self, nc) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.served = 0
        self._stopping = False
        self._task: asyncio.Task | None = None

    async def start(self) -> "SlowInstance":
        await ensure_consumer(self.js, "slow", ack_wait_s=30)
        psub = await self.js.pull_subscribe_bind(durable=consumer_name("slow"), stream=subj.INVOKE_STREAM)
        self._task = asyncio.create_task(self._loop(psub))
        return self

    async def _loop(self, psub) -> None:
        while not self._stopping:  # a cancel alone can be swallowed by nats-py's publish
            try:
                msgs = await psub.fetch(1, timeout=0.2)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                await asyncio.sleep(SERVICE_S)
                headers = {subj.H_REQUEST_ID: msg.headers[subj.H_REQUEST_ID], subj.H_STATUS: "ok",
                           subj.H_INSTANCE: "slow-1"}
                await self.nc.publish(msg.headers[subj.H_REPLY_TO], msg.data, headers=headers)
                await msg.ack()
                self.served += 1

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def platform(nats_url):
    """The stream, the three deployed functions and the one instance of ``slow``."""
    nc = await nats.connect(nats_url)
    js = await seed_functions(nc, SPECS)
    await ensure_consumer(js, "idle", ack_wait_s=30)  # deployed, but no instance ever pulls it
    inst = await SlowInstance(nc).start()
    yield inst
    await inst.stop()
    await nc.close()


async def offer(call, n: int, rate_per_s: float) -> list[tuple[str, float]]:
    """Start ``call()`` ``n`` times at ``rate_per_s``; each call's (outcome, seconds from its own
    start to its end). Outcome: "ok" (a Reply), the HTTP status ``call`` returned, or the
    exception's class name. Fails (AssertionError) if the calls are not all over within
    :data:`HANG_S`: a hang."""

    async def one() -> tuple[str, float]:
        start = time.monotonic()
        try:
            result = await call()
            outcome = result if isinstance(result, str) else "ok"  # a Reply, or an HTTP status
        except Exception as exc:
            outcome = type(exc).__name__
        return outcome, time.monotonic() - start

    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1 / rate_per_s)
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), HANG_S)
    except asyncio.TimeoutError:
        hung = sum(not t.done() for t in tasks)
        raise AssertionError(f"{hung} of {n} calls still running after {HANG_S} s: a hang") from None


def assert_timely(results: list[tuple[str, float]], timeout_s: float, allowed: set[str]) -> Counter:
    """Every call ended with an allowed outcome within its timeout plus the margin; the counts."""
    counts = Counter(outcome for outcome, _ in results)
    assert set(counts) <= allowed, counts
    late = [(o, round(took, 2)) for o, took in results if took > timeout_s + MARGIN_S]
    assert not late, f"{len(late)} calls ended past {timeout_s} + {MARGIN_S} s: {late[:5]}"
    assert sum(counts.values()) == len(results)
    return counts


async def test_client_overloaded_ten_times_answers_every_call_in_time(nats_url, platform):
    timeout_s, seconds = 1.0, 3.0
    rate = OVERLOAD / SERVICE_S
    n = int(rate * seconds)
    async with await AsyncClient.connect(nats_url) as client:
        results = await offer(lambda: client.invoke("slow", b"x", timeout_s=timeout_s), n, rate)
        counts = assert_timely(results, timeout_s, {"ok", "InvocationTimeout", "NoCapacity"})
        stats = client._invoker.stats
        assert counts["ok"] > 0 and counts["InvocationTimeout"] > 0, counts  # it served some, not all
        assert (stats.ok, stats.timeout, stats.dropped) == (counts["ok"], counts["InvocationTimeout"],
                                                            counts["NoCapacity"])
        assert stats.sent == n and client._invoker.outstanding == 0


async def test_gateway_overloaded_ten_times_answers_every_request_in_time(nats_url, platform):
    timeout_s, seconds = 1.0, 2.0
    rate = OVERLOAD / SERVICE_S
    n = int(rate * seconds)
    gw = Gateway(port=0, limits=Limits(default_timeout_s=10.0, max_timeout_s=60.0), drain_s=2.0)
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", limits=pool,
                                                        timeout=HANG_S) as http:
        async def call() -> str:
            resp = await http.post("/v1/functions/slow:invoke", content=b"x",
                                   headers={"Dilu-Timeout": str(timeout_s)})
            if resp.status_code != 200:
                assert resp.headers["content-type"] == "application/problem+json", resp.text
                body = resp.json()
                assert body["status"] == resp.status_code and body["function"] == "slow", body
                assert body["type"] in ("urn:dilu:problem:timeout", "urn:dilu:problem:no-capacity"), body
            return str(resp.status_code)

        results = await offer(call, n, rate)
        counts = assert_timely(results, timeout_s, {"200", "503", "504"})
        assert counts["200"] > 0 and counts["504"] > 0, counts
        assert gw.client._invoker.outstanding == 0

        # no instance at all: 504 in time; none and unplaceable: 503 at once, with Retry-After
        for fn, status in (("idle", "504"), ("full", "503")):
            async def nobody(fn=fn) -> str:
                resp = await http.post(f"/v1/functions/{fn}:invoke", content=b"x", headers={"Dilu-Timeout": "0.5"})
                assert resp.headers["content-type"] == "application/problem+json", resp.text
                assert status != "503" or resp.headers["retry-after"] == "1"
                return str(resp.status_code)
            assert assert_timely(await offer(nobody, 40, 80), 0.5, {status})[status] == 40
        assert gw.client._invoker.outstanding == 0


async def test_gateway_stopping_under_overload_answers_every_request_in_its_drain_time(nats_url, platform):
    """Requests with a long timeout pile up; the stop answers what is left 503 within the drain
    time (plus the gateway's grace), none waits for its own timeout."""
    drain_s, timeout_s = 0.5, 30.0
    rate = OVERLOAD / SERVICE_S
    gw = Gateway(port=0, limits=Limits(default_timeout_s=10.0, max_timeout_s=60.0), drain_s=drain_s)
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=pool, timeout=HANG_S) as http:
        async with running(gw, nats_url):
            url = f"http://127.0.0.1:{gw.port}/v1/functions/slow:invoke"

            async def call() -> tuple[int, float]:
                resp = await http.post(url, content=b"x", headers={"Dilu-Timeout": str(timeout_s)})
                if resp.status_code != 200:
                    assert resp.json()["type"] == "urn:dilu:problem:stopping", resp.text
                return resp.status_code, time.monotonic()

            calls = []
            for _ in range(int(rate)):  # one second of 10x overload
                calls.append(asyncio.create_task(call()))
                await asyncio.sleep(1 / rate)
            stopped = time.monotonic()
        ends = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG_S)
    errors = [e for e in ends if isinstance(e, BaseException)]
    assert not errors, errors[:3]
    codes = Counter(code for code, _ in ends)
    assert set(codes) <= {200, 503} and codes[503] > 0, codes
    latest = max(end for _, end in ends) - stopped
    assert latest <= drain_s + CUT_GRACE_S + MARGIN_S, f"the last request ended {latest:.1f} s after the stop"
    assert gw.client is None or gw.client._invoker.outstanding == 0


async def test_blocking_client_from_many_threads_answers_every_call_in_time(nats_url, platform):
    timeout_s, threads, seconds = 1.0, 40, 2.0  # 40 callers, each waiting ~2 s for 50 ms turns

    def worker(client: Client) -> list[tuple[str, float]]:
        out, until = [], time.monotonic() + seconds
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                client.invoke("slow", b"x", timeout_s=timeout_s)
                outcome = "ok"
            except Exception as exc:
                outcome = type(exc).__name__
            out.append((outcome, time.monotonic() - start))
        return out

    client = await asyncio.to_thread(Client, nats_url)
    loop = asyncio.get_running_loop()
    try:
        with ThreadPoolExecutor(threads) as pool:
            runs = [loop.run_in_executor(pool, worker, client) for _ in range(threads)]
            results = [r for run in await asyncio.wait_for(asyncio.gather(*runs), HANG_S) for r in run]
        counts = assert_timely(results, timeout_s, {"ok", "InvocationTimeout", "NoCapacity"})
        assert counts["ok"] > 0 and counts["InvocationTimeout"] > 0, counts
        stats = client.aio._invoker.stats
        assert stats.sent == len(results) and client.aio._invoker.outstanding == 0
    finally:
        await asyncio.to_thread(client.close)


async def test_no_instance_ends_as_timeout_or_no_capacity_in_time(nats_url, platform):
    timeout_s = 0.5
    async with await AsyncClient.connect(nats_url) as client:
        results = await offer(lambda: client.invoke("idle", b"x", timeout_s=timeout_s), 40, 80)
        assert assert_timely(results, timeout_s, {"InvocationTimeout"})["InvocationTimeout"] == 40
        results = await offer(lambda: client.invoke("full", b"x", timeout_s=timeout_s), 40, 80)
        assert assert_timely(results, timeout_s, {"NoCapacity"})["NoCapacity"] == 40
        assert client._invoker.outstanding == 0


async def test_callers_that_give_up_leave_no_bookkeeping_behind(nats_url, platform):
    """Cancelled at every stage (before the check, while publishing, while waiting for the reply),
    each call ends at once, not at its 60 s timeout, and nothing stays outstanding. Many calls at
    once fill nats-py's write buffer, where it swallows a cancellation: the client honours it."""
    timeout_s = 60.0

    async def cancelled(tasks, delay: float) -> list:
        await asyncio.sleep(delay)
        for task in tasks:
            task.cancel()
        _, hung = await asyncio.wait(tasks, timeout=MARGIN_S)
        assert not hung, f"{len(hung)} of {len(tasks)} cancelled calls still running (delay {delay} s)"
        return await asyncio.gather(*tasks, return_exceptions=True)

    async with await AsyncClient.connect(nats_url) as client:
        invoker = client._invoker
        for delay in (0.0, 0.001, 0.002, 0.005, 0.005, 0.01, 0.01, 0.02, 0.2):
            tasks = [asyncio.create_task(client.invoke(fn, b"x", timeout_s=timeout_s)) for fn in ("idle", "slow") * 40]
            done = await cancelled(tasks, delay)
            assert all(isinstance(d, asyncio.CancelledError) or getattr(d, "payload", None) == b"x" for d in done), done
            assert invoker.outstanding == 0, delay
        # streams closed early, before and after their request went out
        for delay in (0.0, 0.005, 0.2):
            streams = [client.stream("idle", b"x", timeout_s=timeout_s) for _ in range(40)]
            tasks = [asyncio.create_task(anext(aiter(s))) for s in streams]
            await asyncio.sleep(delay)
            for s in streams:
                await s.aclose()
            await cancelled(tasks, 0)
            assert invoker.outstanding == 0, delay
        stats = invoker.stats
        assert stats.sent == stats.ok + stats.error + stats.timeout + stats.dropped
        assert stats.cancelled > 0


class SwallowingJetStream:
    """Publishes as nats-py does when its write buffer is full and the caller is cancelled: the
    cancellation is swallowed and the publish goes on (nats.aio.client._flush_pending)."""

    def __init__(self, js) -> None:
        self.js = js
        self.entered = asyncio.Event()

    async def publish(self, *args, **kwargs):
        self.entered.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass
        return await self.js.publish(*args, **kwargs)


@pytest.mark.parametrize("where", ["publish", "before"])
async def test_a_cancel_swallowed_by_nats_ends_the_call_at_once(nats_url, platform, where):
    nc = await nats.connect(nats_url)
    js = SwallowingJetStream(nc.jetstream())
    invoker = InvokeClient(nc, js)
    await invoker.start(ensure=False)

    async def call():
        before = cancels_now()
        if where == "before":  # the caller's own nats-py work (a KV read) swallowed the cancel
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                pass
        return await invoker.invoke("idle", b"x", request_id="r1", scheduled_ns=time.time_ns(), timeout_s=60,
                                    cancels_before=before)

    task = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    task.cancel()
    _, hung = await asyncio.wait([task], timeout=MARGIN_S)
    assert not hung, "a cancelled call waited for its timeout"
    assert task.cancelled() and invoker.outstanding == 0
    assert invoker.stats.sent == invoker.stats.timeout == invoker.stats.cancelled == (where == "publish")
    await invoker.close()
    await nc.close()
