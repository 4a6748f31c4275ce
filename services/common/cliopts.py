"""Click helpers and defaults the command-line entry points share.

One rule for configuration: every option of a service can also come from an environment variable
named ``DILU_`` + the option's name in capitals with underscores (``--nats-url`` ->
``DILU_NATS_URL``, ``--keep-alive-s`` -> ``DILU_KEEP_ALIVE_S``); a flag on the command line wins
(click's ``auto_envvar_prefix``). systemd units and Nomad jobs use exactly these names.
"""
from __future__ import annotations

import math
import socket
from pathlib import Path
from urllib.parse import urlsplit

import click

ENV_PREFIX = "DILU"

# Default /metrics, /healthz, /readyz port of each service (docs/operations.md section 7).
METRICS_PORTS = {
    "profiler": 9101,
    "scheduler": 9102,
    "horizontal_scaler": 9103,
    "vertical_scaler": 9104,
    "node_agent": 9105,
    "gateway": 9106,  # its HTTP API is --port (8080); this is the runner's health server
}


LOG_LEVELS = ("debug", "info", "warning", "error")
NATS_SCHEMES = ("nats", "tls", "ws", "wss")
MAX_NODE_NAME = 64  # characters; a node name also names shared-memory segments (NAME_MAX 255)


class Finite(click.FloatRange):
    """click.FloatRange that also refuses NaN and infinities (a NaN passes every comparison)."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def check_nats_url(ctx, param, value: str) -> str:
    """Click callback: a NATS URL with a known scheme, a host and a port in 1..65535 (nats-py
    would otherwise raise a traceback, or retry a nonsense host for ever). Raises BadParameter."""
    parts = urlsplit(value if "://" in value else f"nats://{value}")
    try:
        port = parts.port
    except ValueError:
        raise click.BadParameter(f"{value!r} has no valid port (1..65535)") from None
    if parts.scheme not in NATS_SCHEMES or not parts.hostname or (port is not None and port < 1):
        raise click.BadParameter(f"{value!r} is not a NATS URL like nats://host:4222 "
                                 f"(schemes: {', '.join(NATS_SCHEMES)})")
    return value


def check_node(ctx, param, value: str) -> str:
    """Click callback: a node name is non-empty, at most MAX_NODE_NAME characters, without
    whitespace. Raises BadParameter."""
    if value is None:
        return value
    if not value or len(value) > MAX_NODE_NAME or any(c.isspace() for c in value):
        raise click.BadParameter(f"a node name is 1..{MAX_NODE_NAME} characters without spaces, got {value!r}")
    return value


def nats_url_option(f):
    """``--nats-url`` (env DILU_NATS_URL), checked by :func:`check_nats_url`."""
    return click.option("--nats-url", default="nats://127.0.0.1:4222", show_default=True, callback=check_nats_url,
                        help="NATS server (one cluster member is enough)")(f)


def log_level_option(f):
    """``--log-level`` (env DILU_LOG_LEVEL): one of LOG_LEVELS."""
    return click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info",
                        show_default=True)(f)


def metrics_port_option(service: str):
    """``--metrics-port`` (env DILU_METRICS_PORT), defaulting to the service's documented port."""
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=METRICS_PORTS[service],
                        show_default=True, help="/metrics, /healthz, /readyz (0: any free port; bound to "
                                                "DILU_METRICS_HOST, default 127.0.0.1)")


def default_node() -> str:
    """This host's node name: its host name up to the first dot is not enough (two racks may reuse
    short names), so the full ``socket.gethostname()``; subjects sanitise it (DESIGN.md section 5)."""
    return socket.gethostname() or "localhost"


def service_main(command: click.Command, **kwargs) -> None:
    """Run a service's click ``command`` with the ``DILU_*`` environment rule (module docstring)."""
    command.main(auto_envvar_prefix=ENV_PREFIX, **kwargs)


def writable_output(ctx, param, value):
    """Click callback for an output file option (``--json``): the file must be writable, checked
    before a run rather than after minutes of it, by opening it for appending (a file this
    creates is removed again; permission bits alone would pass for root on /sys or /proc).
    Raises click.BadParameter naming the path and the reason."""
    if value is not None:
        path = Path(value)
        existed = path.exists()
        try:
            with path.open("a"):
                pass
        except OSError as exc:
            raise click.BadParameter(f"cannot write {value}: {exc.strerror or exc}") from None
        if not existed:
            path.unlink(missing_ok=True)
    return value


def flag_envvars(command: click.Command) -> click.Command:
    """Let each option of ``command`` (and of its subcommands) that names no variable of its own
    come from ``DILU_<FLAG>``, named after its long flag (``--nats-url`` -> ``DILU_NATS_URL``,
    ``--timeout`` -> ``DILU_TIMEOUT``), not after its Python name as click's
    ``auto_envvar_prefix`` would (``timeout_s`` -> ``DILU_TIMEOUT_S``). Returns ``command``."""
    for param in command.params:
        longs = [o for o in getattr(param, "opts", []) if o.startswith("--")]
        if isinstance(param, click.Option) and param.envvar is None and longs:
            param.envvar = f"{ENV_PREFIX}_{longs[0][2:].replace('-', '_').upper()}"
    return command
