"""LLM request traces: reading the Azure LLM inference trace and planning its replay.

Format. A CSV file with a header naming (in any order) ``TIMESTAMP`` (ISO 8601 date-time, e.g.
``2023-11-16 18:17:03.9799600``; extra fraction digits beyond microseconds are dropped),
``ContextTokens`` (prompt length, tokens) and ``GeneratedTokens`` (output length, tokens), one
request a row: the Azure LLM Inference Trace 2023 (``default_llm_trace()`` is its code workload,
bundled). Rows may come in any order; the reader sorts them by time. Every malformed file raises
:class:`~dilu.loadgen.trace.TraceError` naming the file and the 1-based line.

Replay. Arrivals are taken from the trace exactly, not drawn: the span ``[start_s, start_s +
duration_s * speedup)`` of trace time (seconds from the trace's first request) is replayed in
``duration_s`` wall seconds, each request sent ``(t - start_s) / speedup`` after the replay's
start. Idle gaps of the trace stay idle (shortened by the speed-up like everything else). Only
arrivals are compressed; token counts, hence service times, stay as the trace has them.

Sampling. ``sample`` < 1 keeps each request of the span independently with that probability
(binomial thinning, drawn from a generator seeded with (seed, crc32(function))), to scale the
load down while keeping its burst and gap structure. The plan is a pure function of the trace
and the arguments: the same seed gives the same plan, byte for byte; at ``sample`` 1 the seed
draws nothing.

Payload. An llm function is called with JSON ``{"prompt_tokens": P, "max_new_tokens": N}``
(:func:`payload`), the request the emulated LLaMA2 handler reads: P the trace's prompt length, N
its output length, at least 1 and at most ``max_new_tokens_cap`` when given.
"""
from __future__ import annotations

import math
import zlib
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import msgspec
import numpy as np

from .arrivals import DEFAULT_DURATION_S, MINUTE_S, NS_PER_S, Invocation
from .trace import TraceError, _rows

TIMESTAMP = "TIMESTAMP"
CONTEXT_TOKENS = "ContextTokens"
GENERATED_TOKENS = "GeneratedTokens"
COLUMNS = (TIMESTAMP, CONTEXT_TOKENS, GENERATED_TOKENS)
DEFAULT_LLM_SPEEDUP = 1.0
TRACE_FILE = "AzureLLMInferenceTrace_code.csv"


class LlmRequest(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One request of an LLM trace: ``offset_s`` seconds after the trace's first request,
    ``prompt_tokens`` and ``output_tokens`` (tokens, >= 0) as the trace gives them."""

    offset_s: float
    prompt_tokens: int
    output_tokens: int


class LlmTrace(msgspec.Struct, frozen=True, kw_only=True):
    """A whole LLM trace: ``source`` the file read, ``first_timestamp`` the first request's time
    (ISO 8601, as parsed), ``requests`` sorted by ``offset_s`` (the first at 0.0)."""

    source: str
    first_timestamp: str
    requests: tuple[LlmRequest, ...]

    @property
    def duration_s(self) -> float:
        """Seconds from the first request to the last (0.0 for a single request)."""
        return self.requests[-1].offset_s


class LlmInvocation(Invocation, frozen=True, kw_only=True):
    """An :class:`~dilu.loadgen.arrivals.Invocation` of an llm function, with its request:
    ``prompt_tokens`` (tokens) and ``output_tokens`` (tokens to generate, >= 1, already capped).
    ``trace_minute`` is the minute of the trace it came from, counted from 0 at the first
    request."""

    prompt_tokens: int
    output_tokens: int


class LlmPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What an LLM replay sends.

    ``duration_s`` is the wall-clock length actually planned (shorter than
    ``requested_duration_s`` only when the trace ends first, then ``clipped`` is True);
    ``span_requests`` counts the trace's requests in the span before sampling; ``capped`` the
    planned requests whose output length was cut to ``max_new_tokens_cap``; ``peak_rps`` the
    busiest trace minute's planned requests as wall-clock requests per second
    (``count * speedup / 60``); ``invocations`` sorted by ``scheduled_ns``.
    """

    trace: str
    function: str
    seed: int
    start_s: float
    speedup: float
    duration_s: float
    requested_duration_s: float
    clipped: bool
    sample: float
    max_new_tokens_cap: int | None
    span_requests: int
    capped: int
    peak_rps: float
    invocations: tuple[LlmInvocation, ...]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all planned requests."""
        return sum(i.prompt_tokens for i in self.invocations)

    @property
    def output_tokens(self) -> int:
        """Output tokens asked for by all planned requests."""
        return sum(i.output_tokens for i in self.invocations)


def default_llm_trace() -> Path:
    """The bundled Azure LLM Inference Trace 2023, code workload (package data)."""
    return Path(str(resources.files("dilu.loadgen") / "data" / "azure-llm-2023-code" / TRACE_FILE))


def read_llm_trace(path: str | Path | None = None) -> LlmTrace:
    """Read an LLM trace CSV (default: the bundled code workload; see the module docstring).

    Raises :class:`TraceError` (one line: file, line, reason) when the file is missing or not a
    file, empty, has a header without the three columns, a row with the wrong number of cells,
    a timestamp that is not ISO 8601, a token count that is not a non-negative integer, or no
    request rows.
    """
    src = Path(path) if path is not None else default_llm_trace()
    if not src.is_file():
        raise TraceError(src, 0, "LLM trace file not found" if not src.exists() else "not a file; give the CSV file")
    rows = _rows(src)
    try:
        line, header = next(rows)
    except StopIteration:
        raise TraceError(src, 0, "empty file") from None
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(src, line, f"header lacks column(s) {', '.join(missing)} (needs {','.join(COLUMNS)})")
    i_ts, i_ctx, i_gen = (header.index(c) for c in COLUMNS)
    parsed: list[tuple[datetime, int, int]] = []
    for line, cells in rows:
        if len(cells) != len(header):
            raise TraceError(src, line, f"expected {len(header)} columns, got {len(cells)}")
        parsed.append((_timestamp(src, line, cells[i_ts]), _tokens(src, line, CONTEXT_TOKENS, cells[i_ctx]),
                       _tokens(src, line, GENERATED_TOKENS, cells[i_gen])))
    if not parsed:
        raise TraceError(src, 0, "no request rows")
    parsed.sort(key=lambda r: r[0])  # stable: rows at the same instant keep the file's order
    first = parsed[0][0]
    requests = tuple(
        LlmRequest(offset_s=(ts - first).total_seconds(), prompt_tokens=p, output_tokens=n) for ts, p, n in parsed
    )
    return LlmTrace(source=str(src), first_timestamp=first.isoformat(sep=" "), requests=requests)


def plan_llm_replay(
    trace: LlmTrace,
    *,
    function: str,
    seed: int,
    duration_s: float = DEFAULT_DURATION_S,
    speedup: float = DEFAULT_LLM_SPEEDUP,
    start_s: float = 0.0,
    max_new_tokens_cap: int | None = None,
    sample: float = 1.0,
    id_prefix: str = "",
) -> LlmPlan:
    """Plan the replay of ``trace`` against the llm function ``function`` (module docstring).

    ``seed`` (int >= 0) fixes the sampling draws; ``duration_s`` (> 0) wall-clock seconds of
    replay; ``speedup`` (> 0) trace seconds per wall second; ``start_s`` (0 <= start_s < the
    trace's duration) trace seconds after its first request where the span begins;
    ``max_new_tokens_cap`` (>= 1 or None) the most tokens one request asks for; ``sample``
    (0 < sample <= 1) the fraction of the span's requests kept; invocation ids are
    ``<id_prefix><function>-<n>``, so they stay unique beside other functions' invocations.

    Raises ValueError for an argument out of range. A span running past the trace's last request
    is clipped to it (``clipped`` in the plan).
    """
    _check_args(function, seed, duration_s, speedup, start_s, max_new_tokens_cap, sample, trace)
    available_s = trace.duration_s - start_s
    clipped = duration_s * speedup > available_s
    span_s = min(duration_s * speedup, available_s)
    offsets = np.fromiter((r.offset_s for r in trace.requests), dtype=np.float64, count=len(trace.requests))
    in_span = offsets >= start_s
    if span_s < available_s:  # else the span runs to the trace's last request, which it keeps
        in_span &= offsets < start_s + span_s
    index = np.flatnonzero(in_span)
    if sample < 1.0:
        rng = np.random.default_rng([seed, zlib.crc32(function.encode())])
        index = index[rng.random(len(index)) < sample]
    invocations: list[LlmInvocation] = []
    capped = 0
    for n, i in enumerate(index.tolist()):
        req = trace.requests[i]
        out = max(req.output_tokens, 1)
        if max_new_tokens_cap is not None and out > max_new_tokens_cap:
            out, capped = max_new_tokens_cap, capped + 1
        rel_s = req.offset_s - start_s
        invocations.append(LlmInvocation(
            id=f"{id_prefix}{function}-{n:07d}", function=function,
            scheduled_ns=round(rel_s * NS_PER_S / speedup), trace_minute=int(req.offset_s // MINUTE_S),
            prompt_tokens=req.prompt_tokens, output_tokens=out,
        ))
    per_minute = np.bincount(((offsets[index] - start_s) // MINUTE_S).astype(np.int64)) if len(index) else [0]
    return LlmPlan(
        trace=trace.source, function=function, seed=seed, start_s=float(start_s), speedup=float(speedup),
        duration_s=span_s / speedup, requested_duration_s=float(duration_s), clipped=clipped, sample=float(sample),
        max_new_tokens_cap=max_new_tokens_cap, span_requests=int(in_span.sum()), capped=capped,
        peak_rps=int(max(per_minute)) * speedup / MINUTE_S, invocations=tuple(invocations),
    )


def payload(inv: LlmInvocation) -> bytes:
    """The request body of an llm invocation: JSON ``{"prompt_tokens": P, "max_new_tokens": N}``
    (UTF-8, no spaces), P and N integers as planned."""
    return msgspec.json.encode({"prompt_tokens": inv.prompt_tokens, "max_new_tokens": inv.output_tokens})


# ----------------------------------------------------------------------------------- internals


def _timestamp(path: Path, line: int, cell: str) -> datetime:
    try:
        ts = datetime.fromisoformat(cell)
    except ValueError:
        raise TraceError(path, line, f"{TIMESTAMP} {cell!r} is not an ISO 8601 date-time") from None
    # an explicit offset is honoured by converting to UTC; naive times are taken as they are
    if ts.tzinfo is None:
        return ts
    try:
        return ts.astimezone(timezone.utc).replace(tzinfo=None)
    except OverflowError:  # e.g. 9999-12-31T23:59:59-01:00 is past the last representable UTC time
        raise TraceError(path, line, f"{TIMESTAMP} {cell!r} is out of range in UTC") from None


def _tokens(path: Path, line: int, column: str, cell: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        raise TraceError(path, line, f"{column} {cell!r} is not an integer") from None
    if value < 0:
        raise TraceError(path, line, f"{column} {cell!r} must be >= 0")
    return value


def _check_args(function: str, seed: int, duration_s: float, speedup: float, start_s: float,
                cap: int | None, sample: float, trace: LlmTrace) -> None:
    if not function:
        raise ValueError("function must be a non-empty name")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration must be a positive number of seconds, got {duration_s!r}")
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"speedup must be positive, got {speedup!r}")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise ValueError(f"max_new_tokens_cap must be an integer >= 1, got {cap!r}")
    if not 0 < sample <= 1:
        raise ValueError(f"sample must be a fraction in (0, 1], got {sample!r}")
    if not (0 <= start_s < trace.duration_s or start_s == 0):
        raise ValueError(f"start {start_s!r} s is outside the trace (0 to {trace.duration_s:.1f} s)")
