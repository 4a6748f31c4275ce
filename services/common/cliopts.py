"""Click helpers and defaults the command-line entry points share.

One rule for configuration: every option of a service can also come from an environment variable
named ``DILU_`` + the option's name in capitals with underscores (``--nats-url`` ->
``DILU_NATS_URL``, ``--keep-alive-s`` -> ``DILU_KEEP_ALIVE_S``); a flag on the command line wins
(click's ``auto_envvar_prefix``). systemd units and Nomad jobs use exactly these names.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import re
import socket
import ssl
import stat
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import click
import msgspec
from click import _textwrap

from . import files
from .natsconn import (DEFAULT_URL, ENV_CREDS, ENV_REPLICAS, ENV_URL, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY,
                       MAX_REPLICAS, CredentialsError, NatsOptions, creds_kwargs)

ENV_PREFIX = "DILU"


class _WholeWordWrapper(_textwrap.TextWrapper):
    """Click's help wrapper, never breaking a line inside a hyphenated word: ``--data-dir`` and
    ``horizontal-only`` are names, split across two lines they read as two. (Click builds its
    wrapper with textwrap's default ``break_on_hyphens=True`` and takes no option for it.)"""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["break_on_hyphens"] = False
        super().__init__(*args, **kwargs)


_textwrap.TextWrapper = _WholeWordWrapper  # click.formatting.wrap_text looks it up at each call

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
    """click.FloatRange that also refuses NaN, infinities and overflows ("1e309"), before its
    range is checked, all in one wording ("'x' is not a valid finite number."): a NaN passes
    every comparison, and an infinity would be reported against the range as a value nobody typed."""

    name = "finite number"

    def convert(self, value, param, ctx):
        # finiteness before the range: -inf or 1e309 (a float's inf) is no number, whatever the bounds
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = math.nan
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a valid finite number.", param, ctx)
        return super().convert(v, param, ctx)

    def _describe_range(self) -> str:
        """No range in --help when there is none (click's would read "x<=None")."""
        return "" if self.min is None and self.max is None else super()._describe_range()


class ZeroOrAtLeast(Finite):
    """A period in seconds: 0 (never) or at least ``minimum``, at most ``maximum``. A tiny
    positive period would not be "rarely": a loop at it spins (and a simulated clock stepped by
    it stops moving once the step is below its float resolution)."""

    def __init__(self, minimum: float, maximum: float) -> None:
        super().__init__(min=0, max=maximum)
        self.minimum = minimum

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if 0 < v < self.minimum:
            self.fail(f"{value!r} is neither 0 (never) nor at least {self.minimum:g}", param, ctx)
        return v


# --park-after-s of dilu up, dilu demo, dilu compare and dilu sim: trace seconds (dilu up's are
# wall seconds), 0 (never) up to one day (SimConfig and the horizontal scaler check the same
# range); one type, so that all four say the same of a bad value.
PARK_AFTER_S_TYPE = Finite(min=0, max=86_400)


def check_nats_url(ctx, param, value: str) -> str:
    """Click callback: a NATS URL with a known scheme, a host and a port in 1..65535 (nats-py
    would otherwise raise a traceback, or retry a nonsense host for ever). Raises BadParameter."""
    try:
        value.encode()
    except UnicodeEncodeError:  # undecodable bytes of the command line or environment
        raise click.BadParameter(f"{value!r} is not UTF-8 text") from None
    try:
        parts = urlsplit(value if "://" in value else f"nats://{value}")
    except ValueError as exc:  # "Invalid IPv6 URL", "'zz' does not appear to be an IPv4 or IPv6 address"
        raise click.BadParameter(f"{value!r} is not a NATS URL: {exc}") from None
    try:
        port = parts.port
    except ValueError:
        raise click.BadParameter(f"{value!r} has no valid port (1..65535)") from None
    if parts.scheme not in NATS_SCHEMES or not parts.hostname or (port is not None and port < 1):
        raise click.BadParameter(f"{value!r} is not a NATS URL like nats://host:4222 "
                                 f"(schemes: {', '.join(NATS_SCHEMES)})")
    return value


_NODE_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a host name's characters, and '_'


def check_node(ctx, param, value: str) -> str:
    """Click callback: a node name is 1..MAX_NODE_NAME characters of a host name (letters,
    digits, '.', '-') or '_'. Subjects and permissions carry it as one token, so NATS's
    wildcards ('*', '>') or other characters, which would all read as '_', are refused rather
    than letting two names share a node's subjects. Raises BadParameter."""
    return value if value is None else check_name(value, "node")


def check_name(value: str, what: str) -> str:
    """``value`` when it is a valid name of a node (or of another ``what`` carried in subjects
    the same way, e.g. a caller): see :func:`check_node`. Raises BadParameter naming ``what``."""
    if len(value) > MAX_NODE_NAME or not _NODE_NAME.fullmatch(value):
        raise click.BadParameter(f"a {what} name is 1..{MAX_NODE_NAME} letters, digits, '.', '-' or '_', got {value!r}")
    return value


def nats_url_option(f):
    """``--nats-url`` (env DILU_NATS_URL), checked by :func:`check_nats_url`: one URL or a
    comma-separated list of cluster members."""
    return click.option("--nats-url", default=DEFAULT_URL, show_default=True, callback=check_nats_urls, envvar=ENV_URL,
                        help="NATS server(s), comma-separated (one cluster member is enough)")(f)


def check_nats_urls(ctx, param, value: str) -> str:
    """Click callback: a comma-separated list of NATS URLs, each checked by :func:`check_nats_url`."""
    refuse_empty(value, "URL")
    urls = [u.strip() for u in value.split(",")]
    if not all(urls):
        raise click.BadParameter(f"{value!r}: an empty URL in the list")
    for url in urls:
        check_nats_url(ctx, param, url)
    return ",".join(urls)


def check_creds(ctx, param, value):
    """Click callback: a ``--creds`` file that :func:`natsconn.creds_kwargs` can use, checked
    before anything connects. Raises BadParameter with the one-line reason."""
    if value is not None:
        try:
            creds_kwargs(value)
        except CredentialsError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def nats_options(f):
    """The connection options of every command and service that talks to NATS, combined into
    one :class:`~dilu.services.common.natsconn.NatsOptions` passed as the ``nats`` argument:
    ``--nats-url`` (DILU_NATS_URL), ``--creds`` (DILU_NATS_CREDS), ``--tls-ca``
    (DILU_NATS_TLS_CA), ``--tls-cert`` (DILU_NATS_TLS_CERT), ``--tls-key`` (DILU_NATS_TLS_KEY),
    ``--replicas`` (DILU_REPLICAS)."""
    file = click.Path(exists=True, dir_okay=False, readable=True, path_type=Path)

    @functools.wraps(f)
    def wrapper(*args, nats_url, creds, tls_ca, tls_cert, tls_key, replicas, **kwargs):
        if tls_key and not tls_cert:
            raise click.BadParameter("--tls-key needs --tls-cert", param_hint="--tls-key")
        options = NatsOptions(servers=tuple(nats_url.split(",")), creds=creds, tls_ca=tls_ca,
                              tls_cert=tls_cert, tls_key=tls_key, replicas=replicas)
        try:  # a bad TLS file is the command line's fault, not the server's: say so before connecting
            for path in (tls_ca, tls_cert, tls_key):  # a FIFO would block the ssl module's open for good
                if path is not None:
                    files.check_regular(path)
            options.tls_context()
        except (OSError, ssl.SSLError) as exc:
            raise click.BadParameter(f"cannot load the TLS files ({exc.strerror or exc})",
                                     param_hint="--tls-ca/--tls-cert/--tls-key") from None
        kwargs["nats"] = options
        return f(*args, **kwargs)

    options = [
        click.option("--replicas", type=click.IntRange(1, MAX_REPLICAS), default=1, show_default=True,
                     envvar=ENV_REPLICAS, help="JetStream replicas of a stream or bucket this command has to "
                                               "create, where it does not exist yet; those that exist keep "
                                               "theirs (1: one server; 3: the cluster configuration)"),
        click.option("--tls-key", type=file, envvar=ENV_TLS_KEY, help="this client's TLS key (with --tls-cert)"),
        click.option("--tls-cert", type=file, envvar=ENV_TLS_CERT,
                     help="this client's TLS certificate, for a server that verifies clients"),
        click.option("--tls-ca", type=file, envvar=ENV_TLS_CA, help="CA bundle to verify the NATS server with (TLS)"),
        click.option("--creds", type=file, envvar=ENV_CREDS, callback=check_creds,
                     help="NATS credentials: a .creds file (user JWT + seed) or a user nkey seed"),
        nats_url_option,
    ]
    for option in options:
        wrapper = option(wrapper)
    return wrapper


def log_level_option(f):
    """``--log-level`` (env DILU_LOG_LEVEL): one of LOG_LEVELS. The variable is named here too, not
    only by the services' prefix, so that an instance process, which the node agent starts in its
    own environment, logs at the level its node's services log at."""
    return click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info",
                        envvar=f"{ENV_PREFIX}_LOG_LEVEL", show_default=True)(f)


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
    """Run a service's click ``command`` with the ``DILU_*`` environment rule (module docstring);
    a bad option or value is one line, as ``dilu``'s commands say it (:class:`OneLineUsageError`),
    naming the variable it came from (:func:`name_envvar`)."""
    if not getattr(command, "_names_envvar", False):  # wrapped once, however often it is run
        parse = command.parse_args

        def parse_naming_envvar(ctx, args):
            try:
                return parse(ctx, args)
            except click.UsageError as exc:
                if isinstance(exc, click.BadParameter):
                    name_envvar(exc)
                raise OneLineUsageError(exc.format_message(), exc.ctx) from None

        command.parse_args = parse_naming_envvar
        command._names_envvar = True
        for param in command.params:  # --help names each option's variable
            if isinstance(param, click.Option):
                param.show_envvar = True
    command.main(auto_envvar_prefix=ENV_PREFIX, **kwargs)


def refuse_empty(value, what: str = "path"):
    """Raise click.BadParameter ("an empty path", "an empty URL") when ``value`` is ``""``: an
    empty option value would otherwise read as not given and silently mean the default. Returns
    ``value`` (None passes)."""
    if value == "":
        raise click.BadParameter(f"an empty {what}")
    return value


class NonEmptyPath(click.Path):
    """click.Path that refuses ``""`` (:func:`refuse_empty`) before converting it: with
    ``path_type=Path`` an empty value would become ``Path('.')``, the current directory. With
    ``file_okay=False`` anything there that is not a folder is refused, a device or FIFO too
    (click.Path refuses only a regular file)."""

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("an empty path", param, ctx)
        if not self.file_okay and os.path.lexists(value) and not os.path.isdir(value):
            self.fail(f"{value} is not a folder", param, ctx)
        return super().convert(value, param, ctx)


def optional_nats_urls(ctx, param, value):
    """Click callback for a ``--nats-url`` whose default is None (the command starts its own
    server): None, or URLs checked by :func:`check_nats_urls`."""
    return None if value is None else check_nats_urls(ctx, param, value)


def writable_output(ctx, param, value):
    """Click callback for an output file option (``--json``): the file must be writable, checked
    before a run rather than after minutes of it, by opening it for appending (a file this
    creates is removed again; permission bits alone would pass for root on /sys or /proc).
    Raises click.BadParameter naming the path and the reason (an empty one too)."""
    if refuse_empty(value) is not None:
        path = Path(value)
        existed = path.exists()
        if existed and _kernel_file(path):  # opens for writing, then refuses the write itself
            raise click.BadParameter(f"cannot write {value}: a file of the kernel's (/proc, /sys), not one for output")
        try:  # O_NONBLOCK: a FIFO without a reader is refused (ENXIO), where a plain open would wait for one
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
        except OSError as exc:
            why = ("a named pipe that nobody reads" if exc.errno == errno.ENXIO
                   else write_failure(exc, path.parent, it=str(path.parent)))
            raise click.BadParameter(f"cannot write {value}: {why}") from None
        if not existed:
            path.unlink(missing_ok=True)
    return value


def _kernel_file(path: Path) -> bool:
    """Whether ``path`` is a regular file of /proc or /sys (pipes and terminals reached through
    /proc/self/fd, e.g. /dev/stdout, are not regular files)."""
    try:
        regular = stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False
    return regular and path.resolve().parts[1:2] in (("proc",), ("sys",))


def write_failure(exc: OSError, folder: Path, it: str = "it") -> str:
    """Why a file could not be created in ``folder``, in words: the OS's, but for a folder that
    is there and takes no file (/proc), of which the OS says "No such file or directory"
    ("nothing can be created in" ``it``, the words naming the folder)."""
    if exc.errno == errno.ENOENT and folder.is_dir():
        return f"nothing can be created in {it}"
    return exc.strerror or str(exc)


def writable_dir(ctx, param, value):
    """Click callback for an output directory option (``--plots``): created (with its parents)
    and written to once before the run, so a bad path fails in one line before minutes of work;
    the directories this created are removed again (the command may still refuse its input, and
    then nothing may be left behind; whoever writes the output creates them). Raises
    click.BadParameter naming the path and the reason (an empty one too)."""
    if refuse_empty(value) is not None:
        path = Path(value).resolve()  # so that no "missing/.." below can alias a directory that exists
        created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
        if path.exists() and not path.is_dir():  # mkdir would only say "File exists"
            raise click.BadParameter(f"{value} is not a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path):
                pass
        except OSError as exc:
            there = next((p for p in (path, *path.parents) if p.exists()), path)  # where it failed
            why = write_failure(exc, there, it="it" if there == path else str(there))
            raise click.BadParameter(f"cannot write into {value}: {why}") from None
        finally:
            for p in created:
                with contextlib.suppress(OSError):  # one the failed mkdir never made
                    p.rmdir()
    return value


def write_output(path, text: str) -> None:
    """Write ``text`` to ``path``; a failure (a full disk, a path gone since the option was
    checked) is one line (click.ClickException), not a traceback."""
    try:
        Path(path).write_text(text)
    except BrokenPipeError:  # --json /dev/stdout | head -1: the reader left, 141 as for stdout itself
        raise
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None


def flag_envvar(flag: str, takes_value: bool = True) -> str:
    """The variable an option with long flag ``flag`` comes from: ``DILU_<FLAG>`` (``--nats-url``
    -> ``DILU_NATS_URL``), but ``DILU_JSON_PATH`` for a ``--json PATH`` that names a report file:
    ``DILU_JSON`` is the switch that makes a command print its result, and its errors, as JSON
    (``DILU_JSON=1``), which a command that writes a file must not read as a file named ``1``."""
    name = flag[2:].replace("-", "_").upper()
    return f"{ENV_PREFIX}_{name}_PATH" if name == "JSON" and takes_value else f"{ENV_PREFIX}_{name}"


def flag_envvars(command: click.Command) -> click.Command:
    """Let each option of ``command`` (and of its subcommands) that names no variable of its own
    come from ``DILU_<FLAG>``, named after its long flag (``--nats-url`` -> ``DILU_NATS_URL``,
    ``--timeout`` -> ``DILU_TIMEOUT``), not after its Python name as click's
    ``auto_envvar_prefix`` would (``timeout_s`` -> ``DILU_TIMEOUT_S``); ``--help`` names it. A
    duration option without a metavar of its own shows its unit as one (``--keep-alive-s S``,
    ``--process-start-ms MS``), as every command's do. Returns ``command``."""
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        longs = [o for o in param.opts if o.startswith("--")]
        if param.envvar is None and longs:
            param.envvar = flag_envvar(longs[0], not param.is_flag)
        if param.envvar:
            param.show_envvar = True
        unit = longs[0].rsplit("-", 1)[-1] if longs else ""
        if param.metavar is None and not param.is_flag and unit in ("s", "ms"):
            param.metavar = unit.upper()
    for sub in getattr(command, "commands", {}).values():  # a group's (dilu events tail, dilu bench sim)
        flag_envvars(sub)
    return command


def echo_json_error(message: str, exit_code: int) -> None:
    """The one shape of an error under ``--json``: ``{"error": message, "exit_code": code}`` on
    stdout (where a script reads the command's result), two-space indented as results are."""
    click.echo(msgspec.json.format(msgspec.json.encode({"error": message, "exit_code": exit_code}), indent=2).decode())


class JsonUsageError(click.UsageError):
    """A usage error (a bad option value, a missing file) of a command run with ``--json``:
    shown by :func:`echo_json_error`, with click's exit code (2), not as click's usage text."""

    def show(self, file=None) -> None:
        echo_json_error(self.format_message(), self.exit_code)


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line on stderr, ``Error: <what> (see 'dilu invoke --help')``,
    in place of click's usage text, hint and blank line around the same message; exit code 2."""

    def show(self, file=None) -> None:
        where = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"Error: {self.format_message()}{where}", file=file, err=file is None)


def asks_json(ctx: click.Context | None, argv: list[str]) -> bool:
    """Whether the command of ``ctx`` prints its result as JSON (it has an ``as_json`` flag) and
    ``--json`` is on the command line ``argv`` or its variable (``DILU_JSON``) is true; the option
    may not be parsed yet when a usage error stops the parse, so the words and the environment
    are read, not ``ctx.params``."""
    flag = next((p for p in ctx.command.params if p.name == "as_json"), None) if ctx is not None else None
    if flag is None:
        return False
    if "--json" in argv:
        return True
    value = flag.resolve_envvar_value(ctx)
    try:
        return bool(value) and bool(click.BOOL.convert(value, flag, ctx))
    except click.BadParameter:  # a bad DILU_JSON is the usage error itself: click's text
        return False


def name_envvar(exc: click.BadParameter) -> None:
    """Make ``exc``'s hint name a variable exactly when the bad value came from it: "Invalid value
    for '--minutes' (from DILU_MINUTES)", where click names only the option (whoever set
    DILU_MINUTES would look for a --minutes nobody typed), and, for an option that shows its
    variable in --help, just "'--nodes'" for a value typed (click's "(env var: 'DILU_NODES')"
    reads as if it came from there). An error about no one option is left as it is; naming twice
    changes nothing (the hint is rebuilt from the option)."""
    ctx, param = exc.ctx, _param_of(exc)
    if ctx is None or param is None:
        return
    hint = click.Parameter.get_error_hint(param, ctx)  # the option alone, without click's "(env var: ...)"
    if ctx.get_parameter_source(param.name) is click.core.ParameterSource.ENVIRONMENT:
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        if ctx.auto_envvar_prefix:
            names.append(f"{ctx.auto_envvar_prefix}_{param.name.upper()}")
        var = next((n for n in names if os.environ.get(n)), None)  # the one click read: the first one set
        hint += f" (from {var})" if var else ""
    elif not param.show_envvar:
        return
    exc.param, exc.param_hint = param, hint


def _param_of(exc: click.BadParameter) -> click.Option | None:
    """The option ``exc`` is about: its ``param``, or the one its ``param_hint`` names
    (``BadParameter(..., param_hint="--tls-key")`` raised in a command's body)."""
    if isinstance(exc.param, click.Option):
        return exc.param
    hints = {exc.param_hint} if isinstance(exc.param_hint, str) else set(exc.param_hint or ())
    params = exc.ctx.command.params if exc.ctx is not None else []
    return next((p for p in params if isinstance(p, click.Option) and hints & set(p.opts)), None)
