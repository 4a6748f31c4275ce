"""``dilu up``: a whole local Dilu cluster in the foreground.

nats-server with JetStream (its store in ``<data-dir>/nats``, kept across runs), the five
services, the gateway and one node agent, each its own OS process (:class:`cli.cluster.Cluster`).
It prints where everything listens, then waits: Ctrl-C or SIGTERM stops everything in order
(nats-server last, the store kept); a service that dies is reported with the end of its log and
stops the rest, with a non-zero exit. A later ``dilu up`` on the same data directory resumes: the
deployed functions live in the JetStream buckets of the kept store, and the node keeps its name,
so the services rebuild from them. One ``dilu up`` per data directory at a time (a lock file).

NATS requires credentials: ``<data-dir>/creds/<role>.creds`` (``dilu creds``, generated on the
first run and reused after; ``<data-dir>/nats-auth.conf`` is the server's side) and each service
connects as its role. ``--no-auth`` (``DILU_NO_AUTH``) runs an open server instead.
"""
from __future__ import annotations

import fcntl
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import click
import platformdirs

from dilu.services.common.cliopts import (ENV_PREFIX, PARK_AFTER_S_TYPE, NonEmptyPath, ZeroOrAtLeast, check_node,
                                         default_node, write_failure)
from dilu.services.common.natsserver import port_in_use
from dilu.services.common.policies import DEFRAG_INTERVAL_MIN_S, DEFRAG_INTERVAL_S, PARK_AFTER_S
from dilu.services.node_agent.__main__ import parse_gpus
from dilu.services.node_agent import nvml
from dilu.services.node_agent.devices import MODES

from .cluster import POLICIES, POLICY_HELP, Cluster, StartInterrupted

LOCK_NAME = "up.lock"
HOST = "127.0.0.1"  # everything listens on loopback: a local cluster


class Refused(click.ClickException):
    """``dilu up`` cannot start here (a port taken, the data directory in use or not writable); exit status 2,
    as the services exit when they cannot start."""

    exit_code = 2


@dataclass(frozen=True)
class UpOptions:
    """``dilu up``'s options, checked (see the click options for meanings)."""

    nats_port: int
    gateway_port: int
    data_dir: Path
    device: str
    gpus: str
    node: str
    policy: str
    log_dir: Path
    auth: bool = True
    park_after_s: float | None = None  # seconds; 0: never; None: the policy's
    defrag_interval_s: float | None = None  # seconds; 0: never; None: the policy's

    @property
    def store_dir(self) -> Path:
        """The JetStream store: ``<data-dir>/nats``."""
        return self.data_dir / "nats"


class DataDirLock:
    """An exclusive ``flock`` on ``<data-dir>/up.lock`` while ``dilu up`` runs, with its pid in
    the file. The kernel releases it when the process ends, however it ends, so a stale lock
    file never blocks a later run. A context manager; :meth:`acquire` raises :class:`Refused`
    when another process holds it and OSError when the file cannot be opened."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def check(self) -> None:
        """Raise :class:`Refused` when another process holds the lock, creating nothing: no lock
        file (or none this user may open) counts as free, and :meth:`acquire` has the last word."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return
        self._lock(fd)
        os.close(fd)  # releases the probe's flock

    def acquire(self) -> "DataDirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the services
        self._lock(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def _lock(self, fd: int) -> None:
        """flock ``fd``; when another process holds it, close ``fd`` and raise :class:`Refused`
        naming that process (its pid from the file)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise Refused(f"another dilu up (pid {holder}) is running on {self.path.parent}; "
                          f"stop it first or pick another --data-dir") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "DataDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _creatable(path: Path, what: str) -> None:
    """Refuse ``path`` before anything is created when it, or the nearest of its parents that
    exists, is not a directory or takes no file (:class:`Refused`, naming ``what``; a probe file
    written and removed there, since root passes every access check): then neither of ``dilu
    up``'s directories is made when the other cannot be."""
    there = path
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise Refused(f"{what} {path} is not a writable directory: {there} is not a directory")
    _probe(there, path, what)


def _probe(folder: Path, path: Path, what: str) -> None:
    """Create and remove a file in ``folder``; :class:`Refused` naming ``what`` ``path`` if that fails."""
    probe = folder / f".dilu-write-check-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise Refused(f"{what} {path} is not a writable directory: "
                      f"{write_failure(exc, folder, 'it' if folder == path else str(folder))}") from None


def _directory(path: Path, what: str) -> Path:
    """Create ``path`` (and parents) and check that files can be created in it (a write, since
    root passes every access check). Raises :class:`Refused` (exit 2, bad input) naming ``what``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Refused(f"{what} {path} is not a writable directory: {write_failure(exc, path.parent)}") from None
    _probe(path, path, what)
    return path


def check_options(opts: UpOptions) -> None:
    """What the click types cannot check alone; raises click.UsageError."""
    if opts.gpus == "cpu" and opts.device != "auto":
        raise click.UsageError(f"--gpus cpu runs functions on the CPU, but --device {opts.device} asks for a GPU: "
                               f"leave --device at auto")
    if opts.nats_port == opts.gateway_port:
        raise click.UsageError(f"--nats-port and --gateway-port are both {opts.nats_port}")
    if opts.device == "nvml" and not nvml.available():  # the node agent would fail, after the rest started
        raise click.UsageError("--device nvml: no NVIDIA driver or GPU here (NVML did not start); "
                               "use --device auto or emulated")


def check_ports(opts: UpOptions) -> None:
    """Both listening ports must be free on loopback; raises :class:`Refused` naming the option."""
    for port, option in ((opts.nats_port, "--nats-port"), (opts.gateway_port, "--gateway-port")):
        if port_in_use(port, HOST):
            raise Refused(f"port {port} on {HOST} is in use ({option}): is another dilu up or "
                          f"nats-server running? Stop it or pick another port")


class StopSignals:
    """SIGINT and SIGTERM, while inside, only mark a stop as requested and wake :attr:`fd`
    (``signal.set_wakeup_fd``), so that a wait on the services' exits and the signals is one
    poll and a stop in progress is never interrupted. Main thread only."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.fd = -1
        self._w = -1
        self._old: dict = {}
        self._old_fd = -1

    def requested(self) -> bool:
        return self.signum is not None

    def _on_signal(self, signum, _frame) -> None:
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w)
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.fd)
        os.close(self._w)


def cluster_for(opts: UpOptions) -> Cluster:
    """The Cluster ``dilu up`` runs for ``opts`` (not started); ``opts.park_after_s`` and
    ``opts.defrag_interval_s``, when set, replace the policy's parking delay on the horizontal
    scaler and its defragmentation interval on the scheduler."""
    extra = {}
    if opts.park_after_s is not None:
        extra["horizontal_scaler"] = ["--park-after-s", f"{opts.park_after_s:g}"]
    if opts.defrag_interval_s is not None:
        extra["scheduler"] = ["--defrag-interval-s", f"{opts.defrag_interval_s:g}"]
    return Cluster(log_dir=opts.log_dir, policy=opts.policy, gpus=opts.gpus, node=opts.node, device=opts.device,
                   nats_port=opts.nats_port, nats_store=opts.store_dir, gateway=True, gateway_host=HOST,
                   gateway_port=opts.gateway_port, auth=opts.auth, creds_root=opts.data_dir, extra_args=extra)


def describe(cluster: Cluster, opts: UpOptions, resumed: bool) -> list[str]:
    """The lines printed once the cluster is ready: where each part listens and logs."""
    store = f"JetStream store {opts.store_dir}" + (", resumed" if resumed else ", new")
    lines = [f"dilu up: node {opts.node}, policy {opts.policy}, device {opts.device}, gpus {opts.gpus}",
             f"  NATS     {cluster.url}  ({store})",
             f"  gateway  {cluster.gateway_url}"]
    for name in cluster.service_names:
        svc = cluster.services[name]
        lines.append(f"  metrics  {name:<18} http://{HOST}:{svc.metrics_port}/metrics")
    lines.append(f"  logs     {opts.log_dir}")
    if opts.auth:
        lines.append(f"  creds    {opts.data_dir / 'creds'}  (operator: --creds {cluster.role_creds('operator')})")
    else:
        lines.append("  creds    none: NATS admits anyone (--no-auth)")
    lines.append("ready: Ctrl-C or SIGTERM stops everything (the store is kept)")
    return lines


def run_up(opts: UpOptions) -> None:
    """Check, lock the data directory, start, wait, stop (module docstring). Returns after a
    requested stop; raises click.ClickException (exit 1) when the cluster does not start or a
    part of it dies, :class:`Refused` (exit 2) when the data directory or a port is taken. A
    refusal comes before anything is created (no data or log directory, no lock file)."""
    check_options(opts)
    DataDirLock(opts.data_dir).check()  # first: a second dilu up here also holds the ports
    check_ports(opts)
    _creatable(opts.data_dir, "--data-dir")
    _creatable(opts.log_dir, "--log-dir")
    _directory(opts.data_dir, "--data-dir")
    _directory(opts.log_dir, "--log-dir")
    try:
        lock = DataDirLock(opts.data_dir).acquire()
    except OSError as exc:
        raise click.ClickException(f"cannot create the lock file in {opts.data_dir}: {exc.strerror or exc}") from None
    try:
        resumed = (opts.store_dir / "jetstream").is_dir()
        cluster = cluster_for(opts)
        with StopSignals() as signals:
            _serve(cluster, opts, signals, resumed)
    finally:
        lock.release()


def _serve(cluster: Cluster, opts: UpOptions, signals: StopSignals, resumed: bool) -> None:
    click.echo(f"starting nats-server and {len(cluster.service_names)} services; logs in {opts.log_dir}")
    try:
        cluster.start(abort=signals.requested)
    except StartInterrupted:
        click.echo("stopped before ready")
        return
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    died = None
    try:
        for line in describe(cluster, opts, resumed):
            click.echo(line)
        while not signals.requested():
            died = cluster.wait_exit(signals.fd)
            if died:
                break
            _drain(signals.fd)
    finally:
        if died is None:
            click.echo(f"stopping ({signal.Signals(signals.signum).name if signals.signum else 'exit'})")
        cluster.stop()
    if died:
        name, code = died
        log = cluster.log_path(name)
        tail = cluster.log_tail(name)
        how = f"{code} ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else str(code)
        raise click.ClickException(f"{name} exited with code {how} while up; everything stopped. "
                                   f"End of {log}:\n{tail}")
    click.echo(f"stopped; the store is kept in {opts.store_dir}")


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


def default_data_dir() -> Path:
    """The user's state directory for Dilu (platformdirs: ``~/.local/state/dilu`` on Linux)."""
    return Path(platformdirs.user_state_dir("dilu"))


def _gpus(_ctx, _param, value: str) -> str:
    parse_gpus(value)  # the node agent's own rule; raises click.BadParameter
    return value


@click.command(context_settings={"auto_envvar_prefix": ENV_PREFIX})
@click.option("--nats-port", type=click.IntRange(1, 65535), default=4222, show_default=True,
              help=f"NATS client port on {HOST}")
@click.option("--gateway-port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help=f"the gateway's HTTP port on {HOST}")
@click.option("--data-dir", type=NonEmptyPath(path_type=Path), default=default_data_dir, show_default="user state dir",
              help="JetStream store (nats/), logs (logs/) and the lock file; kept across runs")
@click.option("--device", type=click.Choice(MODES), default="auto", show_default=True,
              help="the node agent's GPUs: auto (this host's GPU when there is one, else emulated), nvml, emulated")
@click.option("--gpus", default="all", show_default=True, callback=_gpus,
              help="GPUs to use: all (an emulated node has 4), a count, or 'cpu' (functions run on the CPU)")
@click.option("--node", default=default_node, show_default="host name", callback=check_node,
              help="node name; keep it stable so a restart finds its placements")
@click.option("--policy", type=click.Choice(list(POLICIES)), default="dilu", show_default=True, help=POLICY_HELP)
@click.option("--log-dir", type=NonEmptyPath(path_type=Path), default=None,
              help="each service's log (default: <data-dir>/logs)")
@click.option("--no-auth", is_flag=True, default=False,
              help="run NATS without credentials (default: every role has its own, in <data-dir>/creds)")
@click.option("--park-after-s", type=PARK_AFTER_S_TYPE, default=None, metavar="S",
              help="park an idle function's instances after this many seconds within its keep-alive (their GPU "
                   "share and device memory given back but for their CUDA context, weights kept in host memory "
                   "until a request resumes them); 0: never (default: the policy's, dilu after "
                   f"{PARK_AFTER_S:g} s, the others never)")
@click.option("--defrag-interval-s", type=ZeroOrAtLeast(DEFRAG_INTERVAL_MIN_S, 86_400), default=None, metavar="S",
              help="how often the scheduler moves instances off lightly used GPUs to empty them; 0: never "
                   f"(default: the policy's, dilu and dilu-published every {DEFRAG_INTERVAL_S:g} s, the others never)")
def up(nats_port, gateway_port, data_dir, device, gpus, node, policy, log_dir, no_auth, park_after_s,
       defrag_interval_s) -> None:
    """Run a local Dilu cluster in the foreground: nats-server, the services, the gateway and a
    node agent. Ctrl-C stops it; a later run on the same --data-dir resumes its functions.
    Every option can also be set as DILU_<OPTION> (e.g. DILU_NATS_PORT)."""
    data_dir = data_dir.expanduser().absolute()
    log_dir = log_dir.expanduser().absolute() if log_dir else data_dir / "logs"
    run_up(UpOptions(nats_port=nats_port, gateway_port=gateway_port, data_dir=data_dir, device=device, gpus=gpus,
                     node=node, policy=policy, log_dir=log_dir, auth=not no_auth, park_after_s=park_after_s,
                     defrag_interval_s=defrag_interval_s))

