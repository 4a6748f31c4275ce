"""The invocation work queue (DESIGN.md section 4.1): stream, consumers, backlog, batch puller.

Requests for function ``f`` are published on ``dilu.v1.invoke.<token(f)>`` into the JetStream
work-queue stream :data:`~dilu.contracts.subjects.INVOKE_STREAM`. Each function has one durable
pull consumer ``fn-<token(f)>`` shared by all of its instances, so JetStream hands each request to
exactly one instance, instances take what they can (dynamic batching, back-pressure), and the
consumer's pending plus in-flight count is the queue-depth signal of the horizontal scaler.

Delivery is at least once: an instance replies first and acknowledges after, so a crash in
between causes a redelivery (and a duplicate reply that the caller ignores), never a lost request.

A request that kills its instance (a poison request) is bounded: a redelivered request runs alone,
never batched with others, so a crash is charged to it and not to batch-mates; one delivered
:data:`MAX_DELIVERIES` times is answered with an error and terminated without running. The
consumer's ``max_deliver`` (:data:`MAX_DELIVER_BACKSTOP`) stops the server from redelivering
forever should no instance get to do that.

A caller that gives up withdraws its request on ``subjects.cancel(fn)`` (the call's reply subject
as payload, :meth:`~dilu.services.common.invoke.InvokeClient.invoke`); a puller that hears it
skips the request if it has not run yet, sends it no more chunks, and acknowledges it unanswered.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from prometheus_client import Counter

from dilu.contracts import subjects as subj

from . import jsresources
from . import logging as dlog
from .bus import settle
from .jsresources import Mismatch

# Stream limits. A request older than this is useless (its caller gave up long before), and a
# full stream refuses new requests (DiscardPolicy.NEW) so callers see an explicit "dropped"
# instead of old requests vanishing silently.
STREAM_MAX_AGE_S = 600.0
STREAM_MAX_BYTES = 1 << 30

# A request delivered this many times is answered with an error and terminated without running:
# each earlier delivery ended with its instance gone before it answered (crashed, killed, hung
# past the ack wait). 3 = a batch crash (the request may be a bystander), then a crash running
# alone (it is the cause), then give up.
MAX_DELIVERIES = 3
# The consumer's max_deliver: the server stops redelivering even if no instance terminates it.
MAX_DELIVER_BACKSTOP = MAX_DELIVERIES + 2

_MAX_HEADER_CHARS = 512

# How long an idle puller's fetch waits for a request (s). A stop (drain, park) is seen when the
# fetch returns, so an idle instance told to stop still takes what arrives before its open fetch
# expires, serves it, then stops: a live drain ends a whole number of these after the puller
# went idle (the simulator models it so, loadgen.sim.run).
FETCH_TIMEOUT_S = 0.5

# Withdrawn requests a puller remembers (their reply subjects, the oldest forgotten first). A
# withdrawal matters until its request leaves the queue, which its deadline bounds; at the
# highest rates measured here (about 10k requests/s per function) this covers a second of them,
# and one forgotten only runs unread, as it would without withdrawals.
_REMEMBER_WITHDRAWN = 10_000

REQUESTS = Counter(
    "dilu_invoke_requests", "Invocation requests finished by instances", ["function", "status"]
)
REDELIVERIES = Counter(
    "dilu_invoke_redeliveries", "Invocation requests delivered more than once", ["function"]
)

log = dlog.get("workqueue")


class ConsumerMissing(LookupError):
    """The work-queue consumer (or the stream) of a function does not exist.

    The horizontal scaler treats this as "no signal" and holds the current scale: a missing or
    misnamed consumer must never read as an empty (scale to zero) or infinite (scale to max) queue.
    """


def consumer_name(function: str) -> str:
    """Durable consumer name of ``function``: ``fn-<token(function)>``."""
    return f"fn-{subj.token(function)}"


async def ensure_stream(
    js: JetStreamContext,
    *,
    storage: StorageType = StorageType.FILE,
    max_age_s: float = STREAM_MAX_AGE_S,
    max_bytes: int = STREAM_MAX_BYTES,
    replicas: int | None = None,
    log=None,
) -> list[Mismatch]:
    """Create the invocation stream if needed; idempotent and safe to call from many processes.

    Work-queue retention: a request is deleted once acknowledged, and each subject has at most
    one consumer. File storage (the default) because requests must survive a nats-server restart
    while no instance is warm; JetStream batches its writes, so it costs little next to a GPU
    batch. ``StorageType.MEMORY`` suits throw-away test servers. ``replicas``: JetStream replicas
    when the stream is created (``NatsOptions.replicas``; None: one, and an existing stream's count
    is not compared).

    An existing stream is used as it is, never updated nor reset: each setting that differs from
    these (limits, replicas, even another retention policy) is logged as a warning on ``log`` and
    returned (:class:`~.jsresources.Mismatch`). Raises ``nats.js.errors.APIError`` when JetStream
    refuses the creation (e.g. more replicas than servers).
    """
    config = StreamConfig(
        name=subj.INVOKE_STREAM,
        subjects=[subj.INVOKE_SUBJECTS],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage,
        discard=DiscardPolicy.NEW,
        max_age=max_age_s,
        max_bytes=max_bytes,
    )
    _info, found = await jsresources.ensure_stream(js, config, replicas=replicas, log=log)
    return found


# Seconds an instance may hold a request unacknowledged before JetStream redelivers it: also the
# longest a request held by a crashed instance waits before another instance gets it.
DEFAULT_ACK_WAIT_S = 30.0


async def ensure_consumer(
    js: JetStreamContext, function: str, *, ack_wait_s: float = DEFAULT_ACK_WAIT_S, max_ack_pending: int = 1000
) -> str:
    """Create (or update) the durable pull consumer of ``function``; returns its name.

    ``ack_wait_s``: seconds an instance may hold a request without acknowledging it (or sending
    an in-progress ack) before JetStream redelivers it. ``max_ack_pending``: requests in flight
    across all instances of the function. ``max_deliver`` is :data:`MAX_DELIVER_BACKSTOP`. Idempotent (create-or-update by name, nats-server >= 2.9);
    the stream must exist (:func:`ensure_stream`). The consumer has the stream's replicas (its
    ``num_replicas`` is left at 0, "as the stream": JetStream requires a work-queue stream's
    consumers to have the stream's count, so a stream created with 3 keeps its consumers on 3).
    """
    name = consumer_name(function)
    await js.add_consumer(
        subj.INVOKE_STREAM,
        ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=subj.invoke(function),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            max_deliver=MAX_DELIVER_BACKSTOP,
        ),
    )
    return name


async def backlog(js: JetStreamContext, function: str) -> int:
    """Requests of ``function`` waiting or in flight: ``num_pending + num_ack_pending``.

    In-flight requests count, so a long request keeps its instance from being retired, and a
    request held by a dead instance (unacknowledged until its ack wait expires) still reads as
    work to do. Raises :class:`ConsumerMissing` when the consumer or the stream does not exist.
    """
    name = consumer_name(function)
    try:
        info = await js.consumer_info(subj.INVOKE_STREAM, name)
    except nats.js.errors.NotFoundError as exc:
        raise ConsumerMissing(
            f"no consumer {name!r} on stream {subj.INVOKE_STREAM!r} for function {function!r}: {exc.description}"
        ) from None
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0)


async def answer_queued(nc: NATS, js: JetStreamContext, function: str, error: str, *, orphans: bool = False,
                        budget_s: float = 10.0, fetch_max: int = 256) -> int:
    """Answer requests of ``function`` nobody will serve with an error reply ``error``
    (``Dilu-Status: error``) and remove them, so that their callers learn now rather than at
    their timeouts; returns how many were answered. A request past its caller's deadline, or
    without a reply inbox, is removed unanswered. Stops when none is left or after ``budget_s``
    seconds.

    - By default, the requests waiting in the queue (not delivered to an instance), pulled through
      the function's durable consumer as an instance pulls (JetStream hands each request to one
      puller, so one an instance takes meanwhile is served, not answered here). Raises
      :class:`ConsumerMissing` when the function has no consumer.
    - ``orphans``: every request still stored for the function, those delivered to an instance
      that ended before acknowledging them too (e.g. killed at the end of a drain). Only once no
      instance is left and the function's consumer is deleted: it pulls through an ephemeral
      consumer of its own (a work-queue stream allows one per subject), deleted at the end.

    Raises a NATS error, e.g. a permissions violation for credentials without the right to pull."""
    if orphans:
        psub = await js.pull_subscribe(subj.invoke(function), stream=subj.INVOKE_STREAM)
    else:
        try:
            psub = await js.pull_subscribe_bind(durable=consumer_name(function), stream=subj.INVOKE_STREAM)
        except nats.js.errors.NotFoundError:
            raise ConsumerMissing(f"no consumer {consumer_name(function)!r} for function {function!r}") from None
    answered = 0
    stop = time.monotonic() + budget_s
    try:
        while time.monotonic() < stop:
            pending = int((await psub.consumer_info()).num_pending or 0)
            if not pending:
                break
            try:
                msgs = await psub.fetch(min(fetch_max, pending), timeout=min(1.0, max(0.05, stop - time.monotonic())))
            except asyncio.TimeoutError:  # taken by an instance meanwhile
                break
            for msg in msgs:
                try:
                    req: Request | None = parse_request(msg)
                except (MalformedRequest, ValueError, nats.errors.Error):  # no caller it could be answered to
                    req = None
                if req is not None and not req.expired(time.time_ns()):
                    await nc.publish(req.reply_to, b"", headers=error_headers(req.request_id, error))
                    answered += 1
                await (msg.ack() if orphans else msg.term())
    finally:
        await _close_puller(nc, js, psub, function, delete=orphans)
    return answered


async def _close_puller(nc: NATS, js: JetStreamContext, psub, function: str, *, delete: bool) -> None:
    """Unsubscribe ``psub`` (and ``delete`` its consumer: an ephemeral one would block the
    function's durable consumer on a redeploy until the server expires it)."""
    try:
        name = (await psub.consumer_info()).name if delete else ""
        await psub.unsubscribe()
        if name:
            await js.delete_consumer(subj.INVOKE_STREAM, name)
        await settle(nc)
    except Exception as exc:  # the answers went; the purge that follows removes what is left
        log.warning("could not close the puller", function=function, error=repr(exc))


@dataclass(slots=True)
class Request:
    """One invocation as an instance sees it.

    ``scheduled_ns``: the caller's intended send time, Unix epoch ns (latency counts from it).
    ``enqueued_ns``: when JetStream stored it, Unix epoch ns. ``delivered``: delivery count
    (> 1 means a redelivery). ``status`` ("ok" / "error") and ``error`` are filled in once the
    request is answered, before the ``on_done`` hook sees it. ``chunks``: streamed chunks sent
    to the caller so far (:meth:`BatchPuller.send_chunk`). ``started_ns``: when the batch holding
    it was handed to the handler, Unix epoch ns, and ``batch`` how many requests it held (0, 0
    until then); both go back in the reply. ``deadline_ns``: when its caller stops waiting, Unix
    epoch ns (``Dilu-Deadline-Ns``; 0: none).
    """

    request_id: str
    scheduled_ns: int
    enqueued_ns: int
    payload: bytes
    reply_to: str
    delivered: int = 1
    deadline_ns: int = 0
    status: str = ""
    error: str = ""
    chunks: int = 0
    started_ns: int = 0
    batch: int = 0

    def expired(self, now_ns: int) -> bool:
        """Whether its caller had stopped waiting (``deadline_ns`` passed) at ``now_ns``."""
        return 0 < self.deadline_ns < now_ns


class MalformedRequest(ValueError):
    """An invocation message without the headers the data plane needs."""


def _header_value(text: str) -> str:
    """A header value on one line (a newline would corrupt the NATS header block)."""
    return " ".join(str(text).split())[:_MAX_HEADER_CHARS]


def error_headers(request_id: str, error: str, instance: str = "") -> dict[str, str]:
    """The headers of an error reply to request ``request_id`` that ran no handler (malformed,
    or its function undeployed): ``Dilu-Status: error`` and ``error`` on one line."""
    headers = {subj.H_REQUEST_ID: request_id, subj.H_STATUS: "error", subj.H_ERROR: _header_value(error)}
    if instance:
        headers[subj.H_INSTANCE] = instance
    return headers


def enqueued_ns_of(msg: Msg) -> int:
    """The JetStream storage time of ``msg`` in Unix epoch ns, read exactly from its ack subject.

    (nats-py's ``metadata.timestamp`` is a datetime, which keeps only microseconds.)
    """
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:  # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[7])
    if len(tokens) >= 11:  # v2: $JS.ACK.<domain>.<account>.<stream>... with the same tail
        return int(tokens[Msg.Ack.Timestamp])
    return int(msg.metadata.timestamp.timestamp() * 1e9)  # raises NotJSMessageError


def parse_request(msg: Msg) -> Request:
    """Decode an invocation message; raises :class:`MalformedRequest` naming what is missing."""
    headers = msg.headers or {}
    missing = [h for h in (subj.H_REQUEST_ID, subj.H_REPLY_TO, subj.H_SCHEDULED_NS) if not headers.get(h)]
    if missing:
        raise MalformedRequest(f"missing header(s) {', '.join(missing)}")
    scheduled_ns = _integer(headers, subj.H_SCHEDULED_NS)
    return Request(
        request_id=headers[subj.H_REQUEST_ID],
        scheduled_ns=scheduled_ns,
        enqueued_ns=enqueued_ns_of(msg),
        payload=msg.data,
        reply_to=headers[subj.H_REPLY_TO],
        delivered=msg.metadata.num_delivered,
        deadline_ns=_integer(headers, subj.H_DEADLINE_NS) if headers.get(subj.H_DEADLINE_NS) else 0,
    )


def _integer(headers: dict, name: str) -> int:
    try:
        return int(headers[name])
    except ValueError:
        raise MalformedRequest(f"{name} is not an integer: {headers[name]!r}") from None


def _delivered(msg: Msg) -> int:
    """JetStream delivery count of ``msg`` (1 when it carries none)."""
    try:
        return int(msg.metadata.num_delivered)
    except Exception:
        return 1


def _late_deliveries(psub: JetStreamContext.PullSubscription) -> list[Msg]:
    """Requests delivered to ``psub`` after its last fetch returned (a pull request that the
    server answered as the fetch timed out): nats-py keeps them in the subscription's queue.
    They are ours already: JetStream counted the delivery, so handing them back would bring a
    fresh request nearer :data:`MAX_DELIVERIES` without it having run."""
    queue = getattr(getattr(psub, "_sub", None), "_pending_queue", None)
    late: list[Msg] = []
    while queue is not None and not queue.empty():
        msg = queue.get_nowait()
        if msg.reply and msg.reply.startswith("$JS.ACK."):
            late.append(msg)
    return late


Process = Callable[[list[Request]], Awaitable[list["bytes | Exception"]]]
OnDone = Callable[[Request, int], None]


class BatchPuller:
    """Pulls batches of one function's requests for one instance, runs them, replies, acks.

    - ``max_batch``: most requests per batch; a fetch takes what is queued up to it (dynamic
      batching), waiting at most ``fetch_timeout_s`` seconds for the first one.
    - ``ready_ns``: Unix epoch ns when this instance became ready; a request stored before it
      waited for this instance's launch and is flagged cold-start in its reply. Settable.
    - ``on_done(request, done_ns)``: called once per answered request (its ``status``/``error``
      set, ``done_ns`` Unix epoch ns), for latency bookkeeping. Must not block.
    - ``progress_interval_s``: period of in-progress acks while a batch runs; default a quarter
      of the consumer's ack wait, so a handler longer than the ack wait causes no redelivery.
    - ``handler_timeout_s``: if set, a batch whose ``process`` runs longer is answered with an
      error (a hung handler would otherwise hold its requests forever, kept alive by +WPI).
    - ``stream``: the function streams its replies (``llm``): while ``process`` runs it sends
      chunks with :meth:`send_chunk`, and every final reply carries ``Dilu-Chunk`` = the number of
      chunks sent before it (0 included). Without it, only a request that got chunks carries it.

    Poison requests: a puller starts fetching one request at a time and keeps doing so while
    what it fetches is redelivered; a redelivered request (delivery count > 1) is run alone, never
    batched with others, so an instance crash is charged to the request that caused it. A request
    whose delivery count reaches :data:`MAX_DELIVERIES` is answered with an error and terminated
    without running.

    Expired requests: one fetched after its caller's deadline (``Dilu-Deadline-Ns``: the caller
    has reported a timeout and reads no reply) is acknowledged without running or answering, so
    a backlog its callers gave up on costs the instance nothing.

    Withdrawn requests: while it runs the puller listens on ``subjects.cancel(function)``. A
    request its caller withdrew is acknowledged without running if it has not run yet; if it is
    running, it gets no more chunks and no reply, and :meth:`withdrawn` tells ``process`` (an llm
    batch whose requests are all withdrawn stops generating).

    Counters: ``batches``, ``handled`` (answered and acked), ``errors`` (answered with an
    error), ``malformed`` (rejected requests, and withdrawals naming no subject), ``redelivered`` (requests seen with delivery count > 1),
    ``poisoned`` (given up after :data:`MAX_DELIVERIES`, answered and terminated), ``expired``
    (skipped past their deadline), ``cancelled`` (withdrawn by their caller: skipped, or left
    unanswered).
    """

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        function: str,
        *,
        instance_id: str,
        max_batch: int,
        ready_ns: int,
        fetch_timeout_s: float = FETCH_TIMEOUT_S,
        on_done: OnDone | None = None,
        progress_interval_s: float | None = None,
        handler_timeout_s: float | None = None,
        stream: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.nc, self.js, self.function = nc, js, function
        self.instance_id = instance_id
        self.max_batch = max_batch
        self.ready_ns = ready_ns
        self.fetch_timeout_s = fetch_timeout_s
        self.on_done = on_done
        self.progress_interval_s = progress_interval_s
        self.handler_timeout_s = handler_timeout_s
        self.stream = stream
        self.log = log.bind(function=function, instance=instance_id)
        self.batches = self.handled = self.errors = self.malformed = self.redelivered = self.poisoned = 0
        self.expired = self.cancelled = 0
        self._withdrawn: OrderedDict[str, None] = OrderedDict()  # reply subjects, oldest first
        self._cancel_sub = None

    def withdrawn(self, req: Request) -> bool:
        """Whether ``req``'s caller has withdrawn it (``subjects.cancel``, heard while running)."""
        return req.reply_to in self._withdrawn

    async def _on_cancel(self, msg: Msg) -> None:
        reply_to = msg.data.decode(errors="replace")
        if not reply_to or len(reply_to) > _MAX_HEADER_CHARS or any(c.isspace() for c in reply_to):
            self.malformed += 1  # no request's reply subject: nothing to withdraw
            self.log.warning("malformed withdrawal ignored", size=len(msg.data))
            return
        self._withdrawn[reply_to] = None
        if len(self._withdrawn) > _REMEMBER_WITHDRAWN:
            self._withdrawn.popitem(last=False)

    async def _bind(self) -> JetStreamContext.PullSubscription:
        """Bind to the function's consumer (creating it with defaults if absent), riding out a NATS
        outage (:func:`~.jsresources.ride_out`)."""
        return await jsresources.ride_out(self._bind_once)

    async def _bind_once(self) -> JetStreamContext.PullSubscription:
        name = consumer_name(self.function)
        try:
            info = await self.js.consumer_info(subj.INVOKE_STREAM, name)
        except nats.js.errors.NotFoundError:
            self.log.warning("consumer missing, creating it with defaults", consumer=name)
            await ensure_stream(self.js)
            await ensure_consumer(self.js, self.function)
            info = await self.js.consumer_info(subj.INVOKE_STREAM, name)
        if self.progress_interval_s is None:
            self.progress_interval_s = max(0.01, float(info.config.ack_wait or 30) / 4)
        return await self.js.pull_subscribe_bind(durable=name, stream=subj.INVOKE_STREAM)

    async def run(self, process: Process, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then drain: finish the batch in hand and the requests
        delivered after the last fetch (they are ours: a hand-back would count a delivery), fetch
        nothing more.

        ``process(requests)`` returns one result per request, in order: reply bytes, or an
        Exception that becomes an error reply (so does anything else, e.g. a str). If ``process`` itself raises, every request of the
        batch gets an error reply. Either way each request is answered, then acknowledged.
        Raises only when binding to the consumer fails.
        """
        psub = await self._bind()
        # before the first fetch: a withdrawal of a request this instance takes must not be missed
        self._cancel_sub = await self.nc.subscribe(subj.cancel(self.function), cb=self._on_cancel)
        self.log.info("pulling", max_batch=self.max_batch)
        # One at a time while redeliveries come (and at start: a crashed sibling's requests come
        # first): a redelivered request held beside one that crashes us would be charged a delivery.
        probing = True
        try:
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(1 if probing else self.max_batch, timeout=self.fetch_timeout_s)
                except asyncio.TimeoutError:  # nothing queued (nats-py raises several subclasses)
                    continue
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                    self.log.warning("connection closed while pulling")
                    return
                except Exception as exc:  # a transient JetStream or connection error: retry
                    self.log.warning("fetch failed", error=repr(exc))
                    await asyncio.sleep(self.fetch_timeout_s)
                    continue
                if probing and all(_delivered(m) <= 1 for m in msgs):  # fresh: fill the batch
                    msgs += await self._top_up(psub, self.max_batch - len(msgs))
                probing = await self._serve_batch(msgs, process)
            if not self.nc.is_closed and (late := _late_deliveries(psub)):
                await self._serve_batch(late, process)
        finally:
            await self._release(psub)
        self.log.info("drained", handled=self.handled, errors=self.errors, malformed=self.malformed,
                      expired=self.expired, cancelled=self.cancelled)

    async def _top_up(self, psub: JetStreamContext.PullSubscription, n: int) -> list[Msg]:
        """Up to ``n`` more requests that are queued now (no waiting for new ones)."""
        if n <= 0:
            return []
        try:
            return await psub.fetch(n, timeout=0.05)
        except Exception:  # nothing queued, or a transient error: serve what we have
            return []

    async def _release(self, psub: JetStreamContext.PullSubscription) -> None:
        """Unsubscribe. Requests that still reached us after the last fetch (the drain serves
        them; these came while it ran, or the run was cancelled) are handed back with a nak,
        which JetStream counts as a delivery: rare, and bounded by the caller's ack wait."""
        if self.nc.is_closed:
            return
        for msg in _late_deliveries(psub):
            await msg.nak()
        try:
            await psub.unsubscribe()
            if self._cancel_sub is not None:
                await self._cancel_sub.unsubscribe()
            await settle(self.nc)
        except Exception as exc:
            self.log.warning("unsubscribe failed", error=repr(exc))

    async def _serve_batch(self, msgs: list[Msg], process: Process) -> bool:
        """Answer the fetched ``msgs``; returns whether any of them was a redelivery.

        Requests delivered :data:`MAX_DELIVERIES` times are answered with an error and terminated;
        redelivered ones run first, each alone; the fresh ones then run as one batch. Every request
        not yet answered gets in-progress acks meanwhile."""
        fresh: list[tuple[Request, Msg]] = []
        redelivered: list[tuple[Request, Msg]] = []
        seen_redelivery = False
        for msg in msgs:
            try:
                req = parse_request(msg)
            except (MalformedRequest, ValueError, nats.errors.Error) as exc:
                await self._reject(msg, str(exc))
                continue
            if req.expired(time.time_ns()):
                await self._expire(req, msg)
                continue
            if self.withdrawn(req):
                await self._drop_withdrawn(req, msg)
                continue
            if req.delivered <= 1:
                fresh.append((req, msg))
                continue
            seen_redelivery = True
            self.redelivered += 1
            REDELIVERIES.labels(self.function).inc()
            if req.delivered >= MAX_DELIVERIES:
                await self._give_up(req, msg)
            else:
                redelivered.append((req, msg))
        groups = [[r] for r in redelivered] + ([fresh] if fresh else [])
        unanswered = [msg for group in groups for _, msg in group]
        progress = asyncio.create_task(self._keep_in_progress(unanswered)) if groups else None
        try:
            for group in groups:
                requests = [req for req, _ in group]
                self.batches += 1
                started = time.time_ns()
                for req in requests:
                    req.started_ns, req.batch = started, len(requests)
                results = await self._run_process(process, requests)
                for (req, msg), result in zip(group, results):
                    await self._answer(req, msg, result)
                    unanswered.remove(msg)
        finally:
            if progress is not None:
                progress.cancel()
        return seen_redelivery

    async def _run_process(self, process: Process, requests: list[Request]) -> list[bytes | Exception]:
        try:
            results = list(await asyncio.wait_for(process(requests), self.handler_timeout_s))
        except asyncio.TimeoutError:
            self.log.warning("batch handler timed out", timeout_s=self.handler_timeout_s, batch=len(requests))
            return [TimeoutError(f"handler ran over {self.handler_timeout_s} s")] * len(requests)
        except Exception as exc:  # the handler failed as a whole: every request gets the error
            self.log.warning("batch handler failed", error=repr(exc), batch=len(requests))
            return [exc] * len(requests)
        if len(results) != len(requests):
            err = RuntimeError(f"handler returned {len(results)} results for {len(requests)} requests")
            self.log.warning("batch handler result count mismatch", error=str(err))
            return [err] * len(requests)
        return results

    async def _keep_in_progress(self, msgs: list[Msg]) -> None:
        """Send +WPI for every held request each interval, resetting their ack-wait timers.

        ``msgs``: the requests not yet answered (the caller removes each as it is answered).
        """
        while True:
            await asyncio.sleep(self.progress_interval_s)
            try:
                for msg in list(msgs):  # a copy: answered requests leave the list meanwhile
                    await msg.in_progress()
            except Exception as exc:  # e.g. reconnecting: try again next interval
                self.log.warning("in-progress ack failed", error=repr(exc))

    async def send_chunk(self, req: Request, chunk: bytes) -> None:
        """Send one output chunk of ``req`` to its caller now, before its final reply (call it
        from ``process``, in order): headers ``Dilu-Status: chunk``, ``Dilu-Chunk`` = the chunk's
        number from 0, ``Dilu-Request-Id``, ``Dilu-Instance``; payload the chunk. A chunk that
        cannot be sent (connection lost) is logged and skipped: the final reply still carries
        the whole output. A withdrawn request gets none (:meth:`withdrawn`)."""
        if self.withdrawn(req):
            return
        headers = {
            subj.H_REQUEST_ID: req.request_id,
            subj.H_STATUS: subj.STATUS_CHUNK,
            subj.H_CHUNK: str(req.chunks),
            subj.H_INSTANCE: self.instance_id,
        }
        req.chunks += 1
        try:
            await self.nc.publish(req.reply_to, bytes(chunk), headers=headers)
        except Exception as exc:
            self.log.warning("chunk not sent", request_id=req.request_id, chunk=req.chunks - 1, error=repr(exc))

    async def _give_up(self, req: Request, msg: Msg) -> None:
        """A request delivered :data:`MAX_DELIVERIES` times: answer it with an error, terminate it."""
        self.poisoned += 1
        self.log.warning("request given up after repeated deliveries", request_id=req.request_id,
                         delivered=req.delivered)
        reason = RuntimeError(f"request was delivered {req.delivered} times; "
                              "each earlier time its instance ended before answering")
        await self._answer(req, msg, reason, terminate=True)

    async def _expire(self, req: Request, msg: Msg) -> None:
        """A request past its caller's deadline: acknowledged, neither run nor answered."""
        self.expired += 1
        REQUESTS.labels(self.function, "expired").inc()
        self.log.debug("request expired before it ran", request_id=req.request_id,
                       late_ms=(time.time_ns() - req.deadline_ns) / 1e6)
        await self._ack_unanswered(req, msg)

    async def _drop_withdrawn(self, req: Request, msg: Msg) -> None:
        """A request its caller withdrew: acknowledged, not answered (run or not)."""
        self.cancelled += 1
        REQUESTS.labels(self.function, "cancelled").inc()
        self.log.debug("request withdrawn by its caller", request_id=req.request_id, ran=bool(req.batch))
        await self._ack_unanswered(req, msg)

    async def _ack_unanswered(self, req: Request, msg: Msg) -> None:
        try:
            await msg.ack()
        except Exception as exc:  # redelivered after the ack wait, and skipped again
            self.log.warning("ack of an unanswered request failed", request_id=req.request_id, error=repr(exc))

    async def _answer(self, req: Request, msg: Msg, result: bytes | Exception, *, terminate: bool = False) -> None:
        if self.withdrawn(req):  # nobody reads the reply
            await self._drop_withdrawn(req, msg)
            return
        if not isinstance(result, (Exception, bytes, bytearray, memoryview)):
            # bytes(str) raises and bytes(int) is zeros: an error for this request alone
            result = TypeError(f"handler returned {type(result).__name__} for request {req.request_id}; expected bytes")
        if isinstance(result, Exception):
            req.status, req.error = "error", f"{type(result).__name__}: {result}"
            data = b""
        else:
            req.status, data = "ok", bytes(result)
        headers = {
            subj.H_REQUEST_ID: req.request_id,
            subj.H_STATUS: req.status,
            subj.H_INSTANCE: self.instance_id,
            subj.H_COLD_START: "1" if req.enqueued_ns < self.ready_ns else "0",
            subj.H_ENQUEUED_NS: str(req.enqueued_ns),
        }
        if req.error:
            headers[subj.H_ERROR] = _header_value(req.error)
        if self.stream or req.chunks:
            headers[subj.H_CHUNK] = str(req.chunks)
        if req.batch:  # 0: answered without running (given up after repeated deliveries)
            headers[subj.H_STARTED_NS] = str(req.started_ns)
            headers[subj.H_BATCH] = str(req.batch)
        headers[subj.H_REPLIED_NS] = str(time.time_ns())
        try:
            await self.nc.publish(req.reply_to, data, headers=headers)
            # after the reply: a crash in between means redelivery, not loss. No flush: acks are
            # published in order on this connection, and the next fetch follows them.
            await (msg.term() if terminate else msg.ack())
        except Exception as exc:  # not acked: JetStream redelivers after the ack wait
            self.log.warning("reply failed, request left for redelivery", request_id=req.request_id, error=repr(exc))
            return
        self.handled += 1
        if req.status == "error":
            self.errors += 1
        REQUESTS.labels(self.function, req.status).inc()
        if self.on_done is not None:
            try:
                self.on_done(req, time.time_ns())
            except Exception as exc:
                self.log.warning("on_done hook failed", error=repr(exc))

    async def _reject(self, msg: Msg, reason: str) -> None:
        """Answer a malformed request if it names a reply inbox, then terminate it (no redelivery)."""
        self.malformed += 1
        REQUESTS.labels(self.function, "malformed").inc()
        headers = msg.headers or {}
        self.log.warning("malformed request rejected", reason=reason, request_id=headers.get(subj.H_REQUEST_ID, ""))
        try:
            if headers.get(subj.H_REPLY_TO):
                await self.nc.publish(headers[subj.H_REPLY_TO], b"", headers=error_headers(
                    headers.get(subj.H_REQUEST_ID, ""), f"malformed request: {reason}", self.instance_id))
            await msg.term()
        except Exception as exc:
            self.log.warning("reject failed", error=repr(exc))
