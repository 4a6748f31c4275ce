"""The pure side of ``dilu chaos``: which faults when, how a run's requests add up, how long the
platform took to recover from each fault, and the slope of each process's resources in a soak.

The fault injector itself (signals, restarts) is in :mod:`dilu.cli.chaos`; everything here takes
times and records in and gives figures out, so it is unit-tested without a cluster.

Accounting follows DESIGN.md section 8: every offered request ends exactly once as completed
(``ok``), failed (``error``), dropped (refused at publish) or timed out; ``lost`` is offered minus
those, so a request the books cannot place shows up there.
"""
from __future__ import annotations

import bisect
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from dilu.loadgen.generator import Record

# Service faults: kill -9, then started again as a supervisor (systemd Restart=on-failure, Nomad
# restart stanza) would. Keys are the fault kinds; values the cluster's service names.
SERVICE_KILLS: dict[str, str] = {
    "kill-scheduler": "scheduler",
    "kill-profiler": "profiler",
    "kill-vertical-scaler": "vertical_scaler",
    "kill-horizontal-scaler": "horizontal_scaler",
    "kill-node-agent": "node_agent",
}
RESTART_NATS = "restart-nats"  # kill -9 nats-server, start it again on its port and store
KILL_INSTANCE = "kill-instance"  # kill -9 one function instance, most likely mid-batch under load
PAUSE_AGENT = "pause-node-agent"  # SIGSTOP the node agent for PAUSE_S, then SIGCONT
LOSE_AGENT = "lose-node-agent"  # kill -9 the node agent for good, once the load is over
KINDS: tuple[str, ...] = (*SERVICE_KILLS, RESTART_NATS, KILL_INSTANCE, PAUSE_AGENT)
PAUSE_S = 5.0
MIN_SPACING_S = 8.0  # faults closer than this would overlap their recoveries
LEAD_S, LEAD_SHARE = 15.0, 1 / 6  # the load settles this long before the first fault, at most this share of a run
TAIL_S, TAIL_SHARE = 20.0, 1 / 5  # and goes on this long after the last, to see it recover


class Fault(msgspec.Struct, kw_only=True):
    """One injected fault. ``at_s``: planned start, s from the start of the load; ``started_ns`` /
    ``whole_ns``: Unix ns when it was injected and when every process of the cluster was running
    and ready again (0: never); ``function``: the function whose instance was killed
    (kill-instance only); ``recovery_s``: see :func:`recovery_s` (None: did not recover);
    ``timed_out``: requests sent while it was the latest fault that timed out (:func:`timeouts_by_fault`);
    ``detail``: what happened, for people."""

    kind: str
    at_s: float
    started_ns: int = 0
    whole_ns: int = 0
    function: str = ""
    recovery_s: float | None = None
    timed_out: int = 0
    detail: str = ""


class Tally(msgspec.Struct, kw_only=True):
    """How a run's requests ended. ``duplicates``: second answers that reached the caller's client
    (it drops them); ``duplicates_to_caller``: requests whose caller got more than one result
    (must be 0); ``lost`` = offered - completed - failed - dropped - timed_out (must be 0)."""

    offered: int
    completed: int
    failed: int
    dropped: int
    timed_out: int
    lost: int
    duplicates: int
    duplicates_to_caller: int


def schedule(kinds: Sequence[str], duration_s: float, *, lead_s: float, tail_s: float) -> list[Fault]:
    """Spread ``kinds`` evenly, in the given order, over ``[lead_s, duration_s - tail_s]``.

    ``lead_s`` lets the load settle first; ``tail_s`` leaves time to see the last recovery.
    Raises ValueError naming the shortest duration that fits when faults would come less than
    MIN_SPACING_S apart, or for an unknown kind.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    if not kinds:
        return []
    span = duration_s - lead_s - tail_s
    if not _spaced(span, len(kinds)):
        need = lead_s + tail_s + MIN_SPACING_S * len(kinds)
        raise ValueError(f"{len(kinds)} faults need a run of at least {need:.0f} s ({need / 60:.1f} min) "
                         f"to come {MIN_SPACING_S:.0f} s apart; got {duration_s:.0f} s")
    step = span / len(kinds)
    return [Fault(kind=k, at_s=round(lead_s + i * step, 3)) for i, k in enumerate(kinds)]


def _spaced(span_s: float, count: int) -> bool:
    """Whether ``span_s`` seconds hold ``count`` faults MIN_SPACING_S apart (with a nanosecond's
    slack, so that a run of exactly :func:`min_duration_s` fits despite rounding)."""
    return span_s >= MIN_SPACING_S * count - 1e-9


def margins_s(duration_s: float) -> tuple[float, float]:
    """The lead and tail (s) of a run of ``duration_s`` seconds for :func:`schedule`: LEAD_S and
    TAIL_S, each cut to its share of a shorter run."""
    return min(LEAD_S, duration_s * LEAD_SHARE), min(TAIL_S, duration_s * TAIL_SHARE)


def min_duration_s(count: int) -> float:
    """The shortest run (s) whose :func:`margins_s` leave room for ``count`` faults; 0 for none.
    Each margin is fixed or a share of the run, so the shortest run solves one of four linear
    equations: it is the least of their solutions that fits (one assuming the wrong margins
    either does not fit or is longer)."""
    if count <= 0:
        return 0.0
    need = MIN_SPACING_S * count
    solutions = [(need + lead + tail) / (1 - lead_share - tail_share)
                 for lead, lead_share in ((LEAD_S, 0.0), (0.0, LEAD_SHARE))
                 for tail, tail_share in ((TAIL_S, 0.0), (0.0, TAIL_SHARE))]
    return min(d for d in solutions if _spaced(d - sum(margins_s(d)), count))


def tally(records: Iterable[Record], *, offered: int, duplicate_replies: int) -> Tally:
    """Count ``records`` (one per result the caller received) against ``offered`` sends."""
    records = list(records)
    by_status = Counter(r.status for r in records)
    per_id = Counter(r.id for r in records)
    ended = by_status["ok"] + by_status["error"] + by_status["dropped"] + by_status["timeout"]
    return Tally(offered=offered, completed=by_status["ok"], failed=by_status["error"],
                 dropped=by_status["dropped"], timed_out=by_status["timeout"], lost=offered - ended,
                 duplicates=duplicate_replies, duplicates_to_caller=sum(n - 1 for n in per_id.values() if n > 1))


def recovery_s(fault: Fault, records: Iterable[Record], started_unix_ns: int) -> float | None:
    """Seconds from the fault until the platform was whole and serving again: the later of (a) every
    process running and ready (``fault.whole_ns``) and (b) the first ``ok`` answer to a request sent
    after the fault (of ``fault.function`` alone when set). None when either never happened.

    ``records`` carry ns offsets from the replay start, ``started_unix_ns`` its Unix time.
    """
    if not fault.whole_ns or not fault.started_ns:
        return None
    since = fault.started_ns - started_unix_ns
    first_ok = min((r.done_ns for r in records
                    if r.status == "ok" and r.sent_ns >= since and (not fault.function or r.function == fault.function)),
                   default=None)
    if first_ok is None:
        return None
    end_ns = max(fault.whole_ns, started_unix_ns + first_ok)
    return round((end_ns - fault.started_ns) / 1e9, 3)


def timeouts_by_fault(faults: Sequence[Fault], records: Iterable[Record], started_unix_ns: int) -> int:
    """Tell each timed-out request to the fault it met: the latest one injected before it was
    sent. Sets each fault's ``timed_out``; returns the timeouts of requests sent before the first
    fault (or with no fault injected), which no fault explains.

    ``faults`` in the order injected (those never injected, ``started_ns`` 0, take none);
    ``records`` carry ns offsets from the replay start, ``started_unix_ns`` its Unix time.
    """
    injected = [f for f in faults if f.started_ns]
    starts = [f.started_ns - started_unix_ns for f in injected]
    for f in faults:
        f.timed_out = 0
    unexplained = 0
    for r in records:
        if r.status != "timeout":
            continue
        i = bisect.bisect_right(starts, r.sent_ns) - 1
        if i < 0:
            unexplained += 1
        else:
            injected[i].timed_out += 1
    return unexplained


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of one process (or of ``shm-segments``: the node agent's shared-memory segments,
    counted in ``fds``, their allocated bytes in ``private_bytes``). ``t_s``: s since the soak
    began; ``private_bytes``: the process's own memory, :func:`own_bytes`; ``fds``: open file
    descriptors; ``threads``."""

    process: str
    t_s: float
    private_bytes: int = 0
    fds: int = 0
    threads: int = 0


class MappedRegion(Protocol):
    """What :func:`own_bytes` reads of one mapping (``psutil.Process.memory_maps(grouped=True)``
    rows have these fields; bytes)."""

    path: str
    private_dirty: int
    swap: int


def own_bytes(maps: Iterable[MappedRegion], shm_dir: str = "/dev/shm") -> int:
    """Bytes a process holds for itself and would free by exiting: private dirty pages (heap,
    malloc arenas, stacks, written library data) and their swap, summed over its mappings.

    Left out: mappings of files under ``shm_dir`` (shared-memory segments; their pages count as
    private to the last process still mapping them, so a segment that instances wrote and left
    would read as the agent's growth: the soak reports segments as their own series), and clean
    file pages (USS counts them, but they turn shared and back as other processes map the same
    libraries: MiB of noise, never a leak). Pure."""
    prefix = shm_dir.rstrip("/") + "/"
    return sum(m.private_dirty + m.swap for m in maps if not m.path.startswith(prefix))


# Share of a soak's span read as warm-up: a process's heap, caches and pools fill while load is
# new (nats-server's Go heap took about 10 minutes to reach its sawtooth between about 24 and 38
# MiB under the 8-function soak), so a leak shows in the slope after it, not in one across it.
WARM_UP_FRACTION = 0.25


class Slope(msgspec.Struct, kw_only=True):
    """Least-squares slopes of one process's series, per minute, over ``samples`` readings spanning
    ``minutes``; ``first``/``last`` private bytes for scale; ``private_bytes_per_min_settled``:
    the private-memory slope over the readings after the first ``WARM_UP_FRACTION`` of the span
    (None: fewer than 3 of them)."""

    samples: int
    minutes: float
    private_bytes_per_min: float
    fds_per_min: float
    threads_per_min: float
    private_first_bytes: int
    private_last_bytes: int
    private_bytes_per_min_settled: float | None = None


def slopes(samples: Iterable[Sample]) -> dict[str, Slope]:
    """Per process, the slope of private memory (over the whole span and after its warm-up),
    descriptors and threads (ordinary least squares, :func:`statistics.linear_regression`). A
    process with fewer than 3 readings, or all at one time, is left out (no slope can be told
    from it)."""
    series: dict[str, list[Sample]] = {}
    for s in samples:
        series.setdefault(s.process, []).append(s)
    out: dict[str, Slope] = {}
    for name, points in series.items():
        points.sort(key=lambda s: s.t_s)
        minutes = [s.t_s / 60.0 for s in points]
        if len(points) < 3 or minutes[0] == minutes[-1]:
            continue

        def per_min(values: list[float], at: list[float] = minutes) -> float:
            return round(statistics.linear_regression(at, values).slope, 3)

        settled_from = minutes[0] + WARM_UP_FRACTION * (minutes[-1] - minutes[0])
        late = [(m, s.private_bytes) for m, s in zip(minutes, points) if m >= settled_from]
        settled = per_min([b for _, b in late], [m for m, _ in late]) if len(late) >= 3 else None
        out[name] = Slope(samples=len(points), minutes=round(minutes[-1] - minutes[0], 3),
                          private_bytes_per_min_settled=settled,
                          private_bytes_per_min=per_min([s.private_bytes for s in points]),
                          fds_per_min=per_min([s.fds for s in points]),
                          threads_per_min=per_min([s.threads for s in points]),
                          private_first_bytes=points[0].private_bytes, private_last_bytes=points[-1].private_bytes)
    return out
