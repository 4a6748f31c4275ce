"""Reader for traces in the Azure Functions 2019 format (DESIGN.md section 7).

A trace is a directory holding:

- ``invocations.csv`` (required): ``HashOwner,HashApp,HashFunction,Trigger,<m>,<m+1>,...``, one row
  per function, one column per trace minute (consecutive integer minute labels), each cell the
  number of invocations that started in that minute (a non-negative integer).
- ``durations.csv`` (optional): ``HashOwner,HashApp,HashFunction,Average,...``, execution time in ms.
- ``memory.csv`` (optional): ``HashFunction,HashOwner,HashApp,SampleCount,AverageAllocatedMb,...``,
  allocated memory in MB; or the raw trace's per-application table
  (``HashOwner,HashApp,SampleCount,AverageAllocatedMb,...``, no ``HashFunction``), in which case
  every function of an application gets the application's figure.

Every malformed file raises :class:`TraceError` naming the file and the line (1-based, as an
editor shows it), so a user handing ``--trace DIR`` a broken trace learns where it breaks.
"""
from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import msgspec

from dilu.services.common import files

INVOCATIONS = "invocations.csv"
DURATIONS = "durations.csv"
MEMORY = "memory.csv"
KEY_COLUMNS = ("HashOwner", "HashApp", "HashFunction", "Trigger")
FUNCTION_KEY = KEY_COLUMNS[:3]
NAME_PREFIX = "fn-"
# Shortest hash prefix used in a function name; lengthened until names are unique.
NAME_HASH_CHARS = 8
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_LINE_BREAK = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")  # what str.splitlines() breaks on


# The most invocations a function may have in one trace minute: 10 million (166,000 a second;
# the bundled Azure Functions 2019 sample peaks at 734). More is a corrupt file, and it would
# be expanded into one arrival each before anything could refuse it.
MAX_COUNT_PER_MINUTE = 10_000_000


class TraceError(ValueError):
    """A trace file is missing or malformed. ``path`` is the file, ``line`` the 1-based line
    (0 when the fault is the file as a whole). The message is one line: a line break taken from
    the file (e.g. inside a quoted cell) is written as its escape."""

    def __init__(self, path: Path | str, line: int, reason: str):
        self.path = Path(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}" + (f" line {line}" if line else "")
        super().__init__(_LINE_BREAK.sub(lambda m: m.group().encode("unicode_escape").decode(), f"{where}: {reason}"))


class TraceFunction(msgspec.Struct, frozen=True, kw_only=True):
    """One function of a trace.

    ``name`` is the platform name (``fn-`` + a hash prefix, safe as a NATS subject token);
    ``counts`` the invocations per trace minute, aligned with :attr:`Trace.minutes`;
    ``duration_ms`` the mean execution time from ``durations.csv`` and ``memory_mb`` the mean
    allocated memory from ``memory.csv`` (None when the file or the row is absent).
    """

    name: str
    owner: str
    app: str
    function: str
    trigger: str
    counts: tuple[int, ...]
    duration_ms: float | None = None
    memory_mb: float | None = None

    @property
    def total(self) -> int:
        """Invocations over the whole trace."""
        return sum(self.counts)


class Trace(msgspec.Struct, frozen=True, kw_only=True):
    """A whole trace: ``first_minute`` is the label of the first minute column (e.g. 480 for the
    bundled sample), ``n_minutes`` the number of minute columns, ``source`` the directory read."""

    source: str
    first_minute: int
    n_minutes: int
    functions: tuple[TraceFunction, ...]

    @property
    def minutes(self) -> range:
        """The trace minute labels, in order."""
        return range(self.first_minute, self.first_minute + self.n_minutes)

    def by_name(self) -> dict[str, TraceFunction]:
        """Functions keyed by platform name."""
        return {f.name: f for f in self.functions}


def default_trace_dir() -> Path:
    """The bundled Azure Functions 2019 sample (100 functions, minutes 480..959), package data."""
    return Path(str(resources.files("dilu.loadgen") / "data" / "azure-functions-2019-100"))


def read_trace(directory: str | Path | None = None) -> Trace:
    """Read a trace directory (default: the bundled sample).

    Raises :class:`TraceError` when the directory or ``invocations.csv`` is missing, or any file
    is malformed: wrong header, wrong number of columns, a count that is not a non-negative
    integer, non-consecutive minute labels, a duplicate function, a bad number in the optional
    files.
    """
    root = Path(directory) if directory is not None else default_trace_dir()
    if not root.is_dir():
        raise TraceError(root, 0, "trace directory not found")
    inv_path = root / INVOCATIONS
    if not inv_path.is_file():
        why = "not a file" if inv_path.exists() else "missing"
        raise TraceError(inv_path, 0, f"{why}; a trace directory needs {INVOCATIONS}")
    first_minute, n_minutes, rows = _read_invocations(inv_path)
    durations = _read_optional(root / DURATIONS, FUNCTION_KEY, "Average")
    memory = _read_optional(root / MEMORY, FUNCTION_KEY, "AverageAllocatedMb", per_app=True)
    names = _unique_names([r[2] for r in rows])
    functions = tuple(
        TraceFunction(
            name=name, owner=owner, app=app, function=fn, trigger=trigger, counts=counts,
            duration_ms=durations.get((owner, app, fn)),
            memory_mb=memory.get((owner, app, fn), memory.get((owner, app))),
        )
        for name, (owner, app, fn, trigger, counts) in zip(names, rows)
    )
    return Trace(source=str(root), first_minute=first_minute, n_minutes=n_minutes, functions=functions)


# ----------------------------------------------------------------------------------- internals


def _rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Yield (1-based line, cells) of a CSV file, skipping blank lines."""
    try:
        fh = files.open_regular(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(path, 0, f"cannot read: {exc.strerror or exc}") from None
    try:
        with fh:
            reader = csv.reader(fh)
            try:
                for cells in reader:
                    if cells and any(c.strip() for c in cells):
                        yield reader.line_num, [c.strip() for c in cells]
            except csv.Error as exc:
                raise TraceError(path, reader.line_num, f"not valid CSV: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(path, 0, f"not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise TraceError(path, 0, f"cannot read: {exc.strerror or exc}") from None


def _read_invocations(path: Path) -> tuple[int, int, list[tuple[str, str, str, str, tuple[int, ...]]]]:
    rows = _rows(path)
    try:
        line, header = next(rows)
    except StopIteration:
        raise TraceError(path, 0, "empty file") from None
    if tuple(header[:4]) != KEY_COLUMNS:
        raise TraceError(path, line, f"header must start with {','.join(KEY_COLUMNS)}, got {','.join(header[:4])!r}")
    minutes = header[4:]
    if not minutes:
        raise TraceError(path, line, "header has no minute columns")
    try:
        labels = [int(m) for m in minutes]
    except ValueError:
        raise TraceError(path, line, f"minute columns must be integers, got {minutes[:5]}...") from None
    if labels != list(range(labels[0], labels[0] + len(labels))):
        raise TraceError(path, line, "minute columns must be consecutive integers")
    width = len(header)
    out: list[tuple[str, str, str, str, tuple[int, ...]]] = []
    seen: dict[tuple[str, str, str], int] = {}
    for line, cells in rows:
        if len(cells) != width:
            raise TraceError(path, line, f"expected {width} columns, got {len(cells)}")
        owner, app, fn, trigger = cells[:4]
        if not (owner and app and fn):
            raise TraceError(path, line, "empty HashOwner, HashApp or HashFunction")
        key = (owner, app, fn)
        if key in seen:
            raise TraceError(path, line, f"duplicate function {fn} (first on line {seen[key]})")
        seen[key] = line
        out.append((owner, app, fn, trigger, _counts(path, line, cells[4:], labels)))
    if not out:
        raise TraceError(path, 0, "no function rows")
    return labels[0], len(labels), out


def _counts(path: Path, line: int, cells: list[str], labels: list[int]) -> tuple[int, ...]:
    counts = []
    for label, cell in zip(labels, cells):
        # Some exports write integral counts as "3.0"; anything fractional or negative is an error.
        try:
            value = float(cell)
        except ValueError:
            raise TraceError(path, line, f"minute {label}: count {cell!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise TraceError(path, line, f"minute {label}: count {cell!r} is not a non-negative integer")
        if value > MAX_COUNT_PER_MINUTE:
            raise TraceError(path, line, f"minute {label}: count {cell} is above the {MAX_COUNT_PER_MINUTE:,} a "
                                         "function can have in a minute")
        counts.append(int(value))
    return tuple(counts)


def _read_optional(path: Path, keys: tuple[str, ...], column: str, *,
                   per_app: bool = False) -> dict[tuple[str, ...], float]:
    """Read one numeric column (finite, >= 0) of an optional per-function file, keyed by ``keys``
    (owner, app, function). ``per_app``: a file without the function column is taken as a
    per-application table, keyed by (owner, app)."""
    if not path.exists():
        return {}
    rows = _rows(path)
    try:
        line, header = next(rows)
    except StopIteration:
        raise TraceError(path, 0, "empty file") from None
    if per_app and keys[-1] not in header:
        keys = keys[:-1]
    missing = [c for c in (*keys, column) if c not in header]
    if missing:
        raise TraceError(path, line, f"header lacks column(s) {', '.join(missing)}")
    idx = [header.index(k) for k in keys]
    col = header.index(column)
    out: dict[tuple[str, ...], float] = {}
    for line, cells in rows:
        if len(cells) != len(header):
            raise TraceError(path, line, f"expected {len(header)} columns, got {len(cells)}")
        try:
            value = float(cells[col])
        except ValueError:
            raise TraceError(path, line, f"{column} {cells[col]!r} is not a number") from None
        if not (math.isfinite(value) and value >= 0):
            raise TraceError(path, line, f"{column} {cells[col]!r} must be >= 0 and finite")
        out[tuple(cells[i] for i in idx)] = value
    return out


def _unique_names(hashes: list[str]) -> list[str]:
    """``fn-`` + the shortest hash prefix (at least 8 characters) that tells the functions apart;
    functions sharing a whole HashFunction (different owner or app) get ``-2``, ``-3``...."""
    safe = [_UNSAFE.sub("_", h).lower() for h in hashes]
    n = NAME_HASH_CHARS
    longest = max(len(s) for s in safe)
    while n < longest and len({s[:n] for s in safe}) < len(set(safe)):
        n += 1
    names: list[str] = []
    used: dict[str, int] = {}
    for s in safe:
        base = NAME_PREFIX + s[:n]
        used[base] = used.get(base, 0) + 1
        names.append(base if used[base] == 1 else f"{base}-{used[base]}")
    return names


def write_trace(
    directory: str | Path,
    counts: dict[str, list[int] | tuple[int, ...]],
    *,
    first_minute: int = 1,
    trigger: str = "http",
) -> Path:
    """Write a synthetic trace in the Azure Functions 2019 format (``invocations.csv`` only).

    ``counts`` maps a HashFunction to its per-minute counts (all the same length, >= 1 minute);
    owner and app hashes are derived from it. Returns the directory. Useful to build small
    traces with known answers (tests, examples). Raises ValueError on ragged or empty counts.
    """
    lengths = {len(c) for c in counts.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError("every function needs the same, non-zero number of minutes")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (n,) = lengths
    with (root / INVOCATIONS).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow([*KEY_COLUMNS, *range(first_minute, first_minute + n)])
        for fn, row in counts.items():
            writer.writerow([f"owner-{fn}", f"app-{fn}", fn, trigger, *row])
    return root
