"""The request log of a live run: one JSON object per offered request, in ``requests.jsonl`` beside
the services' logs (``dilu demo`` / ``dilu compare`` write one per policy into ``--log-dir``).

Each line (:class:`RequestLine`): the request's ``id``, ``function``, ``status`` and
``cold_start``; the caller's times ``scheduled_ns`` (intended send), ``sent_ns`` and ``done_ns``
(answer, or given up); and what the platform's reply said (:class:`~.generator.Timings`):
``instance``, ``enqueued_ns``, ``started_ns``, ``replied_ns`` and ``batch`` (0 / "" where the
reply did not say). Every time is Unix epoch ns, so the four spans of a latency are plain
differences: way in ``enqueued - scheduled``, queue ``started - enqueued``, service ``replied -
started``, way back ``done - replied``. A send may precede its scheduled time by up to the event
loop's timer resolution (1 ms under uvloop), so the way in can be slightly negative. ``dilu
calibrate`` reads it (:mod:`.sim.calibrate`).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec

from dilu.services.common import files

from .generator import RunResult, Status, Timings

FILENAME = "requests.jsonl"
REPORT_FILENAME = "report.json"  # the run's report (``dilu demo --json``'s), beside the request log


class RequestLine(Timings, frozen=True, kw_only=True):
    """One request of a live run (module docstring): the :class:`~.generator.Timings` of its reply
    and the caller's side; times in Unix epoch ns."""

    id: str
    function: str
    status: Status
    cold_start: bool = False
    scheduled_ns: int
    sent_ns: int
    done_ns: int


def lines(result: RunResult) -> Iterator[RequestLine]:
    """The request log lines of a replay (its records' offsets made Unix epoch ns)."""
    base = result.started_unix_ns
    for r in result.records:
        t = r.timings
        yield RequestLine(id=r.id, function=r.function, status=r.status, cold_start=r.cold_start,
                          scheduled_ns=base + r.scheduled_ns, sent_ns=base + r.sent_ns, done_ns=base + r.done_ns,
                          **({} if t is None else msgspec.structs.asdict(t)))


def write(path: str | Path, result: RunResult) -> None:
    """Write the request log of ``result`` to ``path`` (replaced). Raises OSError."""
    enc = msgspec.json.Encoder()
    with open(path, "wb") as fh:
        for line in lines(result):
            fh.write(enc.encode(line) + b"\n")


def read(path: str | Path) -> list[RequestLine]:
    """The lines of a request log. Raises OSError, or ValueError naming the file and line of one
    that is malformed or whose platform times go backwards (stored, batch start, reply, answer:
    each at or after the one before; the send may precede the scheduled time by the event loop's
    timer resolution, so those two are not compared)."""
    dec = msgspec.json.Decoder(RequestLine)
    out = []
    with files.open_regular(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                line = dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ValueError(f"{path}:{n}: not a request log line ({exc})") from None
            times = [t for t in (line.enqueued_ns, line.started_ns, line.replied_ns) if t] + [line.done_ns]
            if line.replied_ns and any(b < a for a, b in zip(times, times[1:])):
                raise ValueError(f"{path}:{n}: times out of order (stored, batch start, reply and answer "
                                 "must not go backwards)")
            out.append(line)
    return out
