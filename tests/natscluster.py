"""Three (or more) nats-servers with JetStream clustered on loopback, for failover tests.

Each server gets a ``server_name``, a client port, a route port (full mesh of routes) and its own
JetStream store folder under one temporary folder; :meth:`NatsCluster.kill` SIGKILLs one (a crash:
nothing flushed) and keeps its store. :meth:`NatsCluster.wait_ready` waits until JetStream has a
meta leader (the cluster answers JetStream API calls), so a stream with 3 replicas can be created.
"""
from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.api
import nats.js.errors

from dilu.services.common.natsserver import find_binary, free_ports

_CONF = """server_name: {name}
listen: 127.0.0.1:{port}
jetstream {{ store_dir: "{store}" }}
cluster {{
  name: dilu-test
  listen: 127.0.0.1:{route}
  routes: [{routes}]
}}
"""


class NatsCluster:
    """``size`` clustered nats-servers (names ``n1``..``nN``); ``urls`` are their client URLs.
    Use as a context manager; every server still running is terminated on exit and the folder
    removed."""

    def __init__(self, size: int = 3, *, startup_timeout_s: float = 15.0) -> None:
        self.size, self._timeout = size, startup_timeout_s
        ports = free_ports(2 * size)
        self.ports, self.route_ports = ports[:size], ports[size:]
        self.names = [f"n{i + 1}" for i in range(size)]
        self.root = Path(tempfile.mkdtemp(prefix="dilu-natscluster-"))
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    def url_of(self, name: str) -> str:
        return self.urls[self.names.index(name)]

    def start(self) -> "NatsCluster":
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.route_ports)
        for name, port, route in zip(self.names, self.ports, self.route_ports):
            store = self.root / name
            store.mkdir()
            conf = self.root / f"{name}.conf"
            conf.write_text(_CONF.format(name=name, port=port, store=store, route=route, routes=routes))
            log = (self.root / f"{name}.log").open("ab")
            self.procs[name] = subprocess.Popen([find_binary(), "-c", str(conf)], stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        deadline = time.monotonic() + self._timeout
        for name, port in zip(self.names, self.ports):
            while True:
                if self.procs[name].poll() is not None:
                    self.stop()
                    raise RuntimeError(f"nats-server {name} exited at start (log: {self.root / name}.log)")
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"nats-server {name} did not listen within {self._timeout} s")
                    time.sleep(0.05)
        return self

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until JetStream answers on every server (a meta leader is elected and every server
        knows it) and the meta leader counts every server online: a stream with a replica on
        each can be placed (before that, creating one fails with "no suitable peers for
        placement, peer offline", as a loaded host showed). Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        for url in self.urls:
            nc = await nats.connect(url)
            try:
                await self._poll(deadline, f"JetStream not ready at {url}", lambda: nc.jetstream(timeout=1).account_info())
            finally:
                await nc.close()
        nc = await nats.connect(self.urls)
        try:
            js = nc.jetstream(timeout=2)
            probe = nats.js.api.StreamConfig(name="READY_PROBE", subjects=["ready.probe"], num_replicas=len(self.urls),
                                             storage=nats.js.api.StorageType.MEMORY)
            await self._poll(deadline, "a stream on every server could not be placed", lambda: js.add_stream(probe))
            await js.delete_stream("READY_PROBE")
        finally:
            await nc.close()

    @staticmethod
    async def _poll(deadline: float, what: str, attempt) -> None:
        """Call ``attempt()`` (a coroutine function) every 0.2 s until it succeeds; TimeoutError
        naming ``what`` once ``deadline`` (monotonic s) has passed."""
        while True:
            try:
                await attempt()
                return
            except (nats.errors.TimeoutError, nats.js.errors.APIError, nats.errors.NoRespondersError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} before the deadline") from None
                await asyncio.sleep(0.2)

    def kill(self, name: str) -> None:
        """SIGKILL server ``name`` (its store is kept)."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        """Terminate every server still running (SIGKILL after 10 s) and remove the folder."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
