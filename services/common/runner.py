"""The common service runner: uvloop, structlog, health/metrics server, graceful shutdown.

A service is an object with ``name``, ``async start(bus)``, ``async stop()`` and ``ready() -> bool``.
SIGINT and SIGTERM (or the injectable ``shutdown`` event, for tests) stop it: ``stop()`` first
(let in-flight work finish), then the NATS connection is drained, then the process exits.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Protocol

import uvloop

from . import logging as dlog
from .bus import Bus
from .metrics import HealthServer


class Service(Protocol):
    name: str

    async def start(self, bus: Bus) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...


async def serve(
    service: Service,
    nats_url: str,
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
    # nats-py retries an unreachable server forever: keep honouring the signals meanwhile
    connecting = asyncio.ensure_future(Bus.connect(nats_url, service.name))
    stopping = asyncio.ensure_future(shutdown.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        log.info("stopped before NATS was reachable", nats=nats_url)
        return
    bus = connecting.result()
    # loopback by default; deployments set DILU_METRICS_HOST (e.g. 0.0.0.0) for remote checks
    host = os.environ.get("DILU_METRICS_HOST", "127.0.0.1")
    health = HealthServer(lambda: bus.ready and service.ready(), host=host, port=metrics_port)
    health.start()
    try:
        await service.start(bus)
        log.info("service started", nats=nats_url, metrics_port=health.port)
        await shutdown.wait()
        log.info("shutting down")
    finally:
        try:
            await asyncio.wait_for(service.stop(), timeout=20)
        except Exception as exc:  # still drain and exit
            log.error("stop failed", error=repr(exc))
        await bus.close()
        health.stop()
        log.info("service stopped")


def run(service: Service, nats_url: str, *, metrics_port: int = 0, log_level: str = "info") -> None:
    """Blocking entry point for ``python -m dilu.services.<name>``: uvloop + :func:`serve`."""
    dlog.configure(service.name, log_level)
    uvloop.run(serve(service, nats_url, metrics_port=metrics_port))


@contextlib.asynccontextmanager
async def running(service: Service, nats_url: str, *, ready_timeout_s: float = 5.0):
    """Run ``service`` in a task of the current loop (tests, benches, embedding): yields once it
    says ready, stops and drains it on exit. Raises TimeoutError if it is not ready in time."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(service, nats_url, shutdown=stop, install_signals=False))
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
