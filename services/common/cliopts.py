"""Click helpers and defaults the command-line entry points share.

One rule for configuration: every option of a service can also come from an environment variable
named ``DILU_`` + the option's name in capitals with underscores (``--nats-url`` ->
``DILU_NATS_URL``, ``--keep-alive-s`` -> ``DILU_KEEP_ALIVE_S``); a flag on the command line wins
(click's ``auto_envvar_prefix``). systemd units and Nomad jobs use exactly these names.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import click

ENV_PREFIX = "DILU"

# Default /metrics, /healthz, /readyz port of each service (docs/operations.md section 7).
METRICS_PORTS = {
    "profiler": 9101,
    "scheduler": 9102,
    "horizontal_scaler": 9103,
    "vertical_scaler": 9104,
    "node_agent": 9105,
}


def default_node() -> str:
    """This host's node name: its host name up to the first dot is not enough (two racks may reuse
    short names), so the full ``socket.gethostname()``; subjects sanitise it (DESIGN.md section 5)."""
    return socket.gethostname() or "localhost"


def service_main(command: click.Command, **kwargs) -> None:
    """Run a service's click ``command`` with the ``DILU_*`` environment rule (module docstring)."""
    command.main(auto_envvar_prefix=ENV_PREFIX, **kwargs)


def writable_output(ctx, param, value):
    """Click callback for an output file option (``--json``): its directory must exist and be
    writable, checked before a run rather than after minutes of it. Raises click.BadParameter."""
    if value is not None:
        parent = Path(value).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"cannot write {value}: {parent} is not a writable directory")
    return value
