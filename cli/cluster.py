"""A local Dilu cluster: nats-server plus the five services, each its own OS process.

Used by ``dilu demo`` and ``dilu compare`` (and the end-to-end tests). Services start in their
own process sessions so a Ctrl-C in the terminal reaches only the orchestrator, which then stops
them in order: SIGTERM (each drains; the node agent retires its instances), SIGKILL after
``STOP_TIMEOUT_S``. Each service's stderr (JSON log lines) goes to ``<log_dir>/<service>.log``.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dilu.services.common.natsserver import EmbeddedNats, free_port

STOP_TIMEOUT_S = 28.0
READY_TIMEOUT_S = 90.0

# --policy -> the knobs of each service it sets:
# dilu            placement by request/limit, tokens resized by the vertical scaler, lazy horizontal
# horizontal-only dilu with the vertical dimension off: quotas fixed at the request and placed by
#                 it alone (reserving limits an instance never bursts to would only strand GPUs),
#                 horizontal scaling on load alone. In effect the static-mps configuration.
# static-mps      fixed MPS-like slices at the request quota (no bursting), horizontal on load
# exclusive       a whole GPU per instance, no token pacing, horizontal on load
POLICIES: dict[str, dict[str, list[str]]] = {
    "dilu": {
        "vertical_scaler": ["--mode", "dilu"],
        "horizontal_scaler": ["--mode", "lazy"],
        "scheduler": ["--policy", "dilu"],
        "node_agent": ["--initial-grant", "request"],
    },
    "horizontal-only": {
        "vertical_scaler": ["--mode", "static"],
        "horizontal_scaler": ["--mode", "eager"],
        "scheduler": ["--policy", "static-mps"],
        "node_agent": ["--initial-grant", "request"],
    },
    "static-mps": {
        "vertical_scaler": ["--mode", "static-limit"],
        "horizontal_scaler": ["--mode", "eager"],
        "scheduler": ["--policy", "static-mps"],
        "node_agent": ["--initial-grant", "request"],
    },
    "exclusive": {
        "vertical_scaler": ["--mode", "off"],
        "horizontal_scaler": ["--mode", "eager"],
        "scheduler": ["--policy", "exclusive"],
        "node_agent": ["--initial-grant", "limit"],
    },
}
SERVICES = ["scheduler", "profiler", "node_agent", "vertical_scaler", "horizontal_scaler"]


def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """Fail fast on a NATS URL nothing listens on (services would wait for it forever).
    Raises RuntimeError naming the URL and the reason."""
    parsed = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        host, port = parsed.hostname, parsed.port or 4222
    except ValueError as exc:  # a port that is not a number
        raise RuntimeError(f"bad NATS URL {url!r}: {exc}") from None
    if not host:
        raise RuntimeError(f"bad NATS URL {url!r}: no host")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise RuntimeError(f"cannot reach NATS at {url}: {exc}") from None


@dataclass
class ServiceProc:
    name: str
    proc: subprocess.Popen
    metrics_port: int
    log_path: Path


@dataclass
class Cluster:
    """Start with :meth:`start`, stop with :meth:`stop` (idempotent; also a context manager)."""

    log_dir: Path
    policy: str = "dilu"
    gpus: str = "4"
    node: str = "node0"
    nats_url: str | None = None
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    services: dict[str, ServiceProc] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.nats_url or (self.nats.url if self.nats else "")

    def start(self) -> "Cluster":
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.nats_url:
            self.nats = EmbeddedNats().start()
        else:
            check_reachable(self.nats_url)
        try:
            for name in SERVICES:
                self._spawn(name)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _args(self, name: str) -> list[str]:
        args = list(POLICIES[self.policy].get(name, []))
        if name == "node_agent":
            # the demo's functions replay model kernels, which run on emulated GPUs (or torch on a CPU node)
            args += ["--node", self.node, "--gpus", self.gpus] + ([] if self.gpus == "cpu" else ["--device", "emulated"])
        if name in ("vertical_scaler", "profiler"):
            args += ["--node", self.node]
        return args + self.extra_args.get(name, [])

    def _spawn(self, name: str) -> None:
        port = free_port()
        log_path = self.log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", f"dilu.services.{name}", "--nats-url", self.url, "--metrics-port", str(port), *self._args(name)]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.services[name] = ServiceProc(name, proc, port, log_path)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every service answers 200 on /readyz; RuntimeError names the laggard or
        the one that exited (with the tail of its log)."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.services)
        while pending:
            for name in sorted(pending):
                svc = self.services[name]
                if svc.proc.poll() is not None:
                    raise RuntimeError(f"service {name} exited with code {svc.proc.returncode}:\n{self.log_tail(name)}")
                if _http_ok(f"http://127.0.0.1:{svc.metrics_port}/readyz"):
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"services not ready after {timeout_s:.0f} s: {', '.join(sorted(pending))}")
            time.sleep(0.1)

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.services[name].log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics(self, name: str) -> dict[str, float]:
        """Scrape one service's /metrics: ``{"sample_name{label=value,...}": value}`` (and
        unlabelled samples by bare name). Empty when the service is gone."""
        svc = self.services.get(name)
        if svc is None:
            return {}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def stop(self) -> None:
        """SIGTERM every service (node agent last drained by its own stop), wait, then SIGKILL."""
        # stop the scalers first so nothing asks for new instances while the node drains
        order = ["horizontal_scaler", "vertical_scaler", "profiler", "scheduler", "node_agent"]
        for name in order:
            svc = self.services.get(name)
            if svc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name in order:
            svc = self.services.get(name)
            if not svc:
                continue
            try:
                svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait()
            _kill_group(svc.proc.pid)  # instances the service left behind, if any
        self.services.clear()
        if self.nats:
            self.nats.stop()
            self.nats = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
