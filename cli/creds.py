"""``dilu creds``: NATS credentials per role and the nats-server configuration that knows them.

Writes ``DIR/creds/<role>.creds`` (a user nkey seed between ``BEGIN/END USER NKEY SEED`` lines,
mode 0600, readable by ``--creds``) and ``DIR/nats-auth.conf`` (the ``authorization`` block to
``include`` in nats-server's configuration, each user with its role's permissions from
:mod:`dilu.services.common.permissions`). Node-scoped roles (node agent, vertical scaler) get
one user per node: ``<role>.<node>.creds``, or plain ``<role>.creds`` when there is one node.
Named callers (``--callers``) get a user each, ``caller.<name>.creds``, whose replies no other
caller can read (the shared ``caller.creds`` users all read one inbox prefix). A re-run keeps
every existing key (it never rotates one) and adds what is missing.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import click
import nkeys

from dilu.contracts import subjects
from dilu.services.common import files
from dilu.services.common.cliopts import NonEmptyPath, check_name, default_node, writable_dir
from dilu.services.common.natsconn import CREDS_MAX_BYTES, inbox_line
from dilu.services.common.permissions import NODE_SCOPED, ROLES, permissions, render_authorization

CREDS_DIR = "creds"
AUTH_CONF = "nats-auth.conf"
_HEADER = re.compile(r"^# dilu role (\S+)(?: (node|name) (\S+))?$", re.M)
_SEED = re.compile(r"\bSU[A-Z2-7]{56}\b")


class CredsError(click.ClickException):
    """Credentials cannot be written or an existing file does not fit (one line)."""


@dataclass(frozen=True)
class Identity:
    """One user: ``role`` (of ``node`` for a node-scoped role), its creds file and public nkey."""

    role: str
    node: str | None
    path: Path
    public_key: str
    caller: str | None = None


def creds_name(role: str, node: str | None, nodes: list[str]) -> str:
    """File name of a role's credentials: ``<role>.creds``; ``<role>.<node>.creds`` for a
    node-scoped role when there are several nodes."""
    if role in NODE_SCOPED and len(nodes) > 1:
        return f"{role}.{subjects.token(node)}.creds"
    return f"{role}.creds"


def _scope(node: str | None, caller: str | None) -> str:
    return f" node {node}" if node else f" name {caller}" if caller else ""


def _render(role: str, node: str | None, seed: str, caller: str | None = None) -> str:
    perms = permissions(role, node, caller=caller)
    lines = [f"# dilu role {role}{_scope(node, caller)}"]
    if perms.inbox_prefix:
        lines.append(inbox_line(perms.inbox_prefix))
    lines += ["-----BEGIN USER NKEY SEED-----", seed, "------END USER NKEY SEED------", ""]
    return "\n".join(lines)


def _read(path: Path, role: str, node: str | None, caller: str | None = None) -> str:
    try:
        text = files.read_bounded(path, CREDS_MAX_BYTES).decode(errors="replace")
    except OSError as exc:
        raise CredsError(f"cannot read {path}: {exc.strerror or exc}") from None
    seeds = _SEED.findall(text)
    header = _HEADER.search(text)
    if len(seeds) != 1 or header is None:
        raise CredsError(f"{path} is not a dilu creds file (one user nkey seed after a '# dilu role' line); "
                         f"move it away or pick another --out")
    kind = "node" if node else "name" if caller else ""
    if (header.group(1), header.group(2) or "", header.group(3) or "") != (role, kind, node or caller or ""):
        was = header.group(1) + (f" {header.group(2)} {header.group(3)}" if header.group(2) else "")
        now = role + _scope(node, caller)
        raise CredsError(f"{path} holds the key of {was}, not {now}: keys are never replaced; "
                         f"move it away or pick another --out")
    return seeds[0]


def _earlier_seed(folder: Path, role: str, node: str | None) -> str | None:
    """The seed ``node`` already had under the one-node name ``<role>.creds`` (from a run with fewer
    nodes), so adding a node never gives an existing one a new key; None when there is none."""
    single = folder / f"{role}.creds"
    if role not in NODE_SCOPED or not single.exists():
        return None
    try:
        return _read(single, role, node)
    except CredsError:  # another node's key
        return None


def ensure_creds(out: Path, nodes: list[str], callers: list[str] = ()) -> list[Identity]:
    """Create (or keep) every role's credentials under ``out/creds`` and write
    ``out/nats-auth.conf`` for them; returns the identities. ``nodes``: at least one node name;
    ``callers``: names of callers that get a user (and reply inbox) each.
    Raises CredsError (an unwritable directory, a file that is not ours or belongs to another
    role or node) and ValueError for an empty node list."""
    if not nodes:
        raise ValueError("at least one node is needed")
    folder = out / CREDS_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise CredsError(f"cannot create {folder}: {exc.strerror or exc}") from None
    identities: list[Identity] = []
    for role in ROLES:
        for node in (nodes if role in NODE_SCOPED else [None]):
            path = folder / creds_name(role, node, nodes)
            if path.exists():
                seed = _read(path, role, node)
            else:
                seed = _earlier_seed(folder, role, node) or nkeys.encode_seed(os.urandom(32),
                                                                              nkeys.PREFIX_BYTE_USER).decode()
                _write_private(path, _render(role, node, seed))
            public = nkeys.from_seed(seed.encode()).public_key.decode()
            identities.append(Identity(role, node, path, public))
    for name in callers:
        path = folder / f"caller.{subjects.token(name)}.creds"
        if path.exists():
            seed = _read(path, "caller", None, name)
        else:
            seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
            _write_private(path, _render("caller", None, seed, name))
        identities.append(Identity("caller", None, path, nkeys.from_seed(seed.encode()).public_key.decode(), name))
    text = ("# Generated by `dilu creds`: one NATS user per Dilu role (node-scoped roles per node).\n"
            "# Include it from nats-server's configuration: include \"nats-auth.conf\"\n"
            + render_authorization([(i.public_key, permissions(i.role, i.node, caller=i.caller, callers=tuple(callers)))
                                    for i in identities]))
    _write_private(out / AUTH_CONF, text, mode=0o644)
    return identities


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` with ``mode``, atomically (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CredsError(f"cannot write {path}: {exc.strerror or exc}") from None


def role_creds(out: Path, role: str, node: str | None = None, nodes: list[str] | None = None) -> Path:
    """Where ``ensure_creds(out, nodes)`` put the credentials of ``role`` (of ``node``)."""
    return out / CREDS_DIR / creds_name(role, node, nodes or [node])


def _nodes(ctx, param, value: str | None) -> list[str]:
    if value is None:
        return [default_node()] if param.name == "nodes" else []
    what = "caller" if param.name == "callers" else "node"
    names = [n.strip() for n in value.split(",")]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise click.BadParameter(f"a comma-separated list of distinct {what} names, got {value!r}")
    tokens = [subjects.token(n) for n in names]
    if len(set(tokens)) != len(tokens):
        raise click.BadParameter(f"{value!r}: two names give the same subject token")
    for n in names:
        check_name(n, what)
    return names


@click.command("creds")
@click.option("--out", "out", type=NonEmptyPath(path_type=Path, file_okay=False), required=True,
              callback=writable_dir, help="directory for creds/<role>.creds and nats-auth.conf")
@click.option("--nodes", callback=_nodes, default=None, show_default="host name",
              help="node names, comma-separated (node agents and vertical scalers get one user per node)")
@click.option("--callers", callback=_nodes, default=None,
              help="names of callers that each get their own user and reply inbox (caller.<name>.creds)")
def creds(out: Path, nodes: list[str], callers: list[str]) -> None:
    """Write NATS credentials for every Dilu role and the nats-server include that admits them.
    Existing keys are kept; missing ones are added."""
    identities = ensure_creds(out.expanduser().absolute(), nodes, callers)
    for i in identities:
        click.echo(f"{i.role + (' ' + (i.node or i.caller) if i.node or i.caller else ''):<28} {i.path}")
    click.echo(f"nats-server include: {out / AUTH_CONF}")
