"""Profiling searches: pure state machines (no I/O, no clock). DESIGN.md section 4.6.

A search proposes one trial at a time and is told what the trial measured::

    s = InferenceSearch(grid_batches=[1, 2, 4], grid_quotas=[0.1, 0.2, ..., 1.0], slo_ms=50)
    while (t := s.next_trial()) is not None:
        s.record(t, Measurement(latency_ms=..., throughput_rps=...))
    s.result()  # -> ProfileResult

The backend that runs a trial (recorded surface, emulated GPU through the node agent, a real GPU)
is the caller's business; the search only sees :class:`Measurement`.

Quota grids: a flat list of fractions (one axis, the SM share), or a list of axes whose product is
the quota, e.g. ``[[0.05, ..., 1.0], [0.1, ..., 1.0]]`` for SM share × time-quota share on the
V100 tables (the share of the GPU's SM-time that setting grants). The first axis is always the
spatial (SM) share.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from dilu.contracts.events import FunctionSpec, Profile
from dilu.services.common import models

Setting = tuple[float, ...]
Index = tuple[int, ...]  # (quota axis indices..., batch index)


class NoFeasibleSetting(ValueError):
    """No measured setting met the objective (inference: the SLO)."""


class SearchProtocolError(RuntimeError):
    """``record`` was called with a trial the search did not propose (or twice)."""


@dataclass(frozen=True)
class Trial:
    """One measurement to make: run batches of ``batch`` at quota setting ``setting``.

    ``quota`` (property) is the product of the setting's fractions: the share of the GPU's SM-time,
    and the SM width the trial runs at. ``grant`` (fraction 0..1 of the GPU), when given, paces the
    trial by tokens to that rate below its width: an instance as deployed (width = its limit,
    grant = its request). None: grant = width, no pacing (the surfaces' own setting).
    """

    setting: Setting
    batch: int
    grant: float | None = None

    @property
    def quota(self) -> float:
        return round(math.prod(self.setting), 6)

    @property
    def rate(self) -> float:
        """The token rate the trial runs at (fraction of the GPU): ``grant``, else ``quota``."""
        return self.quota if self.grant is None else self.grant


@dataclass(frozen=True)
class Measurement:
    """What a trial measured: ``latency_ms`` of one batch (p99 after warm-up when measured live;
    this is also each request's latency), ``throughput_rps`` in requests per second."""

    latency_ms: float
    throughput_rps: float


@dataclass(frozen=True)
class ProfileResult:
    """The outcome of a search.

    ``request_quota``/``request_setting``: the chosen guaranteed share, with ``batch_size``;
    ``limit_quota``/``limit_setting``: the share at which ``burst_batch`` (the largest batch meeting
    the SLO) runs, and ``limit_latency_ms``/``limit_throughput_rps`` what it measured there (0 when
    not measured: a bare sub-search); ``te``: throughput per quota at the request setting (requests/s per unit of
    GPU); ``trials``: distinct settings the search measured.
    """

    kind: str
    request_quota: float
    request_setting: Setting
    batch_size: int
    limit_quota: float
    limit_setting: Setting
    burst_batch: int
    te: float
    throughput_rps: float
    latency_ms: float
    trials: int
    limit_latency_ms: float = 0.0
    limit_throughput_rps: float = 0.0

    def to_profile(self, function: str, backend: str) -> Profile:
        """As the contracts' Profile event payload."""
        return Profile(
            function=function,
            request_quota=self.request_quota,
            limit_quota=self.limit_quota,
            batch_size=self.batch_size,
            burst_batch=self.burst_batch,
            te=self.te,
            throughput_rps=self.throughput_rps,
            latency_ms=self.latency_ms,
            trials=self.trials,
            backend=backend,
            limit_latency_ms=self.limit_latency_ms,
            limit_throughput_rps=self.limit_throughput_rps,
        )


def _axes(grid_quotas: Sequence[float] | Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """Normalise a quota grid to sorted, de-duplicated axes; raises ValueError when empty or out of (0, 1]."""
    if not grid_quotas:
        raise ValueError("empty quota grid")
    raw = [grid_quotas] if isinstance(grid_quotas[0], (int, float)) else list(grid_quotas)
    axes = []
    for axis in raw:
        vals = tuple(sorted({round(float(v), 4) for v in axis}))  # type: ignore[union-attr]
        if not vals or vals[0] <= 0 or vals[-1] > 1:
            raise ValueError(f"quota axis must hold fractions in (0, 1], got {axis}")
        axes.append(vals)
    return tuple(axes)


class _Machine:
    """Shared bookkeeping: one pending trial at a time, a cache of what was measured."""

    def __init__(self) -> None:
        self._pending: Trial | None = None
        self._measured: dict[Trial, Measurement] = {}

    @property
    def trials(self) -> int:
        """Distinct trials measured so far."""
        return len(self._measured)

    def _propose(self, trial: Trial | None) -> Trial | None:
        self._pending = trial
        return trial

    def record(self, trial: Trial, m: Measurement) -> None:
        """Tell the search what ``trial`` measured. Raises SearchProtocolError for a trial it did
        not propose, ValueError for a non-finite or negative measurement."""
        if trial != self._pending:
            raise SearchProtocolError(f"recorded {trial}, but the pending trial is {self._pending}")
        if not (math.isfinite(m.latency_ms) and math.isfinite(m.throughput_rps)) or min(
            m.latency_ms, m.throughput_rps
        ) < 0:
            raise ValueError(f"bad measurement {m}")
        self._measured[trial] = m
        self._pending = None
        self._learn(trial, m)

    def _learn(self, trial: Trial, m: Measurement) -> None:
        """Hook for subclasses that update their state as each measurement arrives."""


class NoThroughput(ValueError):
    """A training profile without throughput: the full GPU measured 0 requests/s (or nothing)."""


class TrainingSearch(_Machine):
    """Minimum-quota search for a training function (DESIGN.md section 4.6).

    Request quota: the smallest grid quota whose throughput ≥ ``threshold`` (default 0.98) × the
    throughput on the full GPU (the largest grid quota, measured first). Limit quota: the smallest
    grid quota at or above the request whose throughput ≥ ``limit_threshold`` (default 1.0) × full,
    i.e. where extra quota stops buying throughput; the vertical scaler lets training burst up to it
    only into idle capacity.

    Guarantee, on any throughput curve (non-monotone, noisy): after the full GPU, quotas are
    measured in ascending order until one meets the threshold, so the request quota is exactly
    ``min{q in grid : thr(q) ≥ threshold · thr(full)}`` over the measured values and every smaller
    grid quota was measured and missed it; the limit likewise continues upwards from the request.
    Each grid quota is measured at most once: at most ``len(grid)`` trials. (A binary search
    needs ⌈log2 n⌉ but, on a curve with a dip, ends above the true minimum.)

    A full-GPU throughput of 0 ends the search: :meth:`result` raises :class:`NoThroughput`.
    """

    def __init__(
        self, grid_quotas: Sequence[float], batch: int = 1, threshold: float = 0.98, limit_threshold: float = 1.0
    ) -> None:
        super().__init__()
        axes = _axes(grid_quotas)
        if len(axes) != 1:
            raise ValueError("TrainingSearch takes one quota axis (a flat list of fractions)")
        self.quotas = axes[0]
        if not 0 < threshold <= limit_threshold <= 1:
            raise ValueError(f"need 0 < threshold ≤ limit_threshold ≤ 1, got {threshold}, {limit_threshold}")
        self.batch = batch
        self.thresholds = (threshold, limit_threshold)
        self._found: list[int] = []  # request index, then limit index
        self._next = 0  # the next grid index to look at (ascending scan)

    def _trial(self, i: int) -> Trial:
        return Trial((self.quotas[i],), self.batch)

    def _thr(self, i: int) -> float:
        return self._measured[self._trial(i)].throughput_rps

    def _full_thr(self) -> float | None:
        full = self._trial(len(self.quotas) - 1)
        return self._measured[full].throughput_rps if full in self._measured else None

    def next_trial(self) -> Trial | None:
        """The next quota to measure, or None when done. Measured points are never proposed twice."""
        if self._pending is not None:
            return self._pending
        full = self._full_thr()
        if full is None:
            return self._propose(self._trial(len(self.quotas) - 1))
        if full <= 0:
            return self._propose(None)
        while len(self._found) < 2:
            i = self._next
            if self._trial(i) not in self._measured:
                return self._propose(self._trial(i))
            # the full GPU meets any threshold ≤ 1, so the scan always ends within the grid
            if self._thr(i) >= self.thresholds[len(self._found)] * full:
                self._found.append(i)  # the limit scan starts at the request itself
            else:
                self._next = i + 1
        return self._propose(None)

    def result(self) -> ProfileResult:
        """Raises NoThroughput when the full GPU measured no throughput, RuntimeError before the
        search finished."""
        full = self._full_thr()
        if full is not None and full <= 0:
            raise NoThroughput(f"training at batch {self.batch} measured no throughput on the full GPU: "
                               "nothing to size a quota by")
        if len(self._found) < 2:
            raise RuntimeError("training search not finished")
        req, lim = self._found
        rq, lq = self.quotas[req], self.quotas[lim]
        m = self._measured[self._trial(req)]
        return ProfileResult(
            kind="training", request_quota=rq, request_setting=(rq,), batch_size=self.batch,
            limit_quota=lq, limit_setting=(lq,), burst_batch=self.batch, te=m.throughput_rps / rq,
            throughput_rps=m.throughput_rps, latency_ms=m.latency_ms, trials=self.trials,
        )


class KneeSearch(_Machine):
    """Binary search along the SM axis for the limit knee of an inference function: the smallest
    SM share at which ``batch`` reaches ``knee`` × its full-GPU throughput (other quota axes at
    full). Assumes throughput grows with SM share (the inference model of :class:`InferenceSearch`);
    ⌈log2 n⌉ + 1 trials at most. ``result()`` is the knee's setting."""

    def __init__(self, axes: tuple[tuple[float, ...], ...], batch: int, knee: float) -> None:
        super().__init__()
        if not 0 < knee <= 1:
            raise ValueError(f"knee must be in (0, 1], got {knee}")
        self.axes, self.batch, self.knee = axes, max(1, batch), knee
        self._lo, self._hi = -1, len(axes[0]) - 1

    def _trial(self, i: int) -> Trial:
        return Trial((self.axes[0][i],) + tuple(a[-1] for a in self.axes[1:]), self.batch)

    def next_trial(self) -> Trial | None:
        """The next setting to measure, or None when done."""
        if self._pending is not None:
            return self._pending
        full = self._trial(len(self.axes[0]) - 1)
        if full not in self._measured:
            return self._propose(full)
        while self._hi - self._lo > 1:
            mid = (self._lo + self._hi) // 2
            t = self._trial(mid)
            if t not in self._measured:
                return self._propose(t)
            ok = self._measured[t].throughput_rps >= self.knee * self._measured[full].throughput_rps
            self._lo, self._hi = (self._lo, mid) if ok else (mid, self._hi)
        return self._propose(None)

    def result(self) -> Setting:
        """The knee's setting. Raises RuntimeError before the search finished."""
        if self._pending is not None or self._hi - self._lo > 1 or self.trials == 0:
            raise RuntimeError("knee search not finished")
        return self._trial(self._hi).setting


class InferenceSearch(_Machine):
    """Guided growth over quota × batch for an inference function (DESIGN.md section 4.6).

    Efficacy TE = throughput / quota (requests/s per unit of GPU); only settings whose latency
    (p99) ≤ ``slo_ms`` are accepted.

    Phase 1, best-first growth. It starts at the smallest quota with batch 1 and always measures
    the unmeasured grid neighbour (±1 step on one axis) of the measured point with the highest TE.
    A point that meets the SLO opens all its neighbours; one that misses it opens only those that
    lower latency (more quota, smaller batch). The search stops when no open neighbour has a parent
    within ``stop_threshold`` (relative, default 0.15) of the best SLO-meeting TE so far. Because
    every point within that margin is still expanded, a noisy dip smaller than the margin does not
    stop the growth (it does not stop at the first dip). If nothing met the SLO it also tries the
    full GPU at batch 1 before giving up.

    Phase 2, burst batch and limit quota. The burst batch is the largest batch meeting the SLO on
    the full GPU (binary search over batches, latency assumed to grow with batch); the limit quota
    is the smallest setting along the SM axis (other axes at full) at which the burst batch meets
    the SLO (binary search, latency assumed to fall with quota). The limit is never below the request.

    ``max_trials`` (optional) caps phase 1; phase 2 adds at most ⌈log2(batches + 1)⌉ +
    ⌈log2(SM steps)⌉ trials, fewer when earlier measurements already imply the answer under the
    monotone model (more quota or a smaller batch never raises latency). ``budget_of_slo``
    (fraction 0..1, default 1) says what part of the function's SLO ``slo_ms`` is, so that an
    error names both (ProfileSearch passes its queueing budget).

    Raises NoFeasibleSetting from :meth:`result` when no measured setting met the SLO.
    """

    def __init__(
        self,
        grid_batches: Sequence[int],
        grid_quotas: Sequence[float] | Sequence[Sequence[float]],
        slo_ms: float,
        *,
        stop_threshold: float = 0.15,
        max_trials: int | None = None,
        budget_of_slo: float = 1.0,
    ) -> None:
        super().__init__()
        if not grid_batches or min(grid_batches) < 1:
            raise ValueError(f"batches must be positive integers, got {grid_batches}")
        if not slo_ms > 0:
            raise ValueError(f"slo_ms must be > 0, got {slo_ms}")
        if not 0 <= stop_threshold < 1:
            raise ValueError(f"stop_threshold must be in [0, 1), got {stop_threshold}")
        self.axes = _axes(grid_quotas)
        self.batches = tuple(sorted({int(b) for b in grid_batches}))
        self.slo_ms = float(slo_ms)
        self.budget_of_slo = budget_of_slo  # slo_ms is this part of the function's SLO (messages only)
        self.stop_threshold = stop_threshold
        self.max_trials = max_trials
        self._dims = tuple(len(a) for a in self.axes) + (len(self.batches),)
        self._by_index: dict[Index, Measurement] = {}
        self._heap: list[tuple[float, int, Index]] = []
        self._seq = itertools.count()
        self._best: tuple[float, Index] | None = None
        self._phase = "grow"
        self._tried_full = False
        self._burst: int | None = None  # batch index
        self._bounds: tuple[int, int] = (-1, -1)
        self._limit: int | None = None  # SM-axis index
        self._push((0,) * len(self._dims), math.inf)

    # ------------------------------------------------------------------ grid helpers

    def _trial(self, idx: Index) -> Trial:
        setting = tuple(axis[i] for axis, i in zip(self.axes, idx[:-1]))
        return Trial(setting, self.batches[idx[-1]])

    def _full(self, b: int) -> Index:
        return tuple(d - 1 for d in self._dims[:-1]) + (b,)

    def _path(self, i: int, b: int) -> Index:
        """Point ``i`` of the limit path: SM axis at ``i``, every other quota axis at full."""
        return (i,) + tuple(d - 1 for d in self._dims[1:-1]) + (b,)

    def _ok(self, idx: Index) -> bool:
        return self._by_index[idx].latency_ms <= self.slo_ms

    def _known(self, idx: Index) -> bool | None:
        """Whether ``idx`` meets the SLO: measured, or implied by a measured point under the
        monotone model (more quota or a smaller batch never raises latency); None if unknown."""
        if idx in self._by_index:
            return self._ok(idx)
        for other, m in self._by_index.items():
            ok = m.latency_ms <= self.slo_ms
            le = all(a <= b for a, b in zip(other[:-1], idx[:-1])) and other[-1] >= idx[-1]
            ge = all(a >= b for a, b in zip(other[:-1], idx[:-1])) and other[-1] <= idx[-1]
            if (ok and le) or (not ok and ge):
                return ok
        return None

    def _te(self, idx: Index) -> float:
        return self._by_index[idx].throughput_rps / self._trial(idx).quota

    def _push(self, idx: Index, priority: float) -> None:
        if idx not in self._by_index and all(0 <= i < d for i, d in zip(idx, self._dims)):
            heapq.heappush(self._heap, (-priority, next(self._seq), idx))

    def _learn(self, trial: Trial, m: Measurement) -> None:
        idx = self._index_of(trial)
        self._by_index[idx] = m
        te = self._te(idx)
        feasible = m.latency_ms <= self.slo_ms
        if feasible and (self._best is None or te > self._best[0]):
            self._best = (te, idx)
        if self._phase != "grow":
            return
        for axis in range(len(self._dims)):
            is_batch = axis == len(self._dims) - 1
            for step in (1, -1):
                lowers_latency = (step == -1) if is_batch else (step == 1)
                nxt = list(idx)
                nxt[axis] += step
                if feasible != lowers_latency:
                    self._push(tuple(nxt), te)
                elif feasible and not is_batch:
                    # more quota rarely buys TE (speed-up is sublinear) but can on time-sliced
                    # GPUs, where a batch that starts to fit one slice runs much faster: try it
                    # only from settings already within the stopping margin of the best
                    self._push(tuple(nxt), te * (1 - self.stop_threshold))

    def _index_of(self, trial: Trial) -> Index:
        return tuple(axis.index(round(v, 4)) for axis, v in zip(self.axes, trial.setting)) + (
            self.batches.index(trial.batch),
        )

    # ------------------------------------------------------------------ the machine

    def next_trial(self) -> Trial | None:
        """The next setting to measure, or None when the search is over."""
        if self._pending is not None:
            return self._pending
        while True:
            idx = self._next_index()
            if idx is None:
                return self._propose(None)
            if idx not in self._by_index:
                return self._propose(self._trial(idx))

    def _budget_left(self) -> bool:
        return self.max_trials is None or self.trials < self.max_trials

    def _next_index(self) -> Index | None:
        """The next index to look at; already-measured ones are consumed by the caller's loop."""
        if self._phase == "grow":
            idx = self._grow()
            if idx is not None:
                return idx
            if self._best is None:
                return None
            self._phase, self._bounds = "burst", (-1, len(self.batches))
        if self._phase == "burst":
            idx = self._burst_step()
            if idx is not None:
                return idx
            self._phase = "limit"
            n_sm = self._dims[0]
            self._bounds = (-1, n_sm - 1)
        if self._phase == "limit":
            idx = self._limit_step()
            if idx is not None:
                return idx
            self._phase = "done"
        return None

    def _grow(self) -> Index | None:
        while self._heap and self._budget_left():
            neg, _, idx = self._heap[0]
            if idx in self._by_index:
                heapq.heappop(self._heap)
                continue
            if self._best is not None and -neg < (1 - self.stop_threshold) * self._best[0]:
                break
            return idx
        if self._best is None and not self._tried_full and self._budget_left():
            self._tried_full = True
            full = self._full(0)
            if full not in self._by_index:
                self._push(full, math.inf)
                return full
        return None

    def _burst_step(self) -> Index | None:
        """Binary search for the largest batch index meeting the SLO on the full GPU."""
        lo, hi = self._bounds  # lo: meets (or -1), hi: misses (or len)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            idx = self._full(mid)
            ok = self._known(idx)
            if ok is None:
                return idx
            lo, hi = (mid, hi) if ok else (lo, mid)
            self._bounds = (lo, hi)
        if lo < 0:  # nothing meets the SLO on the full GPU: the best batch is the burst batch
            lo = self._best[1][-1]
        self._burst = lo
        return None

    def _limit_step(self) -> Index | None:
        """Binary search along the SM axis for the smallest share at which the burst batch fits."""
        lo, hi = self._bounds  # lo: misses (or -1), hi: meets (the full GPU, or assumed)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            idx = self._path(mid, self._burst)
            ok = self._known(idx)
            if ok is None:
                return idx
            lo, hi = (lo, mid) if ok else (mid, hi)
            self._bounds = (lo, hi)
        self._limit = hi
        return None

    def result(self) -> ProfileResult:
        """The chosen profile. Raises NoFeasibleSetting when nothing met the SLO, RuntimeError
        when called before :meth:`next_trial` returned None."""
        if self._best is None and self._phase == "grow" and self.next_trial() is None:
            target = f"the SLO of {self.slo_ms:.3g} ms"
            if self.budget_of_slo < 1:
                target = (f"a batch latency of {self.slo_ms:.3g} ms ({self.budget_of_slo:.0%} of "
                          f"the SLO of {self.slo_ms / self.budget_of_slo:.3g} ms)")
            raise NoFeasibleSetting(
                f"no setting met {target} in {self.trials} trials "
                f"(not even batch {self.batches[0]} on the full GPU)"
            )
        if self._phase != "done":
            raise RuntimeError("inference search not finished")
        te, idx = self._best
        req, m = self._trial(idx), self._by_index[idx]
        lim = self._trial(self._path(self._limit, self._burst))
        if lim.quota < req.quota:  # a limit below the request guarantees nothing more
            lim = Trial(req.setting, lim.batch)
        return ProfileResult(
            kind="inference", request_quota=req.quota, request_setting=req.setting, batch_size=req.batch,
            limit_quota=lim.quota, limit_setting=lim.setting, burst_batch=self.batches[self._burst],
            te=te, throughput_rps=m.throughput_rps, latency_ms=m.latency_ms, trials=self.trials,
        )


# --------------------------------------------------------------------------- the composed profile search

QUOTA_GRID = tuple(round(0.1 * i, 1) for i in range(1, 11))  # the A100 MPS grid: 10 % .. 100 %
BATCH_GRID = (1, 2, 4, 8, 16, 32)
# A live request waits for the batch ahead of it before its own batch runs, so a setting is
# accepted when its batch latency fits half the SLO (the usual batching budget, e.g. Clipper,
# NSDI 2017; INFless, ASPLOS 2022).
QUEUEING_BUDGET = 0.5
# The limit quota is where the burst batch gets this fraction of its full-GPU throughput: beyond
# the knee more SMs buy little, below it a burst is slowed by its own quota.
LIMIT_KNEE = 0.8


class ProfileSearch:
    """The whole profiling procedure as one ask/tell state machine (no I/O, no clock), driven
    alike by the profiler service (trials on a node), ``dilu profile`` (trials from a surface)
    and the simulator::

        s = ProfileSearch("inference", BATCH_GRID, QUOTA_GRID, slo_ms=100)
        while (t := s.next_trial()) is not None:
            s.record(t, measure(t))          # measure: the caller's backend
        s.result()  # -> ProfileResult, with what the burst batch measured at the limit

    Inference: (1) :class:`InferenceSearch` with batch latency within ``queueing_budget`` × the
    request SLO ``slo_ms``; (2) :class:`KneeSearch` for the burst batch's throughput knee
    (``knee``), the limit being the larger of the two searches' limits and never below the
    request; (3) one trial of the burst batch at the limit (what an instance scaled up to its
    limit serves: the horizontal scaler's lazy sizing), skipped when limit and burst equal request
    and batch; (4) the deployed configuration (``deployed``, one quota axis only): an instance runs
    at width = its limit, paced by tokens to its request, so the request's batch is measured at
    width = limit and grant = request; when that misses the latency bound the grant is raised to
    the next grid quota up (width still the limit) until it fits or reaches the limit, and the
    request quota (with its latency, throughput and TE) is the grant found there. ``deployed=False``
    keeps the request as measured at width = grant (the request of the A100 MPS surfaces).
    Training: :class:`TrainingSearch` at the largest batch; its limit is measured there.

    Trials proposed by a later stage that an earlier one measured are answered from memory:
    ``trials`` counts distinct (setting, batch) pairs measured. ``slo_ms`` is in ms (ignored for
    training). Raises ValueError for a bad kind or grid; :meth:`result` raises
    :class:`NoFeasibleSetting` or :class:`NoThroughput` (both ValueError) when there is no profile.
    """

    def __init__(self, kind: str, grid_batches: Sequence[int], grid_quotas: Sequence[float] | Sequence[Sequence[float]],
                 slo_ms: float = 0.0, *, queueing_budget: float = QUEUEING_BUDGET, knee: float = LIMIT_KNEE,
                 stop_threshold: float = 0.15, deployed: bool = True) -> None:
        if kind not in ("inference", "training"):
            raise ValueError(f"kind must be 'inference' or 'training', got {kind!r}")
        if not 0 < queueing_budget <= 1:
            raise ValueError(f"queueing_budget must be in (0, 1], got {queueing_budget}")
        if not grid_batches:
            raise ValueError("empty batch grid")
        self.kind, self.knee = kind, knee
        self.axes = _axes(grid_quotas)
        self._memo: dict[Trial, Measurement] = {}
        self._pending: Trial | None = None
        self._main: InferenceSearch | TrainingSearch
        if kind == "training":
            self._main = TrainingSearch(self.axes[0] if len(self.axes) == 1 else grid_quotas,
                                        batch=max(int(b) for b in grid_batches))
        else:
            self._main = InferenceSearch(grid_batches, grid_quotas, slo_ms * queueing_budget,
                                         stop_threshold=stop_threshold, budget_of_slo=queueing_budget)
        self._stage: _Machine | None = self._main
        self._knee: KneeSearch | None = None
        self._at_limit: Trial | None = None
        self._first: ProfileResult | None = None
        self._deployed = deployed and kind == "inference" and len(self.axes) == 1
        self._grants: list[float] = []  # deployed stage: grants still to try, ascending
        self._found: Trial | None = None  # deployed stage: the trial whose grant is the request
        self._done = False

    @property
    def trials(self) -> int:
        """Distinct (setting, batch) pairs measured so far."""
        return len(self._memo)

    @property
    def done(self) -> bool:
        """Whether :meth:`next_trial` has returned None (the result is known)."""
        return self._done

    def next_trial(self) -> Trial | None:
        """The next trial to measure, or None when the search is over (then call :meth:`result`)."""
        if self._pending is not None:
            return self._pending
        while not self._done:
            if self._stage is not None:
                t = self._stage.next_trial()
                if t is None:
                    self._advance()
                elif t in self._memo:
                    self._stage.record(t, self._memo[t])
                else:
                    self._pending = t
                    return t
            elif self._at_limit is not None and self._at_limit not in self._memo:
                self._pending = self._at_limit
                return self._at_limit
            elif self._grants:
                t = self._deployed_trial(self._grants[0])
                if t not in self._memo:
                    self._pending = t
                    return t
                if self._memo[t].latency_ms <= self._bound or len(self._grants) == 1:
                    self._found, self._grants = t, []  # fits, or the grant reached the limit
                else:
                    self._grants.pop(0)
            else:
                self._done = True
        return None

    @property
    def _bound(self) -> float:
        """The batch latency bound (ms) every accepted setting meets."""
        return self._main.slo_ms

    def _deployed_trial(self, grant: float) -> Trial:
        """The request's batch at width = the limit, paced to ``grant`` (unpaced at the limit)."""
        limit, _ = self._limit()
        g = round(grant, 6)
        return Trial(limit, self._first.batch_size, None if g >= round(math.prod(limit), 6) else g)

    def _advance(self) -> None:
        """The current stage ended: start the next one."""
        if self._stage is self._main:
            try:
                self._first = self._main.result()
            except ValueError:  # no profile: result() says why
                self._stage, self._done = None, True
                return
            if self.kind == "inference":
                self._knee = KneeSearch(self.axes, self._first.burst_batch or self._first.batch_size, self.knee)
                self._stage = self._knee
                return
        self._stage = None
        limit, burst = self._limit()
        first = self._first
        if (round(math.prod(limit), 6), burst) != (first.request_quota, first.batch_size) and self.kind == "inference":
            self._at_limit = Trial(limit, burst)
        lq = round(math.prod(limit), 6)
        if self._deployed and lq > first.request_quota:
            self._grants = [q for q in self.axes[0] if first.request_quota - 1e-9 <= q <= lq + 1e-9]

    def _limit(self) -> tuple[Setting, int]:
        first = self._first
        assert first is not None
        limit = first.limit_setting
        if self._knee is not None:
            k = self._knee.result()
            if math.prod(k) > math.prod(limit):
                limit = k
        if math.prod(limit) < first.request_quota:
            limit = first.request_setting
        return limit, max(first.batch_size, first.burst_batch)

    def record(self, trial: Trial, m: Measurement) -> None:
        """Tell the search what ``trial`` measured. Raises SearchProtocolError for a trial it did
        not propose, ValueError for a non-finite or negative measurement."""
        if trial != self._pending:
            raise SearchProtocolError(f"recorded {trial}, but the pending trial is {self._pending}")
        if self._stage is not None:
            self._stage.record(trial, m)  # validates the measurement
        elif not (math.isfinite(m.latency_ms) and math.isfinite(m.throughput_rps)) or min(
                m.latency_ms, m.throughput_rps) < 0:
            raise ValueError(f"bad measurement {m}")
        self._memo[trial] = m
        self._pending = None

    def result(self) -> ProfileResult:
        """The profile. Raises NoFeasibleSetting (inference: nothing met the SLO) or NoThroughput
        (training: none on the full GPU), RuntimeError before the search is over."""
        if self._first is None and self._done:
            self._main.result()  # raises why there is no profile
        if not self._done:
            raise RuntimeError("profile search not finished")
        first = self._first
        limit, burst = self._limit()
        at = self._memo.get(Trial(limit, burst)) if self._at_limit is not None else None
        if at is None:
            at = Measurement(first.latency_ms, first.throughput_rps)
        rq, rs, req = first.request_quota, first.request_setting, Measurement(first.latency_ms, first.throughput_rps)
        te = first.te
        if self._found is not None:  # the request as deployed: the grant found at width = limit
            rq = self._found.rate
            rs, req = (rq,), self._memo[self._found]
            te = req.throughput_rps / rq
        return ProfileResult(
            kind=first.kind, request_quota=rq, request_setting=rs,
            batch_size=first.batch_size, limit_quota=round(math.prod(limit), 6), limit_setting=limit,
            burst_batch=first.burst_batch, te=te, throughput_rps=req.throughput_rps,
            latency_ms=req.latency_ms, trials=self.trials, limit_latency_ms=at.latency_ms,
            limit_throughput_rps=at.throughput_rps,
        )


def cache_key(spec: FunctionSpec) -> tuple:
    """What a profile depends on: (model, kind, SLO ms to 3 decimals, max batch). Two functions
    with one key share a profile, searched once (the profiler service and ``dilu sim`` alike)."""
    return (spec.model, spec.kind, round(spec.slo_ms, 3), spec.max_batch)


def search_for(spec: FunctionSpec, stop_threshold: float = 0.15, deployed: bool = True) -> ProfileSearch:
    """The profile search for ``spec`` on the A100 grid (:data:`QUOTA_GRID`, batches of
    :data:`BATCH_GRID` up to ``spec.max_batch``); the request SLO is ``spec.slo_ms`` or, when 0,
    5 × the model's batch-1 full-GPU latency; ``deployed``: see :class:`ProfileSearch`. Raises
    KeyError for an unknown model."""
    models.model(spec.model)
    batches = [b for b in BATCH_GRID if b <= max(1, spec.max_batch)]
    slo = 0.0 if spec.kind == "training" else (spec.slo_ms or models.default_slo_ms(spec.model))
    return ProfileSearch("training" if spec.kind == "training" else "inference", batches, QUOTA_GRID, slo,
                         stop_threshold=stop_threshold, deployed=deployed)


# --------------------------------------------------------------------------- profiles without trials

# A CPU node is one slot that its instances share by quota like a GPU (scheduler/inventory.py): a
# function profiled for one gets this share, so four instances fit a node, and batches of at most
# CPU_BATCH (a CPU gains little from larger ones).
CPU_SHARE = 0.25
CPU_BATCH = 4


def given_profile(spec: FunctionSpec) -> Profile:
    """The operator's profile from the spec (``spec.profile``), for ``spec.name``: used as is, no
    trials (``backend`` ``operator``); its batch is capped at the spec's ``max_batch`` and its
    limit raised to its request. Raises ValueError when the spec gives none."""
    if spec.profile is None:
        raise ValueError(f"{spec.name}: the spec gives no profile")
    p = spec.profile
    batch = max(1, min(p.batch_size, spec.max_batch))
    burst = max(batch, min(p.burst_batch, spec.max_batch))
    return msgspec.structs.replace(p, function=spec.name, batch_size=batch, burst_batch=burst,
                                   limit_quota=max(p.limit_quota, p.request_quota), trials=0, backend="operator")


def cpu_profile(spec: FunctionSpec) -> Profile:
    """The profile of a function on a cluster whose nodes are all CPU nodes (nothing to trial
    on): :data:`CPU_SHARE` of a node as request and limit, batches up to :data:`CPU_BATCH`."""
    batch = max(1, min(CPU_BATCH, spec.max_batch))
    return Profile(function=spec.name, request_quota=CPU_SHARE, limit_quota=CPU_SHARE, batch_size=batch,
                   burst_batch=batch, backend="cpu")
