"""``dilu events tail``: every event on the bus as it happens, for people (one line each) or for
programs (``--json``: one object per line with the subject, the CloudEvents headers and the event).

Each message is decoded as the event type of its subject (:data:`~dilu.contracts.subjects.SUBJECT_EVENTS`);
one that does not decode is shown as malformed and counted, one from a newer version whose own
field holds an unknown enum member as skipped (docs/events.md). Ctrl-C (or ``--max``) ends it with
exit code 0 and a count line on stderr; NATS unreachable fails within seconds with one line
(exit code 5), a refused subscription too (6); a reader that leaves ends it with 141.
"""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click
import msgspec
from nats import errors as nats_errors

from dilu.client.errors import EXIT_CODES, NotPermitted
from dilu.contracts import cloudevents, subjects
from dilu.contracts.codec import MalformedEvent, SkippedEvent, decode_counted
from dilu.contracts.events import Event
from dilu.services.common.bus import settle
from dilu.services.common.cliopts import nats_options
from dilu.services.common.natsconn import (CredentialsError, NatsOptions, connect, connect_failure,
                                          is_permissions_violation)

from .functions import UNREACHABLE, USAGE, Failed

CONNECT_TIMEOUT_S = 2.0
REFUSED_HINT = ("these credentials may not read it (the integrator's, creds/integrator.creds, read the event "
                "subjects of docs/events.md and no others; the data plane's invocations are "
                "not events)")
_NAMES = ("name", "function", "instance_id")  # the field that names a nested struct in a line


def check_pattern(pattern: str) -> str:
    """A NATS subject pattern: dot-separated non-empty tokens without whitespace; ``>`` only last.
    Raises click.BadParameter (one line) otherwise."""
    tokens = pattern.split(".")
    if not pattern.isascii():  # NATS subjects here are ASCII; a byte that is not UTF-8 failed in nats-py
        raise click.BadParameter(f"{pattern!r} is not a NATS subject pattern: Dilu's subjects are ASCII",
                                 param_hint="--subject")
    wild = any(t not in ("*", ">") and ("*" in t or ">" in t) for t in tokens)  # a.b* is no pattern: nats-py raised
    if not pattern or any(not t or any(c.isspace() for c in t) for t in tokens) or ">" in tokens[:-1] or wild:
        raise click.BadParameter(f"{pattern!r} is not a NATS subject pattern like dilu.v1.telemetry.gpu.*.*",
                                 param_hint="--subject")
    return pattern


def kind_of(subject: str) -> type[Event] | None:
    """The event type a concrete ``subject`` carries (its SUBJECT_EVENTS pattern), or None."""
    tokens = subject.split(".")
    for pattern, kind in subjects.SUBJECT_EVENTS.items():
        want = pattern.split(".")
        if len(want) == len(tokens) and all(w in ("*", t) for w, t in zip(want, tokens)):
            return kind
    return None


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str):
        return v if v and not any(c.isspace() or c in "\"'=" for c in v) else json.dumps(v)
    return str(v)


def summary(event: msgspec.Struct) -> str:
    """Key fields of ``event`` as ``name=value`` words: fields left at their default are left
    out, lists show their length (``instances=[2]``), a nested struct its name (``spec.name=f``)."""
    words = []
    for f in msgspec.structs.fields(event):
        v = getattr(event, f.name)
        if f.name == "ts_ns" or v is None or (f.default is not msgspec.NODEFAULT and v == f.default):
            continue
        if isinstance(v, (list, tuple)):
            words.append(f"{f.name}=[{len(v)}]")
        elif isinstance(v, dict):
            words.append(f"{f.name}={{{len(v)}}}")
        elif isinstance(v, msgspec.Struct):
            name = next((n for n in _NAMES if hasattr(v, n)), None)
            if name is not None:
                words.append(f"{f.name}.{name}={_value(getattr(v, name))}")
        else:
            words.append(f"{f.name}={_value(v)}")
    return " ".join(words)


def _time(ts_ns: int) -> str:
    try:
        return cloudevents.rfc3339(ts_ns)[:23] + "Z" if ts_ns > 0 else "-"
    except ValueError:
        return "-"


class Tail:
    """Turns each message into one output line and counts what it saw."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.events = self.malformed = self.skipped_events = self.skipped_items = self.unknown = 0

    def line(self, subject: str, data: bytes, headers: dict[str, str] | None) -> str:
        """The output line of one message (no newline); counts it."""
        ce = {k: v for k, v in (headers or {}).items() if k.startswith("ce-") or k == cloudevents.H_CONTENT_TYPE}
        kind = kind_of(subject)
        out: dict[str, Any] = {"subject": subject, "headers": ce}
        if kind is None:
            self.unknown += 1
            text = f"{'-':24}  {subject}  (no event type for this subject: {len(data)} bytes)"
            out.update(unknown_subject=True, bytes=len(data))
        else:
            try:
                decoded = decode_counted(data, kind)
            except SkippedEvent as exc:
                self.skipped_events += 1
                text = f"{'-':24}  {subject}  {kind.__name__}  SKIPPED (newer version): {exc}"
                out.update(type=kind.__name__, skipped_event=True, error=str(exc))
            except MalformedEvent as exc:
                self.malformed += 1
                text = f"{'-':24}  {subject}  MALFORMED: {exc}"
                out.update(type=kind.__name__, malformed=True, error=str(exc))
            else:
                self.events += 1
                self.skipped_items += len(decoded.skipped)
                event = decoded.event
                text = f"{_time(event.ts_ns):24}  {subject}  {kind.__name__}  {summary(event)}"
                out.update(type=kind.__name__, event=msgspec.to_builtins(event))
                if decoded.skipped:
                    paths = [s.path for s in decoded.skipped]
                    text += f"  (skipped {len(paths)} item(s) of a newer version: {', '.join(paths)})"
                    out["skipped"] = paths
        return msgspec.json.encode(out).decode() if self.as_json else text

    def counts(self) -> str:
        """The closing count line."""
        return (f"{self.events} events, {self.malformed} malformed, {self.skipped_events} skipped "
                f"(newer version; {self.skipped_items} items within events), {self.unknown} on other subjects")


async def _tail(nats: NatsOptions, patterns: list[str], tail: Tail, limit: int) -> None:
    errors: list[Exception] = []
    warned: set[str] = set()

    async def on_error(exc: Exception) -> None:  # nats-py would print a traceback per attempt
        errors.append(exc)
        if connected and is_permissions_violation(exc):
            refused.append(str(exc))  # a subscription these credentials may not make: waiting is pointless,
            done.set()  # and the first refusal is the one line said at the end (one per subject would follow)
        elif connected and str(exc) not in warned:
            warned.add(str(exc))
            click.echo(f"NATS: {type(exc).__name__}: {exc}", err=True)

    connected = False
    refused: list[str] = []
    reader_left: list[bool] = []
    done = asyncio.Event()
    try:
        nc = await connect(nats, name="dilu-events-tail", connect_timeout=CONNECT_TIMEOUT_S, allow_reconnect=False,
                           max_reconnect_attempts=1, error_cb=on_error)  # (0 would mean no limit)
    except CredentialsError as exc:
        raise Failed(str(exc), USAGE) from None
    except (OSError, asyncio.TimeoutError, nats_errors.Error) as exc:
        cause = errors[-1] if errors else exc
        reason = connect_failure(cause, CONNECT_TIMEOUT_S)
        raise Failed(f"cannot reach NATS at {nats.url}: {reason}", UNREACHABLE) from None
    connected = True
    nc.options["allow_reconnect"] = True  # once connected, ride out outages
    nc.options["max_reconnect_attempts"] = -1
    seen = 0

    async def on_msg(msg) -> None:
        nonlocal seen
        if done.is_set():
            return
        try:
            click.echo(tail.line(msg.subject, msg.data, msg.headers))
        except BrokenPipeError:  # the reader left (dilu events tail | head -1): stop, as `dilu` says (141)
            reader_left.append(True)
            done.set()
            return
        seen += 1
        if limit and seen >= limit:
            done.set()

    try:
        for pattern in patterns:
            await nc.subscribe(pattern, cb=on_msg)
        await settle(nc)
        click.echo(f"listening on {', '.join(patterns) if len(patterns) < 4 else f'{len(patterns)} event subjects'}"
                   " (Ctrl-C to stop)", err=True)
        await done.wait()
    finally:
        await nc.close()
    if reader_left:
        raise BrokenPipeError
    if refused:
        raise Failed(f"{refused[0]}: {REFUSED_HINT}", EXIT_CODES[NotPermitted])


@click.group()
def events() -> None:
    """Events on the bus (see docs/events.md)."""


@events.command()
@nats_options
@click.option("--subject", "patterns", multiple=True, metavar="PATTERN", callback=lambda c, p, v: tuple(map(check_pattern, v)),
              help="NATS subject pattern to follow (repeatable; default: every event subject, not the "
                   "data plane's invocations)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line: subject, headers, event")
@click.option("--max", "limit", type=click.IntRange(min=0), default=0, help="stop after this many messages (0: never)")
def tail(nats: NatsOptions, patterns: tuple[str, ...], as_json: bool, limit: int) -> None:
    """Print every event as it is published: one line each (time, subject, type, key fields), or
    one JSON object per line with --json. Ctrl-C stops (exit 0) with a count line on stderr.

    \b
    Exit codes:
      0    stopped by Ctrl-C or --max
      2    bad input: an option
      5    NATS unreachable
      6    NATS refused a subscription: these credentials may not read it
      141  the reader of the output left (dilu events tail | head -1)
    """
    show = Tail(as_json)
    try:
        asyncio.run(_tail(nats, list(patterns) or list(subjects.SUBJECT_EVENTS), show, limit))
    except KeyboardInterrupt:
        pass
    click.echo(show.counts(), err=True)
    sys.stdout.flush()


if __name__ == "__main__":
    events()
