"""The common service runner: uvloop, structlog, health/metrics server, graceful shutdown.

A service is an object with ``name``, ``async start(bus)``, ``async stop()`` and ``ready() -> bool``.
SIGINT and SIGTERM (or the injectable ``shutdown`` event, for tests) stop it: ``stop()`` first
(let in-flight work finish), then the NATS connection is drained, then the process exits. A
service with a ``request_stop`` attribute gets it set to a callable that stops it the same way
(for a service that finds it must not go on, e.g. a node agent whose name another agent took).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import Protocol

import uvloop

from . import logging as dlog
from .bus import Bus
from .metrics import HealthServer
from .natsconn import NatsOptions


CANCEL_WAIT_S = 2.0  # how long a stop waits for a NATS connect in progress to give up


class StartFailed(RuntimeError):
    """The service cannot run here (a device missing, a name taken, a port in use); the message
    is one line for the operator. :func:`run` prints it and exits with status 2."""


class Service(Protocol):
    name: str

    async def start(self, bus: Bus) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...


async def serve(
    service: Service,
    nats: NatsOptions | str,
    *,
    metrics_port: int = 0,
    shutdown: asyncio.Event | None = None,
    install_signals: bool = True,
) -> None:
    """Run ``service`` until SIGINT/SIGTERM or ``shutdown`` is set; always drains NATS on the way out."""
    log = dlog.get(service.name)
    shutdown = shutdown or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, shutdown.set)
    if hasattr(service, "request_stop"):
        service.request_stop = shutdown.set
    # Health first: /healthz answers while NATS is still unreachable (a supervisor's liveness
    # check must not restart a service that is only waiting for NATS), /readyz says 503 until then.
    # Loopback by default; deployments set DILU_METRICS_HOST (e.g. 0.0.0.0) for remote checks.
    host = os.environ.get("DILU_METRICS_HOST") or "127.0.0.1"
    state: dict[str, Bus] = {}
    try:
        health = HealthServer(lambda: "bus" in state and state["bus"].ready and service.ready(), host=host, port=metrics_port)
    except OSError as exc:
        raise StartFailed(f"cannot serve /metrics on {host}:{metrics_port}: {exc.strerror or exc} "
                          f"(check --metrics-port / DILU_METRICS_PORT and DILU_METRICS_HOST, an IPv4 address)") from None
    health.start()
    try:
        await _connected(service, nats, shutdown, state, log, health.port)
    finally:
        health.stop()


async def _connected(service: Service, nats: NatsOptions | str, shutdown: asyncio.Event, state: dict, log, port: int) -> None:
    # nats-py retries an unreachable server forever: keep honouring the signals meanwhile
    connecting = asyncio.ensure_future(Bus.connect(nats, service.name))
    stopping = asyncio.ensure_future(shutdown.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        # nats-py's connect loop can swallow a cancellation that lands inside its wait_for
        # (Python 3.11's wait_for race): wait a bounded time, never for ever
        await asyncio.wait({connecting}, timeout=CANCEL_WAIT_S)
        if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
            await connecting.result().close()  # it connected just as the stop came
        log.info("stopped before NATS was reachable", nats=str(nats))
        return
    bus = state["bus"] = connecting.result()
    try:
        try:
            await service.start(bus)
        except StartFailed as exc:
            log.error("cannot start", reason=str(exc))
            raise
        log.info("service started", nats=bus.options.url, metrics_port=port)
        await shutdown.wait()
        log.info("shutting down")
    finally:
        try:
            await asyncio.wait_for(service.stop(), timeout=20)
        except Exception as exc:  # still drain and exit
            log.error("stop failed", error=repr(exc))
        await bus.close()
        log.info("service stopped")


def run(service: Service, nats: NatsOptions | str, *, metrics_port: int = 0, log_level: str = "info") -> None:
    """Blocking entry point for ``python -m dilu.services.<name>``: uvloop + :func:`serve`.
    A StartFailed ends the process with its one-line message and status 2."""
    dlog.configure(service.name, log_level)
    try:
        uvloop.run(serve(service, nats, metrics_port=metrics_port))
    except StartFailed as exc:  # logged where it happened; one plain line for the operator last
        print(f"dilu {service.name}: {exc}", file=sys.stderr)
        sys.exit(2)


@contextlib.asynccontextmanager
async def running(service: Service, nats: NatsOptions | str, *, ready_timeout_s: float = 5.0):
    """Run ``service`` in a task of the current loop (tests, benches, embedding): yields once it
    says ready, stops and drains it on exit. Raises TimeoutError if it is not ready in time."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(service, nats, shutdown=stop, install_signals=False))
    deadline = asyncio.get_running_loop().time() + ready_timeout_s
    while not service.ready():
        if task.done():
            task.result()  # re-raise what stopped it
        if asyncio.get_running_loop().time() > deadline:
            stop.set()
            raise TimeoutError(f"{service.name} not ready within {ready_timeout_s} s")
        await asyncio.sleep(0.02)
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
