"""The asyncio client: call deployed functions over NATS and read what is deployed.

    async with await AsyncClient.connect("nats://127.0.0.1:4222") as c:
        reply = await c.invoke("image-classifier", image_bytes, timeout_s=10)
        async for chunk in c.stream("chat", b"hello"):
            print(chunk.decode(), end="", flush=True)

A call publishes into the JetStream work queue (the request is stored even while no instance is
warm) and waits for the reply on this client's inbox (:class:`~dilu.services.common.invoke.InvokeClient`).
Before publishing, the client checks that the function is deployed, against a cache of KV
``dilu-functions`` kept current by a KV watch (a miss is read once from the bucket, so a function
deployed a moment ago is found), and refuses at once a function the horizontal scaler reports
as unplaceable with no instance (KV ``dilu-function-state``).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from dilu.contracts import subjects
from dilu.contracts.events import FunctionDeployed, FunctionSpec, FunctionState
from dilu.services.common import logging as dlog
from dilu.services.common.invoke import MAX_TIMEOUT_S, InvokeClient, InvokeResult, cancel_swallowed, cancels_now
from dilu.services.common.kvkeys import kv_keys
from dilu.services.common.kvwatch import KvFollower
from dilu.services.common.natsconn import (DEFAULT_URL, CredentialsError, NatsOptions, connect, connect_failure,
                                          is_authorization_violation, is_permissions_violation)

from .errors import (
    BadRequest,
    FunctionError,
    InvocationTimeout,
    NoCapacity,
    NotDeployed,
    NotPermitted,
    Unreachable,
)

DEFAULT_NATS_URL = DEFAULT_URL


def not_permitted(url: object, violation: str) -> NotPermitted:
    """The error for a request the server refused these credentials (``violation``: its text)."""
    return NotPermitted(f"NATS at {url} refused these credentials ({violation}): they are another role's")

DEFAULT_TIMEOUT_S = 30.0
WATCH_RETRY_S = 5.0  # how often a cache whose bucket does not exist yet tries to watch it again
_KV_DELETES = ("DEL", "PURGE")
_MALFORMED_PREFIX = "malformed request"  # the instance's answer to a request it cannot parse

log = dlog.get("client")
V = TypeVar("V")
T = TypeVar("T")


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """A function's answer.

    ``payload``: its output bytes (for a streamed reply, the whole output); ``instance``: the
    instance that served it; ``cold_start``: the request waited for that instance's launch;
    ``latency_ms``: from the call to the final reply; ``chunks``: streamed chunks received (0: a
    plain reply); ``ttft_ms``: time to the first chunk, ``tpot_ms``: mean time between chunks
    after it (None when not streamed, or one chunk for ``tpot_ms``).
    """

    payload: bytes
    request_id: str
    instance: str = ""
    cold_start: bool = False
    latency_ms: float = 0.0
    chunks: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def reply_from(result: InvokeResult, scheduled_ns: int) -> Reply:
    """The :class:`Reply` of an ``ok`` invocation result sent at ``scheduled_ns`` (Unix ns)."""
    ttft = (result.first_chunk_ns - scheduled_ns) / 1e6 if result.chunks else None
    tpot = (result.last_chunk_ns - result.first_chunk_ns) / (result.chunks - 1) / 1e6 if result.chunks > 1 else None
    return Reply(payload=result.payload, request_id=result.request_id, instance=result.instance,
                 cold_start=result.cold_start, latency_ms=(result.done_ns - scheduled_ns) / 1e6,
                 chunks=result.chunks, ttft_ms=ttft, tpot_ms=tpot)


def raise_for(function: str, result: InvokeResult, timeout_s: float) -> None:
    """Raise the client error a failed invocation result stands for (nothing for ``ok``):
    FunctionError (the function's message), BadRequest (an instance refused it as malformed),
    NotDeployed (the function was undeployed before answering it), InvocationTimeout,
    NoCapacity (refused or dropped before any instance saw it)."""
    if result.status == "ok":
        return
    if result.status == "error":
        if result.error.startswith(subjects.ERROR_UNDEPLOYED):
            raise NotDeployed(function, "undeployed before the request was answered")
        if result.error.startswith(_MALFORMED_PREFIX):
            raise BadRequest(f"{function}: {result.error}")
        raise FunctionError(result.error)
    if result.status == "timeout":
        closed = f" ({result.error})" if "closed" in result.error else ""
        if result.chunks:  # a stream that started: its end is what did not come
            raise InvocationTimeout(f"reply from {function!r} incomplete within {timeout_s:g} s: "
                                    f"{result.chunks} chunks, then no final reply{closed}")
        raise InvocationTimeout(f"no reply from {function!r} within {timeout_s:g} s{closed}")
    raise NoCapacity(f"request to {function!r} was not accepted: {result.error}")


def decode_spec(raw: bytes) -> FunctionSpec:
    """A ``dilu-functions`` value: FunctionSpec JSON (what deploy writes), or FunctionDeployed
    JSON (the scheduler reads both). Raises msgspec.ValidationError / DecodeError."""
    try:
        return msgspec.json.decode(raw, type=FunctionSpec)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return msgspec.json.decode(raw, type=FunctionDeployed).spec


async def read_bucket(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    """Every live key of KV ``bucket`` and its value (empty when the bucket does not exist)."""
    try:
        kv = await js.key_value(bucket)
        keys = await kv_keys(js, bucket)
    except nats.js.errors.NotFoundError:  # BucketNotFoundError is one
        return {}
    out = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            continue
        if entry.value:
            out[key] = entry.value
    return out


class KvCache(Generic[V]):
    """The decoded values of one KV bucket, kept current by a watch.

    ``get(key)`` answers from the cache; on a miss it reads the bucket once (so a key put a
    moment ago, before the watch delivered it, is found). While the watch runs, what a read
    found (a value, or that the key is absent) is kept, since the watch reports every later
    change; values carry their revision and only newer ones replace them, so a slow read never
    undoes a later update. A bucket that does not exist yet is watched as soon as it does (tried
    at most every :data:`WATCH_RETRY_S` seconds); meanwhile each miss reads the bucket, unless
    ``optional_bucket`` (its absence means "no values": no read until it exists). Undecodable
    values read as absent.
    """

    def __init__(self, nc: NATS, bucket: str, decode: Callable[[bytes], V], *, optional_bucket: bool = False) -> None:
        self.nc, self.js, self.bucket, self.decode = nc, nc.jetstream(), bucket, decode
        self.optional_bucket = optional_bucket
        self._values: dict[str, tuple[int, V | None]] = {}
        self._follower: KvFollower | None = None
        self._tried = -WATCH_RETRY_S
        self._no_bucket = False

    async def start(self) -> None:
        """Start watching the bucket if it exists (best effort: a failure leaves reads direct).
        Once watching, it goes on through NATS restarts (:class:`KvFollower`)."""
        self._tried = time.monotonic()
        try:
            kv = await self.js.key_value(self.bucket)
            follower = KvFollower(self.nc, kv, self._on_entry, log=log, what=self.bucket)
            await follower.start()
        except nats.js.errors.NotFoundError:
            self._no_bucket = True
            return
        except Exception as exc:  # e.g. a JetStream hiccup: lookups read the bucket instead
            log.warning("cannot watch bucket", bucket=self.bucket, error=repr(exc))
            return
        self._no_bucket = False
        self._follower = follower

    async def _on_entry(self, entry) -> None:
        value = None
        if entry.operation not in _KV_DELETES and entry.value:
            value = self._decode(entry.value)
        self._store(entry.key, entry.revision, value)

    def _decode(self, raw: bytes) -> V | None:
        try:
            return self.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable value in bucket", bucket=self.bucket, error=str(exc))
            return None

    def _store(self, key: str, revision: int, value: V | None) -> None:
        held = self._values.get(key)
        if held is None or revision > held[0]:
            self._values[key] = (revision, value)

    @property
    def watching(self) -> bool:
        return self._follower is not None and self._follower.following

    def peek(self, key: str) -> V | None:
        """The cached value of ``key`` (None: absent or not known yet); no I/O."""
        held = self._values.get(key)
        return held[1] if held else None

    async def get(self, key: str) -> V | None:
        """The value of ``key``: cached, else read from the bucket (see the class)."""
        if not self.watching and time.monotonic() - self._tried >= WATCH_RETRY_S:
            await self.start()
        held = self._values.get(key)
        if held is not None and (held[1] is not None or self.watching):
            return held[1]
        if self._no_bucket and self.optional_bucket and not self.watching:
            return None
        try:
            entry = await (await self.js.key_value(self.bucket)).get(key)
            revision, value = entry.revision, (self._decode(entry.value) if entry.value else None)
        except nats.js.errors.NotFoundError:  # no bucket, no key, or a deleted key
            revision, value = 0, None  # older than any put: the watch's news wins
        if self.watching:  # the watch will tell of a later change; unwatched values are not kept
            self._store(key, revision, value)
        return value

    async def stop(self) -> None:
        follower, self._follower = self._follower, None
        if follower is not None:
            await follower.stop()


_END = object()


class Stream:
    """The chunks of one streamed invocation, as they arrive (an async iterator of bytes).

    The request is published on the first ``__anext__``. A function that does not stream
    (``inference``) yields its whole reply as one chunk. When the stream ends, :attr:`reply`
    holds the final :class:`Reply`; a failed request raises its client error (FunctionError,
    InvocationTimeout, NoCapacity, NotDeployed, BadRequest) from the iteration instead.
    Use ``async with`` (or :meth:`aclose`) to give up early.
    """

    def __init__(self, client: "AsyncClient", function: str, payload: bytes, timeout_s: float) -> None:
        self._client, self.function, self._payload, self._timeout_s = client, function, payload, timeout_s
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._scheduled_ns = 0
        self._yielded = 0
        self._done = False
        self.reply: Reply | None = None

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        if self._task is None:
            cancels = cancels_now()
            await self._client._check(self.function, len(self._payload))
            if cancel_swallowed(cancels):  # nats-py swallowed the caller's cancel: honour it
                self._done = True
                raise asyncio.CancelledError
            self._scheduled_ns = time.time_ns()
            self._task = asyncio.create_task(self._client._send(
                self.function, self._payload, self._timeout_s, self._scheduled_ns, on_chunk=self._queue.put_nowait))
            self._task.add_done_callback(lambda _t: self._queue.put_nowait(_END))
        item = await self._queue.get()
        if item is not _END:
            self._yielded += 1
            return item
        self._done = True
        result = self._task.result()
        raise_for(self.function, result, self._timeout_s)
        self.reply = reply_from(result, self._scheduled_ns)
        if result.chunks == 0 and self._yielded == 0 and result.payload:
            return result.payload  # a plain reply: its payload is the one chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop waiting for the reply (the request itself stays queued or in flight)."""
        self._done = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncClient:
    """A connection to a Dilu cluster for calling functions. Create with :meth:`connect` (owns
    its NATS connection) or :meth:`attach` (uses yours); :meth:`close` at the end, or use it as
    an async context manager."""

    def __init__(self, nc: NATS, *, owns_connection: bool, options: NatsOptions | None = None) -> None:
        self.nc = nc
        # how it connected (None when attached to a connection): ``replicas`` for what it creates
        self.options = options
        self.js: JetStreamContext = nc.jetstream()
        self._owns = owns_connection
        # the server's first permissions violation on this connection (set by connect's error
        # callback): a request it refused goes unanswered, so a caller may race its work with it
        self.refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # set when a client that does not reconnect (connect's ``reconnect=False``, the CLI's)
        # loses its connection: what it waits for can no longer come
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._invoker = InvokeClient(nc, self.js)
        self._specs: KvCache[FunctionSpec] = KvCache(nc, subjects.FUNCTIONS_BUCKET, decode_spec)
        self._states: KvCache[FunctionState] = KvCache(  # written by the horizontal scaler, if one runs
            nc, subjects.FUNCTION_STATE_BUCKET, lambda raw: msgspec.json.decode(raw, type=FunctionState),
            optional_bucket=True)

    @classmethod
    async def connect(cls, nats_url: NatsOptions | str | None = None, *, creds: Path | str | None = None,
                      name: str = "dilu-client", connect_timeout_s: float = 2.0, connect_attempts: int = 2,
                      reconnect: bool = True) -> "AsyncClient":
        """Connect to NATS at ``nats_url`` (a URL, comma-separated URLs, or
        :class:`~dilu.services.common.natsconn.NatsOptions` with credentials and TLS; None: env
        ``DILU_NATS_URL``, else ``nats://127.0.0.1:4222``) and start the client. ``creds``: a
        credentials file (None: env ``DILU_NATS_CREDS``, as ``dilu`` reads it; ``dilu up`` prints
        the operator's), for a server that admits Dilu's roles only.

        The first connection is tried ``connect_attempts`` times, each bounded by
        ``connect_timeout_s`` seconds, so an unreachable server fails within seconds; once
        connected, a lost connection is retried for ever (``reconnect``) or closes the client.
        Raises :class:`Unreachable` (one line naming the URL and the reason), or
        :class:`NotPermitted` as soon as the server refuses what starting the client asks
        (credentials of another role: the refusal comes only to the error callback, and the
        request it refused would otherwise wait out its timeout).
        """
        nats_url = NatsOptions.from_environ(nats_url, creds)
        errors: list[Exception] = []
        refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def quiet(exc: Exception) -> None:  # nats-py would print a traceback per attempt
            errors.append(exc)
            log.debug("NATS connection error", url=nats_url, error=repr(exc))
            if is_permissions_violation(exc) and not refused.done():
                refused.set_result(str(exc))

        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        made: list[NATS] = []  # the connection, once made: a failed first attempt is not a loss

        async def on_disconnect() -> None:  # only while it does not reconnect: then it is for good
            if made and not made[0].options.get("allow_reconnect", True) and not lost.done():
                cause = errors[-1] if errors else None
                lost.set_result(connect_failure(cause, connect_timeout_s) if cause else "the server closed it")

        try:
            # (nats-py reads max_reconnect_attempts 0 as "no limit": one attempt is allow_reconnect off)
            nc = await connect(nats_url, name=name, connect_timeout=connect_timeout_s,
                               allow_reconnect=connect_attempts > 1,
                               max_reconnect_attempts=max(1, connect_attempts - 1), reconnect_time_wait=0.5,
                               error_cb=quiet, disconnected_cb=on_disconnect)
        except CredentialsError as exc:
            raise Unreachable(str(exc)) from None
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
            cause = errors[-1] if errors else exc  # nats-py's own error only says "no servers"
            reason = connect_failure(cause, connect_timeout_s)
            if is_authorization_violation(cause):  # reached, and it said no
                raise NotPermitted(f"NATS at {nats_url} refused the connection: {reason}") from None
            raise Unreachable(f"cannot reach NATS at {nats_url}: {reason}") from None
        # the limits above were for the first connection; a live client rides out outages
        nc.options["allow_reconnect"] = reconnect
        nc.options["max_reconnect_attempts"] = -1
        made.append(nc)
        client = cls(nc, owns_connection=True, options=NatsOptions.of(nats_url))
        client.refused = refused  # the one the error callback sets
        client.lost = lost
        starting = asyncio.ensure_future(client.start())
        try:
            await asyncio.wait({starting, refused}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                raise not_permitted(nats_url, refused.result())
            starting.result()
        except BaseException:
            # close first: the connection fails what is pending, where cancelling the start
            # would leave nats-py a cancelled PONG future to trip over (a traceback on stderr)
            await nc.close()
            await asyncio.wait({starting}, timeout=1.0)
            starting.cancel()
            raise
        return client

    async def unless_refused(self, work: Awaitable[T]) -> T:
        """Run ``work``, or raise :class:`NotPermitted` as soon as the server refuses one of its
        requests (a permissions violation), since the refused request would only time out, or
        :class:`Unreachable` as soon as a client that does not reconnect loses its connection."""
        task = asyncio.ensure_future(work)
        url = self.options.url if self.options else "?"
        try:
            await asyncio.wait({task, self.refused, self.lost}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and self.refused.done():
                raise not_permitted(url, self.refused.result())
            if not task.done():
                raise Unreachable(f"lost the connection to NATS at {url}: {self.lost.result()}")
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)

    @classmethod
    async def attach(cls, nc: NATS) -> "AsyncClient":
        """A client over an existing connection ``nc`` (not closed by :meth:`close`)."""
        client = cls(nc, owns_connection=False)
        await client.start()
        return client

    async def start(self) -> None:
        """Subscribe to replies and start watching the deployed functions."""
        await self._invoker.start(ensure=False)  # deploy creates the stream; a caller never does
        await self._specs.start()
        await self._states.start()

    async def close(self) -> None:
        """Stop watching and receiving replies (calls still waiting end with InvocationTimeout);
        close the connection if this client opened it."""
        await self._specs.stop()
        await self._states.stop()
        await self._invoker.close()
        if self._owns and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5)
            except Exception:  # draining a broken connection: just close it
                await self.nc.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ reading

    async def functions(self) -> dict[str, FunctionSpec]:
        """Every deployed function's spec, by name, read from KV ``dilu-functions`` now."""
        out = {}
        for raw in (await read_bucket(self.js, subjects.FUNCTIONS_BUCKET)).values():
            try:
                spec = decode_spec(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            out[spec.name] = spec
        return out

    async def function(self, name: str) -> FunctionSpec:
        """The spec of deployed function ``name``; raises :class:`NotDeployed`."""
        spec = await self._specs.get(_key(name))
        if spec is None:
            raise NotDeployed(name)
        return spec

    # ------------------------------------------------------------------ calling

    async def invoke(self, function: str, payload: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Reply:
        """Call ``function`` with ``payload`` and wait (at most ``timeout_s`` seconds) for its
        reply; streamed chunks are counted in the reply, not returned separately (see
        :meth:`stream`).

        Raises NotDeployed, BadRequest (not bytes, a bad timeout, a training function, or
        refused as malformed), FunctionError (the function raised: its message),
        InvocationTimeout, NoCapacity.
        """
        data, timeout_s = _payload(payload), _timeout(timeout_s)
        cancels = cancels_now()  # a cancel nats-py swallows during the check still ends the call
        await self._check(function, len(data))
        scheduled_ns = time.time_ns()
        result = await self._send(function, data, timeout_s, scheduled_ns, cancels_before=cancels)
        raise_for(function, result, timeout_s)
        return reply_from(result, scheduled_ns)

    def stream(self, function: str, payload: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Stream:
        """The chunks of ``function``'s reply as they arrive: ``async for chunk in c.stream(...)``
        (see :class:`Stream`; errors as :meth:`invoke`, raised from the iteration)."""
        return Stream(self, function, _payload(payload), _timeout(timeout_s))

    async def _check(self, function: str, size: int = 0) -> FunctionSpec:
        """The function's spec, after checking it can take a request of ``size`` bytes now."""
        limit = payload_limit(self.nc.max_payload)
        if limit and size > limit:
            raise BadRequest(f"the payload is {size} bytes; the NATS server carries at most {limit}")
        spec = await self.function(function)
        if spec.kind == "training":
            raise BadRequest(f"function {function!r} is a training job: it takes no requests")
        state = await self._states.get(_key(function))
        if state is not None and not state.placeable and state.instances == 0:
            raise NoCapacity(f"function {function!r} cannot be placed now and has no instance: "
                             f"{state.reason or 'no GPU with room'}")
        return spec

    async def _send(self, function: str, payload: bytes, timeout_s: float, scheduled_ns: int,
                    on_chunk: Callable[[bytes], None] | None = None,
                    cancels_before: int | None = None) -> InvokeResult:
        return await self._invoker.invoke(function, payload, request_id=uuid.uuid4().hex, scheduled_ns=scheduled_ns,
                                          timeout_s=timeout_s, on_chunk=on_chunk, cancels_before=cancels_before)


# Of the NATS server's max_payload, what a request's headers may take (about 200 bytes are used);
# the rest is the largest payload a call can carry.
HEADER_ROOM_BYTES = 4096


def payload_limit(max_payload: int) -> int:
    """The largest payload (bytes) an invocation can carry on a server whose ``max_payload`` is
    given (0 or less: unknown, no limit)."""
    return max_payload - HEADER_ROOM_BYTES if max_payload > 0 else 0


def _key(name: str) -> str:
    try:
        return subjects.token(name)
    except ValueError:
        raise BadRequest("empty function name") from None


def _payload(payload: Any) -> bytes:
    if isinstance(payload, str):
        raise BadRequest("payload must be bytes, got str (encode it, e.g. text.encode())")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise BadRequest(f"payload must be bytes, got {type(payload).__name__}")
    return bytes(payload)


def _timeout(timeout_s: float) -> float:
    if not (0 < timeout_s <= MAX_TIMEOUT_S):
        raise BadRequest(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    return float(timeout_s)
