"""The typed event bus over NATS: decode, dispatch, reject-and-count, publish.

A malformed message (bad JSON, wrong type, missing field) is logged with its reason and counted
in ``dilu_malformed_messages_total``; a handler that raises is logged and counted in
``dilu_handler_errors_total``. Neither ever stops the service. Request-reply handlers answer a
malformed request with ``{"ok": false, "error": "..."}`` so the caller learns why at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from dilu.contracts import MalformedEvent, decode, encode
from dilu.contracts.events import Event

from . import logging as dlog
from .metrics import HANDLER_ERRORS, MALFORMED, MESSAGES
from .natsconn import NatsOptions, connect

E = TypeVar("E", bound=Event)
Handler = Callable[[E, Msg], Awaitable[None]]
RequestHandler = Callable[[E, Msg], Awaitable[Event]]


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

    ``service`` labels metrics and logs. Create with :meth:`connect`.
    """

    def __init__(self, nc: NATS, service: str, options: NatsOptions | None = None) -> None:
        self.nc = nc
        self.options = options or NatsOptions()  # how it connected; ``replicas`` for what it creates
        self.service = service
        self.js = nc.jetstream()
        self.log = dlog.get(service)
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task] = set()  # concurrent request handlers in flight
        self.malformed = 0
        self.handler_errors = 0

    @classmethod
    async def connect(cls, nats: NatsOptions | str, service: str, **opts: Any) -> "Bus":
        """Connect to NATS with ``nats`` (options or a URL list; reconnecting forever on later loss,
        nats-py does the retries). Raises CredentialsError for an unusable creds file."""
        options = NatsOptions.of(nats)
        opts.setdefault("error_cb", quiet_error_cb(dlog.get(service), options.url))
        nc = await connect(options, name=f"dilu-{service}", max_reconnect_attempts=-1, reconnect_time_wait=0.5, **opts)
        return cls(nc, service, options)

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

    async def subscribe(self, subject: str, kind: type[E], handler: Handler, queue: str = "") -> Any:
        """Subscribe ``handler(event, msg)`` to ``subject`` (wildcards allowed), decoding ``kind``."""

        async def cb(msg: Msg) -> None:
            try:
                event = decode(msg.data, kind)
            except MalformedEvent as exc:
                self._reject(msg, subject, str(exc))
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
                event = decode(msg.data, kind)
            except MalformedEvent as exc:
                self._reject(msg, subject, str(exc))
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
                await self.nc.publish(msg.reply, encode(reply))

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
        await self.nc.publish(subject, encode(event))

    async def request(self, subject: str, event: Event, reply_kind: type[E], timeout: float = 5.0) -> E:
        """Request-reply; raises ``nats.errors.TimeoutError`` or MalformedEvent for a bad reply."""
        msg = await self.nc.request(subject, encode(event), timeout=timeout)
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
