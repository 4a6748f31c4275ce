"""The gateway service: the HTTP API of :mod:`.app` under uvicorn, in the runner's asyncio loop.

Lifecycle (:func:`dilu.services.common.runner.serve`):

- ``start(bus)``: binds the HTTP port (a taken one is a StartFailed; ``__main__`` checks it
  before NATS is reached, :meth:`Gateway.check_address`), follows
  ``dilu.v1.function.deployed.*`` / ``undeployed.*`` on the runner's bus to keep its function
  table current (the list ``GET /v1/functions`` shows, and the names metrics may carry),
  attaches a :class:`dilu.client.AsyncClient` to the bus's connection (the NATS side of every
  request), loads the deployed functions, then serves. Ready (``/readyz`` 200) once all of that
  is done and while NATS stays connected.
- ``stop()``: uvicorn stops accepting connections and lets in-flight requests finish for up to
  ``drain_s`` seconds; requests still running then are answered 503 ``stopping`` (a stream gets
  an ``error`` event), and anything left after a further :data:`CUT_GRACE_S` is cancelled. Then the
  client closes. Nothing keeps running.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from dilu.client import AsyncClient, NotDeployed
from dilu.client.aio import payload_limit
from dilu.contracts import subjects
from dilu.contracts.events import FunctionDeployed, FunctionSpec, FunctionUndeployed
from dilu.services.common import logging as dlog
from dilu.services.common.bus import Bus
from dilu.services.common.runner import StartFailed

from .app import Limits, Stopping, build_app

CONNECT_TIMEOUT_S = 10.0  # the bus is connected already: starting the client is quick or failing
CUT_GRACE_S = 2.0  # after the drain time: for the 503s to go out before uvicorn cancels the rest
STARTUP_TIMEOUT_S = 10.0
# How long an idle HTTP keep-alive connection stays open, s. Longer than the idle expiry of
# client pools and load balancers in front (httpx 5 s, aiohttp 15 s, AWS ALB 60 s), so that the
# client always closes first: a server that closes an idle connection as the client reuses it
# resets the request sent on it (ECONNRESET at the caller). 75 s is nginx's keepalive_timeout.
HTTP_KEEP_ALIVE_S = 75.0

log = dlog.get("gateway")


async def attach_client(bus: Bus) -> Any:
    """A :class:`dilu.client.AsyncClient` over the runner's connection (one connection, one
    reconnect policy; the runner drains it after :meth:`Gateway.stop` closed the client)."""
    return await AsyncClient.attach(bus.nc)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the runner owns SIGTERM/SIGINT and stops us."""

    def capture_signals(self):
        return contextlib.nullcontext()


class Gateway:
    """Service object for the common runner.

    ``host``/``port``: the HTTP address (port 0: any free one; :attr:`port` tells which);
    ``limits``: body and timeout limits; ``drain_s``: seconds in-flight requests get on stop
    (keep it under the runner's 20 s stop budget); ``keep_alive_s``: seconds an idle connection
    stays open (:data:`HTTP_KEEP_ALIVE_S`; ``--http-keep-alive-s``); ``connect``:
    ``async (bus) -> client``, the client every request goes through (tests may inject a
    stand-in). Raises ValueError for a negative ``drain_s`` or a ``keep_alive_s`` not above 0.
    """

    name = "gateway"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 8080, limits: Limits | None = None,
                 drain_s: float = 10.0, keep_alive_s: float = HTTP_KEEP_ALIVE_S,
                 connect: Callable[[Bus], Awaitable[Any]] = attach_client) -> None:
        if drain_s < 0:
            raise ValueError("drain_s must be >= 0")
        if not keep_alive_s > 0:
            raise ValueError("keep_alive_s must be > 0")
        self.host, self.drain_s, self.keep_alive_s = host, drain_s, keep_alive_s
        self.limits = limits or Limits()
        self._port = port
        self._connect = connect
        self.client: Any = None
        self.bus: Bus | None = None
        self._specs: dict[str, FunctionSpec] = {}
        self._loaded = False
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self._cut = asyncio.Event()
        self.app = build_app(self)

    # ------------------------------------------------------------------ lifecycle

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            return socket.create_server((self.host, self._port), family=family, backlog=2048)
        except (OSError, OverflowError) as exc:
            raise StartFailed(f"cannot serve HTTP on {self.host}:{self._port}: "
                              f"{getattr(exc, 'strerror', None) or exc} (check --host/--port, "
                              f"DILU_HOST/DILU_PORT)") from None

    def check_address(self) -> None:
        """Bind the HTTP address and let it go again, so that a taken port or a bad host fails
        at once (``__main__``), not once NATS is reachable, while nothing listens before the
        gateway can answer. Raises StartFailed with one line."""
        self._listen().close()

    def _bind(self) -> socket.socket:
        if self._sock is None:
            self._sock = self._listen()
            self._port = self._sock.getsockname()[1]
        return self._sock

    @property
    def port(self) -> int:
        """The bound HTTP port (the one asked for, or the free one port 0 found)."""
        return self._port

    async def start(self, bus: Bus) -> None:
        sock = self._bind()
        self.bus = bus
        await bus.subscribe(f"{subjects.PREFIX}.function.deployed.*", FunctionDeployed, self._on_deployed)
        await bus.subscribe(f"{subjects.PREFIX}.function.undeployed.*", FunctionUndeployed, self._on_undeployed)
        self._fit_body_limit(bus.nc.max_payload)
        try:
            await asyncio.wait_for(self._attach(bus), CONNECT_TIMEOUT_S)
        except (Exception, asyncio.TimeoutError) as exc:
            await self._close_client()
            raise StartFailed(f"cannot start the client or read the deployed functions: "
                              f"{type(exc).__name__}: {exc}") from None
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False, server_header=False,
                                timeout_keep_alive=self.keep_alive_s, timeout_graceful_shutdown=self.drain_s + CUT_GRACE_S)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway-http")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:  # uvicorn has no started event; on a bound socket this is quick
            if self._task.done():
                self._task.result()
                raise StartFailed("the HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise StartFailed(f"the HTTP server did not start within {STARTUP_TIMEOUT_S:g} s")
            await asyncio.sleep(0.01)
        log.info("serving HTTP", host=self.host, port=self.port, functions=len(self._specs))

    def _fit_body_limit(self, max_payload: int) -> None:
        """Lower the body limit to what NATS carries (its max_payload, less room for the
        request's headers), so that an oversized body is a 413 here, not a failed publish."""
        fits = payload_limit(max_payload)
        if max_payload > 0 and self.limits.max_body_bytes > fits:
            log.warning("body limit lowered to the NATS server's max_payload", asked=self.limits.max_body_bytes,
                        max_payload=max_payload, limit=fits)
            self.limits = dataclasses.replace(self.limits, max_body_bytes=fits)

    async def _attach(self, bus: Bus) -> None:
        await self.load(await self._connect(bus))

    async def load(self, client: Any) -> None:
        """Send every request through ``client`` and load the deployed functions from it
        (:meth:`start` does this; tests call it with a stand-in client)."""
        self.client = client
        self._specs.update(await client.functions())
        self._loaded = True

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            done, _ = await asyncio.wait({self._task}, timeout=self.drain_s)
            if not done:
                log.warning("drain time over: answering the requests still in flight", drain_s=self.drain_s)
                self._cut.set()
                done, _ = await asyncio.wait({self._task}, timeout=2 * CUT_GRACE_S + 1.0)
            if not done:
                self._server.force_exit = True
                self._task.cancel()
                await asyncio.wait({self._task})
            if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
                log.error("HTTP server failed", error=repr(self._task.exception()))
            # uvicorn cancels what outlived its graceful timeout without waiting: wait here
            leftover = set(self._server.server_state.tasks)
            if leftover:
                await asyncio.wait(leftover, timeout=CUT_GRACE_S)
        await self._close_client()
        if self._sock is not None:
            self._sock.close()

    async def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                await client.close()
            except Exception as exc:  # the connection may be gone already
                log.warning("closing the client failed", error=repr(exc))

    def ready(self) -> bool:
        return (self._loaded and self.client is not None and self._server is not None and self._server.started
                and not self._server.should_exit and (self.bus is None or self.bus.ready))

    # ------------------------------------------------------------------ functions (Backend)

    def known(self, name: str) -> bool:
        return name in self._specs

    def forget(self, name: str) -> None:
        self._specs.pop(name, None)

    def specs(self) -> list[FunctionSpec] | None:
        return list(self._specs.values()) if self._loaded else None

    async def lookup(self, name: str) -> FunctionSpec:
        """The spec of ``name`` as the client knows it (its watched cache of ``dilu-functions``,
        read once on a miss). Raises NotDeployed, and forgets the name then."""
        try:
            spec = await self.client.function(name)
        except NotDeployed:
            self.forget(name)
            raise
        self._specs[name] = spec
        return spec

    async def guard(self, aw: Awaitable) -> Any:
        """Await ``aw`` unless the drain time runs out first: then cancel it and raise Stopping."""
        if self._cut.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()
            raise Stopping()
        work = asyncio.ensure_future(aw)
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait({work, cut}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the request itself was cancelled (caller gone, uvicorn's cancel)
            work.cancel()
            raise
        finally:
            cut.cancel()
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.wait({work})
        raise Stopping()

    async def _on_deployed(self, ev: FunctionDeployed, _msg) -> None:
        self._specs[ev.spec.name] = ev.spec

    async def _on_undeployed(self, ev: FunctionUndeployed, _msg) -> None:
        self._specs.pop(ev.name, None)
