"""Several runs of the same comparison, summarised: each figure's mean and range per policy, and
each policy against the first by the ratio of their means (or, for a rate, the difference of the
means in percentage points) with the range of that comparison run by run.

One live run on a small node is one sample: a few late batches move a violation rate by points,
and a placement that spills onto one more GPU for a while moves active GPU·s by a fifth. A
direction read from the means of several runs, with the per-run range beside it, says what one
run cannot. The inputs are what ``dilu compare --json``, ``dilu sim --json`` (``{"policies":
{name: report}}``) and ``dilu demo --json`` (one report, named by its ``run.policy``) write; the
figures are the rows of ``dilu compare`` (:func:`report.render_compare`).

Pure but for :func:`read_runs`; :func:`render_summary` prints.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

import msgspec
from rich.console import Console

from dilu.services.common import files

from . import report as rp
from .report import Report

SUMMARY_TITLE = "Runs summarised: mean (lowest–highest) of each figure"


@dataclass(frozen=True)
class Spread:
    """One figure of one policy over its runs: ``mean``, ``low``, ``high`` and the ``values``
    themselves, in the order of the runs (only the runs that have the figure)."""

    mean: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        """Raises ValueError on no values."""
        if not values:
            raise ValueError("no values")
        return cls(statistics.fmean(values), min(values), max(values), tuple(values))

    @property
    def stderr(self) -> float | None:
        """The standard error of the mean: the sample standard deviation over the square root of
        the number of values; None for one value."""
        n = len(self.values)
        return statistics.stdev(self.values) / math.sqrt(n) if n > 1 else None

    def to_dict(self) -> dict:
        """JSON-ready: ``{"mean", "min", "max", "stderr", "values"}``."""
        return {"mean": self.mean, "min": self.low, "max": self.high, "stderr": self.stderr,
                "values": list(self.values)}


@dataclass(frozen=True)
class Row:
    """One figure: its ``label`` (a ``dilu compare`` row), whether it is a rate (0..1), its format, per
    policy its :class:`Spread` (None: no run has it), and per policy after the first its
    comparison with the first: ``of_means`` (the ratio of the means, or for a rate their
    difference in percentage points; None when either mean is missing or, for a ratio, the
    first's is 0) and ``per_run`` (the same, run by run, over the runs that have both)."""

    label: str
    rate: bool
    fmt: object  # how dilu compare prints the figure: a format string or a function of the value
    spreads: dict[str, Spread | None]
    of_means: dict[str, float | None]
    per_run: dict[str, tuple[float, ...]]


@dataclass(frozen=True)
class Summary:
    """``policies`` in the order they first appear; ``runs`` per policy; ``paired`` per policy
    after the first, the runs that have it and the first; ``rows`` one per figure."""

    policies: list[str]
    runs: dict[str, int]
    paired: dict[str, int]
    rows: list[Row]

    def to_dict(self) -> dict:
        """JSON-ready: ``{"runs": {policy: n}, "policies": {policy: {figure: {mean, min, max,
        stderr, values}}}, "versus": {"P / FIRST": {figure: {"of_means", "per_run"}}}}``; a ratio is a
        number (0.53 for 0.53x), a rate's difference a number of percentage points."""
        first = self.policies[0]
        out: dict = {"runs": dict(self.runs), "policies": {p: {} for p in self.policies}, "versus": {}}
        for row in self.rows:
            for p, s in row.spreads.items():
                if s is not None:
                    out["policies"][p][row.label] = s.to_dict()
            for p in self.policies[1:]:
                out["versus"].setdefault(f"{p} / {first}", {})[row.label] = {
                    "of_means": row.of_means[p], "per_run": list(row.per_run[p])}
        return out


def _compare(first: float | None, other: float | None, rate: bool) -> float | None:
    """``other`` against ``first``: for a rate the difference in percentage points, else the ratio."""
    if first is None or other is None:
        return None
    if rate:
        return 100.0 * (other - first)
    return other / first if first else None


def summarize(runs: Sequence[Mapping[str, Report]]) -> Summary:
    """Summarise ``runs`` (each: policy name -> its report in that run, as one ``dilu compare``
    writes them). A policy missing from a run is summarised over the runs that have it. Raises
    ValueError when no run names a policy."""
    policies: list[str] = []
    for run in runs:
        policies += [p for p in run if p not in policies]
    if not policies:
        raise ValueError("no run to summarise")
    first = policies[0]
    reports = [r for run in runs for r in run.values()]
    rows = []
    for label, get, fmt, _better in rp._compare_rows(reports):
        rate = fmt is rp._pct
        spreads: dict[str, Spread | None] = {}
        for p in policies:
            values = [v for run in runs if p in run and (v := get(run[p])) is not None]
            spreads[p] = Spread.of(values) if values else None
        of_means, per_run = {}, {}
        for p in policies[1:]:
            a, b = spreads[first], spreads[p]
            of_means[p] = _compare(a.mean if a else None, b.mean if b else None, rate)
            pairs = (_compare(get(run[first]), get(run[p]), rate) for run in runs if first in run and p in run)
            per_run[p] = tuple(v for v in pairs if v is not None)
        rows.append(Row(label, rate, fmt, spreads, of_means, per_run))
    return Summary(policies, {p: sum(p in run for run in runs) for p in policies},
                   {p: sum(first in run and p in run for run in runs) for p in policies[1:]}, rows)


_SAME = (("trace", "trace"), ("start_minute", "start minute"), ("seed", "seed"), ("duration_s", "duration"),
         ("speedup", "speed-up"), ("functions", "functions"), ("gpus", "GPUs"),
         ("training_jobs", "training jobs"), ("simulated", "simulated"))  # what makes runs of one comparison
# ... and, per policy, what it ran with (a policy's parking and defragmentation differ from another's)
_SAME_PER_POLICY = (("park_after_s", "parking delay (s)"), ("defrag_interval_s", "defragmentation interval (s)"))


def _comparable(field: str, value):
    """``value`` of RunInfo ``field`` as runs of one comparison share it: a duration to 0.1 s,
    other numbers to 1e-9 (0 means never: 0.04 s is another setting), a trace by its
    directory's name."""
    if field == "trace" and value:
        return PurePath(value).name
    if isinstance(value, float):
        return round(value, 1 if field == "duration_s" else 9)
    return value


def span_key(run: rp.RunInfo) -> tuple:
    """What runs of one comparison share (:func:`check_comparable`), as a key: the span, GPUs,
    training jobs, live or simulated, and the policy's parking and defragmentation settings."""
    return tuple(_comparable(f, getattr(run, f)) for f, _ in _SAME + _SAME_PER_POLICY)


def check_comparable(runs: Sequence[tuple[str, Mapping[str, Report]]]) -> None:
    """Raise ValueError, naming the figure and two of the files, unless every report of
    ``runs`` (``(file name, its reports)``) replays the same span: trace, start minute, seed,
    duration (to 0.1 s: a live run's lasts as long as its last answer), speed-up and
    functions, on as many GPUs, with as many training jobs, all live or all simulated, and each
    policy with the same parking delay and defragmentation interval as in the other files. The
    trace is compared by its directory's name, so the bundled trace of two checkouts is one.
    Averaging runs of other seeds, spans, clusters or settings would mix different experiments
    into one mean. A setting a report does not record (an older build's) is not compared."""
    first: dict[tuple[str, str], tuple[str, object]] = {}
    for name, reports in runs:
        for policy, report in reports.items():
            for field, what, key in ([(f, w, "") for f, w in _SAME]
                                     + [(f, f"{policy}'s {w}", policy) for f, w in _SAME_PER_POLICY]):
                value = _comparable(field, getattr(report.run, field))
                if value is None:
                    continue
                seen = first.setdefault((field, key), (name, value))
                if seen[1] != value:
                    raise ValueError(f"not runs of one comparison: {what} {seen[1]} in {seen[0]}, {value} in {name}")


# what a simulated run was configured with beyond its span (``dilu sim --json``'s ``sim.config``):
# runs that differ in one are other experiments; ``overheads_seed`` is left out (draws of one)
_SAME_SIMULATION = (("nodes", "nodes"), ("gpus_per_node", "GPUs per node"), ("keep_alive_s", "keep-alive (s)"),
                    ("process_start_ms", "process start (ms)"),
                    ("process_start_by_starting_ms", "process start by instances starting (ms)"),
                    ("process_start_initial_ms", "process start of the deploy's launches (ms)"),
                    ("overheads", "--overheads given"), ("vertical_tick_ms", "vertical tick (ms)"),
                    ("horizontal_tick_ms", "horizontal tick (ms)"), ("drain_s", "drain (s)"))


def check_same_simulation(paths: Sequence[str | Path]) -> None:
    """Raise ValueError, naming the setting and two of the files, when simulated runs in
    ``paths`` (``dilu sim --json``) were configured differently beyond what
    :func:`check_comparable` compares: nodes, keep-alive, process start, whether overheads were
    drawn (not which file: each live run's own calibration is that run's machine, as live runs of
    one comparison meet other loads; README, At cluster scale), ticks, drain. A file without a ``sim.config`` (a live run) is skipped; one that cannot
    be read raises as :func:`read_runs` does (each file is read once more here: a
    report does not carry its sim section, and run files are bounded)."""
    first: dict[str, tuple[str, object]] = {}
    for path in paths:
        data = _decode(path)
        config = data.get("sim", {}).get("config") if isinstance(data, dict) and isinstance(data.get("sim"), dict) else None
        if not isinstance(config, dict):
            continue
        for field, what in _SAME_SIMULATION:
            if field not in config:
                continue
            value = config[field]
            if field == "overheads":  # its calibration's source; each live run's own is one environment
                value = value is not None
            seen = first.setdefault(field, (str(path), value))
            if seen[1] != value:
                raise ValueError(f"not runs of one comparison: {what} {seen[1]} in {seen[0]}, {value} in {path}")


def read_runs(path: str | Path) -> dict[str, Report]:
    """The reports of one run file: ``{"policies": {name: report}}`` (``dilu compare``/``dilu
    sim``) or one report (``dilu demo``, named by its ``run.policy``). Raises ValueError naming
    the file when it cannot be read or is neither."""
    data = _decode(path)
    try:
        if isinstance(data, dict) and isinstance(data.get("policies"), dict):
            if not data["policies"]:
                raise ValueError(f"{path}: no run in it (its policies are empty)")
            runs = {str(name): Report.from_dict(r) for name, r in data["policies"].items()}
        else:
            one = Report.from_dict(data)
            runs = {one.run.policy: one}
    except msgspec.ValidationError as exc:
        raise ValueError(_not_a_report(path, exc)) from None
    for name, rep in runs.items():
        for where, fig in [("totals", rep.totals), *((f"function {f.name}", f) for f in rep.functions)]:
            if problem := _impossible(fig):
                raise ValueError(f"{path}: {name}'s {where}: {problem}: not a report dilu wrote")
    return runs


def _impossible(fig) -> str:
    """What no report of a run can hold (``fig``: its totals or a function's figures, DESIGN.md
    section 8): a negative count, requests that do not add up to those offered, a rate outside
    0..1; empty when there is none."""
    counts = {k: getattr(fig, k) for k in ("offered", "completed", "dropped", "failed", "timed_out",
                                           "cold_start_requests", "instance_launches")}
    if negative := [k for k, v in counts.items() if v < 0]:
        return f"{', '.join(negative)} below 0"
    ended = counts["completed"] + counts["dropped"] + counts["failed"] + counts["timed_out"]
    if ended != counts["offered"]:
        return f"completed + dropped + failed + timed_out = {ended:,}, not the {counts['offered']:,} offered"
    if not 0.0 <= fig.slo_violation_rate <= 1.0:
        return f"slo_violation_rate {fig.slo_violation_rate:g} outside 0..1"
    return ""


def _not_a_report(path, exc) -> str:
    return f"{path}: not a dilu compare, sim or demo report ({exc})"


def _decode(path: str | Path):
    """The JSON of a run file, read within ``REPORT_MAX_BYTES``. Raises ValueError naming the
    file when it cannot be read or is no JSON."""
    try:
        return msgspec.json.decode(files.read_bounded(path, rp.REPORT_MAX_BYTES))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except msgspec.DecodeError as exc:
        raise ValueError(_not_a_report(path, exc)) from None


def _show(v: float, fmt) -> str:
    """``v`` as dilu compare prints its figure; a mean of counts keeps one decimal."""
    if callable(fmt):
        return fmt(v)
    if fmt == "{:,}":
        return f"{v:,.1f}" if v != int(v) else f"{int(v):,}"
    return fmt.format(v)


def _bare(text: str) -> str:
    """A range bound without the unit its mean already shows."""
    return text.removesuffix(" %")


def _cell(s: Spread | None, fmt) -> str:
    if s is None:
        return "–"
    if s.low == s.high:
        return _show(s.mean, fmt)
    return f"{_show(s.mean, fmt)} ({_bare(_show(s.low, fmt))}–{_bare(_show(s.high, fmt))})"


def _versus_cell(of_means: float | None, per_run: tuple[float, ...], rate: bool, paired: int) -> str:
    """The comparison of the means, then its range over the ``paired`` runs that have both
    policies (those where it is defined, when fewer)."""
    if of_means is None:
        return "–"
    mean = f"{of_means:+.1f} pp" if rate else f"{of_means:.2f}x"
    bound = "{:+.1f}" if rate else "{:.2f}"
    if not per_run:
        return mean
    if len(per_run) < paired:  # the others have no ratio (the first's figure was 0 there)
        span = bound.format(min(per_run)) if min(per_run) == max(per_run) else \
            f"{bound.format(min(per_run))} … {bound.format(max(per_run))}"
        return f"{mean} ({span}; {len(per_run)} of {paired} runs)"
    if len(per_run) < 2 or min(per_run) == max(per_run):
        return mean
    return f"{mean} ({bound.format(min(per_run))} … {bound.format(max(per_run))})"


def render_summary(summary: Summary, console: Console) -> None:
    """Print the summary as one table (split by columns when wider than the console): a column
    per policy, ``mean (lowest–highest)``, then per policy after the first the comparison of
    the means with the range run by run, then a legend."""
    names, first = summary.policies, summary.policies[0]
    versus_names = [f"{p} / {first}" for p in names[1:]]
    headers = [("figure", "left"), *((p, "right") for p in names), *((v, "right") for v in versus_names)]
    rows = []
    for row in summary.rows:
        cells = [_cell(row.spreads[p], row.fmt) for p in names]
        cells += [_versus_cell(row.of_means[p], row.per_run[p], row.rate, summary.paired[p]) for p in names[1:]]
        rows.append(([row.label, *cells], {}))
    key = max(rp._cell_len(cells[0]) for cells, _ in rows)
    if any(key + rp._cell_len(c) + 7 > console.width for cells, _ in rows for c in cells[1:]):
        # too narrow for a figure and one cell side by side: each range goes under its mean
        rows = [([cells[0], *(c.replace(" (", "\n(", 1) for c in cells[1:])], kw) for cells, kw in rows]
    for table in rp.fitted_tables(SUMMARY_TITLE, headers, rows, console.width):
        console.print(table)
    runs = ", ".join(f"{p} {n}" for p, n in summary.runs.items())
    entries = [("runs", f"runs summarised per policy: {runs}"),
               ("mean (lo–hi)", "the mean over the runs, then the lowest and highest run")]
    entries += [(v, f"the mean of {p}'s figure / the mean of {first}'s (0.53x), or for a rate (%) the "
                    f"difference of the means {p} - {first} in percentage points (pp); then the lowest … highest "
                    f"of the same comparison run by run")
                for p, v in zip(names[1:], versus_names)]
    entries += [("–", rp.LEGEND["–"]), ("figures", "as in dilu compare --help")]
    console.print(rp._legend_table(entries))
