"""The common service runner: uvloop, structlog, health/metrics server, graceful shutdown.

A service is an object with ``name``, ``async start(bus)``, ``async stop()`` and ``ready() -> bool``.
SIGINT and SIGTERM (or the injectable ``shutdown`` event, for tests) stop it: ``stop()`` first
(let in-flight work finish), then the NATS connection is drained, then the process exits. A
service with a ``request_stop`` attribute gets it set to a callable that stops it the same way
(for a service that finds it must not go on, e.g. a node agent whose name another agent took).

Under systemd (``Type=notify``; ``NOTIFY_SOCKET`` set) :func:`run` also reports to the service
manager through the ``sdnotify`` library: ``READY=1`` once the service is ready (the condition
``/readyz`` answers 200 on), ``STOPPING=1`` when a stop begins, ``WATCHDOG=1`` every
``WATCHDOG_USEC``/2 and ``STATUS=`` lines. The pings come from a task of the service's event loop,
so a stuck loop stops them and systemd restarts the service. While waiting for NATS (not ready
yet) the loop keeps extending systemd's start timeout (``EXTEND_TIMEOUT_USEC``), so a service
started before NATS is up stays "activating" instead of failing its start. Without
``NOTIFY_SOCKET`` none of this runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import sdnotify
import uvloop

from . import logging as dlog
from .bus import Bus
from .digits import as_count
from .metrics import HealthServer
from .natsconn import NatsOptions, PlainTextRefused


CANCEL_WAIT_S = 2.0  # how long a stop waits for a NATS connect in progress to give up
STOP_BUDGET_S = 20.0  # how long service.stop() may take before the runner drains NATS anyway
STARTING_POLL_S = 0.1  # readiness poll while not ready yet: READY=1 follows /readyz within this
READY_POLL_S = 1.0  # readiness poll once ready (STATUS= updates), unless the watchdog needs faster
NO_WATCHDOG_PERIOD_S = 5.0  # start-timeout extension period when systemd set no watchdog
EXTEND_PERIODS = 3  # each EXTEND_TIMEOUT_USEC covers this many periods (a stuck loop misses 3)


class StartFailed(RuntimeError):
    """The service cannot run here (a device missing, a name taken, a port in use); the message
    is one line for the operator. :func:`run` prints it and exits with status 2."""


class Service(Protocol):
    name: str

    async def start(self, bus: Bus) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...


# ------------------------------------------------------------------ systemd notify (pure policy)


def watchdog_period_s(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings systemd asks for: half of ``WATCHDOG_USEC``
    (microseconds), or None when no watchdog is set, the value is not a positive integer, or
    ``WATCHDOG_PID`` names another process (sd_watchdog_enabled's rule). Never raises."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):
        return None
    period_us = as_count(usec)
    return period_us / 2e6 if period_us else None


@dataclass(frozen=True)
class Supervision:
    """What has been told to systemd so far. ``watchdog_s``: ping period (s) or None;
    ``last_ping``/``last_extend``: loop time (s) of the last ``WATCHDOG=1`` / start-timeout
    extension; ``ready``: the readiness last reported (None: nothing yet)."""

    watchdog_s: float | None = None
    ready_sent: bool = False
    stopping_sent: bool = False
    ready: bool | None = None
    last_ping: float | None = None
    last_extend: float | None = None

    @property
    def period_s(self) -> float:
        """The keep-alive period (s): the watchdog's, else :data:`NO_WATCHDOG_PERIOD_S`."""
        return self.watchdog_s or NO_WATCHDOG_PERIOD_S

    def poll_s(self) -> float:
        """Seconds until the supervision loop should look again."""
        if not self.ready_sent:
            return min(STARTING_POLL_S, self.period_s)
        return min(READY_POLL_S, self.period_s)


def supervise_step(s: Supervision, *, ready: bool, stopping: bool, now: float,
                   waiting_for: str = "") -> tuple[Supervision, list[str]]:
    """One look at the service: the next state and the sd_notify messages to send now.

    ``ready``: the /readyz condition; ``stopping``: a stop has begun; ``now``: loop time (s);
    ``waiting_for``: what the service waits for, for STATUS= while not ready. Pure."""
    out: list[str] = []
    if stopping:
        if not s.stopping_sent:
            out.append("STOPPING=1\nSTATUS=stopping")
            s = replace(s, stopping_sent=True)
    elif ready and not s.ready_sent:
        out.append("READY=1\nSTATUS=ready")
        s = replace(s, ready_sent=True, ready=True)
    elif ready != s.ready:
        if ready:
            out.append("STATUS=ready")
        else:
            out.append("STATUS=not ready" + (f": {waiting_for}" if waiting_for else ""))
        s = replace(s, ready=ready)
    if not s.ready_sent and not s.stopping_sent and (
            s.last_extend is None or now - s.last_extend >= s.period_s):
        out.append(f"EXTEND_TIMEOUT_USEC={int(EXTEND_PERIODS * s.period_s * 1e6)}")
        s = replace(s, last_extend=now)
    if s.watchdog_s is not None and (s.last_ping is None or now - s.last_ping >= s.watchdog_s):
        out.append("WATCHDOG=1")
        s = replace(s, last_ping=now)
    return s, out


class Notifier:
    """sd_notify to ``NOTIFY_SOCKET`` through the ``sdnotify`` library (send errors ignored, as
    sd_notify does), with the watchdog period systemd asked for."""

    def __init__(self, watchdog_s: float | None) -> None:
        self.watchdog_s = watchdog_s
        self._sd = sdnotify.SystemdNotifier()

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "Notifier | None":
        """A notifier when ``NOTIFY_SOCKET`` is set, else None. Takes the NOTIFY_SOCKET and
        WATCHDOG_* variables out of ``environ`` (default os.environ) so the processes this one
        starts do not inherit them (sd_notify's unset_environment)."""
        environ = os.environ if environ is None else environ
        if not environ.get("NOTIFY_SOCKET"):
            return None
        notifier = cls(watchdog_period_s(environ, os.getpid()))
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            environ.pop(key, None)
        return notifier

    def notify(self, message: str) -> None:
        self._sd.notify(message)


async def _supervise(notifier: Notifier, ready: Callable[[], bool], shutdown: asyncio.Event,
                     waiting_for: str) -> None:
    """Report to systemd until cancelled (runs in the service's loop: a stuck loop stops pinging)."""
    loop = asyncio.get_running_loop()
    s = Supervision(watchdog_s=notifier.watchdog_s)
    try:
        while True:
            s, messages = supervise_step(s, ready=ready(), stopping=shutdown.is_set(), now=loop.time(),
                                         waiting_for=waiting_for)
            for message in messages:
                notifier.notify(message)
            if s.stopping_sent:
                await asyncio.sleep(s.poll_s())
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(shutdown.wait(), s.poll_s())
    finally:  # the service ended on its own (a failed start): still say it is stopping
        if not s.stopping_sent:
            notifier.notify("STOPPING=1\nSTATUS=stopping")


# ------------------------------------------------------------------------------------- running


async def serve(
    service: Service,
    nats: NatsOptions | str,
    *,
    metrics_port: int = 0,
    shutdown: asyncio.Event | None = None,
    install_signals: bool = True,
    notifier: Notifier | None = None,
) -> None:
    """Run ``service`` until SIGINT/SIGTERM or ``shutdown`` is set; always drains NATS on the way out.
    ``notifier``: report READY/STOPPING/WATCHDOG to systemd (module docstring). Raises
    :class:`StartFailed` when the service cannot run here."""
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

    def ready() -> bool:  # the one readiness condition: /readyz and READY=1
        return "bus" in state and state["bus"].ready and service.ready()

    try:
        health = HealthServer(ready, host=host, port=metrics_port)
    except OSError as exc:
        raise StartFailed(f"cannot serve /metrics on {host}:{metrics_port}: {exc.strerror or exc} "
                          f"(check --metrics-port / DILU_METRICS_PORT and DILU_METRICS_HOST, an IPv4 address)") from None
    health.start()
    supervising = None
    if notifier is not None:
        waiting_for = f"NATS at {NatsOptions.of(nats).url}, then {service.name} to start"
        supervising = asyncio.ensure_future(_supervise(notifier, ready, shutdown, waiting_for))
    try:
        await _connected(service, nats, shutdown, state, log, health.port)
    finally:
        if supervising is not None:
            supervising.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervising
        health.stop()


async def _connected(service: Service, nats: NatsOptions | str, shutdown: asyncio.Event, state: dict, log, port: int) -> None:
    # nats-py retries an unreachable server forever: keep honouring the signals meanwhile
    connecting = asyncio.ensure_future(Bus.connect(nats, service.name, node=getattr(service, "node", "") or ""))
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
    try:
        bus = state["bus"] = connecting.result()
    except PlainTextRefused as exc:  # TLS asked for, the server in clear: a deployment's mistake
        log.error("cannot start", reason=str(exc))
        raise StartFailed(str(exc)) from None
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
            await asyncio.wait_for(service.stop(), timeout=STOP_BUDGET_S)
        except Exception as exc:  # still drain and exit
            log.error("stop failed", error=repr(exc))
        await bus.close()
        log.info("service stopped")


def run(service: Service, nats: NatsOptions | str, *, metrics_port: int = 0, log_level: str = "info") -> None:
    """Blocking entry point for ``python -m dilu.services.<name>``: uvloop + :func:`serve`.
    A StartFailed ends the process with its one-line message and status 2."""
    dlog.configure(service.name, log_level)
    # A fatal signal (systemd's watchdog sends SIGABRT to a stuck service) prints every thread's
    # traceback to stderr, so the journal shows where the loop was stuck.
    faulthandler.enable()
    notifier = Notifier.from_environ()
    try:
        uvloop.run(serve(service, nats, metrics_port=metrics_port, notifier=notifier))
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
