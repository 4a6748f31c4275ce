"""The gateway's HTTP API: a Starlette app over a :class:`Backend` (the NATS side).

Routes:

- ``POST /v1/functions/{name}:invoke``: the request body is the payload (at most
  ``Limits.max_body_bytes``, else 413); header ``Dilu-Timeout`` = seconds to wait for the reply
  (a number in (0, ``Limits.max_timeout_s``], default ``Limits.default_timeout_s``). 200 with
  the function's output (``application/octet-stream``) and headers ``Dilu-Request-Id``,
  ``Dilu-Instance``, ``Dilu-Cold-Start`` (0/1). An ``llm`` function asked with ``Accept:
  text/event-stream`` or ``?stream=1`` answers with server-sent events instead: ``chunk`` events
  (data: one output chunk as UTF-8 text, invalid bytes replaced; id: its number from 0), then one
  ``done`` event (JSON: request_id, instance, cold_start, chunks, ttft_ms, tpot_ms) or one
  ``error`` event (JSON problem details). A stream that fails before its first chunk answers with
  the plain HTTP error instead. Another kind of function asked with ``?stream=1`` is a 400; its
  ``Accept`` alone is a preference it answers plainly.
- ``GET /v1/functions`` and ``GET /v1/functions/{name}``: deployed functions (public fields of
  their specs, :data:`PUBLIC_FIELDS`).
- ``GET /metrics`` (Prometheus text), ``GET /healthz`` (200 while the process runs), ``GET
  /readyz`` (200 while the backend is ready, else 503).

A caller that disconnects before its reply (streaming or not) has its call withdrawn
(``subjects.cancel``), so the instance drops it.

Every error is an RFC 9457 problem (``application/problem+json``: type, title, status, detail,
plus ``function`` and ``request_id`` where known); :data:`PROBLEMS` lists the types.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from dilu.client import BadRequest, DiluError, FunctionError, InvocationTimeout, NoCapacity, NotDeployed
from dilu.client.spec import name_problem
from dilu.contracts import subjects
from dilu.contracts.events import FunctionSpec
from dilu.services.common import logging as dlog
from dilu.services.common.digits import as_count

log = dlog.get("gateway")

from dilu.services.common.functions import MIB  # noqa: E402  (memory units, one truth)
H_TIMEOUT = "Dilu-Timeout"
SSE = "text/event-stream"
UNKNOWN = "(unknown)"  # metrics label of a name that is no deployed function (never a valid name)
CLIENT_GONE = 499  # metrics code of a stream whose caller went away (nginx's convention)
# Extra seconds past a request's own timeout before the gateway gives up on the client library
# (which enforces the timeout itself; this only bounds a wait that should never happen).
TIMEOUT_SLACK_S = 5.0

# slug -> (status, title). The problem type is ``urn:dilu:problem:<slug>``.
PROBLEMS: dict[str, tuple[int, str]] = {
    "bad-request": (400, "Bad request"),
    "not-found": (404, "Not found"),
    "not-deployed": (404, "Function not deployed"),
    "method-not-allowed": (405, "Method not allowed"),
    "payload-too-large": (413, "Payload too large"),
    "function-error": (500, "The function raised an error"),
    "internal-error": (500, "Internal gateway error"),
    "bad-gateway": (502, "The platform failed the request"),
    "no-capacity": (503, "No capacity"),
    "not-ready": (503, "Gateway not ready"),
    "stopping": (503, "Gateway stopping"),
    "timeout": (504, "Function timed out"),
}
_SLUG_OF_STATUS = {404: "not-found", 405: "method-not-allowed", 413: "payload-too-large", 400: "bad-request"}

# The spec fields a caller may see (no code, entry, handler, profile or config: those are the
# operator's business, and config may hold settings not meant for callers).
PUBLIC_FIELDS = ("name", "kind", "slo_ms", "ttft_ms", "tpot_ms", "priority", "max_batch",
                 "min_instances", "max_instances", "model")

REQUESTS = Counter("dilu_gateway_requests", "Invocations answered over HTTP, by function and HTTP status code "
                   f"(a stream's error event counts under its status, a caller gone mid-stream as {CLIENT_GONE})",
                   ["function", "code"])
LATENCY = Histogram("dilu_gateway_request_seconds", "Invocation time at the gateway, arrival to last byte, s",
                    ["function"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900))
IN_FLIGHT = Gauge("dilu_gateway_in_flight", "Invocations in progress at the gateway")


@dataclass(frozen=True)
class Limits:
    """Request limits: body bytes, and the default and largest ``Dilu-Timeout`` in seconds."""

    max_body_bytes: int = 8 * MIB
    default_timeout_s: float = 30.0
    max_timeout_s: float = 900.0


class Stopping(Exception):
    """The gateway is stopping and its drain time is up: the request is abandoned (503)."""


class Backend(Protocol):
    """What the HTTP layer needs from the gateway service (:class:`dilu.services.gateway.service.Gateway`).

    ``client``: a :class:`dilu.client.AsyncClient` (or None before it is connected);
    ``lookup(name)``: the function's spec, raises NotDeployed; ``known(name)``: whether ``name``
    is a deployed function as far as the gateway knows (bounds metric labels); ``forget(name)``:
    drop a function found undeployed; ``specs()``: all known specs (None until loaded);
    ``guard(aw)``: await ``aw`` unless the drain time runs out first (then raises Stopping).
    """

    client: Any
    limits: Limits

    def ready(self) -> bool: ...

    def known(self, name: str) -> bool: ...

    def forget(self, name: str) -> None: ...

    def specs(self) -> list[FunctionSpec] | None: ...

    async def lookup(self, name: str) -> FunctionSpec: ...

    async def guard(self, aw: Awaitable) -> Any: ...


class Problem(Exception):
    """An HTTP error as RFC 9457 problem details; ``slug`` is a key of :data:`PROBLEMS`."""

    def __init__(self, slug: str, detail: str, *, status: int | None = None, function: str = "", request_id: str = "",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        default_status, self.title = PROBLEMS[slug]
        self.slug, self.detail, self.status = slug, detail, status or default_status
        self.function, self.request_id, self.headers = function, request_id, dict(headers or {})

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": f"urn:dilu:problem:{self.slug}", "title": self.title, "status": self.status,
                               "detail": self.detail}
        if self.function:
            out["function"] = self.function
        if self.request_id:
            out["request_id"] = self.request_id
        return out

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers,
                            media_type="application/problem+json")


def problem_of(exc: BaseException, function: str) -> Problem:
    """The problem a client-library error (or a gateway-side timeout or stop) maps to."""
    rid = str(getattr(exc, "request_id", "") or "")
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, NotDeployed):
        return Problem("not-deployed", f"function {function!r} is not deployed", function=function)
    if isinstance(exc, FunctionError):
        return Problem("function-error", str(exc) or "the function failed", function=function, request_id=rid)
    if isinstance(exc, NoCapacity):
        return Problem("no-capacity", str(exc) or "no capacity for the request", function=function, request_id=rid,
                       headers={"Retry-After": "1"})
    if isinstance(exc, (InvocationTimeout, TimeoutError)):
        return Problem("timeout", str(exc) or "no reply in time", function=function, request_id=rid)
    if isinstance(exc, BadRequest):
        return Problem("bad-request", str(exc), function=function, request_id=rid)
    if isinstance(exc, Stopping):
        return Problem("stopping", "the gateway is shutting down; retry", function=function, request_id=rid,
                       headers={"Retry-After": "1"})
    if isinstance(exc, DiluError):
        return Problem("bad-gateway", str(exc) or type(exc).__name__, function=function, request_id=rid)
    log.error("invocation failed in the gateway", function=function, error=repr(exc), exc_info=exc)
    return Problem("internal-error", f"unexpected {type(exc).__name__} in the gateway (logged)", function=function,
                   request_id=rid)


# ------------------------------------------------------------------------------------- parsing


def check_name(name: str) -> str:
    why = name_problem(name)
    if why:
        raise Problem("bad-request", why)
    return name


def parse_timeout(values: list[str], limits: Limits) -> float:
    """``Dilu-Timeout`` (every value the request carries) in seconds; raises a 400 Problem
    unless it is given at most once, as a decimal number in (0, max] (Python's ``float`` also
    reads ``1_0`` as 10: digit separators are refused)."""
    if not values:
        return limits.default_timeout_s
    if len(values) > 1:
        raise Problem("bad-request", f"{H_TIMEOUT} given {len(values)} times; give it once")
    value = values[0]
    try:
        timeout_s = math.nan if "_" in value else float(value)
    except ValueError:
        timeout_s = math.nan
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= limits.max_timeout_s):
        raise Problem("bad-request", f"{H_TIMEOUT} must be seconds, a number in (0, {limits.max_timeout_s:g}], "
                                     f"got {value!r}")
    return timeout_s


def wants_stream(request: Request, name: str, kind: str) -> bool:
    """Whether to answer a call of function ``name``, of ``kind``, with server-sent events: ``?stream=1|true``
    asks for them (a 400 Problem for a function that does not stream), ``0|false`` declines;
    without it, an ``Accept`` naming text/event-stream asks an ``llm`` function for them, and a
    function of another kind answers plainly, as an HTTP server may when it cannot meet the
    preference."""
    flag = request.query_params.get("stream")
    if flag is None:
        return kind == "llm" and SSE in request.headers.get("accept", "")
    if flag.lower() in ("0", "false", ""):
        return False
    if flag.lower() not in ("1", "true"):
        raise Problem("bad-request", f"stream must be 1 or 0, got {flag!r}")
    if kind != "llm":
        raise Problem("bad-request", f"{name!r} is an {kind} function; only llm functions stream", function=name)
    return True


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (a 413 Problem past that, checked against
    Content-Length first and counted while reading, so an oversized body is never held)."""
    declared = as_count(request.headers.get("content-length", ""))
    if declared is not None and declared > limit:
        raise Problem("payload-too-large", f"the payload is {declared} bytes; the limit is {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise Problem("payload-too-large", f"the payload exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


# ------------------------------------------------------------------------------------- invoking


class _Call:
    """One invocation's bookkeeping: in-flight gauge, and status and latency once it ends."""

    def __init__(self, backend: Backend, name: str) -> None:
        self.backend, self.name, self.started = backend, name, time.perf_counter()
        self.ended = False
        IN_FLIGHT.inc()

    def end(self, code: int) -> None:
        if self.ended:
            return
        self.ended = True
        IN_FLIGHT.dec()
        label = self.name if self.backend.known(self.name) else UNKNOWN
        REQUESTS.labels(label, str(code)).inc()
        LATENCY.labels(label).observe(time.perf_counter() - self.started)


async def invoke(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    name = request.path_params["name"]
    call = _Call(backend, name)
    try:
        response = await _invoke(backend, request, name, call)
    except ClientDisconnect:  # gone while sending its body: nobody to answer
        response = Response(status_code=CLIENT_GONE)
    except Exception as exc:  # mapped to a problem; anything unexpected is a logged 500
        response = problem_of(exc, name).response()
    if not isinstance(response, _StreamResponse):
        call.end(response.status_code)
    return response


async def _invoke(backend: Backend, request: Request, name: str, call: _Call) -> Response:
    check_name(name)
    limits = backend.limits
    timeout_s = parse_timeout(request.headers.getlist(H_TIMEOUT), limits)
    if backend.client is None:
        raise Problem("not-ready", "the gateway is not connected to Dilu yet", headers={"Retry-After": "1"})
    spec = await backend.lookup(name)
    if spec.kind == "training":
        raise Problem("bad-request", f"{name!r} is a training function; it takes no requests", function=name)
    stream = wants_stream(request, name, spec.kind)
    payload = await read_body(request, limits.max_body_bytes)
    if stream:
        return await _start_stream(backend, name, payload, timeout_s, call)
    try:
        reply = await _unless_gone(request, backend.guard(_bounded(backend.client.invoke(name, payload,
                                                                                      timeout_s=timeout_s), timeout_s)))
    except NotDeployed:
        backend.forget(name)
        raise
    headers = {subjects.H_REQUEST_ID: reply.request_id, subjects.H_INSTANCE: reply.instance,
               subjects.H_COLD_START: "1" if reply.cold_start else "0"}
    return Response(reply.payload, media_type="application/octet-stream", headers=headers)


async def _unless_gone(request: Request, aw: Awaitable) -> Any:
    """``aw``, cancelled (so the call is withdrawn and its instance drops it) if the HTTP client
    disconnects first, which raises ClientDisconnect. The body has been read: the next ASGI
    message is the disconnect."""
    call = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not call.done():
            raise ClientDisconnect()
        return call.result()
    finally:
        for task in (call, gone):
            task.cancel()
        await asyncio.wait({call, gone})


async def _disconnected(request: Request) -> None:
    """Returns once the HTTP client has gone (``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _bounded(aw: Awaitable, timeout_s: float) -> Any:
    """``aw``, given up (TimeoutError) :data:`TIMEOUT_SLACK_S` after ``timeout_s`` seconds."""
    return await asyncio.wait_for(aw, timeout_s + TIMEOUT_SLACK_S)


# ------------------------------------------------------------------------------------- streaming


class _StreamResponse(EventSourceResponse):
    """Server-sent events whose end, however it comes (done, error, the caller gone, never
    started), closes the client's stream and records the call."""

    def __init__(self, content, *, on_end, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_end()

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        # The gateway ends its streams itself once its drain time is over (an error event, see
        # Gateway.stop), while sse-starlette's shutdown watcher (a poller per event loop, started
        # here) would outlive the server. A private hook of sse-starlette (2.x and 3.x); the
        # integration test's check that a stop leaves no task running guards it.
        await anyio.sleep_forever()


async def _next(it: AsyncIterator[bytes]) -> tuple[bool, bytes]:
    try:
        return True, await it.__anext__()
    except StopAsyncIteration:
        return False, b""


async def _start_stream(backend: Backend, name: str, payload: bytes, timeout_s: float, call: _Call) -> Response:
    """Open the stream and wait for its first chunk before answering, so that a request that
    fails at once (not deployed, no capacity, timeout) gets its plain HTTP status."""
    deadline = time.perf_counter() + timeout_s + TIMEOUT_SLACK_S
    source = backend.client.stream(name, payload, timeout_s=timeout_s)
    it = source.__aiter__()

    async def close_source() -> None:  # stop waiting for chunks (a no-op once the stream ended)
        try:
            await source.aclose()
        except Exception as exc:  # closing must not hide the outcome
            log.warning("closing a stream failed", function=name, error=repr(exc))

    async def pull() -> tuple[bool, bytes]:
        return await backend.guard(asyncio.wait_for(_next(it), max(0.0, deadline - time.perf_counter())))

    try:
        more, first = await pull()
    except BaseException as exc:
        await close_source()
        if isinstance(exc, NotDeployed):
            backend.forget(name)
        raise
    state = {"code": CLIENT_GONE}

    async def events():
        sent, chunk, going = 0, first, more
        try:
            while going:
                yield {"event": "chunk", "id": str(sent), "data": chunk.decode("utf-8", "replace")}
                sent += 1
                going, chunk = await pull()
            state["code"] = 200
            yield {"event": "done", "data": json.dumps(_done_event(source.reply, sent))}
        except Exception as exc:  # the stream failed after its first chunk: an error event ends it
            problem = problem_of(exc, name)
            state["code"] = problem.status
            yield {"event": "error", "data": json.dumps(problem.body())}

    async def on_end() -> None:
        await close_source()
        call.end(state["code"])

    return _StreamResponse(events(), on_end=on_end)


def _done_event(reply: Any, sent: int) -> dict[str, Any]:
    """The ``done`` event from the stream's final :class:`dilu.client.Reply` (ms figures as the
    client measured them from its send; null where not applicable)."""
    return {"request_id": reply.request_id, "instance": reply.instance, "cold_start": bool(reply.cold_start),
            "chunks": reply.chunks or sent, "ttft_ms": reply.ttft_ms, "tpot_ms": reply.tpot_ms}


# ------------------------------------------------------------------------------------- the rest


def _public(spec: FunctionSpec) -> dict[str, Any]:
    data = msgspec.to_builtins(spec)
    return {k: data[k] for k in PUBLIC_FIELDS if k in data}


async def list_functions(request: Request) -> Response:
    specs = request.app.state.backend.specs()
    if specs is None:
        raise Problem("not-ready", "the function list is not loaded yet", headers={"Retry-After": "1"})
    return JSONResponse({"functions": [_public(s) for s in sorted(specs, key=lambda s: s.name)]})


async def function_resource(request: Request) -> Response:
    """``/v1/functions/{name}``: GET describes a function. Any other method on a name with an
    action (``x:invokes``) is a 404, since no such route exists; on a plain name a 405."""
    name = request.path_params["name"]
    if request.method in ("GET", "HEAD"):
        return await get_function(request)
    if name.endswith(":invoke"):  # the invoke route, asked with another method
        raise HTTPException(405, headers={"Allow": "POST"})
    if ":" in name:
        raise HTTPException(404, f"no action {':' + name.partition(':')[2]!r} (the one action is :invoke)")
    raise HTTPException(405, headers={"Allow": "GET"})


async def get_function(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    name = request.path_params["name"]
    if name.endswith(":invoke"):  # the invoke route, asked with GET
        raise HTTPException(405, headers={"Allow": "POST"})
    check_name(name)
    if backend.client is None:
        raise Problem("not-ready", "the gateway is not connected to Dilu yet", headers={"Retry-After": "1"})
    try:
        spec = await backend.lookup(name)
    except NotDeployed:
        raise Problem("not-deployed", f"function {name!r} is not deployed", function=name) from None
    return JSONResponse(_public(spec))


async def metrics(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok\n")


async def readyz(request: Request) -> Response:
    ok = request.app.state.backend.ready()
    return PlainTextResponse("ready\n" if ok else "not ready\n", status_code=200 if ok else 503)


async def _problem_handler(request: Request, exc: Exception) -> Response:
    return problem_of(exc, request.path_params.get("name", "")).response()


async def _http_problem(request: Request, exc: HTTPException) -> Response:
    slug = _SLUG_OF_STATUS.get(exc.status_code, "bad-request")
    detail = f"{request.method} {request.url.path}: {exc.detail}"
    return Problem(slug, detail, status=exc.status_code, headers=exc.headers).response()


def build_app(backend: Backend) -> Starlette:
    """The gateway's Starlette app over ``backend``."""
    app = Starlette(
        routes=[
            Route("/v1/functions/{name}:invoke", invoke, methods=["POST"]),
            Route("/v1/functions", list_functions, methods=["GET"]),
            Route("/v1/functions/{name}", function_resource, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ],
        exception_handlers={Problem: _problem_handler, HTTPException: _http_problem},
    )
    app.state.backend = backend
    return app
