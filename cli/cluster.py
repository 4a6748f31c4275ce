"""A local Dilu cluster: nats-server plus the five services (and optionally the gateway), each
its own OS process.

Used by ``dilu up``, ``dilu demo`` and ``dilu compare`` (and the end-to-end tests). Services start
in their own process sessions so a Ctrl-C in the terminal reaches only the orchestrator, which
then stops them in order: SIGTERM (each drains; the node agent retires its instances), SIGKILL
after ``STOP_TIMEOUT_S``, nats-server last. Each service's stdout and stderr (JSON log lines) go
to ``<log_dir>/<service>.log``, nats-server's to ``<log_dir>/nats-server.log``.

With ``auth`` (what ``dilu up``, ``dilu demo``, ``compare`` and ``chaos`` use) the cluster's own
nats-server admits only the users of ``dilu creds`` (:func:`cli.creds.ensure_creds`, kept in
``creds_root``) with their roles' permissions, and each service connects as its role
(``DILU_NATS_CREDS``, ``DILU_NATS_INBOX_PREFIX``; the node agent's instances with the instance
credentials, ``--instance-creds``). :meth:`Cluster.nats_options` gives a role's connection
settings to a client of the cluster (the load generator connects as caller and operator).
"""
from __future__ import annotations

import os
import select
import shutil
import tempfile
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from dilu.services.common.lifetime import tied_to_caller
from dilu.client.errors import Unreachable
from dilu.services.common.natsconn import ENV_CREDS, ENV_INBOX_PREFIX, NatsOptions, connect_failure
from dilu.services.common.metrics import PID_HEADER
from dilu.services.common.natsserver import MAX_PAYLOAD_BYTES, EmbeddedNats, free_ports
from dilu.services.common.permissions import SERVICE_ROLES, inbox_prefix
from dilu.services.common.policies import POLICIES as _POLICY_MODES

from .creds import AUTH_CONF, ensure_creds, role_creds

STOP_TIMEOUT_S = 28.0
READY_TIMEOUT_S = 90.0

# --policy -> the knobs of each service it sets, derived from the one table of named policies
# (services/common/policies.py, which says what each policy is; the simulator reads it too)
POLICIES: dict[str, dict[str, list[str]]] = {name: m.service_args() for name, m in _POLICY_MODES.items()}
POLICY_HELP = ("the platform's policy: dilu (tokens resized per instance, lazy horizontal scaling); baselines: "
               "horizontal-only (Knative's KPA over fixed quotas), static-mps (fixed slices), exclusive (a GPU "
               "per instance), dilu-published (the paper's vertical scaling)")
SERVICES = ["scheduler", "profiler", "node_agent", "vertical_scaler", "horizontal_scaler"]
GATEWAY = "gateway"
NATS = "nats-server"  # its name where a process of the cluster is named (logs, exits)
# Stop order, one stage after the other: the gateway takes no new requests and answers those in
# flight while instances still run; then the control plane, so nothing asks for new instances or
# places them while the node drains; the node agent last (it retires its instances); nats-server
# after all of them.
STOP_STAGES = [[GATEWAY], ["horizontal_scaler", "vertical_scaler", "profiler", "scheduler"], ["node_agent"]]


def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """Fail fast on a NATS URL nothing listens on (services would wait for it forever).
    Raises :class:`Unreachable` (exit code 5, as for every command) naming the URL and the reason
    in the words of :func:`connect_failure`; RuntimeError for a URL without a host or port."""
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
        raise Unreachable(f"cannot reach NATS at {url}: {connect_failure(exc, timeout_s)}") from None


@dataclass
class ServiceProc:
    name: str
    proc: subprocess.Popen
    metrics_port: int
    log_path: Path


class StartInterrupted(RuntimeError):
    """:meth:`Cluster.start` was asked to give up (its ``abort`` callable said so) before ready."""


@dataclass
class Cluster:
    """Start with :meth:`start`, stop with :meth:`stop` (idempotent; also a context manager).

    ``log_dir``: the services' logs. ``policy``: a key of POLICIES. ``gpus``: the node agent's
    ``--gpus`` (all, a count, cpu). ``device``: its ``--device`` (auto, nvml, emulated; a CPU
    node always runs auto). ``node``: the node name (agent, vertical scaler, profiler).
    ``nats_url``: a running NATS server to use; otherwise one is started on ``nats_port`` (0: a
    free one) with its JetStream store in ``nats_store`` (kept; None: a temporary one, removed).
    ``gateway``: also run the gateway, its HTTP API on ``gateway_host:gateway_port`` (0: a free
    port). ``extra_args``: more command-line arguments per service. Metrics ports are free ports
    chosen at start (``services[name].metrics_port``). ``auth``: the started nats-server
    requires credentials (module docstring), generated in (or reused from) ``creds_root``
    (None: a temporary directory removed at stop); ignored with ``nats_url`` (whoever runs that
    server brings the credentials, e.g. in ``DILU_NATS_CREDS``).
    """

    log_dir: Path
    policy: str = "dilu"
    gpus: str = "4"
    node: str = "node0"
    nats_url: str | None = None
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    device: str = "emulated"  # the demo's functions replay model kernels, which run on emulated GPUs
    nats_port: int = 0
    nats_store: Path | None = None
    gateway: bool = False
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0
    auth: bool = False
    creds_root: Path | None = None
    nats: EmbeddedNats | None = None
    services: dict[str, ServiceProc] = field(default_factory=dict)
    _tmp_creds: str | None = None

    @property
    def secured(self) -> bool:
        """Whether this cluster's processes connect with role credentials."""
        return self.auth and not self.nats_url

    def role_creds(self, role: str) -> Path | None:
        """The credentials file of ``role`` (this cluster's node for a node-scoped role); None
        without auth. Valid once :meth:`start` has generated them."""
        if not self.secured or self.creds_root is None:
            return None
        return role_creds(self.creds_root, role, self.node)

    def nats_options(self, role: str) -> NatsOptions:
        """How a client of this cluster connects as ``role`` (a role of
        :mod:`~dilu.services.common.permissions`): the URL, and with auth its credentials and
        inbox prefix."""
        creds = self.role_creds(role)
        if creds is None:
            return NatsOptions.of(self.url)
        return NatsOptions(servers=(self.url,), creds=creds, inbox_prefix=inbox_prefix(role, self.node))

    @property
    def url(self) -> str:
        return self.nats_url or (self.nats.url if self.nats else "")

    @property
    def gateway_url(self) -> str:
        """The gateway's HTTP base URL (``http://host:port``); empty when it does not run."""
        if not self.gateway:
            return ""
        return f"http://{self.gateway_host}:{self.gateway_port}"

    @property
    def service_names(self) -> list[str]:
        """The services this cluster runs, in start order (the gateway last, once the rest spawned)."""
        return SERVICES + ([GATEWAY] if self.gateway else [])

    def start(self, abort: Callable[[], bool] | None = None) -> "Cluster":
        """Start nats-server (unless ``nats_url``) and the services, and wait until each answers
        /readyz. ``abort``: polled while waiting; True stops everything and raises
        StartInterrupted. Raises ValueError (unknown policy), RuntimeError (a service exited, or
        not ready in READY_TIMEOUT_S; nats-server did not start), TimeoutError, OSError;
        nothing is left running after any of them."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # every port chosen here at once, so no two of them repeat (free ports picked one by one
        # can: about 1 cluster start in 700 drew a port twice, and the second service to bind it
        # then exited while its twin answered its readiness check)
        ports = iter(free_ports(len(self.service_names) + 2))
        if self.gateway and not self.gateway_port:
            self.gateway_port = next(ports)
        nats_port = self.nats_port or next(ports)
        try:
            if not self.nats_url:
                config = None
                if self.auth:
                    if self.creds_root is None:
                        self.creds_root = Path(self._tmp_creds or tempfile.mkdtemp(prefix="dilu-creds-"))
                        self._tmp_creds = str(self.creds_root)
                    ensure_creds(self.creds_root, [self.node])
                    config = self.creds_root / AUTH_CONF
                self.nats = EmbeddedNats(nats_port, store_dir=self.nats_store, log_path=self.log_dir / f"{NATS}.log",
                                         config=config, max_payload_bytes=MAX_PAYLOAD_BYTES).start()
            else:
                check_reachable(self.nats_url)
            for name in self.service_names:
                self._spawn(name, next(ports))
            self.wait_ready(abort=abort)
        except BaseException:
            self.stop()
            raise
        return self

    def _args(self, name: str) -> list[str]:
        args = list(POLICIES[self.policy].get(name, []))
        if name == "node_agent":
            # a CPU node (torch handlers) takes no device mode: the agent refuses one with --gpus cpu
            device = "auto" if self.gpus == "cpu" else self.device
            args += ["--node", self.node, "--gpus", self.gpus, "--device", device]
        if name in ("vertical_scaler", "profiler"):
            args += ["--node", self.node]
        if name == GATEWAY:
            args += ["--host", self.gateway_host, "--port", str(self.gateway_port)]
        if name == "node_agent" and self.secured:
            args += ["--instance-creds", str(self.role_creds("instance"))]
        return args + self.extra_args.get(name, [])

    def _env(self, name: str) -> dict[str, str]:
        """The environment of service ``name``: this one's, with its role's credentials and inbox
        prefix when the cluster has auth."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.secured:
            options = self.nats_options(SERVICE_ROLES[name])
            env[ENV_CREDS] = str(options.creds)
            env[ENV_INBOX_PREFIX] = options.inbox_prefix or ""
        return env

    def _spawn(self, name: str, port: int) -> None:
        log_path = self.log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", f"dilu.services.{name}", "--nats-url", self.url, "--metrics-port", str(port), *self._args(name)]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=self._env(name), preexec_fn=tied_to_caller())
        self.services[name] = ServiceProc(name, proc, port, log_path)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to service ``name`` (or NATS, nats-server: SIGKILL only, store kept).
        SIGKILL also waits until the process has ended. Raises KeyError for a name not running here."""
        if name == NATS:
            if self.nats is None:
                raise KeyError(f"{NATS} was not started by this cluster")
            self.nats.kill()
            return
        proc = self.services[name].proc
        if proc.poll() is None:
            proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait()

    def restart(self, name: str) -> None:
        """Start service ``name`` (or nats-server) again after it ended, as a supervisor with
        ``Restart=on-failure`` would: same arguments, same metrics port (the gateway: same HTTP
        port), nats-server on the same port and store. Returns once it is spawned; readiness is
        :meth:`ready`'s. Raises RuntimeError while the old process still runs."""
        if name == NATS:
            if self.nats is None or (self.nats.proc and self.nats.proc.poll() is None):
                raise RuntimeError(f"{NATS} is not stopped")
            self.nats.start()
            return
        svc = self.services[name]
        if svc.proc.poll() is None:
            raise RuntimeError(f"service {name} is still running (pid {svc.proc.pid})")
        _kill_group(svc.proc.pid)  # what the dead service left behind in its process group
        self._spawn(name, svc.metrics_port)

    def ready(self, name: str) -> bool:
        """Service ``name`` runs and answers 200 on /readyz (nats-server: accepts connections)."""
        if name == NATS:
            if self.nats is None or self.nats.proc is None or self.nats.proc.poll() is not None:
                return False
            try:
                check_reachable(self.url, timeout_s=0.5)
                return True
            except Unreachable:
                return False
        svc = self.services.get(name)
        return bool(svc and svc.proc.poll() is None and _answers_ready(svc))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, abort: Callable[[], bool] | None = None) -> None:
        """Block until every service answers 200 on /readyz; RuntimeError names the laggard or
        the one that exited (with the tail of its log); StartInterrupted once ``abort()`` is True."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.services)
        while pending:
            if abort is not None and abort():
                raise StartInterrupted("stopped before every service was ready")
            for name in sorted(pending):
                svc = self.services[name]
                if svc.proc.poll() is not None:
                    raise RuntimeError(self._exit_reason(name, svc.proc.returncode))
                if _answers_ready(svc):
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"services not ready after {timeout_s:.0f} s: {', '.join(sorted(pending))}")
            time.sleep(0.1)

    def _exit_reason(self, name: str, code: int) -> str:
        """Why service ``name`` stopped at start: its own one-line reason when it refused to
        start (status 2, last log line ``dilu <name>: ...``, see services/common/runner.py),
        else its exit code and the tail of its log."""
        tail = self.log_tail(name)
        last = tail.splitlines()[-1] if tail else ""
        if code == 2 and last.startswith(f"dilu {name}: "):
            return last
        return f"service {name} exited with code {code}:\n{tail}"

    def log_path(self, name: str) -> Path:
        """Where the log of ``name`` (a service, or NATS = "nats-server") goes."""
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of the log of ``name`` (a service or "nats-server"); empty
        when it cannot be read."""
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exited(self) -> tuple[str, int] | None:
        """The first process of the cluster that is no longer running, as (name, exit code; a
        negative code is the signal that ended it), nats-server included when started here;
        None while all run."""
        for name, proc in self._procs().items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def wait_exit(self, wake_fd: int | None = None, timeout_s: float | None = None) -> tuple[str, int] | None:
        """Block until a process of the cluster exits (returns :meth:`exited`'s pair), ``wake_fd``
        becomes readable (e.g. the signal.set_wakeup_fd pipe), or ``timeout_s`` seconds pass
        (then None). Woken by the processes' pidfds, without polling their state."""
        poller = select.poll()
        pidfds: list[int] = []
        try:
            for proc in self._procs().values():
                try:
                    fd = os.pidfd_open(proc.pid)
                except (OSError, AttributeError):  # already reaped, or no pidfd on this kernel
                    timeout_s = 1.0 if timeout_s is None else min(timeout_s, 1.0)
                    continue
                pidfds.append(fd)
                poller.register(fd, select.POLLIN)
            if wake_fd is not None:
                poller.register(wake_fd, select.POLLIN)
            if self.exited() is None:
                poller.poll(None if timeout_s is None else timeout_s * 1000)
            return self.exited()
        finally:
            for fd in pidfds:
                os.close(fd)

    def _procs(self) -> dict[str, subprocess.Popen]:
        procs = {name: svc.proc for name, svc in self.services.items()}
        if self.nats and self.nats.proc:
            procs[NATS] = self.nats.proc
        return procs

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
        """Stop the services stage by stage (STOP_STAGES): SIGTERM a stage, wait up to
        STOP_TIMEOUT_S for it, SIGKILL what is left of it, and of each service's process group
        (instances it left behind); then nats-server. A kept store (``nats_store``) stays."""
        for stage in STOP_STAGES:
            procs = [self.services[n] for n in stage if n in self.services]
            for svc in procs:
                if svc.proc.poll() is None:
                    svc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for svc in procs:
                try:
                    svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill_group(svc.proc.pid)
                    svc.proc.wait()
                _kill_group(svc.proc.pid)  # instances the service left behind, if any
                del self.services[svc.name]
        self.services.clear()
        if self.nats:
            self.nats.stop()
            self.nats = None
        if self._tmp_creds:
            shutil.rmtree(self._tmp_creds, ignore_errors=True)
            self._tmp_creds = None
            self.creds_root = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _answers_ready(svc: ServiceProc) -> bool:
    """Whether ``svc``'s own process answers 200 on its /readyz. Another process that holds the
    port (the service could not bind it and is exiting) does not count: its ``Dilu-Pid`` differs."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/readyz", timeout=0.5) as resp:
            return resp.status == 200 and resp.headers.get(PID_HEADER) == str(svc.proc.pid)
    except OSError:
        return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
