"""``dilu bench loadgen``: how fast one load-generator process sends, and how close to schedule.

Runs the real :class:`~dilu.loadgen.generator.OpenLoopGenerator` on a steady schedule of
``--rate`` requests/s for ``--seconds`` with a no-op ``invoke`` (it returns at once), so what is
measured is the generator alone: its send rate and its send-time error (actual send - scheduled
send, the moment ``invoke`` is called). With ``--nats-url`` each no-op invoke also publishes the
request as one core NATS message nobody answers (the socket write of a real send, no reply).

Writes ``{"rate_rps", "seconds", "sent", "send_rate_rps", "send_error_ms_p50",
"send_error_ms_p99", "send_error_ms_max", "late_sends", "late_threshold_ms", "goal", "setup"}``
(HDR histogram, µs resolution). Goal (informational): >= 5,000 req/s with p99 error < 1 ms.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import click
import uvloop
from click.core import ParameterSource
from nats.errors import Error as NatsError
from hdrh.histogram import HdrHistogram

from dilu.services.common.cliopts import Finite, nats_options, writable_output
from dilu.services.common.interrupt import SignalExit
from dilu.services.common.natsconn import NatsOptions, connect

from .arrivals import NS_PER_S, Invocation
from .generator import DEFAULT_LATE_THRESHOLD_MS, OpenLoopGenerator, Outcome

GOAL_RATE_RPS = 5000.0
GOAL_SEND_ERROR_MS_P99 = 1.0
CONNECT_TIMEOUT_S = 3.0  # a bench's connection: one attempt, no reconnect (a refusal fails the run at once)
SUBJECT = "dilu.bench.loadgen"  # core NATS subject of --nats-url sends (no subscriber)
OWN_SERVER = "a nats-server of its own"  # what a bench that starts one uses without --nats-url


def steady_plan(rate_rps: float, seconds: float, function: str = "bench-noop") -> list[Invocation]:
    """Invocations evenly spaced at ``rate_rps`` requests/s over ``seconds`` s (offsets in ns).

    Raises ValueError when either is not positive."""
    if rate_rps <= 0 or seconds <= 0:
        raise ValueError(f"rate and seconds must be positive, got {rate_rps} req/s, {seconds} s")
    n = max(1, round(rate_rps * seconds))
    return [Invocation(id=f"r{i}", function=function, scheduled_ns=round(i * NS_PER_S / rate_rps), trace_minute=0)
            for i in range(n)]


def ms_histogram() -> HdrHistogram:
    """An HDR histogram of µs values from 1 µs to 10 min, 3 significant digits."""
    return HdrHistogram(1, 600_000_000, 3)


async def run_bench(rate_rps: float, seconds: float, nats_url: NatsOptions | str | None = None) -> dict:
    """Run the generator with a no-op invoke and return the figures (see the module docstring).
    ``nats_url``: also publish each request there (a URL list or full :class:`NatsOptions`:
    credentials, TLS). Raises what :func:`natsconn.connect` raises when that server refuses us."""
    nc = None
    if nats_url:
        nc = await connect(nats_url, name="dilu-bench-loadgen", connect_timeout=CONNECT_TIMEOUT_S,
                           allow_reconnect=False)

    async def invoke(inv: Invocation) -> Outcome:
        if nc is not None:
            await nc.publish(SUBJECT, inv.id.encode())
        return Outcome()

    try:
        result = await OpenLoopGenerator(invoke).run(steady_plan(rate_rps, seconds))
    finally:
        if nc is not None:
            await nc.close()
    hist = ms_histogram()
    for r in result.records:
        hist.record_value(max(1, r.late_ns // 1000))
    sent = len(result.records)
    sends = [r.sent_ns for r in result.records]
    span_s = (max(sends) - min(sends)) / 1e9 if sent > 1 else 0.0
    p99 = hist.get_value_at_percentile(99) / 1000.0
    send_rate = (sent - 1) / span_s if span_s > 0 else None
    return {
        "rate_rps": rate_rps,
        "seconds": seconds,
        "sent": sent,
        "send_rate_rps": send_rate,
        "send_error_ms_p50": hist.get_value_at_percentile(50) / 1000.0,
        "send_error_ms_p99": p99,
        "send_error_ms_max": hist.get_max_value() / 1000.0,
        "late_sends": result.late_sends,
        "late_threshold_ms": result.late_threshold_ms,
        "goal": {"send_rate_rps": GOAL_RATE_RPS, "send_error_ms_p99": GOAL_SEND_ERROR_MS_P99,
                 "met": send_rate is not None and send_rate >= GOAL_RATE_RPS * 0.99
                 and p99 < GOAL_SEND_ERROR_MS_P99},
        "setup": {"invoke": "no-op" + (" + core NATS publish" if nc is not None else ""),
                  "clock": "time.monotonic_ns", "measured": "Record.sent_ns - Record.scheduled_ns",
                  "send_rate": "(sent - 1) / (last send - first send)"},
    }


def given_nats(nats: NatsOptions) -> NatsOptions | None:
    """``nats`` when ``--nats-url`` (or DILU_NATS_URL) was given, else None: the bench then needs
    no server (or starts its own). Raises click.UsageError for --creds/--tls-* without --nats-url
    (they would silently not apply)."""
    ctx = click.get_current_context()
    if ctx.get_parameter_source("nats_url") not in (None, ParameterSource.DEFAULT):
        return nats
    if nats.creds or nats.tls_ca or nats.tls_cert:
        raise click.UsageError("--creds and --tls-* apply to the server of --nats-url: give it too")
    return None


def nats_default_shown(text: str):
    """Decorator of a bench's click command: its ``--nats-url`` help shows ``[default: text]``
    instead of the shared option's nats://127.0.0.1:4222, which a bench never connects to when
    the flag is not given (:func:`given_nats`)."""
    def apply(command: click.Command) -> click.Command:
        next(p for p in command.params if p.name == "nats_url").show_default = text
        return command
    return apply


def reachable_or_exit(nats: NatsOptions | str | None) -> None:
    """Exit with one clear line (click error) when ``nats`` is given and none of its servers answers:
    exit code 5, as every command gives an unreachable NATS (:data:`dilu.client.errors.EXIT_CODES`)."""
    if nats:
        from dilu.cli.cluster import check_reachable
        from dilu.cli.functions import Failed
        from dilu.client.errors import Unreachable, exit_code

        error: Unreachable | None = None
        for url in NatsOptions.of(nats).servers:
            try:
                check_reachable(url)
                return
            except Unreachable as exc:
                error = exc
        raise Failed(str(error), exit_code(error))


@contextlib.contextmanager
def one_line_nats_errors(nats: NatsOptions | str | None):
    """Turn a NATS or TLS failure inside the block (a refused certificate or identity, a lost
    server) into one click error line naming the server, instead of a traceback."""
    try:
        yield
    except (NatsError, OSError) as exc:  # ssl.SSLError is an OSError
        where = f"NATS at {NatsOptions.of(nats).url}" if nats else "NATS"
        raise click.ClickException(f"{where}: {type(exc).__name__}: {exc}") from None


@nats_default_shown("none: nothing is published")
@click.command("loadgen")
@click.option("--rate", type=Finite(1, 1_000_000), default=5000.0, show_default=True,
              help="scheduled sends per second")
@click.option("--seconds", type=Finite(0.1, 3600), default=5.0, show_default=True,
              help="length of the schedule, in s (--rate x --seconds sends)")
@nats_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=writable_output, help="write the figures here")
def bench_loadgen(rate, seconds, nats, json_path):
    """Open-loop generator send rate and send-time error with a no-op invoke (goal >= 5,000 req/s, p99 < 1 ms).
    With --nats-url each request is also published (core NATS, no reply) to that server.
    Ctrl-C or SIGTERM stops it with exit status 130 (143)."""
    with SignalExit() as stop:
        nats_url = given_nats(nats)
        reachable_or_exit(nats_url)
        with one_line_nats_errors(nats_url):
            result = uvloop.run(stop.cancelling(run_bench(rate, seconds, nats_url)))
        text = json.dumps(result, indent=2)
        if json_path:
            json_path.write_text(text + "\n")
        click.echo(text)
