"""How a process reaches NATS: servers, identity (credentials), TLS and JetStream replicas.

One :class:`NatsOptions` travels from the command line (``cliopts.nats_options``: ``--nats-url``,
``--creds``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--replicas``, each also from its
``DILU_*`` variable) to every connection the process opens, through :func:`connect`. Services,
commands, the client library and instances all connect this way, so a deployment that turns on
credentials or TLS turns them on everywhere (docs/operations.md section 4: "Credentials",
"Replicas and existing state", "TLS").

Credentials (``--creds FILE``) are either

- a standard NATS ``.creds`` file (a user JWT and its nkey seed, as ``nsc`` writes them for a server
  in operator mode), or
- a user nkey seed (``SU...``), bare or between ``-----BEGIN USER NKEY SEED-----`` lines, for a
  server whose configuration lists the users' public nkeys (``dilu creds`` writes both sides).
"""
from __future__ import annotations

import os
import re
import socket
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.protocol.parser import AUTHORIZATION_VIOLATION, PERMISSIONS_ERR

from . import files

DEFAULT_URL = "nats://127.0.0.1:4222"
ENV_URL = "DILU_NATS_URL"
ENV_CREDS = "DILU_NATS_CREDS"
ENV_TLS_CA = "DILU_NATS_TLS_CA"
ENV_TLS_CERT = "DILU_NATS_TLS_CERT"
ENV_TLS_KEY = "DILU_NATS_TLS_KEY"
ENV_REPLICAS = "DILU_REPLICAS"
ENV_INBOX_PREFIX = "DILU_NATS_INBOX_PREFIX"
ENV_NATS = (ENV_CREDS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_REPLICAS, ENV_INBOX_PREFIX)  # what :meth:`NatsOptions.env` sets
MAX_REPLICAS = 5  # JetStream's limit for a stream's replicas

_JWT_MARK = b"BEGIN NATS USER JWT"
# a .creds file's JWT: one token (header.payload.signature, base64url) between its two lines
_JWT = re.compile(rb"-+BEGIN NATS USER JWT-+\s*[\r\n]+\s*([A-Za-z0-9_=-]+\.[A-Za-z0-9_=-]+\.[A-Za-z0-9_=-]+)\s*[\r\n]+\s*-+END NATS USER JWT-+")
_SEED = re.compile(rb"\bSU[A-Z2-7]{56}\b")  # a user nkey seed: "SU" + base32 (nkeys' encoding)


class CredentialsError(ValueError):
    """A ``--creds`` file that cannot be read or holds neither a user JWT nor a user nkey seed.
    The message is one line naming the file."""


@dataclass(frozen=True)
class NatsOptions:
    """Connection settings of one process.

    ``servers``: one or more URLs (``nats://``, ``tls://``, ``ws://``, ``wss://``); one cluster member is
    enough, more are tried in turn at connect. ``creds``: credentials file (module docstring) or
    None for a server without authentication. ``tls_ca``: CA bundle to verify the server with
    (None: no TLS unless the URL says ``tls://``, then the system's CAs); ``tls_cert`` and
    ``tls_key``: this client's certificate and key, for a server that verifies clients.
    ``replicas``: JetStream replicas of the streams and buckets this process creates (1 on a single
    server, 3 in the cluster configuration). ``inbox_prefix``: the subject prefix of this
    connection's reply inboxes (nats-py's ``inbox_prefix``; None: ``_INBOX``), for credentials
    that may only read replies under their own prefix (``dilu creds`` names it in each file);
    default: env ``DILU_NATS_INBOX_PREFIX``. Other credentials (:meth:`with_creds`) drop it.
    """

    servers: tuple[str, ...] = (DEFAULT_URL,)
    creds: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    replicas: int = 1
    inbox_prefix: str | None = field(default_factory=lambda: os.environ.get(ENV_INBOX_PREFIX) or None)

    @classmethod
    def of(cls, value: "NatsOptions | str") -> "NatsOptions":
        """``value`` itself, or options for a comma-separated URL list with nothing else set."""
        if isinstance(value, NatsOptions):
            return value
        return cls(servers=tuple(u.strip() for u in value.split(",") if u.strip()))

    @property
    def url(self) -> str:
        """The servers as one comma-separated string (for logs and for ``--nats-url`` of a child)."""
        return ",".join(self.servers)

    def __str__(self) -> str:
        return self.url

    @classmethod
    def from_environ(cls, value: "NatsOptions | str | None" = None, creds: Path | str | None = None) -> "NatsOptions":
        """Options of a library caller, as the command line reads them: ``value`` (a URL list or
        options; None: env ``DILU_NATS_URL``, else :data:`DEFAULT_URL`) with ``creds`` (None: env
        ``DILU_NATS_CREDS`` for a URL list, the options' own for options; empty: none)."""
        if value is None:
            value = os.environ.get(ENV_URL) or DEFAULT_URL
        options = cls.of(value)
        if creds is None and isinstance(value, NatsOptions):
            return options
        creds = os.environ.get(ENV_CREDS) if creds is None else creds
        return replace(options, creds=Path(creds)) if creds else options

    def with_creds(self, creds: Path | str | None) -> "NatsOptions":
        """The same options with other credentials (e.g. an instance's, launched by its agent)."""
        return replace(self, creds=Path(creds) if creds else None, inbox_prefix=None)

    def env(self) -> dict[str, str]:
        """The ``DILU_*`` variables that give a child process these same options (its
        ``--nats-url`` aside): set ones only."""
        pairs = {ENV_CREDS: self.creds, ENV_TLS_CA: self.tls_ca, ENV_TLS_CERT: self.tls_cert,
                 ENV_TLS_KEY: self.tls_key}
        out = {k: str(v) for k, v in pairs.items() if v is not None}
        out[ENV_REPLICAS] = str(self.replicas)
        if self.inbox_prefix:
            out[ENV_INBOX_PREFIX] = self.inbox_prefix
        return out

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (servers, credentials, TLS).

        Raises CredentialsError for an unusable creds file, OSError / ssl.SSLError for unreadable
        TLS files.
        """
        kwargs: dict[str, Any] = {"servers": list(self.servers)}
        if self.creds is not None:
            kwargs.update(creds_kwargs(self.creds))  # may name the role's inbox prefix
        if self.inbox_prefix:  # an explicit one wins over the file's
            kwargs["inbox_prefix"] = self.inbox_prefix
        context = self.tls_context()
        if context is not None:
            kwargs["tls"] = context
        return kwargs

    def tls_context(self) -> ssl.SSLContext | None:
        """The client's TLS context, or None when no TLS file is set and no URL asks for TLS."""
        wants = any(u.startswith(("tls://", "wss://")) for u in self.servers)
        if not (self.tls_ca or self.tls_cert or wants):
            return None
        context = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
        if self.tls_cert:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key) if self.tls_key else None)
        return context


def inbox_line(prefix: str) -> str:
    """The comment line of a creds file naming the reply-inbox prefix its user may read
    (``dilu creds`` writes it; :func:`creds_kwargs` reads it back)."""
    return f"# connect with inbox prefix {prefix} (env {ENV_INBOX_PREFIX})"


CREDS_MAX_BYTES = 64 * files.KiB  # a creds file (JWT and seed, or a seed) is a few KB
_INBOX_LINE = re.compile(rb"^# connect with inbox prefix (\S+)", re.MULTILINE)


def creds_kwargs(path: Path) -> dict[str, Any]:
    """``nats.connect`` arguments for the credentials in ``path``: ``user_credentials`` for a
    JWT ``.creds`` file, ``nkeys_seed_str`` for a user nkey seed, plus ``inbox_prefix`` when the
    file names one (:func:`inbox_line`), so ``--creds`` alone is enough to read one's replies.
    Raises CredentialsError."""
    try:
        data = files.read_bounded(path, CREDS_MAX_BYTES)
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials {path}: {exc.strerror or exc}") from None
    if _JWT_MARK in data:
        if not _JWT.search(data) or len(_SEED.findall(data)) != 1:  # nats-py would fail on it with a traceback
            raise CredentialsError(f"{path} is not a valid .creds file: it needs one user JWT between its "
                                   "BEGIN/END NATS USER JWT lines and one user nkey seed (SU...)")
        return {"user_credentials": str(path)}
    seeds = _SEED.findall(data)
    if len(seeds) != 1:
        raise CredentialsError(f"{path} holds no NATS user JWT and not exactly one user nkey seed (SU...)")
    kwargs: dict[str, Any] = {"nkeys_seed_str": seeds[0].decode()}
    inbox = _INBOX_LINE.search(data)
    if inbox:
        kwargs["inbox_prefix"] = inbox.group(1).decode()
    return kwargs


def is_permissions_violation(exc: BaseException) -> bool:
    """Whether ``exc`` (as nats-py hands it to the error callback) is the server refusing a
    publish or subscription these credentials may not make ("Permissions Violation for ...")."""
    return PERMISSIONS_ERR in str(exc).lower()


def is_authorization_violation(exc: BaseException) -> bool:
    """Whether ``exc`` is the server refusing the connection itself (no or unknown credentials)."""
    return AUTHORIZATION_VIOLATION in str(exc).lower()


def connect_failure(cause: BaseException, connect_timeout_s: float) -> str:
    """One line saying why a first connection failed (``cause``: the last error nats-py reported),
    with the fix where there is an obvious one."""
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is nats-server running there?)"
    if isinstance(cause, TimeoutError):  # asyncio.TimeoutError is TimeoutError on 3.11
        return f"no answer within {connect_timeout_s:g} s"
    if isinstance(cause, socket.gaierror):  # the host name does not resolve
        return f"no such host ({cause.strerror})"
    if isinstance(cause, OSError) and cause.strerror:  # the OS's words without "[Errno n]"
        return cause.strerror[:1].lower() + cause.strerror[1:]
    reason = str(cause) or type(cause).__name__
    if is_authorization_violation(cause):
        reason += " (the server admits Dilu's roles only: --creds FILE or DILU_NATS_CREDS)"
    return reason


class PlainTextRefused(ConnectionError):
    """TLS was asked for (a ``tls://`` or ``wss://`` URL, or a ``--tls-*`` file) and the server's
    greeting offers none. nats-py would go on in clear (it upgrades only when the server requires
    TLS) and send its CONNECT line, the identity's signature of the server's nonce included, which
    a machine in the middle could pass on; :class:`TlsOnlyClient` refuses before that line."""


class _ClearOnReconnect(NatsError):
    """A reconnect met a server in clear: a failed attempt (nats-py tries the next server)."""


class TlsOnlyClient(NATS):
    """nats-py's client for a connection that asked for TLS: TLS or nothing. Read from the server's
    greeting (INFO) before anything is sent: a server that offers TLS without requiring it is
    upgraded all the same; one that offers none is refused, on the first connection with
    :class:`PlainTextRefused` at once (no retry), on a reconnect as a failed attempt. (nats-py
    has no public hook between INFO and CONNECT; this overrides its ``_process_info``.)"""

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and self._current_server is not None:
            scheme = self._current_server.uri.scheme
            if info.get("tls_available") and scheme not in ("ws", "wss"):
                info["tls_required"] = True  # nats-py starts TLS only on this flag
            if not (info.get("tls_required") or scheme == "wss"):
                server = self._current_server.uri.geturl()
                if self.is_reconnecting:
                    raise _ClearOnReconnect(f"{server} offers no TLS")
                self.options["allow_reconnect"] = False  # nats-py then raises it at once, no retry
                raise PlainTextRefused(f"{server} offers no TLS, which was asked for (a tls:// URL or --tls-* "
                                       "files): turn TLS on in its configuration, or use nats:// without the "
                                       "TLS files; nothing was sent to it")
        await super()._process_info(info, initial_connection)


def encrypted(nc: NATS) -> bool:
    """Whether ``nc``'s connection to its current server runs over TLS: the socket's TLS
    session (nats-py's TCP transport, read through its private ``_transport``: the TLS tests
    fail, rather than let clear text through, should that change), or ``wss://`` for a WebSocket."""
    url = nc.connected_url
    if url is not None and url.scheme in ("ws", "wss"):
        return url.scheme == "wss"
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    return writer is not None and writer.get_extra_info("ssl_object") is not None


async def connect(options: NatsOptions | str, *, name: str, **opts: Any) -> NATS:
    """``nats.connect`` with ``options`` (servers, credentials, TLS); ``opts`` are nats-py's own
    (reconnect policy, callbacks) and win over nothing here: they are passed as given.

    Raises what nats-py raises (e.g. ``nats.errors.NoServersError``, an authorization error on a
    refused identity), CredentialsError for an unusable creds file, and PlainTextRefused when
    TLS was asked for and the server offers none (before anything is sent to it:
    :class:`TlsOnlyClient`).
    """
    options = NatsOptions.of(options)
    kwargs = options.connect_kwargs()
    if "tls" not in kwargs:
        return await nats.connect(name=name, **kwargs, **opts)
    nc = TlsOnlyClient()
    try:
        await nc.connect(name=name, **kwargs, **opts)
    except PlainTextRefused:
        await nc.close()  # nats-py leaves the socket of a refused first attempt open
        raise
    if not encrypted(nc):  # the guard behind the greeting's check, should nats-py change under it
        await nc.close()
        raise PlainTextRefused(f"{options.url}: the connection is not encrypted, and TLS was asked for")
    return nc
