"""systemd's notify protocol from a real service process (``Type=notify`` in deploy/systemd).

The test plays systemd: it binds the unix datagram socket named by NOTIFY_SOCKET, sets
WATCHDOG_USEC, starts ``python -m dilu.services.scheduler`` before its NATS server exists, then
starts the server on that port, then sends SIGTERM. READY=1 must wait for /readyz, WATCHDOG=1 must
keep coming the whole time, STOPPING=1 must follow SIGTERM.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from ports import ports_outside_ephemeral_range

from dilu.services.common.natsserver import EmbeddedNats, free_ports
from dilu.services.common.runner import serve

pytestmark = pytest.mark.nats

WATCHDOG_USEC = 600_000  # pings every 0.3 s


class FakeSystemd:
    """Collects (monotonic time, message) from a NOTIFY_SOCKET in a thread."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dilu-sd-")  # short: AF_UNIX paths max 108 bytes
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def lines(self, prefix: str, since: float = 0.0) -> list[float]:
        return [t for t, m in list(self.messages) if m.startswith(prefix) and t >= since]

    def wait_for(self, prefix: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.lines(prefix)
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no {prefix} within {timeout_s} s; got {[m for _, m in self.messages]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_ready_after_readyz_watchdog_throughout_stopping_on_sigterm(tmp_path):
    systemd = FakeSystemd()
    # NATS starts seconds later on its port: one outside the ephemeral range, which no other
    # test's free_port nor any outgoing connection can take meanwhile (tests/ports.py)
    (nats_port,), (metrics_port,) = ports_outside_ephemeral_range(1), free_ports(1)
    env = {**os.environ, "NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": str(WATCHDOG_USEC),
           "DILU_METRICS_HOST": "127.0.0.1"}
    log = open(tmp_path / "scheduler.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilu.services.scheduler", "--nats-url", f"nats://127.0.0.1:{nats_port}",
         "--metrics-port", str(metrics_port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = EmbeddedNats(port=nats_port)
    try:
        # No NATS yet: alive, not ready, no READY=1; the loop pings and extends the start timeout.
        systemd.wait_for("WATCHDOG=1", 20)
        t0 = time.monotonic()
        time.sleep(1.5)
        assert proc.poll() is None, (tmp_path / "scheduler.log").read_text()
        assert status(metrics_port, "/healthz") == 200
        assert status(metrics_port, "/readyz") == 503
        assert not systemd.lines("READY=1")
        assert systemd.lines("EXTEND_TIMEOUT_USEC=")
        assert any(m.startswith("STATUS=not ready") for _, m in systemd.messages)
        assert len(systemd.lines("WATCHDOG=1", since=t0)) >= 3

        server.start()
        ready_at = systemd.wait_for("READY=1", 30)
        assert status(metrics_port, "/readyz") == 200  # READY=1 is the /readyz condition
        time.sleep(1.5)
        assert len(systemd.lines("WATCHDOG=1", since=ready_at)) >= 3  # and the pings go on
        assert not systemd.lines("STOPPING=1")

        stop_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=35) == 0
        assert systemd.lines("STOPPING=1", since=stop_at)
        assert len(systemd.lines("READY=1")) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        server.stop()
        systemd.close()


def test_without_notify_socket_nothing_is_sent_and_nothing_breaks(tmp_path):
    # The service's environment has no NOTIFY_SOCKET: it runs and stops as before.
    (port,) = free_ports(1)
    with EmbeddedNats() as server:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        proc = subprocess.Popen([sys.executable, "-m", "dilu.services.scheduler", "--nats-url", server.url,
                                 "--metrics-port", str(port)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if status(port, "/readyz") == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=35) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# Every service runs under Type=notify in deploy/systemd: each must say READY=1 and STOPPING=1.
SERVICES = ["profiler", "scheduler", "horizontal_scaler", "vertical_scaler", "node_agent", "gateway"]


def test_every_service_says_ready_and_stopping(nats_url, tmp_path):
    ports = free_ports(2 * len(SERVICES))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_"))}
    base.update({"DILU_NODE": "notify-node", "DILU_DEVICE": "emulated", "DILU_METRICS_HOST": "127.0.0.1",
                 "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                 "DILU_MPS_DIR": str(tmp_path / "mps")})
    sockets, procs = {}, {}
    try:
        for i, pkg in enumerate(SERVICES):
            sockets[pkg] = FakeSystemd()
            argv = [sys.executable, "-m", f"dilu.services.{pkg}", "--nats-url", nats_url,
                    "--metrics-port", str(ports[2 * i])]
            if pkg == "gateway":
                argv += ["--port", str(ports[2 * i + 1])]
            env = {**base, "NOTIFY_SOCKET": sockets[pkg].path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
            log = open(tmp_path / f"{pkg}.log", "wb")
            procs[pkg] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            log.close()
        for i, pkg in enumerate(SERVICES):
            try:
                sockets[pkg].wait_for("READY=1", 60)
            except AssertionError:
                raise AssertionError((pkg, (tmp_path / f"{pkg}.log").read_text()[-3000:])) from None
            assert status(ports[2 * i], "/readyz") == 200, pkg
            assert sockets[pkg].lines("WATCHDOG=1"), pkg
        stop_at = time.monotonic()
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for pkg, proc in procs.items():
            assert proc.wait(timeout=35) == 0, (pkg, (tmp_path / f"{pkg}.log").read_text()[-3000:])
            assert sockets[pkg].lines("STOPPING=1", since=stop_at), pkg
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for sd in sockets.values():
            sd.close()


class Recorder:
    """A Notifier stand-in: (loop-independent monotonic time, message)."""

    def __init__(self, watchdog_s: float) -> None:
        self.watchdog_s = watchdog_s
        self.sent: list[tuple[float, str]] = []

    def notify(self, message: str) -> None:
        self.sent.append((time.monotonic(), message))


class Wedged:
    """A service whose event loop gets stuck (a blocking call in a handler) when told to."""

    name = "wedged"

    def __init__(self) -> None:
        self.started = False

    async def start(self, bus) -> None:
        self.started = True

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return self.started


async def test_a_stuck_event_loop_stops_the_watchdog_pings(nats_url):
    notifier, svc, stop = Recorder(watchdog_s=0.1), Wedged(), asyncio.Event()
    task = asyncio.create_task(serve(svc, nats_url, shutdown=stop, install_signals=False, notifier=notifier))
    while not any(m.startswith("READY=1") for _, m in notifier.sent):
        assert not task.done()
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    stuck_from = time.monotonic()
    time.sleep(1.0)  # the loop is wedged: systemd must see no ping for the whole second
    stuck_to = time.monotonic()
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(task, 30)
    pings = [t for t, m in notifier.sent if m == "WATCHDOG=1"]
    assert not [t for t in pings if stuck_from < t < stuck_to]
    assert len([t for t in pings if t < stuck_from]) >= 3 and [t for t in pings if t > stuck_to]  # before and after
    assert any(m.startswith("STOPPING=1") for _, m in notifier.sent)
