"""``dilu deploy``, ``dilu undeploy``, ``dilu invoke``, ``dilu status``: functions on a running
cluster, through the client library (:mod:`dilu.client`).

Every option can also come from ``DILU_<OPTION>`` (``--nats-url`` -> ``DILU_NATS_URL``). Errors
are one line on stderr; the exit codes are those of :data:`dilu.client.errors.EXIT_CODES`
(1 the function or the deploy failed, 2 bad input or not deployed, 3 timeout, 4 no capacity,
5 NATS unreachable, 6 NATS refused these credentials). ``--json`` puts the machine-readable result on stdout.
"""
from __future__ import annotations

import asyncio
import base64
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec
import nats.errors
from rich.console import Console
from rich.markup import escape

from dilu.client import admin
from dilu.client.aio import AsyncClient, Reply
from dilu.client.errors import EXIT_CODES, DiluError, NoCapacity, NotPermitted, exit_code
from dilu.client.spec import SpecError, load_spec, name_problem
from dilu.services.common import files
from dilu.services.common.cliopts import ENV_PREFIX, Finite, NonEmptyPath, echo_json_error, nats_options
from dilu.services.common.console import output_failed
from dilu.services.common.invoke import MAX_TIMEOUT_S
from dilu.services.common.natsconn import NatsOptions

T = TypeVar("T")
CONTEXT = {"auto_envvar_prefix": ENV_PREFIX}  # --nats-url <- DILU_NATS_URL, as for the services
EPILOG = "Every option can also be set as DILU_<OPTION>, e.g. DILU_NATS_URL."
USAGE, UNREACHABLE = 2, 5
ROLES_NEEDED = "deploy, undeploy and status need the operator's credentials, invoke a caller's or the operator's"


class Failed(click.ClickException):
    """One line on stderr (``Error: ...``) and the given exit code; under ``--json`` the line is
    ``{"error": message, "exit_code": code}`` on stdout instead, where a script reads results."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = code
        ctx = click.get_current_context(silent=True)  # raised inside the command: its options are known
        self.as_json = bool(ctx is not None and ctx.params.get("as_json"))

    def show(self, file: Any = None) -> None:
        if self.as_json:
            echo_json_error(self.message, self.exit_code)
        else:
            super().show(file)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="print the result as JSON on stdout")(f)


class ReaderLeft(Exception):
    """The reader of stdout left while a command wrote to it (a closed pipe)."""


def run(options: NatsOptions, work: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Connect (failing within seconds when NATS is unreachable), run ``work(client)``, close;
    every error becomes a one-line :class:`Failed` with its exit code. SIGTERM ends the work as
    Ctrl-C does (a call in flight is withdrawn, the client closes) and exits 143 (128 + 15);
    :class:`ReaderLeft` from ``work`` comes out as BrokenPipeError (the command line's 141)."""
    terminated = asyncio.Event()

    async def main() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        watching = threading.current_thread() is threading.main_thread()  # signals reach only that one
        if watching:
            loop.add_signal_handler(signal.SIGTERM, lambda: (terminated.set(), task.cancel()))
        try:
            client = await AsyncClient.connect(options, name="dilu-cli", connect_attempts=1, reconnect=False)
            try:
                return await client.unless_refused(work(client))
            finally:
                await client.close()
        finally:
            if watching:
                loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:  # nothing but a signal cancels the main task
        if terminated.is_set():
            raise SystemExit(128 + signal.SIGTERM) from None
        # Ctrl-C: asyncio.run raises KeyboardInterrupt only when the task's cancel count is back
        # at 0, and a cancel nats-py swallowed on the way leaves it above (cancel_swallowed)
        raise KeyboardInterrupt from None
    except ReaderLeft:
        raise BrokenPipeError from None
    except NotPermitted as exc:
        raise Failed(f"{exc}; {ROLES_NEEDED}", exit_code(exc)) from None
    except DiluError as exc:
        raise Failed(str(exc), exit_code(exc)) from None
    except (nats.errors.Error, OSError) as exc:  # e.g. the connection lost mid-call, JetStream off
        if output_failed(exc):  # our own stdout on a full device, not NATS: the command line's line
            raise
        hint = (f" (a request these credentials may not make goes unanswered: {ROLES_NEEDED})"
                if options.creds and isinstance(exc, TimeoutError) else "")
        raise Failed(f"NATS at {options.url}: {type(exc).__name__}: {exc}{hint}", UNREACHABLE) from None


def _out() -> Console:
    # the demo's width rule: a terminal's width, 100 columns in a file or pipe unless COLUMNS
    # says; sys.stdout as it is when printing
    from dilu.cli.demo import make_console

    return make_console(highlight=False)


def _err() -> Console:
    from dilu.services.common.console import PipeConsole

    return PipeConsole(stderr=True, highlight=False)


def _print_json(obj: Any) -> None:
    click.echo(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


def _quota(q: float | None) -> str:
    return "-" if q is None else f"{q:.2f}"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------- deploy


@click.command(context_settings=CONTEXT, epilog=EPILOG)
@click.argument("spec_file", type=NonEmptyPath(path_type=Path))
@nats_options
@click.option("--timeout", "timeout_s", type=Finite(min=1, max=MAX_TIMEOUT_S), default=150.0, metavar="S",
              show_default=True, envvar="DILU_DEPLOY_TIMEOUT",  # not DILU_TIMEOUT: that one is invoke's, and far shorter
              help="seconds to wait for the profile")
@click.option("--wait-ready", "wait_ready_s", type=Finite(min=0, max=MAX_TIMEOUT_S), default=60.0, metavar="S",
              show_default=True, help="seconds to wait for the first instance (still starting after it is no error)")
@json_option
def deploy(spec_file: Path, nats: NatsOptions, timeout_s: float, wait_ready_s: float, as_json: bool) -> None:
    """Deploy the function described by SPEC_FILE (function.toml, or a folder holding one): ship
    its code folder, have the scheduler admit it and the profiler profile it, store it, and wait
    for its first instance. Redeploying a name replaces its spec.

    \b
    Exit codes:
      0  deployed (an instance still starting after --wait-ready is no error)
      1  the deploy failed: profiling, the first instance's start, a service not answering
      2  bad input: the spec file, its code folder or an option
      4  no capacity: no GPU of the cluster can take one instance (refused before
         it is stored), or none can now (stored: it is placed once one has room)
      5  NATS unreachable
      6  NATS refused these credentials: deploy needs the operator's (see --creds)
    """
    try:
        loaded = load_spec(spec_file)
    except SpecError as exc:
        raise Failed(str(exc), USAGE) from None
    progress = None if as_json else (lambda text: _err().print(f"[dim]… {escape(text)}[/dim]", soft_wrap=True))
    result = run(nats, lambda c: admin.deploy(c, loaded, timeout_s=timeout_s, wait_ready_s=wait_ready_s,
                                                  on_step=progress))
    if result.unplaceable:  # deployed, but no instance can run now: a capacity error to a script
        raise Failed(f"{result.spec.name} is deployed, but no GPU can take an instance now: {result.unplaceable} "
                     "(it is placed once one has room; see dilu status)", EXIT_CODES[NoCapacity])
    if as_json:
        _print_json(result)
        return
    _print_deployed(result, wait_ready_s)


def _print_deployed(r: admin.DeployResult, wait_ready_s: float) -> None:
    out, s, p = _out(), r.spec, r.profile
    objective = f"SLO {s.slo_ms:g} ms" if s.kind != "training" else "training job"
    if s.kind == "llm":
        objective += f" (TTFT {s.ttft_ms:g} ms, TPOT {s.tpot_ms:g} ms)"
    out.print(f"deployed [bold]{s.name}[/bold] ({s.kind}, {objective}, {_bytes(s.memory_bytes)} per instance)"
              + (f", code {r.code[:19]}…" if r.code else ""), soft_wrap=True)  # one line: never "code" / "sha256-…"
    if p is not None:
        out.print(f"profile ({p.backend}): request quota {p.request_quota:.2f}, limit quota {p.limit_quota:.2f}, "
                  f"batch {p.batch_size}" + (f", {p.throughput_rps:.1f} req/s at the request" if p.throughput_rps else ""))
    if r.ready is not None:
        out.print(f"ready: instance {r.ready.instance_id} on {r.ready.node} GPU {r.ready.gpu}, "
                  f"cold start {r.ready.cold_start_ms:.0f} ms")
    elif r.existing_instances:
        out.print(f"{r.existing_instances} instance(s) already running; they take the new spec as the scheduler "
                  "replaces them")
    elif s.kind == "training" or s.initial_scale != 0 or s.min_instances >= 1:
        out.print(f"no instance ready after {wait_ready_s:g} s: still starting (see dilu status)")
    else:
        out.print("no instance started at deploy (initial_scale = 0): the first request starts one")


# ---------------------------------------------------------------------------- undeploy


def _function_name(_ctx, _param, value: str) -> str:
    """NAME as a function name (``client.spec.NAME_RE``); a bad one is a usage error (exit 2), as
    the gateway's 400, instead of "not deployed" from the cluster."""
    why = name_problem(value)
    if why:
        raise click.BadParameter(why)
    return value


@click.command(context_settings=CONTEXT, epilog=EPILOG)
@click.argument("name", callback=_function_name)
@nats_options
@click.option("--wait", "wait_s", type=Finite(min=0, max=MAX_TIMEOUT_S), default=30.0, metavar="S", show_default=True,
              help="seconds to wait for its instances to drain before removing its queue")
@json_option
def undeploy(name: str, nats: NatsOptions, wait_s: float, as_json: bool) -> None:
    """Remove function NAME: its instances drain and stop, then its queue goes. Callers of
    requests still queued get a 'not deployed' error at once (exit 2 from dilu invoke, 404 from
    the gateway); those whose requests an instance held when its drain ran out (--wait), once
    it is gone."""
    result = run(nats, lambda c: admin.undeploy(c, name, wait_s=wait_s))
    answered = (f"; {result.answered} request(s) answered 'not deployed'" if result.answered else "")
    if as_json:
        _print_json(result)
    elif result.cleaned:
        queue = "" if result.kind == "training" else ", its request queue removed"
        _out().print(f"undeployed [bold]{name}[/bold]: no instance left{queue}{answered}", soft_wrap=True)
    else:  # soft_wrap: one line in a pipe, never "'not" / "deployed'"
        _out().print(f"undeployed [bold]{name}[/bold]: {result.remaining_instances} instance(s) still draining "
                     f"(its queue stays until they are gone; run undeploy again later to remove it){answered}",
                     soft_wrap=True)


# ---------------------------------------------------------------------------- invoke


DATA_MAX_BYTES = 64 * files.MiB  # nats-server's ceiling on max_payload: no server carries more


def read_data(data: str) -> bytes:
    """``--data``: ``@FILE`` (its bytes), ``-`` (stdin's bytes) or the text itself (UTF-8; bytes of
    the command line that are not UTF-8 are sent as given). A file or stdin is read up to
    DATA_MAX_BYTES (a FIFO, device or longer input is refused: Failed with USAGE); the server's
    own, lower, limit is checked when the call is made."""
    if data == "-":
        try:
            return files.read_stream(sys.stdin.buffer, DATA_MAX_BYTES, "stdin")
        except OSError as exc:
            raise Failed(f"--data -: {exc.strerror or exc}", USAGE) from None
    if data.startswith("@"):
        try:
            return files.read_bounded(data[1:], DATA_MAX_BYTES)
        except OSError as exc:
            raise Failed(f"--data: cannot read {data[1:]!r}: {exc.strerror or exc}", USAGE) from None
    return os.fsencode(data)  # the argument's own bytes: Python holds undecodable ones as surrogates


def _reply_json(reply: Reply) -> dict:
    try:
        text = reply.payload.decode()
    except UnicodeDecodeError:
        text = None
    fields = msgspec.structs.asdict(reply)
    fields.pop("payload")
    return {**fields, "payload": text, "payload_base64": base64.b64encode(reply.payload).decode()}


@click.command(context_settings=CONTEXT, epilog=EPILOG)
@click.argument("name", callback=_function_name)
@click.option("--data", default="", show_default=False, metavar="@FILE|-|TEXT",
              help="the request: @FILE (its bytes), - (stdin) or the text itself [default: empty]")
@click.option("--timeout", "timeout_s", type=Finite(min=0.001, max=MAX_TIMEOUT_S), default=30.0, metavar="S",
              show_default=True, help="seconds to wait for the reply")
@click.option("--stream", is_flag=True,
              help="write each chunk of a streamed (llm) reply as it arrives; a function that does not "
                   "stream writes its reply as one chunk")
@nats_options
@json_option
def invoke(name: str, data: str, timeout_s: float, stream: bool, nats: NatsOptions, as_json: bool) -> None:
    """Call function NAME and write its reply, raw, to stdout.

    With --json the reply's payload (text and base64) and its figures (instance, cold start,
    latency, chunks, TTFT, TPOT) are printed as JSON instead.

    \b
    Exit codes:
      0  the reply was written
      1  the function raised an error (its message on stderr)
      2  bad input, or NAME is not deployed
      3  no reply within --timeout
      4  no capacity: the request was refused, or the function cannot be placed now
      5  NATS unreachable
      6  NATS refused these credentials: they are another role's (see --creds)
      130, 143  stopped by Ctrl-C or SIGTERM: the call is withdrawn, so the instance drops it
      141  the reader of stdout left (a closed pipe): the call is withdrawn too
    """
    payload = read_data(data)
    sink = sys.stdout.buffer

    async def call(c: AsyncClient) -> Reply:
        if not stream or as_json:
            return await c.invoke(name, payload, timeout_s=timeout_s)
        async with c.stream(name, payload, timeout_s=timeout_s) as s:
            async for chunk in s:
                try:
                    sink.write(chunk)
                    sink.flush()
                except BrokenPipeError:  # the reader left: the stream ends (and is withdrawn)
                    raise ReaderLeft from None
            return s.reply

    reply = run(nats, call)
    if as_json:
        _print_json(_reply_json(reply))
    elif not stream:
        sink.write(reply.payload)
        sink.flush()


# ---------------------------------------------------------------------------- status


@click.command(context_settings=CONTEXT, epilog=EPILOG)
@nats_options
@click.option("--listen", "listen_s", type=Finite(min=0, max=60), default=2.0, metavar="S", show_default=True,
              help="seconds to listen for telemetry (each instance's current grant)")
@json_option
def status(nats: NatsOptions, listen_s: float, as_json: bool) -> None:
    """Nodes and GPUs; functions with their profile, instances (quotas, current grant and state:
    placed, parked or draining), backlog and last scale decisions."""
    st = run(nats, lambda c: admin.status(c, telemetry_s=listen_s))
    if as_json:
        _print_json(st)
        return
    out = _out()
    if st.nodes:
        _print_table(out, f"Nodes ({len(st.nodes)})", *_nodes_rows(st))
    else:
        out.print("No nodes: no node agent has registered in dilu-nodes.")
    if st.functions:
        _print_table(out, f"Functions ({len(st.functions)})", *_functions_rows(st), wrap=("instances", "last decisions"))
    else:
        out.print("No functions deployed.")
    if any(f.instances for f in st.functions):
        _print_table(out, "Instances", *_instances_rows(st), keys=2)


Rows = list[tuple[list[str], dict]]


def _print_table(out: Console, title: str, columns: tuple[str, ...], rows: Rows, **fit) -> None:
    """One table within the console's width: split by columns when too wide (the first ``keys``
    columns, default 1, repeated in each part; the ``wrap`` ones wrapped at words), as the demo's
    report is (:func:`dilu.loadgen.report.fitted_tables`)."""
    from dilu.loadgen.report import fitted_tables

    for table in fitted_tables(title, [(col, "left") for col in columns], rows, out.width, title_justify="left", **fit):
        out.print(table)


def _nodes_rows(st: admin.Status) -> tuple[tuple[str, ...], Rows]:
    rows: Rows = []
    for n in st.nodes:
        inv = n.inventory
        seen = f"{n.age_s:.0f} s ago"
        if not inv.gpus:
            rows.append(([escape(inv.node), inv.device, inv.mps, "-", "", "", "", "", seen], {}))
        for g in inv.gpus:
            health = "ok" if g.healthy else f"[red]{escape(g.health_reason or 'unhealthy')}[/red]"
            rows.append(([escape(inv.node), inv.device, inv.mps, str(g.index), escape(g.name), _bytes(g.memory_bytes),
                          str(g.sms), health, seen], {}))
            seen = ""
    return ("node", "device", "mps", "gpu", "name", "memory", "SMs", "health", "seen"), rows


def _decision_text(d, now_ns: int) -> str:
    ago = f", {(now_ns - d.ts_ns) / 1e9:.0f} s ago" if d.ts_ns else ""
    return f"{d.direction} {d.count}" + (f" ({escape(d.reason)})" if d.reason else "") + ago


def _functions_rows(st: admin.Status) -> tuple[tuple[str, ...], Rows]:
    rows: Rows = []
    for f in st.functions:
        s, p, state = f.spec, f.profile, f.state
        kind = s.kind if s else "[dim]undeployed[/dim]"
        objective = "-" if s is None or s.kind == "training" else f"{s.slo_ms:g} ms"
        prof = f"{p.request_quota:.2f} / {p.limit_quota:.2f} / {p.batch_size}" if p else "-"
        count = str(len(f.instances))
        parked = sum(i.parked for i in f.instances)
        if state is not None:
            count += f" (ready {state.ready}, desired {state.desired}" + (f", parked {parked})" if parked else ")")
            if not state.placeable:
                count += f" [red]unplaceable: {escape(state.reason)}[/red]"
        elif parked:
            count += f" (parked {parked})"
        backlog = "-" if f.backlog is None else str(f.backlog)
        decisions = "\n".join(_decision_text(d, st.taken_ns) for d in (state.decisions[-3:] if state else [])) or "-"
        rows.append(([escape(f.name), kind, objective, prof, count, backlog, decisions], {}))
    return ("function", "kind", "objective", "profile req/lim/batch", "instances", "backlog", "last decisions"), rows


def _instance_state(i: admin.InstanceStatus) -> str:
    """What the placement table says of an instance: ``placed`` (on its GPU), ``parked`` (off
    it, weights in host memory: node and GPU are where it resumes), ``draining``, or both."""
    states = [name for name, on in (("parked", i.parked), ("draining", i.draining)) if on]
    return ", ".join(states) or "placed"


def _instances_rows(st: admin.Status) -> tuple[tuple[str, ...], Rows]:
    rows: Rows = [([escape(f.name), escape(i.instance_id), escape(i.node), str(i.gpu), _quota(i.request_quota),
                    _quota(i.limit_quota), _quota(i.grant), _bytes(i.memory_bytes), str(i.batch_size),
                    _instance_state(i)], {})
                  for f in st.functions for i in f.instances]
    return ("function", "instance", "node", "gpu", "request", "limit", "grant", "memory", "batch", "state"), rows
