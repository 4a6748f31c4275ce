"""KvFollower against a real nats-server that restarts: a key put after the restart reaches the
follower within a few seconds (nats-py's own watch found out only after missed idle heartbeats,
15 to 20 s), a failing handler does not stop the entries after it, a stop lets the entry in
hand finish and hands on none after it, and a closed connection ends the follower."""
from __future__ import annotations

import asyncio
import time

import nats
import nats.errors
import pytest
from nats.js.api import KeyValueConfig
from structlog.testing import capture_logs

from dilu.services.common import logging as dlog
from dilu.services.common.kvwatch import KvFollower
from dilu.services.common.natsserver import EmbeddedNats
from ports import ports_outside_ephemeral_range

pytestmark = pytest.mark.nats

BUCKET = "kvwatch-test"
PROMPT_S = 8.0  # the rewatch takes about a reconnect and a poll (0.5 s); nats-py alone, over 15 s


async def _until(pred, what: str, timeout_s: float) -> float:
    """Seconds until ``pred()`` held; fails the test after ``timeout_s``."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_a_key_put_after_a_nats_restart_reaches_the_follower_promptly():
    # a port no other test's server can draw while this one is down (see tests/ports.py)
    with EmbeddedNats(port=ports_outside_ephemeral_range(1)[0]) as server:
        nc = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET))
        await kv.put("before", b"1")
        seen: list[tuple[str, str | None, bytes | None]] = []

        async def on_entry(entry) -> None:
            seen.append((entry.key, entry.operation, entry.value))

        follower = KvFollower(nc, kv, on_entry, log=dlog.get("test"), what=BUCKET)
        await follower.start()
        try:
            await _until(lambda: ("before", None, b"1") in seen, "the present state", 10)
            server.kill()
            await asyncio.sleep(0.5)
            server.start()
            await _until(lambda: nc.stats["reconnects"] >= 1 and nc.is_connected, "reconnected", 20)
            other = await nats.connect(server.url)
            okv = await other.jetstream().key_value(BUCKET)
            await okv.put("after", b"2")
            await okv.delete("before")
            took = await _until(lambda: ("after", None, b"2") in seen and ("before", "DEL", b"") in seen,
                                "the put and the delete after the restart", PROMPT_S)
            assert follower.watches >= 2 and follower.following, (took, follower.watches)
            await other.close()
        finally:
            await follower.stop()
        await nc.close()


async def test_a_failing_handler_is_logged_and_the_next_entry_follows(nats_url):
    nc = await nats.connect(nats_url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET))
    handled: list[str] = []

    async def on_entry(entry) -> None:
        if entry.key == "bad":
            raise ValueError("cannot apply")
        handled.append(entry.key)

    follower = KvFollower(nc, kv, on_entry, log=dlog.get("test"), what=BUCKET)
    with capture_logs() as logs:
        await follower.start()
        await kv.put("bad", b"x")
        await kv.put("good", b"y")
        await _until(lambda: "good" in handled, "the entry after the failing one", 10)
        await follower.stop()
    assert [(e["event"], e["key"]) for e in logs if e["log_level"] == "error"] == [("bucket entry failed", "bad")]
    assert follower.watches == 1  # a failing handler is not a broken watch
    await nc.close()


async def test_stop_lets_the_entry_in_hand_finish_and_hands_on_no_later_one(nats_url):
    nc = await nats.connect(nats_url)
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET))
    release, started = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def on_entry(entry) -> None:  # the first entry is slow, as a launch is
        if entry.key == "slow":
            started.set()
            await release.wait()
        finished.append(entry.key)

    follower = KvFollower(nc, kv, on_entry, log=dlog.get("test"), what=BUCKET)
    await follower.start()
    await kv.put("slow", b"1")
    await kv.put("later", b"2")
    await asyncio.wait_for(started.wait(), 10)
    stopping = asyncio.create_task(follower.stop())
    await asyncio.sleep(0.3)
    assert not stopping.done()  # waiting for the entry in hand
    release.set()
    await asyncio.wait_for(stopping, 10)
    assert finished == ["slow"] and not follower.following
    await kv.put("after-stop", b"3")
    await asyncio.sleep(0.3)
    assert finished == ["slow"]
    await nc.close()


async def test_a_closed_connection_ends_the_follower_without_retrying():
    """A command's client does not reconnect: once its connection is closed, a watch that ended
    is not tried again (and again, a warning a second)."""
    class Closed:  # the connection, closed after the first watch
        stats = {"reconnects": 0}
        is_closed = False

    class Watcher:  # ends at once, as a stopped watch does
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        async def stop(self):
            pass

    class Bucket:
        calls = 0

        async def watchall(self):
            Bucket.calls += 1
            if Closed.is_closed:
                raise nats.errors.ConnectionClosedError
            Closed.is_closed = True
            return Watcher()

    async def on_entry(entry) -> None:
        pass

    follower = KvFollower(Closed(), Bucket(), on_entry, log=dlog.get("test"), what=BUCKET, retry_s=0.01)
    with capture_logs() as logs:
        await follower.start()
        await _until(lambda: not follower.following, "the follower ended", 5)
    assert Bucket.calls == 2 and follower.watches == 1  # one more try, which found it closed
    assert not [e for e in logs if e["event"].startswith("watching a bucket failed")]
    await follower.stop()
