"""The caller side of the data plane: publish an invocation, wait for its one reply.

A request is published with ``js.publish`` into the work-queue stream, so when :meth:`invoke`
moves on from publishing the request is stored and survives until an instance takes it, even
while no instance is warm. The reply comes to this client's own inbox (named in the
``Dilu-Reply-To`` header, since ``msg.reply`` of a JetStream message is its ack subject); one
wildcard subscription receives every reply and routes it by request id.

Every call ends in exactly one :class:`InvokeResult` whose status is ``ok``, ``error``,
``timeout`` or ``dropped`` (DESIGN.md section 8: offered = completed + dropped + failed + timed
out). A second reply for the same request id (after a redelivery) is ignored and counted.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from typing import Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dilu.contracts import subjects as subj

from . import logging as dlog
from .bus import settle
from .workqueue import ensure_stream

Status = Literal["ok", "error", "timeout", "dropped"]

# How many finished request ids are remembered to recognise a duplicate reply. A duplicate
# arrives at most one ack wait (seconds) after the original, so this covers any realistic rate.
_REMEMBER_DONE = 200_000


class InvokeResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one invocation.

    ``done_ns``: Unix epoch ns when the reply arrived (or when the call gave up); latency is
    ``done_ns - scheduled_ns``. ``cold_start``: the request was stored before the answering
    instance became ready. ``enqueued_ns``: when JetStream stored it (0 if unknown).
    ``payload``: the handler's reply bytes (``ok`` only).
    """

    request_id: str
    status: Status
    done_ns: int
    cold_start: bool = False
    instance: str = ""
    error: str = ""
    enqueued_ns: int = 0
    payload: bytes = b""


class InvokeStats(msgspec.Struct, kw_only=True):
    """Counters of an :class:`InvokeClient`; ``sent`` = ok + error + timeout + dropped + outstanding."""

    sent: int = 0
    ok: int = 0
    error: int = 0
    timeout: int = 0
    dropped: int = 0
    duplicate_replies: int = 0  # a second reply for a request already answered
    late_replies: int = 0  # a reply for a request that had already timed out
    unknown_replies: int = 0  # a reply naming no request of this client
    closed_outstanding: int = 0  # requests still waiting when the client closed (counted as timeout)


class InvokeClient:
    """Invokes functions over the JetStream work queue and collects their replies.

    ``inbox_prefix``: subject prefix of this client's replies (default: a fresh ``_INBOX``).
    Call :meth:`start` once before :meth:`invoke`, :meth:`close` at the end.
    ``publish_timeout_s`` bounds the wait for JetStream's store acknowledgement.
    """

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        *,
        inbox_prefix: str | None = None,
        publish_timeout_s: float = 5.0,
    ) -> None:
        self.nc, self.js = nc, js
        self.inbox_prefix = inbox_prefix or nc.new_inbox()
        self.publish_timeout_s = publish_timeout_s
        self.stats = InvokeStats()
        self.log = dlog.get("invoke")
        self._seq = itertools.count()
        self._waiting: dict[str, asyncio.Future[InvokeResult]] = {}
        self._done: OrderedDict[str, bool] = OrderedDict()  # id -> True answered / False timed out
        self._sub = None

    async def start(self, *, ensure: bool = True) -> None:
        """Subscribe to the reply inbox; with ``ensure``, create the invocation stream if absent."""
        if ensure:
            await ensure_stream(self.js)
        self._sub = await self.nc.subscribe(f"{self.inbox_prefix}.>", cb=self._on_reply)
        await settle(self.nc)

    async def invoke(
        self, function: str, payload: bytes, *, request_id: str, scheduled_ns: int, timeout_s: float
    ) -> InvokeResult:
        """Invoke ``function`` with ``payload`` and wait for its reply, at most ``timeout_s``
        seconds from this call (publishing included).

        ``request_id`` must be unique among this client's requests (a repeat of one still in
        flight is ``dropped``); ``scheduled_ns`` is the intended send time, Unix epoch ns.
        Never raises for a failed invocation: the result says what happened.
        """
        if self._sub is None:
            raise RuntimeError("InvokeClient.start() was not called")
        deadline = time.monotonic() + timeout_s
        self.stats.sent += 1
        if request_id in self._waiting:
            return self._finish_dropped(request_id, "request id already in flight")
        fut: asyncio.Future[InvokeResult] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        headers = {
            subj.H_REQUEST_ID: request_id,
            subj.H_SCHEDULED_NS: str(scheduled_ns),
            subj.H_REPLY_TO: f"{self.inbox_prefix}.{next(self._seq)}",
        }
        try:
            await self.js.publish(
                subj.invoke(function),
                payload,
                headers=headers,
                timeout=max(0.001, min(self.publish_timeout_s, deadline - time.monotonic())),
            )
        except Exception as exc:  # not stored: no instance will ever see it
            self._waiting.pop(request_id, None)
            self._remember(request_id, answered=False)  # it may have been stored after all
            return self._finish_dropped(request_id, f"publish failed: {type(exc).__name__}: {exc}")
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            if fut.done():  # the reply won the race against the timer
                return fut.result()
            self._waiting.pop(request_id, None)
            self._remember(request_id, answered=False)
            self.stats.timeout += 1
            return InvokeResult(
                request_id=request_id, status="timeout", done_ns=time.time_ns(), error=f"no reply within {timeout_s} s"
            )

    def _finish_dropped(self, request_id: str, reason: str) -> InvokeResult:
        self.stats.dropped += 1
        self.log.warning("invocation dropped", request_id=request_id, reason=reason)
        return InvokeResult(request_id=request_id, status="dropped", done_ns=time.time_ns(), error=reason)

    def _remember(self, request_id: str, *, answered: bool) -> None:
        self._done[request_id] = answered
        if len(self._done) > _REMEMBER_DONE:
            self._done.popitem(last=False)

    async def _on_reply(self, msg: Msg) -> None:
        done_ns = time.time_ns()
        headers = msg.headers or {}
        request_id = headers.get(subj.H_REQUEST_ID, "")
        fut = self._waiting.pop(request_id, None)
        if fut is None or fut.done():
            if request_id in self._done:
                if self._done[request_id]:
                    self.stats.duplicate_replies += 1
                else:
                    self.stats.late_replies += 1
            else:
                self.stats.unknown_replies += 1
                self.log.warning("reply for no known request", request_id=request_id, subject=msg.subject)
            return
        status = "ok" if headers.get(subj.H_STATUS) == "ok" else "error"
        try:
            enqueued_ns = int(headers.get(subj.H_ENQUEUED_NS, "0"))
        except ValueError:
            enqueued_ns = 0
        result = InvokeResult(
            request_id=request_id,
            status=status,
            done_ns=done_ns,
            cold_start=headers.get(subj.H_COLD_START) == "1",
            instance=headers.get(subj.H_INSTANCE, ""),
            error=headers.get(subj.H_ERROR, "" if status == "ok" else "error reply without a reason"),
            enqueued_ns=enqueued_ns,
            payload=msg.data if status == "ok" else b"",
        )
        self._remember(request_id, answered=True)
        setattr(self.stats, status, getattr(self.stats, status) + 1)
        fut.set_result(result)

    @property
    def outstanding(self) -> int:
        """Requests published and still waiting for their reply."""
        return len(self._waiting)

    async def close(self) -> int:
        """Stop receiving replies; every request still waiting ends as ``timeout`` (error
        "client closed before a reply") and is counted in ``stats.closed_outstanding``.

        Returns that count.
        """
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # connection already gone: nothing more can arrive anyway
                self.log.warning("unsubscribe failed", error=repr(exc))
        closed = 0
        for request_id, fut in list(self._waiting.items()):
            if fut.done():
                continue
            closed += 1
            self._remember(request_id, answered=False)
            fut.set_result(
                InvokeResult(
                    request_id=request_id, status="timeout", done_ns=time.time_ns(), error="client closed before a reply"
                )
            )
        self._waiting.clear()
        self.stats.closed_outstanding += closed
        self.stats.timeout += closed
        return closed
