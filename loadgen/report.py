"""The run report: per-function and total figures, GPU figures and mechanism counters.

Definitions (DESIGN.md section 8, pinned):

- ``offered = completed + dropped + failed + timed_out``, always: every sent request is in
  exactly one outcome (generator statuses ``ok``, ``dropped``, ``error``, ``timeout``).
- Latency is ``answer time - scheduled send time`` of completed requests, recorded in HDR
  histograms at 1 µs resolution with 3 significant digits (values are within 0.1 %), reported in
  ms as ``p50``, ``p99``, ``p999`` (99.9th). Totals come from a histogram of all requests, never
  from averaging per-function percentiles. No completed request: percentiles are ``None``.
- ``slo_violation_rate`` = (completed later than the function's SLO after the scheduled send +
  dropped + failed + timed out) / offered (0 when nothing was offered).
- ``goodput_rps`` = requests completed within SLO per wall-clock second of the run
  (``run.wall_s``, whatever the trace speed-up).
- ``cold_start_requests``: requests whose service waited for an instance launch (the
  ``cold_start`` flag of their outcome).
- GPU-side figures come from the platform's own accounting, in :class:`RunFacts`:
  ``instance_launches`` and ``quota_seconds`` (sum of quota x seconds of the grants in effect)
  per function; ``active_gpu_seconds``, ``allocation_fragmentation`` (time-weighted mean over
  active GPUs of 1 - sum of request quotas) and ``idle_fragmentation`` (time-weighted mean over
  active GPUs of 1 - sum of measured SM-time shares) for the whole run only, as they are
  properties of GPUs; and the mechanism counters.

:func:`render` prints one report as rich tables; :func:`render_compare` prints several policies'
reports side by side in one table.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
from hdrh.histogram import HdrHistogram
from rich.console import Console
from rich.table import Table

from .arrivals import ReplayPlan
from .generator import Record, RunResult

HDR_LOWEST_US = 1
HDR_HIGHEST_US = 3_600_000_000  # one hour; longer latencies are clamped to it
HDR_DIGITS = 3
PERCENTILES = {"p50": 50.0, "p99": 99.0, "p999": 99.9}


# ------------------------------------------------------------------------------------- inputs


class FunctionMeta(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed function as deployed: its ``model`` and latency objective ``slo_ms``."""

    model: str
    slo_ms: float


class FunctionFacts(msgspec.Struct, kw_only=True):
    """GPU-side accounting of one function: ``instance_launches`` (instances started for it) and
    ``quota_seconds`` (sum over its instances of granted quota x seconds in effect)."""

    instance_launches: int = 0
    quota_seconds: float = 0.0


class Mechanism(msgspec.Struct, kw_only=True):
    """Counters that show the machinery moved (DESIGN.md section 8): ``profiler_trials``
    (measurements the profiler made), ``grant_changes`` (TokenGrants that changed a quota),
    ``token_wait_ms`` (time launches waited for tokens, summed), ``scale_outs`` and
    ``retirements`` (instances added and removed by the horizontal scaler), ``scale_to_zero``
    (times a function went to zero instances)."""

    profiler_trials: int = 0
    grant_changes: int = 0
    token_wait_ms: float = 0.0
    scale_outs: int = 0
    retirements: int = 0
    scale_to_zero: int = 0
    vertical_reaction_ms_p50: float = 0.0  # stretch detected -> grant in the control block
    vertical_reaction_ms_p99: float = 0.0


class RunFacts(msgspec.Struct, kw_only=True):
    """What the platform accounted during the run (node agent, scalers, profiler).

    ``functions``: per-function facts by function name; ``active_gpu_seconds``: seconds during
    which each GPU hosted at least one instance, summed over GPUs; ``allocation_fragmentation``
    and ``idle_fragmentation``: fractions 0..1 as defined in the module docstring.
    """

    functions: dict[str, FunctionFacts] = msgspec.field(default_factory=dict)
    active_gpu_seconds: float = 0.0
    allocation_fragmentation: float = 0.0
    idle_fragmentation: float = 0.0
    mechanism: Mechanism = msgspec.field(default_factory=Mechanism)


class RunInfo(msgspec.Struct, kw_only=True):
    """How the run was made. ``wall_s`` (> 0) is the goodput denominator; ``share`` the fraction
    of the span's invocations the replayed functions carry; ``late_sends`` sends more than
    ``late_threshold_ms`` behind schedule; ``not_sent`` planned requests never sent (stopped)."""

    wall_s: float
    policy: str = "dilu"
    seed: int = 0
    trace: str = ""
    start_minute: int = 0
    speedup: float = 1.0
    duration_s: float = 0.0
    functions: int = 0
    share: float = 0.0
    late_sends: int = 0
    late_threshold_ms: float = 0.0
    max_late_ms: float = 0.0
    not_sent: int = 0
    gpus: int = 0


def run_info(plan: ReplayPlan, result: RunResult, *, policy: str = "dilu", gpus: int = 0) -> RunInfo:
    """The :class:`RunInfo` of a replay from its plan and the generator's result."""
    return RunInfo(
        wall_s=result.wall_s, policy=policy, seed=plan.seed, trace=plan.trace, start_minute=plan.start_minute,
        speedup=plan.speedup, duration_s=plan.duration_s, functions=len(plan.functions), share=plan.share,
        late_sends=result.late_sends, late_threshold_ms=result.late_threshold_ms,
        max_late_ms=result.max_late_ms, not_sent=result.not_sent, gpus=gpus,
    )


# ------------------------------------------------------------------------------------ outputs


class LatencyMs(msgspec.Struct, kw_only=True):
    """Latency percentiles in ms from the scheduled send time; None without completions."""

    p50: float | None = None
    p99: float | None = None
    p999: float | None = None


class Figures(msgspec.Struct, kw_only=True):
    """The request and cost figures a function and the whole run both have (module docstring)."""

    offered: int
    completed: int
    dropped: int
    failed: int
    timed_out: int
    goodput_rps: float
    slo_violation_rate: float
    latency_ms: LatencyMs
    cold_start_requests: int
    instance_launches: int
    quota_seconds: float


class FunctionReport(Figures, kw_only=True):
    """One function's figures (see the module docstring for each definition)."""

    name: str
    model: str
    slo_ms: float


class Totals(Figures, kw_only=True):
    """The whole run's figures: the per-function ones over all requests, plus GPU properties."""

    active_gpu_seconds: float
    allocation_fragmentation: float
    idle_fragmentation: float


class Report(msgspec.Struct, kw_only=True):
    """``{"totals": ..., "functions": [...], "mechanism": ..., "run": ...}``; functions sorted by
    offered requests, most first."""

    totals: Totals
    functions: list[FunctionReport]
    mechanism: Mechanism
    run: RunInfo

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Report:
        """Inverse of :meth:`to_dict`; raises ``msgspec.ValidationError`` on a wrong shape."""
        return msgspec.convert(data, cls)


def write_report(report: Report, path: str | Path) -> None:
    """Write the report as indented JSON."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(report.to_dict()), indent=2) + b"\n")


def read_report(path: str | Path) -> Report:
    """Read a JSON report written by :func:`write_report`; raises ValueError naming the file."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Report)
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"{path}: not a Dilu report ({exc})") from exc


# ---------------------------------------------------------------------------------- building


class _Tally:
    """Counts and the latency histogram of one function (or of all)."""

    def __init__(self) -> None:
        self.counts = {"ok": 0, "dropped": 0, "error": 0, "timeout": 0}
        self.good = 0
        self.late = 0
        self.cold = 0
        self.hist = HdrHistogram(HDR_LOWEST_US, HDR_HIGHEST_US, HDR_DIGITS)

    def add(self, r: Record, slo_ns: float) -> None:
        self.counts[r.status] += 1
        self.cold += r.cold_start
        if r.status != "ok":
            return
        latency_ns = r.latency_ns
        self.hist.record_value(min(max(latency_ns // 1000, HDR_LOWEST_US), HDR_HIGHEST_US))
        if latency_ns > slo_ns:
            self.late += 1
        else:
            self.good += 1

    @property
    def offered(self) -> int:
        return sum(self.counts.values())

    def figures(self, wall_s: float) -> dict:
        offered = self.offered
        bad = self.late + offered - self.counts["ok"]
        return dict(
            offered=offered, completed=self.counts["ok"], dropped=self.counts["dropped"],
            failed=self.counts["error"], timed_out=self.counts["timeout"],
            goodput_rps=self.good / wall_s, slo_violation_rate=bad / offered if offered else 0.0,
            latency_ms=self.latency(), cold_start_requests=self.cold,
        )

    def latency(self) -> LatencyMs:
        if not self.hist.get_total_count():
            return LatencyMs()
        values = self.hist.get_percentile_to_value_dict(list(PERCENTILES.values()))
        return LatencyMs(**{k: values[p] / 1000.0 for k, p in PERCENTILES.items()})


def build_report(
    records: Iterable[Record], functions: Mapping[str, FunctionMeta], facts: RunFacts, run: RunInfo
) -> Report:
    """Build the report from the generator's records, the deployed functions, the platform's
    accounting and the run's facts.

    Every record's function must be in ``functions`` (ValueError otherwise); a function without
    records reports zeros. Raises ValueError if ``run.wall_s`` is not positive.
    """
    if not run.wall_s > 0:
        raise ValueError(f"run.wall_s must be positive, got {run.wall_s}")
    tallies = {name: _Tally() for name in functions}
    total = _Tally()
    for r in records:
        meta = functions.get(r.function)
        if meta is None:
            raise ValueError(f"record {r.id} is for function {r.function!r}, which is not among the replayed functions")
        slo_ns = meta.slo_ms * 1e6
        tallies[r.function].add(r, slo_ns)
        total.add(r, slo_ns)
    per_function = [
        FunctionReport(
            name=name, model=meta.model, slo_ms=meta.slo_ms, **tallies[name].figures(run.wall_s),
            instance_launches=facts.functions.get(name, FunctionFacts()).instance_launches,
            quota_seconds=facts.functions.get(name, FunctionFacts()).quota_seconds,
        )
        for name, meta in functions.items()
    ]
    per_function.sort(key=lambda f: (-f.offered, f.name))
    totals = Totals(
        **total.figures(run.wall_s),
        instance_launches=sum(f.instance_launches for f in facts.functions.values()),
        quota_seconds=sum(f.quota_seconds for f in facts.functions.values()),
        active_gpu_seconds=float(facts.active_gpu_seconds),
        allocation_fragmentation=float(facts.allocation_fragmentation),
        idle_fragmentation=float(facts.idle_fragmentation),
    )
    return Report(totals=totals, functions=per_function, mechanism=facts.mechanism, run=run)


# --------------------------------------------------------------------------------- rendering


def _ms(v: float | None) -> str:
    return "–" if v is None else (f"{v:,.1f}" if v < 1000 else f"{v:,.0f}")


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def _row(f: FunctionReport | Totals) -> list[str]:
    lat = f.latency_ms
    return [
        f"{f.offered:,}", f"{f.completed:,}", f"{f.dropped:,}", f"{f.failed:,}", f"{f.timed_out:,}",
        f"{f.goodput_rps:,.2f}", _pct(f.slo_violation_rate), _ms(lat.p50), _ms(lat.p99), _ms(lat.p999),
        f"{f.cold_start_requests:,}", f"{f.instance_launches:,}", f"{f.quota_seconds:,.1f}",
    ]


_FIGURE_COLUMNS = [
    "offered", "completed", "dropped", "failed", "timed out", "goodput/s", "SLO viol.",
    "p50 ms", "p99 ms", "p99.9 ms", "cold starts", "launches", "quota·s",
]


def render(report: Report, console: Console) -> None:
    """Print the report: one row per function plus a total row, then GPU figures and the
    mechanism counters, with the run's facts as a caption."""
    run = report.run
    table = Table(
        title=f"Dilu replay — policy {run.policy}",
        caption=(
            f"trace {Path(run.trace).name or run.trace} from minute {run.start_minute}, "
            f"{run.duration_s:g} s at speed-up {run.speedup:g}, seed {run.seed}; {run.functions} functions carry "
            f"{_pct(run.share)} of the span's invocations; wall {run.wall_s:.1f} s; "
            f"late sends (> {run.late_threshold_ms:g} ms) {run.late_sends}, worst {run.max_late_ms:.1f} ms"
            + (f"; not sent {run.not_sent}" if run.not_sent else "")
        ),
    )
    table.add_column("function")
    table.add_column("model")
    table.add_column("SLO ms", justify="right")
    for name in _FIGURE_COLUMNS:
        table.add_column(name, justify="right")
    for i, f in enumerate(report.functions):
        table.add_row(f.name, f.model, _ms(f.slo_ms), *_row(f), end_section=i == len(report.functions) - 1)
    table.add_row("total", "", "", *_row(report.totals), style="bold")
    console.print(table)

    t, m = report.totals, report.mechanism
    gpu = Table(title="GPUs and mechanism", show_header=True)
    for name in ("active GPU·s", "alloc. frag.", "idle frag.", "profiler trials", "grant changes",
                 "token wait ms", "scale-outs", "retirements", "scale to zero", "reaction p50/p99 ms"):
        gpu.add_column(name, justify="right")
    gpu.add_row(
        f"{t.active_gpu_seconds:,.1f}", _pct(t.allocation_fragmentation), _pct(t.idle_fragmentation),
        f"{m.profiler_trials:,}", f"{m.grant_changes:,}", f"{m.token_wait_ms:,.1f}", f"{m.scale_outs:,}",
        f"{m.retirements:,}", f"{m.scale_to_zero:,}",
        _reaction(m),
    )
    console.print(gpu)


def _reaction(m: "Mechanism") -> str:
    """Vertical reaction p50 / p99, or a dash when no grant changed (nothing was measured)."""
    if not m.grant_changes:
        return "–"
    return f"{m.vertical_reaction_ms_p50:.1f} / {m.vertical_reaction_ms_p99:.1f}"


# (label, getter, format, better) ; better: "low", "high" or None (no best is marked)
_COMPARE_ROWS: list[tuple[str, object, object, str | None]] = [
    ("offered", lambda r: r.totals.offered, "{:,}", None),
    ("completed", lambda r: r.totals.completed, "{:,}", "high"),
    ("dropped", lambda r: r.totals.dropped, "{:,}", "low"),
    ("failed", lambda r: r.totals.failed, "{:,}", "low"),
    ("timed out", lambda r: r.totals.timed_out, "{:,}", "low"),
    ("goodput/s", lambda r: r.totals.goodput_rps, "{:,.2f}", "high"),
    ("SLO violation rate", lambda r: r.totals.slo_violation_rate, _pct, "low"),
    ("latency p50 ms", lambda r: r.totals.latency_ms.p50, _ms, "low"),
    ("latency p99 ms", lambda r: r.totals.latency_ms.p99, _ms, "low"),
    ("latency p99.9 ms", lambda r: r.totals.latency_ms.p999, _ms, "low"),
    ("cold-start requests", lambda r: r.totals.cold_start_requests, "{:,}", "low"),
    ("instance launches", lambda r: r.totals.instance_launches, "{:,}", "low"),
    ("quota·s", lambda r: r.totals.quota_seconds, "{:,.1f}", "low"),
    ("active GPU·s", lambda r: r.totals.active_gpu_seconds, "{:,.1f}", "low"),
    ("allocation fragmentation", lambda r: r.totals.allocation_fragmentation, _pct, "low"),
    ("idle fragmentation", lambda r: r.totals.idle_fragmentation, _pct, "low"),
    ("profiler trials", lambda r: r.mechanism.profiler_trials, "{:,}", None),
    ("grant changes", lambda r: r.mechanism.grant_changes, "{:,}", None),
    ("token wait ms", lambda r: r.mechanism.token_wait_ms, "{:,.1f}", None),
    ("scale-outs", lambda r: r.mechanism.scale_outs, "{:,}", None),
    ("retirements", lambda r: r.mechanism.retirements, "{:,}", None),
    ("scale to zero", lambda r: r.mechanism.scale_to_zero, "{:,}", None),
    ("vertical reaction p99 ms",
     lambda r: r.mechanism.vertical_reaction_ms_p99 if r.mechanism.grant_changes else None, "{:,.1f}", None),
    ("wall s", lambda r: r.run.wall_s, "{:,.1f}", None),
    ("late sends", lambda r: r.run.late_sends, "{:,}", None),
]


def render_compare(reports: Mapping[str, Report], console: Console) -> None:
    """Print several policies' totals side by side, one column per policy (in the mapping's
    order), one row per figure; the best value of a row is bold where lower or higher is
    plainly better. Raises ValueError on an empty mapping."""
    if not reports:
        raise ValueError("nothing to compare")
    table = Table(title="Policies compared on the same replay")
    table.add_column("figure")
    for policy in reports:
        table.add_column(policy, justify="right")
    for label, get, fmt, better in _COMPARE_ROWS:
        values = [get(r) for r in reports.values()]
        present = [v for v in values if v is not None]
        best = None
        if better and len(present) > 1 and len(set(present)) > 1:
            best = min(present) if better == "low" else max(present)
        cells = []
        for v in values:
            text = fmt(v) if callable(fmt) else ("–" if v is None else fmt.format(v))
            cells.append(f"[bold]{text}[/bold]" if best is not None and v == best else text)
        table.add_row(label, *cells)
    console.print(table)
