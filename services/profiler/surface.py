"""Measured performance surfaces: loading them, and answering profiling trials from them.

Two CSV formats are read (see ``surfaces/ATTRIBUTION.md`` for their origin):

- ``a100-mps``: columns ``batch,sm_percent,latency_s,throughput_rps``. One quota axis, the MPS
  active-thread share (SM share), so a setting is ``(sm_fraction,)``. For generative models
  (``tokens_per_request`` > 1, LLaMA2) ``latency_s`` is one decode step and a request generates
  ``tokens_per_request`` tokens, so request latency = tokens_per_request × latency_s; the
  ``throughput_rps`` column already counts whole requests.
- ``v100-sm-quota``: columns ``batch,sm_percent,time_quota_percent,latency_ms``. Two quota axes,
  SM share × time-quota share, so a setting is ``(sm_fraction, time_fraction)`` and its quota
  (share of the GPU's SM-time) is their product. Throughput = batch / latency.

Settings are fractions 0..1 rounded to 4 decimals, so keys never carry float artefacts.
"""
from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from dilu.services.common import files, models

from .policy import Measurement, Trial

SURFACES_DIR = models.SURFACES  # the measured files, shared with the emulated GPU
A100_HEADER = ("batch", "sm_percent", "latency_s", "throughput_rps")
V100_HEADER = ("batch", "sm_percent", "time_quota_percent", "latency_ms")

Setting = tuple[float, ...]


class SurfaceError(ValueError):
    """A surface file that cannot be read (unknown header, bad number, empty), or a trial off its grid."""


@dataclass(frozen=True)
class Optimum:
    """The exhaustive optimum among SLO-meeting grid points: TE (requests/s per unit quota), where, cost."""

    te: float
    quota: float
    setting: Setting
    batch: int
    latency_ms: float
    trials: int


@dataclass
class Surface:
    """A measured grid: ``points[(setting, batch)] = Measurement`` (request latency ms, requests/s).

    ``quota_axes``: the sorted values of each quota axis (first = SM share); ``batches`` sorted.
    """

    name: str
    fmt: str
    quota_axes: tuple[tuple[float, ...], ...]
    batches: tuple[int, ...]
    points: dict[tuple[Setting, int], Measurement]
    tokens_per_request: int = 1

    @property
    def full_setting(self) -> Setting:
        """The whole GPU: every quota axis at its largest value."""
        return tuple(axis[-1] for axis in self.quota_axes)

    def measure(self, setting: Setting, batch: int) -> Measurement:
        """The measured point; raises SurfaceError when (setting, batch) is not on the grid."""
        key = (tuple(round(v, 4) for v in setting), int(batch))
        try:
            return self.points[key]
        except KeyError:
            raise SurfaceError(f"{self.name}: no measurement at setting={key[0]} batch={key[1]}") from None

    def baseline_latency_ms(self) -> float:
        """Latency of batch 1 on the full GPU (the reference the default SLOs are multiples of)."""
        return self.measure(self.full_setting, self.batches[0]).latency_ms

    def exhaustive(self, slo_ms: float) -> Optimum | None:
        """Best TE over every grid point with latency ≤ ``slo_ms``; None when no point meets it."""
        best: Optimum | None = None
        for (setting, batch), m in sorted(self.points.items()):
            if m.latency_ms > slo_ms:
                continue
            q = math.prod(setting)
            te = m.throughput_rps / q
            if best is None or te > best.te:
                best = Optimum(te, q, setting, batch, m.latency_ms, len(self.points))
        return best


def _num(row: dict[str, str], col: str, path: Path, line: int) -> float:
    try:
        value = float(row[col])
    except (KeyError, TypeError, ValueError):
        raise SurfaceError(f"{path}:{line}: column {col!r} is not a number: {row.get(col)!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise SurfaceError(f"{path}:{line}: column {col!r} must be a positive number, got {value}")
    return value


def _fraction(row: dict[str, str], col: str, path: Path, line: int) -> float:
    """A percentage column as a fraction in (0, 1], 4 decimals. Raises SurfaceError outside (0, 100]."""
    value = _num(row, col, path, line)
    if value > 100:
        raise SurfaceError(f"{path}:{line}: column {col!r} is a percentage in (0, 100], got {value:g}")
    return round(value / 100, 4)


def _batch(row: dict[str, str], path: Path, line: int) -> int:
    """The ``batch`` column: a whole number >= 1. Raises SurfaceError otherwise."""
    value = _num(row, "batch", path, line)
    if value != int(value):
        raise SurfaceError(f"{path}:{line}: column 'batch' must be a whole number, got {value:g}")
    return int(value)


def load_surface(path: str | Path, tokens_per_request: int | None = None) -> Surface:
    """Read a surface CSV in either format (detected from its header).

    ``tokens_per_request`` defaults to 32 for a file whose name starts with ``llama`` (per-token
    latency, DESIGN.md section 7) and 1 otherwise. Raises SurfaceError for an unknown header,
    a non-numeric or non-positive value, a percentage above 100, a batch that is not a whole
    number, a point (setting and batch) measured on two lines, an empty or binary file.
    """
    path = Path(path)
    if tokens_per_request is None:
        tokens_per_request = 32 if path.name.lower().startswith("llama") else 1
    try:
        with files.open_regular(path, newline="") as fh:
            reader = csv.DictReader(fh)
            header = tuple(c.strip() for c in (reader.fieldnames or ()))
            rows = list(reader)
    except UnicodeDecodeError:
        raise SurfaceError(f"{path}: not a text CSV file") from None
    except csv.Error as exc:
        raise SurfaceError(f"{path}: {exc}") from None
    except OSError as exc:  # missing, unreadable, not a regular file
        raise SurfaceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if header == A100_HEADER:
        fmt = "a100-mps"
    elif header == V100_HEADER:
        fmt = "v100-sm-quota"
    else:
        raise SurfaceError(f"{path}: unknown header {header}; expected {A100_HEADER} or {V100_HEADER}")
    points: dict[tuple[Setting, int], Measurement] = {}
    first_line: dict[tuple[Setting, int], int] = {}
    for line, row in enumerate(rows, start=2):
        batch = _batch(row, path, line)
        sm = _fraction(row, "sm_percent", path, line)
        if fmt == "a100-mps":
            setting: Setting = (sm,)
            latency = _num(row, "latency_s", path, line) * 1000 * tokens_per_request
            if not math.isfinite(latency):  # 1e308 s passes as a number but not as ms
                raise SurfaceError(f"{path}:{line}: column 'latency_s' is too large: {row['latency_s']}")
            throughput = _num(row, "throughput_rps", path, line)
        else:
            setting = (sm, _fraction(row, "time_quota_percent", path, line))
            latency = _num(row, "latency_ms", path, line)
            throughput = batch / latency * 1000
        if (setting, batch) in first_line:  # two measurements of one point: which one is meant?
            raise SurfaceError(f"{path}:{line}: measures again the point of line {first_line[setting, batch]} "
                               f"(batch {batch} at {', '.join(f'{v:g}' for v in setting)})")
        first_line[setting, batch] = line
        points[(setting, batch)] = Measurement(latency_ms=latency, throughput_rps=throughput)
    if not points:
        raise SurfaceError(f"{path}: no rows")
    n_axes = len(next(iter(points))[0])
    axes = tuple(tuple(sorted({s[i] for s, _ in points})) for i in range(n_axes))
    batches = tuple(sorted({b for _, b in points}))
    return Surface(path.stem, fmt, axes, batches, points, tokens_per_request)


def surface_files() -> list[Path]:
    """Every surface CSV shipped with the profiler, sorted."""
    return sorted(SURFACES_DIR.glob("*/*.csv"))


@dataclass
class SurfaceBackend:
    """Answers trials from a recorded surface, and counts the distinct grid points measured.

    Answers are grid points, never interpolated: a trial off the grid raises SurfaceError.
    A paced trial (``trial.grant`` below its width, one quota axis) is the grid point at its width
    slowed by :func:`dilu.services.common.models.pacing_stretch` (the emulated GPU's pacing: the
    same rule the simulator and the node's trials follow): latency × w/g, throughput × g/w.
    ``trials`` counts distinct (setting, batch, grant) triples, so measuring one twice costs once.
    """

    surface: Surface
    measured: set[tuple[Setting, int, float | None]] = field(default_factory=set)

    @property
    def trials(self) -> int:
        return len(self.measured)

    def run(self, trial: Trial) -> Measurement:
        """The measurement of ``trial``. Raises SurfaceError off the grid, or for a paced trial
        on a surface with more than one quota axis (its time-quota axis is a pacing of its own)."""
        m = self.surface.measure(trial.setting, trial.batch)
        if trial.grant is not None:
            if len(trial.setting) != 1:
                raise SurfaceError(f"{self.surface.name}: a paced trial needs a one-axis (SM share) surface")
            stretch = models.pacing_stretch(trial.quota, trial.grant)
            m = Measurement(latency_ms=m.latency_ms * stretch, throughput_rps=m.throughput_rps / stretch)
        self.measured.add((tuple(round(v, 4) for v in trial.setting), trial.batch, trial.grant))
        return m


def run_search(search, backend: SurfaceBackend):
    """Drive a search state machine against ``backend`` to its end; returns ``search.result()``."""
    while (trial := search.next_trial()) is not None:
        search.record(trial, backend.run(trial))
    return search.result()


def iter_surfaces(paths: Iterable[Path] | None = None) -> Iterable[Surface]:
    for p in paths if paths is not None else surface_files():
        yield load_surface(p)


@lru_cache(maxsize=None)
def model_surface(name: str) -> Surface:
    """A catalogue model's A100 surface as request latency (a generative model's request is
    ``steps_per_request`` decode steps). Raises KeyError for an unknown model."""
    info = models.spec(name)
    return load_surface(SURFACES_DIR / info.surface, tokens_per_request=info.steps_per_request)
