"""Replay plan: which trace functions are replayed, and when each invocation is sent.

Pure and deterministic: the same trace, arguments and seed give the same plan, byte for byte.

Time. The replay covers ``duration_s`` wall-clock seconds starting at trace minute
``start_minute``; ``speedup`` compresses trace time (speedup 10: one trace minute lasts 6 wall
seconds), so the span covers ``duration_s * speedup / 60`` trace minutes. Only arrivals are
compressed; service and cold-start times stay real (DESIGN.md section 7).

Arrivals. Each function's count in each trace minute is kept exactly; the arrival instants within
the minute are drawn as the sorted order statistics of ``count`` independent uniform draws over the
minute. That is the same as a Poisson process conditioned on the minute's count, so the replay is
Poisson-like inside a minute and exact at minute granularity. Minutes with zero invocations
produce none: idle gaps stay idle.

Partial last minute. When the span ends inside a minute (e.g. 90 s at speedup 1), that minute's
full count is drawn over the whole minute and only the arrivals before the end of the span are
kept: the kept count is proportional to the covered fraction of the minute in expectation
(binomial thinning), and a shorter replay is exactly the prefix of a longer one with the same
seed and start minute.

Randomness. Each function draws from its own generator seeded with (seed, crc32(function name),
start minute), so adding or removing other functions never moves a function's arrivals.

Selection. The K busiest functions of the replayed span (most invocations in the span; ties by
name) are selected; ``"all"`` selects every function with at least one invocation in the span.
The plan reports the share of the span's invocations the selected functions carry.
"""
from __future__ import annotations

import math
import zlib
from typing import Literal

import msgspec
import numpy as np

from .trace import Trace, TraceFunction

NS_PER_S = 1_000_000_000
MINUTE_S = 60
DEFAULT_DURATION_S = 120.0
DEFAULT_SPEEDUP = 10.0
# Trace seconds per wall second a replay may run at: below 0.01 a minute of trace lasts over
# 100 minutes (and the simulator would tick through all of them), above 1000 a minute lasts 60 ms.
SPEEDUP_MIN, SPEEDUP_MAX = 0.01, 1000.0
DEFAULT_FUNCTIONS = 16


class Invocation(msgspec.Struct, frozen=True, kw_only=True):
    """One request to send. ``id`` is unique within the plan; ``scheduled_ns`` is the intended
    send time as an offset from the start of the replay in wall-clock ns; ``trace_minute`` the
    trace minute label it came from."""

    id: str
    function: str
    scheduled_ns: int
    trace_minute: int


class FunctionLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A selected function's load over the span.

    ``invocations``: invocations in the span; ``peak_minute_count``: the largest count of one
    trace minute in the span; ``peak_rps``: that minute's mean rate in wall-clock requests per
    second at the plan's speedup (``peak_minute_count * speedup / 60``); ``duration_ms`` and
    ``memory_mb`` are the trace's own figures for the function, when it has them.
    """

    name: str
    trigger: str
    invocations: int
    peak_minute_count: int
    peak_rps: float
    duration_ms: float | None = None
    memory_mb: float | None = None


class ReplayPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a replay sends.

    ``duration_s`` is the wall-clock length of the replay actually planned (shorter than
    ``requested_duration_s`` only when the trace ends first, then ``clipped`` is True);
    ``span_invocations`` counts all functions' invocations in the span, ``selected_invocations``
    those of the selected functions, ``share`` their ratio (0..1; 0 when the span is empty);
    ``functions`` are the selected functions, busiest first; ``invocations`` are sorted by
    ``scheduled_ns`` (ties by function name).
    """

    trace: str
    seed: int
    start_minute: int
    speedup: float
    duration_s: float
    requested_duration_s: float
    clipped: bool
    span_invocations: int
    selected_invocations: int
    share: float
    functions: tuple[FunctionLoad, ...]
    invocations: tuple[Invocation, ...]


def plan_replay(
    trace: Trace,
    *,
    seed: int,
    duration_s: float = DEFAULT_DURATION_S,
    speedup: float = DEFAULT_SPEEDUP,
    start_minute: int | None = None,
    functions: int | Literal["all"] = DEFAULT_FUNCTIONS,
    id_prefix: str = "",
) -> ReplayPlan:
    """Build the replay plan (see the module docstring for the rules).

    ``seed`` (int >= 0) fixes every draw; ``duration_s`` (> 0) is wall-clock seconds of replay;
    ``speedup`` (``SPEEDUP_MIN``..``SPEEDUP_MAX``) is trace seconds per wall second;
    ``start_minute`` a trace minute label (default: the trace's first); ``functions`` K >= 1 or
    ``"all"``; ``id_prefix`` is put in front of every invocation id (e.g. a run id, so ids stay
    unique across runs).

    Raises ValueError for arguments out of range or a start minute outside the trace. A span
    running past the end of the trace is clipped to it (``clipped`` in the plan).
    """
    _check_args(seed, duration_s, speedup, functions)
    start = _start_minute(trace, start_minute)
    span_s = _span_s(trace, start, duration_s, speedup)
    clipped = duration_s * speedup > span_s
    touched = min(math.ceil(span_s / MINUTE_S), trace.minutes.stop - start)
    first_idx = start - trace.first_minute

    arrivals = {f.name: _arrivals(f, seed, start, first_idx, touched, span_s) for f in trace.functions}
    span_total = sum(len(a) for a in arrivals.values())
    ranked = sorted((f for f in trace.functions if len(arrivals[f.name])), key=lambda f: (-len(arrivals[f.name]), f.name))
    selected = ranked if functions == "all" else ranked[:functions]
    selected_total = sum(len(arrivals[f.name]) for f in selected)

    loads = tuple(_load(f, arrivals[f.name], first_idx, touched, speedup) for f in selected)
    invocations = _invocations(selected, arrivals, start, speedup, id_prefix)
    return ReplayPlan(
        trace=trace.source, seed=seed, start_minute=start, speedup=float(speedup),
        duration_s=span_s / speedup, requested_duration_s=float(duration_s), clipped=clipped,
        span_invocations=span_total, selected_invocations=selected_total,
        share=selected_total / span_total if span_total else 0.0,
        functions=loads, invocations=invocations,
    )


def replay_s(trace: Trace, *, duration_s: float, speedup: float, start_minute: int | None = None) -> float:
    """Wall-clock seconds a replay of ``duration_s`` seconds at ``speedup`` from ``start_minute``
    (default: the trace's first) actually covers: ``duration_s``, or less when the trace ends
    first (the plan's ``duration_s``, known without planning: a command can check it before
    anything starts). Raises ValueError for a start minute outside the trace."""
    return _span_s(trace, _start_minute(trace, start_minute), duration_s, speedup) / speedup


# ----------------------------------------------------------------------------------- internals


def _start_minute(trace: Trace, start_minute: int | None) -> int:
    start = trace.first_minute if start_minute is None else int(start_minute)
    if start not in trace.minutes:
        raise ValueError(
            f"start minute {start} is outside the trace (minutes {trace.minutes.start}..{trace.minutes.stop - 1})"
        )
    return start


def _span_s(trace: Trace, start: int, duration_s: float, speedup: float) -> float:
    """Trace seconds the replay spans from minute ``start``: cut where the trace ends."""
    return min(duration_s * speedup, (trace.minutes.stop - start) * MINUTE_S)


def _check_args(seed: int, duration_s: float, speedup: float, functions: int | str) -> None:
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration must be a positive number of seconds, got {duration_s!r}")
    if not (SPEEDUP_MIN <= speedup <= SPEEDUP_MAX):
        raise ValueError(f"speedup must be in [{SPEEDUP_MIN:g}, {SPEEDUP_MAX:g}], got {speedup!r}")
    if functions != "all" and not (isinstance(functions, int) and functions >= 1):
        raise ValueError(f"functions must be an integer >= 1 or 'all', got {functions!r}")


def _arrivals(f: TraceFunction, seed: int, start: int, first_idx: int, touched: int, span_s: float) -> np.ndarray:
    """Arrival instants of one function in trace seconds from the start of the span, sorted."""
    counts = np.asarray(f.counts[first_idx:first_idx + touched], dtype=np.int64)
    rng = np.random.default_rng([seed, zlib.crc32(f.name.encode()), start])
    offsets = np.repeat(np.arange(len(counts), dtype=np.float64) * MINUTE_S, counts)
    t = np.sort(offsets + rng.uniform(0.0, MINUTE_S, size=int(counts.sum())))
    return t[t < span_s]


def _load(f: TraceFunction, t: np.ndarray, first_idx: int, touched: int, speedup: float) -> FunctionLoad:
    per_minute = np.bincount((t // MINUTE_S).astype(np.int64), minlength=touched)
    peak = int(per_minute.max()) if len(per_minute) else 0
    return FunctionLoad(
        name=f.name, trigger=f.trigger, invocations=len(t), peak_minute_count=peak,
        peak_rps=peak * speedup / MINUTE_S, duration_ms=f.duration_ms, memory_mb=f.memory_mb,
    )


def _invocations(
    selected: list[TraceFunction], arrivals: dict[str, np.ndarray], start: int, speedup: float, prefix: str
) -> tuple[Invocation, ...]:
    rows: list[tuple[int, str, int]] = []
    for f in selected:
        t = arrivals[f.name]
        ns = np.rint(t * (NS_PER_S / speedup)).astype(np.int64)
        minutes = (t // MINUTE_S).astype(np.int64) + start
        rows.extend(zip(ns.tolist(), [f.name] * len(t), minutes.tolist()))
    rows.sort()
    return tuple(
        Invocation(id=f"{prefix}{i:07d}", function=name, scheduled_ns=ns, trace_minute=minute)
        for i, (ns, name, minute) in enumerate(rows)
    )
