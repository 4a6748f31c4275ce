"""Following a JetStream KV bucket through NATS server restarts.

nats-py's ``KeyValue.watchall()`` rides on an ordered push consumer. When the server restarts,
that consumer is gone; nats-py finds out only after it has missed idle heartbeats (about 15 to
20 s in a chaos run), and every change put meanwhile reaches the watcher that late. For the
scheduler that was long enough for each live node to miss its 15 s TTL and leave; for a node
agent, placements written in that window started late.

:class:`KvFollower` watches again as soon as the connection's reconnect count changes (polled
every :data:`RECONNECT_POLL_S`), and whenever the watch fails or ends. A new watch delivers each
key's latest entry first (puts, and the markers of deletes and purges), so a follower misses no
key's present state; an entry may be delivered again, and handlers skip what they have seen (by
revision, or because applying it twice changes nothing).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

RECONNECT_POLL_S = 0.5  # how soon after a reconnect the bucket is watched again (s)
RETRY_S = 1.0  # wait after a failed watch before the next (s)
STOP_GRACE_S = 30.0  # the most a stop waits for the entry in hand (s): longer than a JetStream request

Entry = KeyValue.Entry
OnEntry = Callable[[Entry], Awaitable[None]]


class KvFollower:
    """Hand every entry of one KV bucket to ``on_entry``, from its present state on, for as long
    as it runs.

    ``nc`` is the connection whose ``stats["reconnects"]`` is watched and ``kv`` the bucket bound
    on it; ``on_entry`` is awaited for each entry in order (a put, a ``DEL`` or a ``PURGE``; never
    the watcher's end-of-initial-values ``None``). An exception from ``on_entry`` is logged with
    the entry's key and the next entry follows. ``what`` names the bucket in logs; ``log`` is a
    structlog logger. Used by the scheduler (``dilu-nodes``), the node agent (the placement
    table) and the client's caches (function specs and states).
    """

    def __init__(self, nc: NATS, kv: KeyValue, on_entry: OnEntry, *, log: Any,
                 what: str, reconnect_poll_s: float = RECONNECT_POLL_S, retry_s: float = RETRY_S) -> None:
        self.nc, self.kv, self.on_entry, self.log, self.what = nc, kv, on_entry, log, what
        self.reconnect_poll_s, self.retry_s = reconnect_poll_s, retry_s
        self.watches = 0  # watches begun, the first included
        self._watcher = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._in_hand = False  # an on_entry is running

    async def start(self) -> None:
        """Begin the first watch (its errors, e.g. no such bucket, are raised here), then follow."""
        self._stopping = False
        await self._watch()
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._on_reconnect())]

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop following: no entry is handed on after the one in hand, which may finish for up to
        ``grace_s`` seconds (a launch half done is worse than a late stop) and is then cancelled."""
        self._stopping = True
        if not self._tasks:
            return
        follow, monitor = self._tasks
        monitor.cancel()
        await self._unwatch()
        if self._in_hand:  # else it waits for an entry (or a watch): nothing to finish
            await asyncio.wait({follow}, timeout=grace_s)
        follow.cancel()
        await asyncio.gather(follow, monitor, return_exceptions=True)
        self._tasks = []
        await self._unwatch()

    @property
    def following(self) -> bool:
        return bool(self._tasks) and not self._tasks[0].done()

    async def _watch(self) -> None:
        self._watcher = await self.kv.watchall()
        self.watches += 1

    async def _unwatch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                await watcher.stop()
            except Exception:  # its subscription is gone already
                pass

    async def _follow(self) -> None:
        while not self._stopping:
            try:
                if self._watcher is None:
                    await self._watch()
                async for entry in self._watcher:
                    if self._stopping:  # entries queued before the stop are not handed on
                        break
                    if entry is not None:
                        await self._hand(entry)
                # ended: stopped by _on_reconnect (watch again at once) or by stop
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watch broke, or could not begin: try again shortly
                await self._unwatch()
                if self.nc.is_closed:  # closed for good (a command's client): nothing to watch again
                    return
                self.log.warning("watching a bucket failed; watching again", bucket=self.what,
                                 error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.retry_s)
            await self._unwatch()

    async def _hand(self, entry: Entry) -> None:
        self._in_hand = True
        try:
            await self.on_entry(entry)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.error("bucket entry failed", bucket=self.what, key=entry.key, error=repr(exc))
        finally:
            self._in_hand = False

    async def _on_reconnect(self) -> None:
        seen = self.nc.stats["reconnects"]
        while True:
            await asyncio.sleep(self.reconnect_poll_s)
            if self.nc.stats["reconnects"] != seen:
                seen = self.nc.stats["reconnects"]
                self.log.info("reconnected to NATS; watching the bucket again", bucket=self.what)
                await self._unwatch()  # ends _follow's iteration, which watches again
