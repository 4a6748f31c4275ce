"""The caller side of the data plane: publish an invocation, wait for its one reply.

A request is published with ``js.publish`` into the work-queue stream, so when :meth:`invoke`
moves on from publishing the request is stored and survives until an instance takes it, even
while no instance is warm. The reply comes to this client's own inbox (named in the
``Dilu-Reply-To`` header, since ``msg.reply`` of a JetStream message is its ack subject); one
wildcard subscription receives every reply and routes it by request id.

Every call ends in exactly one :class:`InvokeResult` whose status is ``ok``, ``error``,
``timeout`` or ``dropped`` (DESIGN.md section 8: offered = completed + dropped + failed + timed
out). A second reply for the same request id (after a redelivery) is ignored and counted.

Streamed replies (``llm`` functions): before its final reply an instance may send chunk messages
(``Dilu-Status: chunk``, ``Dilu-Chunk`` = sequence number from 0). A chunk never ends the call;
the final reply does. Only the next expected sequence number is taken, so a redelivered request
that restreams from 0 adds nothing until it passes the chunks already received. Pass
``on_chunk`` to :meth:`InvokeClient.invoke` to receive each chunk as it arrives.

A call that ends without its reply (cancelled by its caller, timed out, or still waiting when
the client closes) is withdrawn: its reply subject goes to ``subjects.cancel(fn)``, so the
function's instances skip it if it is still queued and stop streaming to it if it runs.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import nats.errors
import tenacity
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dilu.contracts import subjects as subj

from . import jsresources
from . import logging as dlog
from .bus import settle
from .workqueue import ensure_stream

Status = Literal["ok", "error", "timeout", "dropped"]

# How many finished request ids are remembered to recognise a duplicate reply. A duplicate
# arrives at most one ack wait (seconds) after the original, so this covers any realistic rate.
_REMEMBER_DONE = 200_000

# One publish attempt's wait for JetStream's store acknowledgement (s). A lost acknowledgement (the
# server restarted, or JetStream is electing a leader) is retried with the same Nats-Msg-Id, so the
# stream stores the request once (JetStream deduplicates ids within its duplicate window, 2 min by
# default) until the call's publish budget is spent.
PUBLISH_ATTEMPT_S = 1.0
# The longest a caller may wait for one reply, s (an hour): the client library, the CLI and the
# gateway's cap all stop here, and a spec's objectives (slo_ms, ttft_ms, ...) may not exceed it.
MAX_TIMEOUT_S = 3600.0
_RETRY_PUBLISH = jsresources.TRANSIENT_ERRORS


def _retryable(exc: BaseException) -> bool:
    """A publish failure worth another attempt: no answer, no stream leader, JetStream not ready."""
    return isinstance(exc, _RETRY_PUBLISH)


class InvokeResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one invocation.

    ``done_ns``: Unix epoch ns when the reply arrived (or when the call gave up); latency is
    ``done_ns - scheduled_ns``. ``cold_start``: the request was stored before the answering
    instance became ready. ``enqueued_ns``: when JetStream stored it (0 if unknown).
    ``payload``: the handler's reply bytes (``ok`` only; for a streamed reply the whole output).
    ``chunks``: streamed chunks received in order (0 for a plain reply; for a ``timeout``, those
    that came before it); ``first_chunk_ns`` /
    ``last_chunk_ns``: Unix epoch ns at which the first / last of them arrived (0: none), so
    TTFT = ``first_chunk_ns - scheduled_ns`` and TPOT = ``(last - first) / (chunks - 1)``.
    ``started_ns`` / ``replied_ns``: Unix epoch ns at which the answering instance began the batch
    holding the request and published this reply, and ``batch`` how many requests that batch held
    (0 where the reply does not say: an older instance, or a request given up unrun).
    """

    request_id: str
    status: Status
    done_ns: int
    cold_start: bool = False
    instance: str = ""
    error: str = ""
    enqueued_ns: int = 0
    payload: bytes = b""
    chunks: int = 0
    first_chunk_ns: int = 0
    last_chunk_ns: int = 0
    started_ns: int = 0
    replied_ns: int = 0
    batch: int = 0


def _int_header(headers: dict, name: str) -> int:
    """A reply header holding a non-negative integer, 0 when absent or not one."""
    try:
        return max(0, int(headers.get(name, "0")))
    except ValueError:
        return 0


OnChunk = Callable[[bytes], None]


@dataclass(slots=True)
class _Pending:
    """A request waiting for its final reply, and the chunks taken so far."""

    fut: asyncio.Future
    on_chunk: OnChunk | None = None
    function: str = ""
    reply_to: str = ""
    chunks: int = 0  # also the next expected chunk sequence number
    first_chunk_ns: int = 0
    last_chunk_ns: int = 0


def cancels_now() -> int:
    """The running task's ``cancelling()`` count (0 outside a task)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def cancel_swallowed(since: int) -> bool:
    """Whether the running task was asked to cancel after its ``cancelling()`` count was
    ``since`` and is still running: the request was swallowed on the way. nats-py's publish
    drops a cancellation that lands while its write buffer is full (``_flush_pending``), so a
    caller that gave up would otherwise wait out its whole timeout."""
    return cancels_now() > since


def _retrieve(task: asyncio.Future) -> None:
    """Mark the outcome of a publish nobody awaits any more (its caller cancelled) as seen."""
    if not task.cancelled():
        task.exception()


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
    cancelled: int = 0  # calls cancelled by their caller before a reply (counted as timeout)
    withdrawn: int = 0  # calls ended without their reply whose instances were told (subjects.cancel)
    chunks: int = 0  # streamed chunks taken (in order, first time)
    ignored_chunks: int = 0  # chunks out of order, repeated by a restream, or for no waiting request


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
        self._waiting: dict[str, _Pending] = {}
        self._done: OrderedDict[str, bool] = OrderedDict()  # id -> True answered / False timed out
        self._withdrawing: set[asyncio.Future] = set()  # withdrawals not yet handed to the connection
        self._sub = None

    async def start(self, *, ensure: bool = True) -> None:
        """Subscribe to the reply inbox; with ``ensure``, create the invocation stream if absent."""
        if ensure:
            await ensure_stream(self.js)
        self._sub = await self.nc.subscribe(f"{self.inbox_prefix}.>", cb=self._on_reply)
        await settle(self.nc)

    async def invoke(
        self,
        function: str,
        payload: bytes,
        *,
        request_id: str,
        scheduled_ns: int,
        timeout_s: float,
        on_chunk: OnChunk | None = None,
        cancels_before: int | None = None,
    ) -> InvokeResult:
        """Invoke ``function`` with ``payload`` and wait for its reply, at most ``timeout_s``
        seconds from this call (publishing included).

        ``request_id`` must be unique among this client's requests (a repeat of one still in
        flight is ``dropped``); ``scheduled_ns`` is the intended send time, Unix epoch ns.
        ``on_chunk(data)`` is called in the event loop with each streamed chunk, in order, as it
        arrives (it must not block; an exception it raises is logged and the call goes on).
        Never raises for a failed invocation: the result says what happened. Cancelling the
        call forgets the request (a reply arriving later is counted as late), also when the
        cancellation was swallowed on the way (see :func:`cancel_swallowed`): ``cancels_before``
        is the calling task's ``cancelling()`` count when the caller's own work began (default:
        at this call), and a cancellation requested since is honoured (CancelledError).
        """
        if self._sub is None:
            raise RuntimeError("InvokeClient.start() was not called")
        deadline = time.monotonic() + timeout_s
        if cancels_before is None:
            cancels_before = cancels_now()
        elif cancel_swallowed(cancels_before):  # given up before this call: nothing is sent
            raise asyncio.CancelledError
        self.stats.sent += 1
        if request_id in self._waiting:
            return self._finish_dropped(request_id, "request id already in flight")
        fut: asyncio.Future[InvokeResult] = asyncio.get_running_loop().create_future()
        reply_to = f"{self.inbox_prefix}.{next(self._seq)}"
        self._waiting[request_id] = _Pending(fut, on_chunk, function, reply_to)
        headers = {
            subj.H_REQUEST_ID: request_id,
            subj.H_SCHEDULED_NS: str(scheduled_ns),
            subj.H_REPLY_TO: reply_to,
            subj.H_DEADLINE_NS: str(time.time_ns() + int(timeout_s * 1e9)),  # then nobody reads the reply
            # a retried publish is stored once; the reply subject is unique to this call, while a
            # request id is the caller's and two callers may use the same one
            "Nats-Msg-Id": reply_to,
        }
        budget_s = max(0.001, min(self.publish_timeout_s, deadline - time.monotonic()))
        publishing = asyncio.ensure_future(self._store(subj.invoke(function), payload, headers, budget_s))
        publishing.add_done_callback(_retrieve)
        try:
            # shielded: nats-py swallows a cancellation that lands while its write buffer is
            # full, so awaited directly a caller's cancel could be lost (the call would then
            # wait its whole timeout); cancelled here, the publish finishes on its own
            await asyncio.shield(publishing)
        except asyncio.CancelledError:
            self._forget_cancelled(request_id)
            raise
        except Exception as exc:  # not stored: no instance will ever see it
            pending = self._waiting.pop(request_id, None)
            self._remember(request_id, answered=False)  # it may have been stored after all
            if isinstance(exc, asyncio.TimeoutError) and time.monotonic() >= deadline:
                # the call's own time ran out while storing: that is the caller's timeout
                self.stats.timeout += 1
                if pending is not None:
                    self._withdraw(pending)
                return InvokeResult(request_id=request_id, status="timeout", done_ns=time.time_ns(),
                                    error=f"no reply within {timeout_s} s (the request was not stored yet)")
            return self._finish_dropped(request_id, f"publish failed: {type(exc).__name__}: {exc}")
        if cancel_swallowed(cancels_before):  # the caller gave up before the request went out
            self._forget_cancelled(request_id)
            raise asyncio.CancelledError
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:
            if not fut.done():
                self._forget_cancelled(request_id)
            raise
        except asyncio.TimeoutError:
            if fut.done():  # the reply won the race against the timer
                return fut.result()
            taken = self._waiting.pop(request_id, None) or _Pending(fut)
            self._remember(request_id, answered=False)
            self.stats.timeout += 1
            self._withdraw(taken)  # a stream still running stops (a queued request expires anyway)
            return InvokeResult(  # with the chunks taken so far: a stream cut short, not silence
                request_id=request_id, status="timeout", done_ns=time.time_ns(), error=f"no reply within {timeout_s} s",
                chunks=taken.chunks, first_chunk_ns=taken.first_chunk_ns, last_chunk_ns=taken.last_chunk_ns)

    async def _store(self, subject: str, payload: bytes, headers: dict, budget_s: float) -> None:
        """Publish into the stream until JetStream acknowledges storing it: attempts of at most
        PUBLISH_ATTEMPT_S, retried on a lost acknowledgement (the first retry at once, then
        exponential back-off from 50 ms to 0.5 s) within ``budget_s`` seconds. Raises the last
        attempt's error once the budget is spent, or at once for an error a retry cannot mend
        (e.g. a payload over the limit)."""
        end = time.monotonic() + budget_s

        async def publish_once() -> None:
            await self.js.publish(subject, payload, headers=headers,
                                  timeout=max(0.001, min(PUBLISH_ATTEMPT_S, end - time.monotonic())))

        try:  # the first attempt outside tenacity: its set-up costs ~20 µs a call on the hot path
            await publish_once()
            return
        except Exception as exc:  # noqa: BLE001 - sorted below: retried, or raised as it is
            if not _retryable(exc) or time.monotonic() >= end:
                raise
        retrying = tenacity.AsyncRetrying(  # the first retry goes at once: the lost ack took a whole attempt
            retry=tenacity.retry_if_exception(_retryable),
            stop=tenacity.stop_after_delay(max(0.0, end - time.monotonic())),
            wait=tenacity.wait_exponential(multiplier=0.05, max=0.5),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await publish_once()

    def _forget_cancelled(self, request_id: str) -> None:
        """The caller gave up (cancelled): stop waiting, so a late reply is counted, not routed,
        and tell the function's instances (:meth:`_withdraw`)."""
        if (pending := self._waiting.pop(request_id, None)) is not None:
            self._remember(request_id, answered=False)
            self.stats.cancelled += 1
            self.stats.timeout += 1
            self._withdraw(pending)

    def _withdraw(self, pending: _Pending) -> None:
        """Publish the call's reply subject to ``subjects.cancel(fn)`` without waiting (the
        caller may be cancelling): best effort, a lost message only leaves the request to its
        deadline. Nothing is sent for a call without a reply subject or once the connection
        is closed."""
        if not pending.reply_to or self.nc.is_closed:
            return
        self.stats.withdrawn += 1
        sending = asyncio.ensure_future(self.nc.publish(subj.cancel(pending.function), pending.reply_to.encode()))
        self._withdrawing.add(sending)
        sending.add_done_callback(self._withdrawing.discard)
        sending.add_done_callback(_retrieve)

    def _finish_dropped(self, request_id: str, reason: str) -> InvokeResult:
        self.stats.dropped += 1
        self.log.warning("invocation dropped", request_id=request_id, reason=reason)
        return InvokeResult(request_id=request_id, status="dropped", done_ns=time.time_ns(), error=reason)

    def _remember(self, request_id: str, *, answered: bool) -> None:
        self._done[request_id] = answered
        if len(self._done) > _REMEMBER_DONE:
            self._done.popitem(last=False)

    def _on_chunk(self, request_id: str, headers: dict, msg: Msg, now_ns: int) -> None:
        """Take a chunk if it is the next one its request expects; ignore it otherwise."""
        pending = self._waiting.get(request_id)
        try:
            seq = int(headers.get(subj.H_CHUNK, ""))
        except ValueError:
            seq = -1
        if pending is None or pending.fut.done() or seq != pending.chunks:
            self.stats.ignored_chunks += 1
            return
        pending.chunks += 1
        pending.first_chunk_ns = pending.first_chunk_ns or now_ns
        pending.last_chunk_ns = now_ns
        self.stats.chunks += 1
        if pending.on_chunk is not None:
            try:
                pending.on_chunk(msg.data)
            except Exception as exc:  # the caller's callback must not break the reply route
                self.log.warning("on_chunk callback failed", request_id=request_id, error=repr(exc))

    async def _on_reply(self, msg: Msg) -> None:
        done_ns = time.time_ns()
        headers = msg.headers or {}
        request_id = headers.get(subj.H_REQUEST_ID, "")
        if headers.get(subj.H_STATUS) == subj.STATUS_CHUNK:  # a chunk never ends the request
            self._on_chunk(request_id, headers, msg, done_ns)
            return
        pending = self._waiting.pop(request_id, None)
        fut = pending.fut if pending is not None else None
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
        result = InvokeResult(
            request_id=request_id,
            status=status,
            done_ns=done_ns,
            cold_start=headers.get(subj.H_COLD_START) == "1",
            instance=headers.get(subj.H_INSTANCE, ""),
            error=headers.get(subj.H_ERROR, "" if status == "ok" else "error reply without a reason"),
            enqueued_ns=_int_header(headers, subj.H_ENQUEUED_NS),
            payload=msg.data if status == "ok" else b"",
            chunks=pending.chunks,
            first_chunk_ns=pending.first_chunk_ns,
            last_chunk_ns=pending.last_chunk_ns,
            started_ns=_int_header(headers, subj.H_STARTED_NS),
            replied_ns=_int_header(headers, subj.H_REPLIED_NS),
            batch=_int_header(headers, subj.H_BATCH),
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
            except nats.errors.ConnectionClosedError:  # the connection is gone: nothing more can arrive
                pass
            except Exception as exc:
                self.log.warning("unsubscribe failed", error=repr(exc))
        closed = 0
        for request_id, pending in list(self._waiting.items()):
            fut = pending.fut
            if fut.done():
                continue
            closed += 1
            self._remember(request_id, answered=False)
            self._withdraw(pending)
            fut.set_result(
                InvokeResult(
                    request_id=request_id, status="timeout", done_ns=time.time_ns(), error="client closed before a reply"
                )
            )
        self._waiting.clear()
        self.stats.closed_outstanding += closed
        self.stats.timeout += closed
        if self._withdrawing and not self.nc.is_closed:  # the withdrawals leave before the connection does
            try:
                await asyncio.wait(set(self._withdrawing), timeout=1)
                await self.nc.flush(timeout=1)
            except Exception as exc:  # noqa: BLE001 - best effort: the deadlines still end them
                self.log.debug("withdrawals not flushed", error=repr(exc))
        return closed
