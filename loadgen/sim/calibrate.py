"""``dilu calibrate``: the simulator's overheads (:mod:`.overheads`) measured from live runs.

Input: the log directories ``dilu demo`` / ``dilu compare`` leave per policy under ``--log-dir``
(``requests.jsonl`` and ``report.json``, :mod:`dilu.loadgen.requestlog`; the node agent's
``node_agent.log``). From each:

- **process start**: each instance launched after the initial ones were all ready, its
  InstanceReady cold start less the emulated weight load (:func:`models.cold_start_ms`); the
  initial ones start all at once and share the CPU. The median over every run, and the median
  by how many other instances were starting on the node when it launched (any instance, the
  initial ones too; its start is its ready time less its cold start): starting processes share
  the node's CPU, so one launched beside three others starts several times slower than one alone
  (:func:`starts_by_starting`). The deploy's launches (each function's first instance, all at
  once) are measured apart, by launch order: the k-th is up (launched after the first, plus its
  process start) a median of ``process_start_initial_ms[k]`` after the first's launch
  (:func:`initial_by_order`). Those of other runs of the same node may stand in for the later
  launches (``starts_from``): one run launches too few instances after its deploy to measure
  them alone; the deploy's launches stay the runs' own (:func:`own_deploy`).
- **transport**: per answered request, way in + way back (:mod:`.overheads`).
- **pickup**: per instance, from a batch's last reply to its next batch's start, where a request
  of that next batch was already stored before that reply (the instance had work waiting).
- **dispatch**: per instance, from the first stored request of a batch to the batch's start, where
  that request was stored after the batch before had its last reply (the instance was idle) and
  the instance was not parked in between (a resume is modelled apart, :func:`models.resume_ms`).
- **loop timing**: from the horizontal scaler's log, its tick period (the gaps between its
  ``scale decided`` lines, each a whole number of ticks apart: their sum over the sum of those
  numbers, gaps of at most :data:`TICK_GAPS_MAX` ticks, where the drift of a tick stays far
  under half a tick) over every run, and for each run its :class:`~.overheads.LoopTiming`: the
  first request's scheduled send and the scheduler's defragmentation round nearest to it
  (``defragmentation planned`` or ``defragmented`` lines; without them, whole intervals after
  its ``placement policy`` line, which it logs as its rounds start), ms after the tick that
  decided the deploy's initial scale. At ``DILU_LOG_LEVEL`` info these lines are there.
- **batch**: the live service of each batch (the first reply of each (instance, start) pair:
  handler called -> reply published) against the simulator's service of the batches of the same
  function and size, simulated on the run's own plan, policy and process start: the k-th of n
  live services (ascending) less the simulated quantile at (k + 1/2) / n. A function and batch size
  with fewer than ``min_batches`` batches either way is left out. These differences, pooled over
  the runs, are the batch overhead's sample (negative ones count as 0).
"""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Annotated, Iterator, NamedTuple, Sequence

import msgspec
import numpy as np

from dilu.loadgen import report, requestlog
from dilu.services.common import files, models
from dilu.services.horizontal_scaler.policy import INITIAL_SCALE_REASON, TICK_MS
from dilu.services.horizontal_scaler.service import WAKE_REASON

from .overheads import LoopTiming, Overheads, OverheadsError

MIN_BATCHES = 20  # fewer batches of one function and size say little about its service's spread
MIN_STARTS = 10  # a process start table's entry comes from at least this many launches (else pooled)
NODE_AGENT_LOG = "node_agent.log"
HORIZONTAL_LOG = "horizontal_scaler.log"
SCHEDULER_LOG = "scheduler.log"
# Scale decisions at most this many horizontal ticks apart time the tick: the live tick drifts
# by its own work (1.6 ms a tick on the emulated node), 80 ms over 50 ticks, far under half a
# tick, so the whole number of ticks between two decisions is never mistaken.
TICK_GAPS_MAX = 50
TICKS_MIN = 20  # fewer ticks between decisions in all time the tick too loosely: not measured
LOG_MAX_BYTES = files.GiB  # a node agent's log of one run: hours of it are tens of MB


class _Ready(msgspec.Struct):
    """The node agent's log line of an instance's first ready (``instance ready``): the instance
    id, its cold start (ms, launch to ready) and when it was logged (ISO 8601)."""

    instance: str
    cold_start_ms: Annotated[float, msgspec.Meta(ge=0)]
    timestamp: datetime


class _Parked(msgspec.Struct):
    """The node agent's log line of an instance parked: its id and when it was logged."""

    instance: str
    timestamp: datetime


class _Decided(msgspec.Struct):
    """A ``scale decided`` line of the horizontal scaler: when, why and how many instances."""

    timestamp: datetime
    reason: str = ""
    count: int = 0


class _Logged(msgspec.Struct):
    """Any service's log line, by its time."""

    timestamp: datetime


class _Policy(msgspec.Struct):
    """The scheduler's ``placement policy`` line, logged as its defragmentation loop starts: its
    rounds come every ``defrag_interval_s`` (s, or "off") after it."""

    timestamp: datetime
    defrag_interval_s: float | str = "off"


class Starts(NamedTuple):
    """The process starts (ms) read from node agents' logs: ``initial``, (launch order k, ms from
    the first launch until its process was up) of the deploy's launches (each function's first
    instance); ``later``, (other instances starting on the node at its launch, process start) of
    each instance launched once the initial ones were all ready."""

    initial: list[tuple[int, float]]
    later: list[tuple[int, float]]


def _log_events(log: Path, events: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    """(line number, decoded line) of each JSON line of a service's log ``log`` (the node
    agent's, the horizontal scaler's, ...) whose ``event`` is one of ``events``; a last line cut
    short (no newline after it: the service was killed while writing it) is left out. Raises
    OSError, or ValueError naming the log (and line) when it is not UTF-8 text or another line
    is not JSON."""
    try:
        text = files.read_bounded(log, LOG_MAX_BYTES).decode()
    except UnicodeDecodeError:
        raise ValueError(f"{log}: not text (not UTF-8): not a service's log of a run") from None
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.startswith("{"):
            continue
        try:
            e = msgspec.json.decode(line)
        except msgspec.DecodeError:
            if n == len(lines) and not text.endswith("\n"):
                return  # cut short by a kill: what came before is whole
            raise ValueError(f"{log}:{n}: not a JSON log line") from None
        if isinstance(e, dict) and e.get("event") in events:
            yield n, e


def process_starts_ms(log: Path, model_of: dict[str, str]) -> Starts:
    """The process starts of the instances a live run launched, from the node agent's JSON log
    (module docstring): the initial ones, and those launched once the initial ones were up with
    the other instances starting on the node at their launch (empty when it launched none then).
    ``model_of``: function name -> model. Raises OSError, or ValueError naming the log (and line)
    when it is not UTF-8 text, a line is not JSON, a ready line is malformed or no instance became
    ready in it."""
    ready: list[_Ready] = []
    for n, e in _log_events(log, ("instance ready",)):
        if "cold_start_ms" in e:
            try:
                ready.append(msgspec.convert(e, _Ready))
            except msgspec.ValidationError as exc:
                raise ValueError(f"{log}:{n}: not an 'instance ready' line of the node agent: {exc}") from None
    if not ready:
        raise ValueError(f"{log}: no instance became ready in it: not the node agent's log of a run (at DILU_LOG_LEVEL info or debug)")
    spans = [(r.timestamp.timestamp() * 1000.0 - r.cold_start_ms, r.timestamp.timestamp() * 1000.0)
             for r in ready]  # (launched, ready) in ms since the epoch
    first: dict[str, int] = {}
    for k, r in enumerate(ready):
        first.setdefault(_function(r.instance), k)
    last_initial = max(first.values(), default=-1)
    initial, later = [], []
    for k, r in enumerate(ready):
        fn = _function(r.instance)
        if fn not in model_of:
            continue
        start = max(0.0, r.cold_start_ms - models.cold_start_ms(model_of[fn]))
        if first[fn] == k:
            initial.append((spans[k][0], start))
        elif k > last_initial:
            at = spans[k][0]
            later.append((sum(1 for j, (a, b) in enumerate(spans) if j != k and a <= at < b), start))
    initial.sort()
    deploy = initial[0][0] if initial else 0.0
    return Starts([(k, at - deploy + start) for k, (at, start) in enumerate(initial)], later)


def _lines_of(log: Path, events: tuple[str, ...], struct: type = _Logged) -> list:
    """The lines of ``events`` in ``log`` as ``struct``; raises as :func:`_log_events`, or
    ValueError naming the line when one lacks a field."""
    out = []
    for n, e in _log_events(log, events):
        try:
            out.append(msgspec.convert(e, struct))
        except msgspec.ValidationError as exc:
            raise ValueError(f"{log}:{n}: not a '{e.get('event')}' line of a Dilu service: {exc}") from None
    return out


def tick_gaps(log_dir: Path, nominal_ms: float) -> tuple[float, int]:
    """(sum of the gaps in ms, sum of their whole numbers of ticks) between the horizontal
    scaler's successive ticks that decided something in the run of ``log_dir`` (decisions of one
    tick are logged within a few ms: the first line stands for the tick; a resume decided when a
    request came, :data:`WAKE_REASON`, is off the tick and left out), over gaps of 1 to
    :data:`TICK_GAPS_MAX` ticks of ``nominal_ms``; (0, 0) without the scaler's log. Raises as
    :func:`_log_events`."""
    log = log_dir / HORIZONTAL_LOG
    if not log.exists():
        return 0.0, 0
    ticks: list[float] = []
    for d in sorted(x.timestamp.timestamp() * 1000.0 for x in _lines_of(log, ("scale decided",), _Decided)
                    if x.reason != WAKE_REASON):
        if not ticks or d - ticks[-1] > nominal_ms / 2:
            ticks.append(d)
    total, count = 0.0, 0
    for a, b in zip(ticks, ticks[1:]):
        k = round((b - a) / nominal_ms)
        if 1 <= k <= TICK_GAPS_MAX:
            total, count = total + b - a, count + k
    return total, count


def loop_timing(log_dir: Path, lines: list[requestlog.RequestLine], nominal_ms: float) -> LoopTiming | None:
    """The run's :class:`~.overheads.LoopTiming` (module docstring): from the tick whose
    ``scale decided`` lines gave the deploy's initial scale (the first such line, and those
    within half a tick of ``nominal_ms`` after it, whose counts are the deploy's launches), the
    first request of ``lines`` and the defragmentation round nearest to it. None without the
    scaler's log, an initial scale or a request. Raises as :func:`_log_events`."""
    log = log_dir / HORIZONTAL_LOG
    sent = [r.scheduled_ns for r in lines if r.scheduled_ns]
    if not log.exists() or not sent:
        return None
    initial = sorted((x.timestamp.timestamp() * 1000.0, x.count) for x in _lines_of(log, ("scale decided",), _Decided)
                     if INITIAL_SCALE_REASON in x.reason)
    if not initial:
        return None
    deploy = initial[0][0]
    launches = sum(n for at, n in initial if at - deploy < nominal_ms / 2)
    first = min(sent) / 1e6 - deploy
    rounds: list[float] = []
    slog = log_dir / SCHEDULER_LOG
    if slog.exists():
        rounds = [x.timestamp.timestamp() * 1000.0 - deploy
                  for x in _lines_of(slog, ("defragmentation planned", "defragmented"))]
        if not rounds:  # at info level a round is logged only when it moves something: count from the start
            for p in _lines_of(slog, ("placement policy",), _Policy):
                if isinstance(p.defrag_interval_s, (int, float)) and p.defrag_interval_s > 0:
                    every = p.defrag_interval_s * 1000.0
                    start = p.timestamp.timestamp() * 1000.0 - deploy
                    rounds = [start + every * max(1, round((first - start) / every))]
    defrag = min(rounds, key=lambda r: abs(r - first)) if rounds else None
    if launches < 1 or first < 0:
        return None
    return LoopTiming(launches, round(first, 3), None if defrag is None else round(defrag, 3))


def initial_by_order(initial: list[tuple[int, float]]) -> list[float]:
    """The median (ms) of each launch order k of the deploy's launches, k = 0 up to the largest
    (``initial``: :attr:`Starts.initial`'s pairs, pooled over runs); made non-decreasing (a later
    launch is up no sooner: the medians of neighbouring orders cross by chance). Empty when
    ``initial`` is."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for k, ms in initial:
        by_k[k].append(ms)
    table = [statistics.median(by_k[k]) for k in sorted(by_k)]
    return [max(table[:i + 1]) for i in range(len(table))]


def parked_ns(log: Path) -> dict[str, list[int]]:
    """Instance id -> when it was parked (Unix ns, ascending), from the node agent's log
    (``instance parked``). Raises as :func:`process_starts_ms`."""
    out: dict[str, list[int]] = defaultdict(list)
    for n, e in _log_events(log, ("instance parked",)):
        try:
            p = msgspec.convert(e, _Parked)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{log}:{n}: not an 'instance parked' line of the node agent: {exc}") from None
        out[p.instance].append(int(p.timestamp.timestamp() * 1e9))
    return {k: sorted(v) for k, v in out.items()}


def starts_by_starting(starts: list[tuple[int, float]], min_starts: int = MIN_STARTS) -> list[float]:
    """The median process start (ms) by the number k of other instances starting on the node:
    entry k for k of them while k holds ``min_starts`` launches and so do those above it; then one
    entry pools k and above (or, too few for that, joins the entry before). ``starts``: (k, ms)
    pairs of :func:`process_starts_ms`. Empty for fewer than ``min_starts`` launches."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for k, ms in starts:
        by_k[k].append(ms)

    def from_k(k: int) -> list[float]:
        return [ms for j, v in by_k.items() if j >= k for ms in v]

    table: list[float] = []
    for k in range(max(by_k, default=-1) + 1):
        if len(by_k[k]) >= min_starts and len(from_k(k + 1)) >= min_starts:
            table.append(statistics.median(by_k[k]))
        elif len(from_k(k)) >= min_starts:
            table.append(statistics.median(from_k(k)))
            break
        else:
            if table:
                table[-1] = statistics.median(from_k(k - 1))
            break
    return table


def _function(instance: str) -> str:
    """An instance id's function (``<function>-<10 hex>``, as the scheduler names instances)."""
    return instance.rsplit("-", 1)[0]


def transport_ms(lines: list[requestlog.RequestLine]) -> list[float]:
    """Way in + way back (ms) of each answered request whose reply carried its timings."""
    return [((r.enqueued_ns - r.scheduled_ns) + (r.done_ns - r.replied_ns)) / 1e6
            for r in lines if r.status == "ok" and r.enqueued_ns and r.replied_ns]


def _batches(lines: list[requestlog.RequestLine]) -> dict[str, dict[int, list[int]]]:
    """instance -> batch start (ns) -> [its last reply, its first request's storage] (ns), over
    the answered requests with their timings (a batch: those of one (instance, start) pair)."""
    batches: dict[str, dict[int, list[int]]] = defaultdict(dict)
    for r in lines:
        if r.status != "ok" or not (r.started_ns and r.replied_ns and r.enqueued_ns and r.batch):
            continue
        b = batches[r.instance].setdefault(r.started_ns, [r.replied_ns, r.enqueued_ns])
        b[0], b[1] = max(b[0], r.replied_ns), min(b[1], r.enqueued_ns)
    return batches


def pickups_ms(lines: list[requestlog.RequestLine]) -> list[float]:
    """The pickups (ms) of the live run's instances (module docstring): for each instance's
    consecutive batches, the next one's start less the last reply of the one before, where the
    next one's first request was stored before that reply."""
    out: list[float] = []
    for starts in _batches(lines).values():
        ordered = sorted(starts.items())
        for (_, (replied, _)), (start, (_, stored)) in zip(ordered, ordered[1:]):
            if stored < replied:
                out.append((start - replied) / 1e6)
    return out


def dispatches_ms(lines: list[requestlog.RequestLine], parked: dict[str, list[int]]) -> list[float]:
    """The dispatches (ms) of the live run's instances (module docstring): for each instance's
    consecutive batches, the next one's start less its first request's storage, where that
    request was stored at or after the last reply of the batch before and the instance was not
    parked in between (``parked``: :func:`parked_ns`)."""
    out: list[float] = []
    for instance, starts in _batches(lines).items():
        parks = parked.get(instance, ())
        ordered = sorted(starts.items())
        for (_, (replied, _)), (start, (_, stored)) in zip(ordered, ordered[1:]):
            if stored >= replied:
                k = bisect.bisect_left(parks, replied)
                if k == len(parks) or parks[k] > start:
                    out.append((start - stored) / 1e6)
    return out


def live_services(lines: list[requestlog.RequestLine]) -> dict[tuple[str, int], list[float]]:
    """(function, batch size) -> the live service (ms) of each of its batches: from the handler's
    call to the batch's first reply."""
    first: dict[tuple[str, int], int] = {}
    size: dict[tuple[str, int], tuple[str, int]] = {}
    for r in lines:
        if r.status != "ok" or not (r.started_ns and r.replied_ns and r.batch):
            continue
        key = (r.instance, r.started_ns)
        if key not in first or r.replied_ns < first[key]:
            first[key] = r.replied_ns
            size[key] = (r.function, r.batch)
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for key, replied in first.items():
        out[size[key]].append((replied - key[1]) / 1e6)
    return dict(out)


def sim_config(run: report.RunInfo, training_jobs: int, **settings):
    """The :class:`SimConfig` that replays the live run described by ``run`` (a report's ``run``
    section; ``training_jobs`` beside it, its ``training`` list's length): its trace, span, seed,
    speed-up and GPUs, with ``settings`` (process start, overheads, ...) on top. Raises
    ValueError for a run the simulator cannot replay (an llm trace beside it, a CPU node)."""
    from .run import SimConfig

    if run.llm:
        raise ValueError("the run replayed the LLM trace beside the functions (--llm-share), "
                         "which the simulator does not: calibrate from runs without it")
    if run.gpus < 1:
        raise ValueError("the run had no emulated GPU (--gpus cpu): nothing to calibrate")
    return SimConfig(trace_dir=_trace_dir(run.trace), functions=run.functions,
                     hours=run.duration_s * run.speedup / 3600.0, gpus_per_node=run.gpus, seed=run.seed,
                     start_minute=run.start_minute, speedup=run.speedup, training_jobs=training_jobs / run.gpus,
                     **settings)


def simulated_services(run: report.RunInfo, training_jobs: int, process_start_ms: float,
                       by_starting: Sequence[float] = (),
                       initial: Sequence[float] = ()) -> dict[tuple[str, int], list[float]]:
    """(function, batch size) -> the simulated service (ms) of each batch of a simulation of the
    live run described by ``run`` (:func:`sim_config`), under its policy, with the process start
    ``process_start_ms`` or by those starting (``by_starting``) and the deploy's launches' by
    launch order (``initial``; :class:`SimConfig`). Raises ValueError for a run the simulator
    cannot replay."""
    from .run import Simulation, prepare

    cfg = sim_config(run, training_jobs, process_start_ms=process_start_ms,
                     process_start_by_starting_ms=tuple(by_starting), process_start_initial_ms=tuple(initial),
                     keep_records=False)
    sim = Simulation(cfg, run.policy, prepare(cfg))
    sim.batch_log = []
    sim.run()
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for fn, size, ms in sim.batch_log:
        out[(fn, size)].append(ms)
    return dict(out)


def _trace_dir(recorded: str) -> str:
    """The replayed trace's directory: as the report recorded it (an absolute path), or this
    checkout's copy of the bundled sample when the run used that sample from a checkout that is
    gone, so logs moved off their machine still calibrate."""
    from dilu.loadgen.trace import default_trace_dir

    bundled = default_trace_dir()
    if recorded and not Path(recorded).exists() and Path(recorded).name == bundled.name:
        return str(bundled)
    return recorded


def batch_overheads_ms(live: dict, simulated: dict, min_batches: int = MIN_BATCHES) -> list[float]:
    """Live service less simulated service, quantile by quantile, for each (function, batch size)
    with at least ``min_batches`` batches in both (module docstring); one value per live batch."""
    out: list[float] = []
    for key, services in live.items():
        sims = simulated.get(key, ())
        if len(services) < min_batches or len(sims) < min_batches:
            continue
        ranked = np.sort(np.asarray(services))
        at = (np.arange(len(ranked)) + 0.5) / len(ranked) * 100.0
        out.extend((ranked - np.percentile(np.asarray(sims), at)).tolist())
    return out


def read_runs(log_dirs: list[Path]) -> list[tuple[Path, report.Report, list[requestlog.RequestLine]]]:
    """Each log directory's report and request log, refusing a directory given twice, a copy of
    one given (the same requests) or one that is not a policy's log directory of a run. Raises
    OSError, ValueError naming what is wrong."""
    runs = []
    seen: set[Path] = set()
    owner: dict[tuple[str, int], Path] = {}  # each request read (its id, when it was scheduled) -> its run
    for d in log_dirs:
        if d.resolve() in seen:
            raise ValueError(f"{d} is given twice: what it holds would count twice")
        seen.add(d.resolve())
        inner = sorted(p.parent.name for p in d.glob(f"*/{requestlog.REPORT_FILENAME}"))
        if inner and not (d / requestlog.REPORT_FILENAME).exists():  # the --log-dir, not a policy's
            raise ValueError(f"{d} holds one log directory per policy: name them ("
                             + ", ".join(str(d / name) for name in inner) + ")")
        if d.is_dir() and not (d / requestlog.REPORT_FILENAME).exists():
            raise ValueError(f"{d} holds no {requestlog.REPORT_FILENAME}: not the log directory of a run "
                             f"(dilu demo or compare --log-dir DIR writes one in DIR/<policy>)")
        rep = report.read_report(d / requestlog.REPORT_FILENAME)
        if rep.run.simulated:
            raise ValueError(f"{d / requestlog.REPORT_FILENAME}: a simulated run's report: calibrate from live runs")
        lines = requestlog.read(d / requestlog.FILENAME)
        if not lines:
            raise ValueError(f"{d / requestlog.FILENAME}: holds no request")
        _check_belongs(d, rep, lines)
        # a copy of a run under another path (reordered or edited, too) holds its requests: ids are
        # drawn per run and times are Unix ns, so two runs never share a request
        keys = [(r.id, r.scheduled_ns) for r in lines]
        if (other := next((owner[k] for k in keys if k in owner), None)) is not None:
            raise ValueError(f"{d} holds requests of {other} (the same run): what it holds would count twice")
        if len(set(keys)) < len(keys):
            raise ValueError(f"{d / requestlog.FILENAME} holds a request twice: not a run's request log")
        owner.update(dict.fromkeys(keys, d))
        runs.append((d, rep, lines))
    return runs


def _check_belongs(d: Path, rep: report.Report, lines: list[requestlog.RequestLine]) -> None:
    """Raise ValueError unless the request log is the report's run's: one line per request it
    offered, each of one of its functions (a log cut short or another run's is refused)."""
    if len(lines) != rep.totals.offered:
        raise ValueError(f"{d / requestlog.FILENAME} holds {len(lines):,} requests where its report offered "
                         f"{rep.totals.offered:,}: not that run's whole request log")
    names = {f.name for f in rep.functions}
    if stray := next((r.function for r in lines if r.function not in names), None):
        raise ValueError(f"{d / requestlog.FILENAME} holds requests of {stray}, which its report does not "
                         f"replay: not that run's request log")


def starts_of(runs: list[tuple[Path, report.Report, list]]) -> Starts:
    """The process starts (:func:`process_starts_ms`) of every run's node agent log (``runs``:
    :func:`read_runs`'s), pooled."""
    out = Starts([], [])
    for d, rep, _ in runs:
        got = process_starts_ms(d / NODE_AGENT_LOG, {f.name: f.model for f in rep.functions})
        out.initial.extend(got.initial)
        out.later.extend(got.later)
    return out


def own_deploy(own: Starts, pooled: Starts) -> Starts:
    """The deploy's launches of the runs calibrated (``own``: their :func:`starts_of`; every run
    has one per function), with the later launches of ``pooled`` (more runs of the node). A run's
    own deploy says when each of its initial instances was ready, and a keep-alive runs from
    there: medians pooled over other runs moved it by 140 ms on this machine, enough for a
    keep-alive to run out one tick sooner than live."""
    return Starts(own.initial or pooled.initial, pooled.later)


class StartsFromError(ValueError):
    """A directory of :func:`calibrate`'s ``starts_from`` that cannot be used or read
    (``--starts-from``)."""


def calibrate(log_dirs: list[Path], min_batches: int = MIN_BATCHES,
              starts_from: list[Path] | None = None) -> Overheads:
    """The overheads measured from the live runs' log directories (module docstring).
    ``starts_from``: the log directories whose launches after their deploy give the process
    start instead of ``log_dirs``' (they may overlap): the node's process start needs tens of
    launches, where one run's way in and back, batch overhead and deploy (:func:`own_deploy`)
    are its own and say how loaded its machine was.
    Raises OSError for a file of ``log_dirs`` missing or unreadable, ValueError (OverheadsError)
    naming what cannot be used, :class:`StartsFromError` for a directory of ``starts_from`` (one
    that cannot be read too)."""
    runs = read_runs(log_dirs)
    if starts_from is None:
        return measure(runs, starts_of(runs), min_batches)
    try:
        starts = starts_of(read_runs(starts_from))
    except ValueError as exc:
        raise StartsFromError(str(exc)) from None
    except OSError as exc:  # said of --starts-from, not of the LOG_DIRS read before
        raise StartsFromError(f"cannot read {exc.filename or ''}: {exc.strerror or exc}") from None
    return measure(runs, own_deploy(starts_of(runs), starts), min_batches, starts_from)



def measure(runs: list[tuple[Path, report.Report, list]], starts: Starts,
            min_batches: int = MIN_BATCHES, starts_from: list[Path] | None = None) -> Overheads:
    """:func:`calibrate` of runs already read (:func:`read_runs`) with the process starts
    ``starts`` (:func:`starts_of`; ``starts_from``: where they come from, for the ``source``).
    Each run's own node agent log gives its parks (:func:`parked_ns`), its horizontal scaler's and
    scheduler's logs its loop timing (:func:`tick_gaps`, :func:`loop_timing`); raises as
    :func:`calibrate`."""
    later = starts.later
    start_ms = statistics.median(ms for _, ms in later) if later else models.PROCESS_START_MS
    by_starting = starts_by_starting(later)
    initial = initial_by_order(starts.initial)
    transport: list[float] = []
    batch: list[float] = []
    pickup: list[float] = []
    dispatch: list[float] = []
    timings: list[LoopTiming] = []
    gap_ms, gap_ticks = 0.0, 0
    nominal = TICK_MS
    for d, rep, lines in runs:
        g, k = tick_gaps(d, nominal)
        gap_ms, gap_ticks = gap_ms + g, gap_ticks + k
        if (timing := loop_timing(d, lines, nominal)) is not None:
            timings.append(timing)
        transport += transport_ms(lines)
        pickup += pickups_ms(lines)
        dispatch += dispatches_ms(lines, parked_ns(d / NODE_AGENT_LOG))
        simulated = simulated_services(rep.run, len(rep.training), start_ms, by_starting, initial)
        batch += batch_overheads_ms(live_services(lines), simulated, min_batches)
    if not batch:
        raise OverheadsError(f"no function served {min_batches} batches of one size in both the live runs "
                             "and their simulation: give longer or busier runs")
    source = {"runs": [str(d) for d, _, _ in runs], "transport_samples": len(transport),
              "batch_samples": len(batch), "pickup_samples": len(pickup), "dispatch_samples": len(dispatch),
              "process_start_samples": len(later), "initial_process_start_samples": len(starts.initial),
              "horizontal_ticks": gap_ticks}
    if starts_from is not None:
        source["process_starts_from"] = [str(d) for d in starts_from]
    tick = gap_ms / gap_ticks if gap_ticks >= TICKS_MIN else None
    return Overheads.from_samples(transport, batch, start_ms if later else None, source, by_starting, pickup,
                                  dispatch, initial, tick, timings)
