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
  properties of GPUs; and the mechanism counters. The time integrals (quota·s, active GPU·s,
  the fragmentations) run from the replay's first send to its end (its last request ended), live as in
  ``dilu sim``: the profiling trials and the initial instances' warm-up before it are left out.
  Counts of events (launches, trials, grants, scale-outs) are the whole run's.

Token-level figures, for ``llm`` functions only (``FunctionMeta.kind == "llm"``; their replies
stream one chunk per generated token):

- ``ttft_ms`` (time to first token) = first chunk's arrival - scheduled send; ``tpot_ms`` (time per
  output token) = (last chunk's arrival - first chunk's arrival) / (chunks - 1). Both over
  completed requests, in HDR histograms like latency (1 µs, 3 digits), reported in ms as ``p50``,
  ``p99``, ``p999``. A completed reply that streamed no chunk has TTFT = its latency (its first
  token came with the reply) and no TPOT; a reply of one chunk has no TPOT.
- ``token_slo_violation_rate`` = (completed requests whose TTFT exceeds the function's ``ttft_ms``
  objective or whose TPOT exceeds its ``tpot_ms`` objective + dropped + failed + timed out) /
  offered (0 when nothing was offered). An objective that is None or 0 is not checked.
- Totals take these over the requests of llm functions only (histograms of all of them, never
  averages of percentiles; offered = the llm functions' offered). Inference functions, and totals
  of a run without an llm function, have no token figures: the fields are absent from the JSON
  (None in :class:`Figures`). ``slo_violation_rate`` and goodput of an llm function stay the
  request-level ones, against its whole-reply objective ``slo_ms``.

Training jobs (``kind == "training"``) take no requests: they are not among ``functions`` and
add nothing to the request figures (their launches and quota-seconds are in the totals). The
``training`` section has one entry per training job (those in :attr:`RunFacts.training` and
those deployed as training): ``iterations_per_s`` = ``iterations / seconds`` (None when no second
was accounted), ``seconds`` being the time the job ran. Absent from the JSON when there is none.

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
from rich.text import Text

from dilu.services.common import files

from .arrivals import ReplayPlan
from .generator import Record, RunResult
from .llm import LlmPlan

REPORT_MAX_BYTES = 256 * files.MiB  # a report is tens of KB per function
HDR_LOWEST_US = 1
HDR_HIGHEST_US = 3_600_000_000  # one hour; longer latencies are clamped to it
HDR_DIGITS = 3
PERCENTILES = {"p50": 50.0, "p99": 99.0, "p999": 99.9}


# ------------------------------------------------------------------------------------- inputs


class FunctionMeta(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed function as deployed: its ``model``, request latency objective ``slo_ms``, its
    ``kind`` (``inference``, ``llm`` or ``training``, as in FunctionSpec) and, for llm, its token
    objectives ``ttft_ms`` and ``tpot_ms`` (ms; None or 0: not checked)."""

    model: str
    slo_ms: float
    kind: str = "inference"
    ttft_ms: float | None = None
    tpot_ms: float | None = None


class FunctionFacts(msgspec.Struct, kw_only=True):
    """GPU-side accounting of one function: ``instance_launches`` (instances started for it) and
    ``quota_seconds`` (sum over its instances of granted quota x seconds in effect)."""

    instance_launches: int = 0
    quota_seconds: float = 0.0


class TrainingFacts(msgspec.Struct, kw_only=True):
    """What a training job did: ``iterations`` completed and ``seconds`` it ran (s, >= 0)."""

    iterations: int = 0
    seconds: float = 0.0


class Mechanism(msgspec.Struct, kw_only=True):
    """Counters that show the machinery moved (DESIGN.md section 8): ``profiler_trials``
    (measurements the profiler made), ``grant_changes`` (TokenGrants that changed a quota),
    ``token_wait_ms`` (time launches waited for tokens, summed), ``scale_outs`` and
    ``retirements`` (instances added and removed by the horizontal scaler), ``scale_to_zero``
    (times a function went to zero instances), ``parks`` (instances parked: each one whose
    placement and share were freed, its weights moved to host memory; once per park, not per
    decision: an instance resumed and parked again counts again) and ``resumes`` (parked instances brought back on the GPU they left, their weights
    copied back: the live scaler's ``dilu_resumes_total{outcome="resumed"}`` over every
    ``function``; a resume that
    found that GPU full and relaunched the instance elsewhere is a launch, counted in
    ``scale_outs`` instead, and a refused one in neither); ``migrations`` (instances the
    scheduler's defragmentation moved: each relaunched on a fuller GPU, the old one drained once
    it is ready; the live scheduler's ``dilu_scheduler_migrations_total``); ``vertical_reaction_ms_p50``/``_p99``: stretch
    detected -> grant in the control block, ms (None where it is not measured: ``dilu sim``
    does not model the reaction, its grants take effect at the next vertical tick)."""

    profiler_trials: int = 0
    grant_changes: int = 0
    token_wait_ms: float = 0.0
    scale_outs: int = 0
    retirements: int = 0
    scale_to_zero: int = 0
    parks: int = 0
    resumes: int = 0
    migrations: int = 0
    vertical_reaction_ms_p50: float | None = 0.0
    vertical_reaction_ms_p99: float | None = 0.0


class RunFacts(msgspec.Struct, kw_only=True):
    """What the platform accounted for the run (node agent, scalers, profiler): time integrals
    over the replay, counts over the whole run (module docstring).

    ``functions``: per-function facts by function name; ``active_gpu_seconds``: seconds during
    which each GPU hosted at least one instance, summed over GPUs; ``allocation_fragmentation``
    and ``idle_fragmentation``: fractions 0..1 as defined in the module docstring; ``training``:
    per training job (by function name) its iterations and seconds.
    """

    functions: dict[str, FunctionFacts] = msgspec.field(default_factory=dict)
    training: dict[str, TrainingFacts] = msgspec.field(default_factory=dict)
    active_gpu_seconds: float = 0.0
    allocation_fragmentation: float = 0.0
    idle_fragmentation: float = 0.0
    mechanism: Mechanism = msgspec.field(default_factory=Mechanism)


class LlmRunInfo(msgspec.Struct, kw_only=True):
    """The LLM trace replayed beside (or instead of) the functions trace: the file ``trace``, the
    llm ``function`` it drove, ``start_s`` (trace seconds), ``duration_s`` (wall seconds planned),
    ``speedup``, ``sample`` (fraction of the span's requests kept), ``max_new_tokens_cap`` (None:
    uncapped) and ``requests`` planned."""

    trace: str
    function: str
    start_s: float = 0.0
    duration_s: float = 0.0
    speedup: float = 1.0
    sample: float = 1.0
    max_new_tokens_cap: int | None = None
    requests: int = 0


class RunInfo(msgspec.Struct, kw_only=True):
    """How the run was made. ``wall_s`` (> 0) is the goodput denominator; ``share`` the fraction
    of the span's invocations the replayed functions carry; ``late_sends`` sends more than
    ``late_threshold_ms`` behind schedule; ``not_sent`` planned requests never sent (stopped);
    ``llm`` the LLM trace replayed, if any. What the policy ran with: ``training_jobs`` beside
    the functions, ``park_after_s`` and ``defrag_interval_s`` in force, trace seconds (0: never);
    None: not recorded (a report of an older build). ``simulated``: made by ``dilu sim`` (its
    seconds are simulated ones)."""

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
    training_jobs: int | None = None
    park_after_s: float | None = None
    defrag_interval_s: float | None = None
    simulated: bool = False
    llm: LlmRunInfo | None = None


def run_info(
    plan: ReplayPlan | None, result: RunResult, *, policy: str = "dilu", gpus: int = 0,
    llm_plan: LlmPlan | None = None, training_jobs: int | None = None, park_after_s: float | None = None,
    defrag_interval_s: float | None = None, simulated: bool = False,
) -> RunInfo:
    """The :class:`RunInfo` of a replay from its plan(s) and the generator's result; the
    keywords are recorded as they are (see :class:`RunInfo`).

    ``plan``: the functions-trace plan (the top-level trace, duration, functions and share are
    its own); ``llm_plan``: the LLM-trace plan replayed with it, described in ``llm`` (or alone,
    ``plan`` None: then seed, trace, speed-up and duration are the LLM plan's, ``functions`` 1).
    Raises ValueError when both are None.
    """
    common = dict(
        wall_s=result.wall_s, policy=policy, late_sends=result.late_sends,
        late_threshold_ms=result.late_threshold_ms, max_late_ms=result.max_late_ms, not_sent=result.not_sent,
        gpus=gpus, training_jobs=training_jobs, park_after_s=park_after_s, defrag_interval_s=defrag_interval_s,
        simulated=simulated,
    )
    llm = None
    if llm_plan is not None:
        llm = LlmRunInfo(
            trace=llm_plan.trace, function=llm_plan.function, start_s=llm_plan.start_s,
            duration_s=llm_plan.duration_s, speedup=llm_plan.speedup,
            sample=llm_plan.sample, max_new_tokens_cap=llm_plan.max_new_tokens_cap,
            requests=len(llm_plan.invocations),
        )
    if plan is not None:
        return RunInfo(
            seed=plan.seed, trace=plan.trace, start_minute=plan.start_minute, speedup=plan.speedup,
            duration_s=plan.duration_s, functions=len(plan.functions), share=plan.share, llm=llm, **common,
        )
    if llm_plan is None:
        raise ValueError("run_info needs a plan or an llm_plan")
    share = len(llm_plan.invocations) / llm_plan.span_requests if llm_plan.span_requests else 0.0
    return RunInfo(seed=llm_plan.seed, trace=llm_plan.trace, speedup=llm_plan.speedup,
                   duration_s=llm_plan.duration_s, functions=1, share=share, llm=llm, **common)


# ------------------------------------------------------------------------------------ outputs


class LatencyMs(msgspec.Struct, kw_only=True):
    """Latency percentiles in ms from the scheduled send time; None without completions."""

    p50: float | None = None
    p99: float | None = None
    p999: float | None = None


class Figures(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The request and cost figures a function and the whole run both have (module docstring).

    ``ttft_ms``, ``tpot_ms`` and ``token_slo_violation_rate`` are set only where llm requests
    are counted; None (and absent from the JSON) elsewhere."""

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
    ttft_ms: LatencyMs | None = None
    tpot_ms: LatencyMs | None = None
    token_slo_violation_rate: float | None = None


class FunctionReport(Figures, kw_only=True):
    """One function's figures (see the module docstring for each definition). ``kind`` (absent
    from the JSON for ``inference``), and for llm ``ttft_slo_ms`` / ``tpot_slo_ms``: the token
    objectives the violation rate was judged against (None: not checked)."""

    name: str
    model: str
    slo_ms: float
    kind: str = "inference"
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None


class Totals(Figures, kw_only=True):
    """The whole run's figures: the per-function ones over all requests, plus GPU properties."""

    active_gpu_seconds: float
    allocation_fragmentation: float
    idle_fragmentation: float


class TrainingReport(msgspec.Struct, kw_only=True):
    """One training job: ``iterations`` and ``seconds`` (s) it ran, ``iterations_per_s`` (None
    when no second was accounted), and its ``instance_launches`` and ``quota_seconds``."""

    name: str
    model: str
    iterations: int
    seconds: float
    iterations_per_s: float | None
    instance_launches: int = 0
    quota_seconds: float = 0.0


class Report(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``{"totals": ..., "functions": [...], "mechanism": ..., "run": ..., "training": [...]}``;
    functions sorted by offered requests, most first; ``training`` by name, absent when empty."""

    totals: Totals
    functions: list[FunctionReport]
    mechanism: Mechanism
    run: RunInfo
    training: list[TrainingReport] = msgspec.field(default_factory=list)

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
    """Read a JSON report written by :func:`write_report`; raises ValueError naming the file and
    what is wrong: it cannot be read (the OS's words), or it is not a report."""
    try:
        data = files.read_bounded(path, REPORT_MAX_BYTES)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return msgspec.json.decode(data, type=Report)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a Dilu report ({exc})") from exc


# ---------------------------------------------------------------------------------- building


def _record_us(hist: HdrHistogram, us: float) -> None:
    """Record a duration in µs, clamped to the histogram's range (negative -> the lowest)."""
    hist.record_value(min(max(int(us), HDR_LOWEST_US), HDR_HIGHEST_US))


def _percentiles(hist: HdrHistogram) -> LatencyMs:
    if not hist.get_total_count():
        return LatencyMs()
    values = hist.get_percentile_to_value_dict(list(PERCENTILES.values()))
    return LatencyMs(**{k: values[p] / 1000.0 for k, p in PERCENTILES.items()})


def _new_hist() -> HdrHistogram:
    return HdrHistogram(HDR_LOWEST_US, HDR_HIGHEST_US, HDR_DIGITS)


class _Tally:
    """Counts and the latency histogram of one function (or of all); with ``tokens``, also the
    token figures of its llm requests."""

    def __init__(self, tokens: bool = False) -> None:
        self.counts = {"ok": 0, "dropped": 0, "error": 0, "timeout": 0}
        self.good = 0
        self.late = 0
        self.cold = 0
        self.hist = _new_hist()
        self.tokens = tokens
        self.token_offered = 0
        self.token_bad = 0
        self.ttft = _new_hist()
        self.tpot = _new_hist()

    def add(self, r: Record, meta: FunctionMeta) -> None:
        self.counts[r.status] += 1
        self.cold += r.cold_start
        if meta.kind == "llm":
            self._add_tokens(r, meta)
        if r.status != "ok":
            return
        latency_ns = r.latency_ns
        _record_us(self.hist, latency_ns // 1000)
        if latency_ns > meta.slo_ms * 1e6:
            self.late += 1
        else:
            self.good += 1

    def _add_tokens(self, r: Record, meta: FunctionMeta) -> None:
        self.token_offered += 1
        if r.status != "ok":
            self.token_bad += 1
            return
        # an unstreamed reply brought its first token with it
        ttft = r.ttft_ms if r.ttft_ms is not None else r.latency_ns / 1e6
        _record_us(self.ttft, ttft * 1000)
        if r.tpot_ms is not None:
            _record_us(self.tpot, r.tpot_ms * 1000)
        slow_first = bool(meta.ttft_ms) and ttft > meta.ttft_ms
        slow_rest = bool(meta.tpot_ms) and r.tpot_ms is not None and r.tpot_ms > meta.tpot_ms
        self.token_bad += slow_first or slow_rest

    @property
    def offered(self) -> int:
        return sum(self.counts.values())

    def figures(self, wall_s: float) -> dict:
        offered = self.offered
        bad = self.late + offered - self.counts["ok"]
        out = dict(
            offered=offered, completed=self.counts["ok"], dropped=self.counts["dropped"],
            failed=self.counts["error"], timed_out=self.counts["timeout"],
            goodput_rps=self.good / wall_s, slo_violation_rate=bad / offered if offered else 0.0,
            latency_ms=_percentiles(self.hist), cold_start_requests=self.cold,
        )
        if self.tokens:
            out.update(
                ttft_ms=_percentiles(self.ttft), tpot_ms=_percentiles(self.tpot),
                token_slo_violation_rate=self.token_bad / self.token_offered if self.token_offered else 0.0,
            )
        return out


def build_report(
    records: Iterable[Record], functions: Mapping[str, FunctionMeta], facts: RunFacts, run: RunInfo
) -> Report:
    """Build the report from the generator's records, the deployed functions, the platform's
    accounting and the run's facts.

    Every record's function must be in ``functions`` and not a training job (ValueError
    otherwise); a function without records reports zeros; training jobs (kind ``training`` in
    ``functions``, or in ``facts.training``) go to the ``training`` section. Raises ValueError if
    ``run.wall_s`` is not positive.
    """
    if not run.wall_s > 0:
        raise ValueError(f"run.wall_s must be positive, got {run.wall_s}")
    serving = {name: meta for name, meta in functions.items() if meta.kind != "training"}
    tallies = {name: _Tally(tokens=meta.kind == "llm") for name, meta in serving.items()}
    total = _Tally(tokens=any(meta.kind == "llm" for meta in serving.values()))
    for r in records:
        meta = serving.get(r.function)
        if meta is None:
            why = "a training job, which takes no requests" if r.function in functions else \
                "not among the replayed functions"
            raise ValueError(f"record {r.id} is for function {r.function!r}, which is {why}")
        tallies[r.function].add(r, meta)
        total.add(r, meta)
    per_function = [_function_report(name, meta, tallies[name].figures(run.wall_s), facts)
                    for name, meta in serving.items()]
    per_function.sort(key=lambda f: (-f.offered, f.name))
    totals = Totals(
        **total.figures(run.wall_s),
        instance_launches=sum(f.instance_launches for f in facts.functions.values()),
        quota_seconds=sum(f.quota_seconds for f in facts.functions.values()),
        active_gpu_seconds=float(facts.active_gpu_seconds),
        allocation_fragmentation=float(facts.allocation_fragmentation),
        idle_fragmentation=float(facts.idle_fragmentation),
    )
    return Report(totals=totals, functions=per_function, mechanism=facts.mechanism, run=run,
                  training=_training(functions, facts))


def _function_report(name: str, meta: FunctionMeta, figures: dict, facts: RunFacts) -> FunctionReport:
    f = facts.functions.get(name, FunctionFacts())
    llm = meta.kind == "llm"
    return FunctionReport(
        name=name, model=meta.model, slo_ms=meta.slo_ms, kind=meta.kind, **figures,
        ttft_slo_ms=(meta.ttft_ms or None) if llm else None, tpot_slo_ms=(meta.tpot_ms or None) if llm else None,
        instance_launches=f.instance_launches, quota_seconds=f.quota_seconds,
    )


def _training(functions: Mapping[str, FunctionMeta], facts: RunFacts) -> list[TrainingReport]:
    names = {n for n, m in functions.items() if m.kind == "training"} | set(facts.training)
    out = []
    for name in sorted(names):
        t = facts.training.get(name, TrainingFacts())
        f = facts.functions.get(name, FunctionFacts())
        meta = functions.get(name)
        out.append(TrainingReport(
            name=name, model=meta.model if meta else "", iterations=t.iterations, seconds=float(t.seconds),
            iterations_per_s=t.iterations / t.seconds if t.seconds > 0 else None,
            instance_launches=f.instance_launches, quota_seconds=f.quota_seconds,
        ))
    return out


# --------------------------------------------------------------------------------- rendering

# What each printed column (and compare row) means: one truth for the legend printed under the
# tables and for the ``--help`` of ``dilu demo`` and ``dilu compare`` (:func:`legend_text`).
LEGEND: dict[str, str] = {
    "function": "the replayed function (fn- and the start of its trace hash)",
    "total": "the functions' requests together; its instance launches and quota·s also count the training "
             "jobs' (listed below), so they exceed the sum of the rows above",
    "model": "the model it serves (assigned by the seeded rule)",
    "SLO ms": "its latency objective: ms from a request's scheduled send to its answer",
    "offered": "requests sent; each ends as exactly one of completed, dropped, failed, timed out",
    "completed": "requests answered",
    "dropped": "requests never delivered (the bus refused them)",
    "failed": "requests answered with an error",
    "timed out": "requests not answered within their timeout or before the run ended",
    "goodput/s": "requests completed within SLO per wall-clock second of the run",
    "SLO viol.": "SLO violation rate: (completed later than SLO + dropped + failed + timed out) / offered",
    "p50 ms": "median latency of completed requests, ms from scheduled send to answer (HDR histogram)",
    "p99 ms": "99th percentile of that latency, ms",
    "p99.9 ms": "99.9th percentile of that latency, ms",
    "cold starts": "cold-start requests: requests that waited for an instance to launch",
    "launches": "instances started",
    "quota·s": "GPU share granted x seconds during the replay, summed over instances (1.0 = one whole GPU "
               "for one second)",
    "TTFT / TPOT SLO ms": "an llm function's token objectives: time to first token / time per output token",
    "TTFT p50 ms": "median time to first token of completed llm requests, ms from scheduled send",
    "TTFT p99 ms": "99th percentile of the time to first token, ms",
    "TPOT p50 ms": "median time per output token after the first, ms",
    "TPOT p99 ms": "99th percentile of the time per output token, ms",
    "token SLO viol.": "(llm requests over their TTFT or TPOT objective + dropped + failed + timed out) / offered",
    "active GPU·s": "seconds each GPU held at least one instance during the replay, summed over GPUs",
    "alloc. frag.": "allocation fragmentation: time-weighted mean over active GPUs of 1 - sum of request "
                    "quotas (capacity no instance asked for)",
    "idle frag.": "idle fragmentation: time-weighted mean over active GPUs of 1 - sum of measured SM-time "
                  "shares (capacity left unused)",
    "profiler trials": "measurements the profiler made",
    "grant changes": "token grants that changed an instance's quota (vertical scaling)",
    "token wait ms": "time kernel launches waited for tokens, summed, ms",
    "scale-outs": "instances added by the horizontal scaler",
    "retirements": "instances removed by the horizontal scaler",
    "scale to zero": "times a function went to zero instances",
    "parks": "instances parked: GPU share freed, weights moved to host memory (their CUDA context stays)",
    "resumes": "parked instances brought back on the GPU they left (weights copied back); one relaunched "
               "elsewhere because that GPU was full counts as a scale-out instead",
    "migrations": "instances moved by defragmentation: each relaunched on a fuller GPU, the old one "
                  "drained once the new one is ready",
    "reaction p50/p99 ms": "vertical scaling's reaction, stretch detected -> new grant in force, ms "
                           "(– when no grant changed, and in dilu sim, which does not model it)",
    "iterations": "training iterations done during the replay",
    "seconds": "seconds the training job ran",
    "iterations/s": "training iterations per second",
    "wall s": "wall-clock seconds of the replay, draining included (the goodput denominator)",
    "late sends": "sends later than the late threshold behind schedule (the load generator fell behind)",
    "–": "nothing to measure (no completed request, no llm function, no grant change, a ratio to 0)",
}

# What the seconds of LEGEND mean in a simulated run (dilu sim): simulated seconds, not wall time.
SIMULATED_LEGEND: dict[str, str] = {
    "goodput/s": "requests completed within SLO per simulated second of the run",
    "wall s": "simulated seconds of the replay, draining included (the goodput denominator)",
}
# compare rows whose label is not itself a LEGEND key
_COMPARE_KEYS = {
    "SLO violation rate": "SLO viol.", "latency p50 ms": "p50 ms", "latency p99 ms": "p99 ms",
    "latency p99.9 ms": "p99.9 ms", "cold-start requests": "cold starts", "instance launches": "launches",
    "allocation fragmentation": "alloc. frag.", "idle fragmentation": "idle frag.",
    "vertical reaction p99 ms": "reaction p50/p99 ms", "token SLO violation rate": "token SLO viol.",
}


def legend_text(keys: Iterable[str] | None = None, width: int = 78) -> str:
    """The legend as plain text, one ``name  meaning`` entry per key (default: every LEGEND key),
    meanings wrapped to ``width`` columns under a hanging indent. Raises KeyError on an unknown key."""
    import textwrap

    keys = list(LEGEND if keys is None else keys)
    pad = max(len(k) for k in keys) + 2
    lines = []
    for key in keys:
        lines += textwrap.wrap(LEGEND[key], width=width, initial_indent=key.ljust(pad),
                               subsequent_indent=" " * pad) or [key]
    return "\n".join(lines)


def _legend_table(entries: Iterable[tuple[str, str]]) -> Table:
    """A borderless two-column legend (name, meaning); meanings wrap to the console's width."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    for name, meaning in entries:
        grid.add_row(name, meaning)
    return grid


def _ms(v: float | None) -> str:
    return "–" if v is None else (f"{v:,.1f}" if v < 1000 else f"{v:,.0f}")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def _row(f: FunctionReport | Totals) -> list[str]:
    lat = f.latency_ms
    return [
        f"{f.offered:,}", f"{f.completed:,}", f"{f.dropped:,}", f"{f.failed:,}", f"{f.timed_out:,}",
        f"{f.goodput_rps:,.2f}", _pct(f.slo_violation_rate), _ms(lat.p50), _ms(lat.p99), _ms(lat.p999),
        f"{f.cold_start_requests:,}", f"{f.instance_launches:,}", f"{f.quota_seconds:,.1f}",
    ]


def _token_row(f: FunctionReport | Totals) -> list[str]:
    """TTFT p50/p99, TPOT p50/p99 and the token SLO violation rate; dashes where not llm."""
    ttft, tpot = f.ttft_ms or LatencyMs(), f.tpot_ms or LatencyMs()
    return [_ms(ttft.p50), _ms(ttft.p99), _ms(tpot.p50), _ms(tpot.p99), _pct(f.token_slo_violation_rate)]


def _token_slo(f: FunctionReport) -> str:
    if f.kind != "llm":
        return ""
    return f"{_ms(f.ttft_slo_ms)} / {_ms(f.tpot_slo_ms)}"


_FIGURE_COLUMNS = [
    "offered", "completed", "dropped", "failed", "timed out", "goodput/s", "SLO viol.",
    "p50 ms", "p99 ms", "p99.9 ms", "cold starts", "launches", "quota·s",
]
_TOKEN_COLUMNS = ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "token SLO viol."]
_GPU_ROWS = ["active GPU·s", "alloc. frag.", "idle frag.", "profiler trials", "grant changes",
             "token wait ms", "scale-outs", "retirements", "scale to zero", "parks", "resumes",
             "migrations", "reaction p50/p99 ms"]


def _cell_len(cell: str) -> int:
    """Columns a cell takes: its widest line, markup left out."""
    return max(Text(line).cell_len for line in Text.from_markup(cell).plain.split("\n"))


def split_columns(widths: list[int], keys: int, width: int) -> list[list[int]]:
    """Group the columns after the first ``keys`` (repeated in every group) so that each group's
    table fits ``width`` cells: a column of content width w takes w + 3 (padding and its border),
    a table 1 more. As few groups as can be, as even in width as can be (no lone last column).
    Returns lists of column indices, in order; a column too wide even alone with the keys gets a
    group of its own."""
    groups = _pack(widths, keys, width)
    low, high = 0, width  # the narrowest limit that still needs no more groups
    while low < high:
        mid = (low + high) // 2
        if len(_pack(widths, keys, mid)) <= len(groups):
            high = mid
        else:
            low = mid + 1
    return _pack(widths, keys, high)


def _pack(widths: list[int], keys: int, width: int) -> list[list[int]]:
    """Greedy packing in order: each group takes columns while its table fits ``width``."""
    base = 1 + sum(w + 3 for w in widths[:keys])
    groups: list[list[int]] = []
    current: list[int] = []
    used = base
    for i in range(keys, len(widths)):
        cost = widths[i] + 3
        if current and used + cost > width:
            groups.append(current)
            current, used = [], base
        current.append(i)
        used += cost
    if current:
        groups.append(current)
    return groups


WRAP_MIN_WIDTH = 24  # columns a wrapping (free-text) column of a fitted table keeps at least


def fitted_tables(title: str, headers: list[tuple[str, str]], rows: list[tuple[list[str], dict]], width: int,
                  *, keys: int = 1, wrap: Iterable[str] = (), **table_options) -> list[Table]:
    """The table as one or more tables of at most ``width`` cells (console columns), split by
    columns (the first ``keys`` columns repeated in each); no cell wraps or is cut, except in the
    columns named in ``wrap`` (free text): those are packed at their header's width or
    :data:`WRAP_MIN_WIDTH`, then take what their table has left, and wrap at words within it.
    ``headers``: (name, justify); ``rows``: (cells, add_row keyword arguments); ``table_options``:
    further keyword arguments of each :class:`rich.table.Table` (e.g. ``title_justify``)."""
    wraps = [name in set(wrap) for name, _ in headers]
    natural = [max([_cell_len(h)] + [_cell_len(cells[i]) for cells, _ in rows]) for i, (h, _) in enumerate(headers)]
    base = 1 + sum(w + 3 for w in natural[:keys])
    widths = [min(w, max(_cell_len(h), WRAP_MIN_WIDTH), max(1, width - base - 3)) if wraps[i] else w
              for i, (w, (h, _)) in enumerate(zip(natural, headers))]
    groups = split_columns(widths, keys, width) or [[]]
    for group in groups:  # the room a table has left goes to its wrapping columns, evenly
        spare = width - base - sum(widths[i] + 3 for i in group)
        while spare > 0 and (short := [i for i in group if wraps[i] and widths[i] < natural[i]]):
            for i in short[:spare]:
                widths[i] += 1
            spare -= len(short[:spare])
    tables = []
    for n, group in enumerate(groups):
        part = f" ({n + 1}/{len(groups)})" if len(groups) > 1 else ""
        # wide enough for its title on one line, within the console
        table = Table(title=title + part, min_width=min(width, _cell_len(title + part) + 4), **table_options)
        cols = [*range(keys), *group]
        for i in cols:
            name, justify = headers[i]
            table.add_column(name, justify=justify, no_wrap=not wraps[i], min_width=widths[i],
                             max_width=widths[i] if wraps[i] else None)
        for cells, kw in rows:
            table.add_row(*(cells[i] for i in cols), **kw)
        tables.append(table)
    return tables


def render(report: Report, console: Console) -> None:
    """Print the report within the console's width: one row per function plus a total row (split
    into several tables by columns when too wide, the function column repeated), the legend of
    its columns, then the training jobs (when there are any) and the GPU figures and mechanism
    counters (one per line, with their meaning); the run's facts under the first tables. The token
    columns (TTFT/TPOT objectives and percentiles, token SLO violations) appear only when an llm
    function is in the report."""
    run = report.run
    width = console.width
    tokens = any(f.kind == "llm" for f in report.functions)
    headers = [("function", "left"), ("model", "left"), ("SLO ms", "right")]
    headers += [(name, "right") for name in _FIGURE_COLUMNS]
    if tokens:
        headers += [("TTFT / TPOT SLO ms", "right")] + [(name, "right") for name in _TOKEN_COLUMNS]
    rows: list[tuple[list[str], dict]] = []
    for i, f in enumerate(report.functions):
        extra = [_token_slo(f), *_token_row(f)] if tokens else []
        rows.append(([f.name, f.model, _ms(f.slo_ms), *_row(f), *extra],
                     {"end_section": i == len(report.functions) - 1}))
    rows.append((["total", "", "", *_row(report.totals), *(["", *_token_row(report.totals)] if tokens else [])],
                 {"style": "bold"}))
    for table in fitted_tables(f"Dilu replay — policy {run.policy}", headers, rows, width):
        console.print(table)
    console.print(Text(_caption(run), style="table.caption"))
    shown = [h for h, _ in headers]
    if report.training:
        t_headers, t_rows = _training_rows(report.training)
        for table in fitted_tables("Training jobs", t_headers, t_rows, width):
            console.print(table)
        shown += [h for h, _ in t_headers if h not in shown]
    notes = [("total", LEGEND["total"])] if report.training else []
    console.print(_legend_table([(h, LEGEND[h]) for h in shown] + notes + [("–", LEGEND["–"])]))

    t, m = report.totals, report.mechanism
    values = [
        f"{t.active_gpu_seconds:,.1f}", _pct(t.allocation_fragmentation), _pct(t.idle_fragmentation),
        f"{m.profiler_trials:,}", f"{m.grant_changes:,}", f"{m.token_wait_ms:,.1f}", f"{m.scale_outs:,}",
        f"{m.retirements:,}", f"{m.scale_to_zero:,}", f"{m.parks:,}", f"{m.resumes:,}", f"{m.migrations:,}",
        _reaction(m),
    ]
    gpu = Table(title="GPUs and mechanism")
    gpu.add_column("figure", no_wrap=True)
    gpu.add_column("value", justify="right", no_wrap=True)
    gpu.add_column("meaning")
    for name, value in zip(_GPU_ROWS, values):
        gpu.add_row(name, value, LEGEND[name])
    console.print(gpu)


def _caption(run: RunInfo) -> str:
    llm = run.llm
    llm_only = llm is not None and run.trace == llm.trace
    text = "" if llm_only else (
        f"trace {Path(run.trace).name or run.trace} from minute {run.start_minute}, "
        f"{run.duration_s:g} s at speed-up {run.speedup:g}, seed {run.seed}; {run.functions} functions carry "
        f"{run.share:.1%} of the span's invocations; "  # as the run's first line says it, and unbroken
    )
    if llm is not None:
        cap = f", output capped at {llm.max_new_tokens_cap} tokens" if llm.max_new_tokens_cap else ""
        sample = f", {_pct(llm.sample)} sampled" if llm.sample < 1 else ""
        text += (f"LLM trace {Path(llm.trace).name} -> {llm.function} from {llm.start_s:g} s, "
                 f"{llm.duration_s:g} s at speed-up {llm.speedup:g}" + (f", seed {run.seed}" if llm_only else "")
                 + f": {llm.requests:,} requests{sample}{cap}; ")
    return text + (
        f"wall {run.wall_s:.1f} s; late sends (> {run.late_threshold_ms:g} ms) {run.late_sends}, "
        f"worst {run.max_late_ms:.1f} ms" + (f"; not sent {run.not_sent}" if run.not_sent else "")
    )


def _training_rows(training: list[TrainingReport]) -> tuple[list[tuple[str, str]], list[tuple[list[str], dict]]]:
    headers = [("function", "left"), ("model", "left")]
    headers += [(name, "right") for name in ("iterations", "seconds", "iterations/s", "launches", "quota·s")]
    rows = []
    for t in training:
        rate = "–" if t.iterations_per_s is None else f"{t.iterations_per_s:,.2f}"
        rows.append(([t.name, t.model, f"{t.iterations:,}", f"{t.seconds:,.1f}", rate,
                      f"{t.instance_launches:,}", f"{t.quota_seconds:,.1f}"], {}))
    return headers, rows


def _reaction(m: "Mechanism") -> str:
    """Vertical reaction p50 / p99, or a dash when no grant changed or it was not measured."""
    if not m.grant_changes or m.vertical_reaction_ms_p50 is None or m.vertical_reaction_ms_p99 is None:
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
    ("parks", lambda r: r.mechanism.parks, "{:,}", None),
    ("resumes", lambda r: r.mechanism.resumes, "{:,}", None),
    ("migrations", lambda r: r.mechanism.migrations, "{:,}", None),
    ("vertical reaction p99 ms",
     lambda r: r.mechanism.vertical_reaction_ms_p99 if r.mechanism.grant_changes else None, "{:,.1f}", None),
    ("wall s", lambda r: r.run.wall_s, "{:,.1f}", None),
    ("late sends", lambda r: r.run.late_sends, "{:,}", None),
]


def _totals_token(key: str, p: str):
    def get(r: Report) -> float | None:
        figures = getattr(r.totals, key)
        return None if figures is None else getattr(figures, p)
    return get


_TOKEN_COMPARE_ROWS: list[tuple[str, object, object, str | None]] = [
    ("TTFT p50 ms", _totals_token("ttft_ms", "p50"), _ms, "low"),
    ("TTFT p99 ms", _totals_token("ttft_ms", "p99"), _ms, "low"),
    ("TPOT p50 ms", _totals_token("tpot_ms", "p50"), _ms, "low"),
    ("TPOT p99 ms", _totals_token("tpot_ms", "p99"), _ms, "low"),
    ("token SLO violation rate", lambda r: r.totals.token_slo_violation_rate, _pct, "low"),
]


def _training_rate(name: str):
    def get(r: Report) -> float | None:
        return next((t.iterations_per_s for t in r.training if t.name == name), None)
    return get


def _compare_rows(reports: Iterable[Report]) -> list[tuple[str, object, object, str | None]]:
    """The compare rows: the token rows after the latency ones when some report has llm totals,
    and one iterations/s row per training job after the GPU figures."""
    reports = list(reports)
    rows = list(_COMPARE_ROWS)
    if any(r.totals.token_slo_violation_rate is not None for r in reports):
        at = next(i for i, row in enumerate(rows) if row[0] == "latency p99.9 ms") + 1
        rows[at:at] = _TOKEN_COMPARE_ROWS
    jobs = sorted({t.name for r in reports for t in r.training})
    if jobs:
        at = next(i for i, row in enumerate(rows) if row[0] == "idle fragmentation") + 1
        rows[at:at] = [(f"{name} iterations/s", _training_rate(name), "{:,.2f}", "high") for name in jobs]
    return rows


def versus(first: float | None, other: float | None, *, rate: bool = False) -> str:
    """How ``other`` compares with ``first``: their ratio ``other / first`` as ``"0.53x"``, or for a
    rate (a fraction 0..1) the difference in percentage points as ``"+1.2 pp"``, taken between the
    two rates as printed (to 0.1 %), so that it is their visible difference; ``"–"`` when either is
    missing or, for a ratio, ``first`` is 0."""
    if first is None or other is None:
        return "–"
    if rate:
        return f"{round(100 * other, 1) - round(100 * first, 1):+.1f} pp"
    if first == 0:
        return "–"
    return f"{other / first:.2f}x"


def render_compare(reports: Mapping[str, Report], console: Console, *, simulated: bool = False) -> None:
    """Print several policies' totals side by side, one column per policy (in the mapping's
    order), one row per figure, then for each policy after the first a column comparing it with
    the first (:func:`versus`: the ratio, or for rates the difference in percentage points), then
    a legend of the rows and columns; split by columns when wider than the console. The best
    value of a row is bold where lower or higher is plainly better. Token rows (TTFT, TPOT, token
    SLO violations) appear when some report has an llm function, an iterations/s row per training
    job when some report has one; ``simulated``: the legend says simulated seconds
    (:data:`SIMULATED_LEGEND`). Raises ValueError on an empty mapping."""
    if not reports:
        raise ValueError("nothing to compare")
    names = list(reports)
    first = names[0]
    versus_names = [f"{p} / {first}" for p in names[1:]]
    headers = [("figure", "left"), *((p, "right") for p in names), *((v, "right") for v in versus_names)]
    rows: list[tuple[list[str], dict]] = []
    labels = []
    for label, get, fmt, better in _compare_rows(reports.values()):
        values = [get(r) for r in reports.values()]
        present = [v for v in values if v is not None]
        best = None
        if better and len(present) > 1 and len(set(present)) > 1:
            best = min(present) if better == "low" else max(present)
        cells = []
        for v in values:
            text = fmt(v) if callable(fmt) else ("–" if v is None else fmt.format(v))
            cells.append(f"[bold]{text}[/bold]" if best is not None and v == best else text)
        cells += [versus(values[0], v, rate=fmt is _pct) for v in values[1:]]
        rows.append(([label, *cells], {}))
        labels.append(label)
    for table in fitted_tables("Policies compared on the same replay", headers, rows, console.width):
        console.print(table)
    meanings = {**LEGEND, **SIMULATED_LEGEND} if simulated else LEGEND
    entries = [(label, meanings[_compare_key(label)]) for label in labels]
    entries += [(v, f"{p}'s figure / {first}'s (0.53x: {p} has 53 % of it); for a rate (%), the difference "
                    f"{p} - {first} in percentage points (pp)") for p, v in zip(names[1:], versus_names)]
    entries += [("bold", "the best value of a row, where lower or higher is plainly better"), ("–", LEGEND["–"])]
    console.print(_legend_table(entries))


def _compare_key(label: str) -> str:
    """The LEGEND key of a compare row's label."""
    if label.endswith(" iterations/s"):
        return "iterations/s"
    return _COMPARE_KEYS.get(label, label)
