"""Click helpers the command-line entry points share."""
from __future__ import annotations

import os
from pathlib import Path

import click


def writable_output(ctx, param, value):
    """Click callback for an output file option (``--json``): its directory must exist and be
    writable, checked before a run rather than after minutes of it. Raises click.BadParameter."""
    if value is not None:
        parent = Path(value).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"cannot write {value}: {parent} is not a writable directory")
    return value
