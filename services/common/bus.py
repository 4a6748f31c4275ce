"""The typed event bus over NATS: decode, dispatch, reject-and-count, publish.

A malformed message (bad JSON, wrong type, missing field) is logged with its reason and counted
in ``dilu_malformed_messages_total``; a handler that raises is logged and counted in
``dilu_handler_errors_total``. Neither ever stops the service. A message of a newer version holding
an enum member this one does not know loses only that item (docs/events.md): each skipped list
element, or the whole event when the member is its own field, is counted in
``dilu_skipped_items_total{reason}`` (``unknown-enum`` / ``unknown-enum-event``) and logged once per
kind (subject, field, value). Every event sent carries the CloudEvents attributes as NATS headers
(:mod:`dilu.contracts.cloudevents`). Request-reply handlers answer a
malformed request with ``{"ok": false, "error": "..."}`` so the caller learns why at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from dilu.contracts import cloudevents
from dilu.contracts.codec import REASON_UNKNOWN_ENUM, MalformedEvent, SkippedEvent, decode, decode_counted, encode
from dilu.contracts.events import Event

from . import logging as dlog
from .metrics import HANDLER_ERRORS, MALFORMED, MESSAGES, SKIPPED
from .natsconn import NatsOptions, connect

E = TypeVar("E", bound=Event)
Handler = Callable[[E, Msg], Awaitable[None]]
RequestHandler = Callable[[E, Msg], Awaitable[Event]]

REASON_UNKNOWN_ENUM_EVENT = REASON_UNKNOWN_ENUM + "-event"  # a whole event skipped (label value)
_SKIP_LOG_KINDS = 1024  # kinds of skip logged once each; past that, counted only


async def settle(nc: NATS, timeout_s: float = 5.0) -> None:
    """Return once the server has processed every command this client sent so far (e.g. a SUB).

    nats-py's ``flush()`` writes its PING straight to the socket, ahead of commands still queued
    for its flusher task (nats-py 2.16), so one flush can come back before a just-buffered SUB
    reaches the server. The first round trip lets the flusher write the queue; the second PING
    is then behind it on the wire. Raises ``nats.errors.FlushTimeoutError`` after ``timeout_s``.
    """
    await nc.flush(timeout=timeout_s)
    await nc.flush(timeout=timeout_s)


def quiet_error_cb(log, url: str, every_s: float = 30.0):
    """A nats-py ``error_cb`` that logs one JSON line per ``every_s`` seconds through ``log``
    instead of nats-py's printed traceback for every failed reconnect attempt."""
    last = [float("-inf")]

    async def on_error(exc: Exception) -> None:
        now = asyncio.get_running_loop().time()
        if now - last[0] >= every_s:
            last[0] = now
            log.warning("NATS connection error (retrying)", url=url, error=repr(exc))

    return on_error


class Bus:
    """One NATS connection with typed subscribe / publish / request helpers.

    ``service`` labels metrics and logs; ``node`` (optional) completes the CloudEvents source of
    what it publishes (``dilu/<service>/<node>``). Create with :meth:`connect`.
    """

    def __init__(self, nc: NATS, service: str, options: NatsOptions | None = None, node: str = "") -> None:
        self.nc = nc
        self.options = options or NatsOptions()  # how it connected; ``replicas`` for what it creates
        self.service = service
        self.source = cloudevents.source(service, node)  # ce-source of every event it sends
        self.js = nc.jetstream()
        self.log = dlog.get(service)
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task] = set()  # concurrent request handlers in flight
        self.malformed = 0
        self.handler_errors = 0
        self.skipped = 0  # list elements and whole events skipped for unknown enum members
        self._skip_logged: set[tuple[str, str, str]] = set()

    @classmethod
    async def connect(cls, nats: NatsOptions | str, service: str, *, node: str = "", **opts: Any) -> "Bus":
        """Connect to NATS with ``nats`` (options or a URL list; reconnecting forever on later loss,
        nats-py does the retries); ``node``: see the class. Raises CredentialsError for an unusable
        creds file."""
        options = NatsOptions.of(nats)
        opts.setdefault("error_cb", quiet_error_cb(dlog.get(service), options.url))
        nc = await connect(options, name=f"dilu-{service}", max_reconnect_attempts=-1, reconnect_time_wait=0.5, **opts)
        return cls(nc, service, options, node)

    @property
    def ready(self) -> bool:
        """True while connected and every subscription is live."""
        return self.nc.is_connected and all(not getattr(s, "_closed", False) for s in self._subs)

    # ---------------------------------------------------------------- receive

    def _reject(self, msg: Msg, pattern: str, reason: str, *, error: bool = False) -> None:
        """Log and count a rejected message. Metrics are labelled by the subscription
        ``pattern``, never the concrete subject: a sender must not create time series at will."""
        counter = HANDLER_ERRORS if error else MALFORMED
        counter.labels(self.service, pattern).inc()
        if error:
            self.handler_errors += 1
        else:
            self.malformed += 1
        self.log.warning("message rejected", subject=msg.subject, reason=reason, handler_error=error)

    def _skip(self, msg: Msg, pattern: str, reason: str, field: str, value: str) -> None:
        """Count one skipped item; log the first of each (subject pattern, field, value)."""
        SKIPPED.labels(self.service, pattern, reason).inc()
        self.skipped += 1
        kind = (pattern, field, value)
        if kind not in self._skip_logged and len(self._skip_logged) < _SKIP_LOG_KINDS:
            self._skip_logged.add(kind)
            self.log.warning("unknown enum member skipped (a newer version's message; logged once)",
                             subject=msg.subject, field=field, value=value, reason=reason)

    def _decode(self, msg: Msg, pattern: str, kind: type[E]) -> E:
        """Decode ``msg`` as ``kind``, counting skipped items. Raises MalformedEvent (already counted
        and logged: as skipped for a SkippedEvent, else as malformed)."""
        try:
            decoded = decode_counted(msg.data, kind)
        except SkippedEvent as exc:
            self._skip(msg, pattern, REASON_UNKNOWN_ENUM_EVENT, exc.path, exc.value)
            raise
        except MalformedEvent as exc:
            self._reject(msg, pattern, str(exc))
            raise
        for item in decoded.skipped:
            self._skip(msg, pattern, item.reason, item.field, item.value)
        return decoded.event

    async def subscribe(self, subject: str, kind: type[E], handler: Handler, queue: str = "") -> Any:
        """Subscribe ``handler(event, msg)`` to ``subject`` (wildcards allowed), decoding ``kind``."""

        async def cb(msg: Msg) -> None:
            try:
                event = self._decode(msg, subject, kind)
            except MalformedEvent:
                return
            try:
                await handler(event, msg)
                MESSAGES.labels(self.service, subject).inc()
            except Exception as exc:  # a bad message must never stop the service
                self._reject(msg, subject, f"{type(exc).__name__}: {exc}", error=True)

        return await self._subscribe(subject, queue, cb)

    async def serve(self, subject: str, kind: type[E], handler: RequestHandler, queue: str = "",
                    *, concurrent: bool = False) -> Any:
        """Serve request-reply on ``subject``: ``handler(request, msg)`` returns the reply event.

        Malformed requests and handler errors are answered ``{"ok": false, "error": ...}``.
        ``concurrent``: answer each request from its own task (for slow handlers, e.g. a profile
        search taking many trials), instead of one after another in arrival order.
        """

        async def cb(msg: Msg) -> None:
            if not concurrent:
                await answer(msg)
                return
            task = asyncio.create_task(answer(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        async def answer(msg: Msg) -> None:
            try:
                event = self._decode(msg, subject, kind)
            except MalformedEvent as exc:
                await self._answer_error(msg, str(exc))
                return
            try:
                reply = await handler(event, msg)
            except Exception as exc:
                self._reject(msg, subject, f"{type(exc).__name__}: {exc}", error=True)
                await self._answer_error(msg, f"{type(exc).__name__}: {exc}")
                return
            MESSAGES.labels(self.service, subject).inc()
            if msg.reply:
                data = encode(reply)
                await self.nc.publish(msg.reply, data, headers=cloudevents.headers(reply, self.source))

        return await self._subscribe(subject, queue, cb)

    async def _subscribe(self, subject: str, queue: str, cb: Callable[[Msg], Awaitable[None]]) -> Any:
        sub = await self.nc.subscribe(subject, queue=queue, cb=cb)
        # The server must have the SUB before we return (and before readiness says so), or a
        # message published right after by another connection is silently missed.
        await settle(self.nc)
        self._subs.append(sub)
        return sub

    async def _answer_error(self, msg: Msg, error: str) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, msgspec.json.encode({"ok": False, "error": error}))

    # ---------------------------------------------------------------- send

    async def publish(self, subject: str, event: Event) -> None:
        """Publish ``event`` (JSON, ``ts_ns`` stamped) with its CloudEvents headers."""
        data = encode(event)
        await self.nc.publish(subject, data, headers=cloudevents.headers(event, self.source))

    async def request(self, subject: str, event: Event, reply_kind: type[E], timeout: float = 5.0) -> E:
        """Request-reply (the request with its CloudEvents headers); raises
        ``nats.errors.TimeoutError`` or MalformedEvent for a bad reply."""
        data = encode(event)
        msg = await self.nc.request(subject, data, timeout=timeout, headers=cloudevents.headers(event, self.source))
        return decode(msg.data, reply_kind)

    async def close(self) -> None:
        """Drain: finish in-flight callbacks, flush pending publishes, then close. Concurrent
        request handlers still running are cancelled (their callers time out)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=10)
        except Exception:
            await self.nc.close()
