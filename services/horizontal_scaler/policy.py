"""Horizontal scaling policy: how many instances each function should have (pure).

Time is an argument (seconds on any monotonic clock); nothing here reads a clock or does I/O
(DESIGN.md section 3), so the live service and the cluster simulator drive the same object.

Per function, every tick the caller :meth:`HorizontalPolicy.record`\\ s the *backlog* (requests
pending plus in flight: the concurrency Knative measures at its queue proxy) and then asks
:meth:`HorizontalPolicy.decide`. The decision follows Knative's KPA (serving
``pkg/autoscaler/scaling/autoscaler.go``), with the corrections the field has taught:

- **Windows.** The stable window (default 60 s) and the panic window (``panic_window_pct`` of it,
  default 10 %) average the per-tick backlog samples inside them (over the part of the window seen
  so far, as Knative's bucketed average does). ``desired = ceil(average / target)``, where
  ``target`` is the in-flight requests one instance is sized for.
- **Target utilisation.** An instance with no vertical headroom is scaled at
  ``target_utilization`` (70 %, Knative's ``container-concurrency-target-percentage``) of its
  target: the rest absorbs a burst while a new instance starts. That is every instance in
  ``kpa`` and ``eager`` mode, and in ``lazy`` mode a *rigid* function's, whose capacity at its
  limit is no more than at its request (e.g. BERT-base: no latency gain from SMs, so its limit
  is its request): lazy scaling leans on vertical headroom, and such a function has none. An
  elastic function in ``lazy`` mode is scaled at its full reach-sized target, since its burst
  buffer is the headroom between request and limit (:meth:`FunctionParams.scaling_target`).
- **Panic.** When the panic estimate reaches ``panic_threshold`` (200 %) of the ready instances,
  the function panics; panic lasts a stable window after the last time the threshold was met.
  In panic the count never goes down, and it is ``max(panic, stable, highest so far)``: Knative's
  plain panic value can sit below the stable estimate (it used 20 where 34 was due). Leaving
  panic hands over to a stable window that by then covers only the high load, so the scale-up
  is not undone.
- **Rates and tolerance.** Knative's max scale-up rate (1000 x ready) and max scale-down rate
  (halving per decision); outside panic, a change smaller than ``tolerance`` (10 %, the
  Kubernetes HPA default) of current capacity is ignored, which keeps a steady load from
  flapping.
- **Lazy.** In ``lazy`` mode an instance is sized by its burst capacity (``burst_target``: the
  in-flight requests it serves within the SLO once the vertical scaler has raised it to its
  limit quota), so a burst the vertical scaler can absorb asks for no new instance. Where its
  GPUs cannot give the limit, it is sized by the share they can give: the target goes from the
  request's to the burst's by the least :func:`burst_reach` of its ready instances (0 on a GPU
  whose requests sum to 1, where the instance never rises above its request), and a scale-in
  retires the instance that can rise least first.
  A scale-out also waits while the function still has vertical headroom
  (Σ limit − Σ quota of its instances, realisable on their GPUs; see :func:`vertical_headroom`)
  of at least ``headroom_min``: the vertical scaler absorbs the burst in milliseconds. If the
  headroom has not been used after ``lazy_max_hold_s`` (default: one panic window) it is not
  realisable and the scale-out goes ahead. ``eager`` mode (static-mps, exclusive) ignores
  headroom, as :class:`KnativeKPA` (``kpa``, the horizontal-only baseline) does.
- **Victims.** Scale-in cancels starting instances first (newest first), then retires the ready
  instance with the lowest busy share (newest on ties), never one already draining: the order of
  the Kubernetes ReplicaSet controller (not-ready before ready). Retiring drains: the instance
  stops pulling and finishes its in-flight work.
- **Keep-alive, pre-warm, zero.** Idle times (backlog 0 → next request) feed an
  :class:`IdleTimeHistogram`, the hybrid histogram policy of Shahrad et al., "Serverless in the
  Wild", USENIX ATC 2020. While idle, one instance is kept for the keep-alive window; after it,
  the function scales to zero (if ``min_instances`` is 0) regardless of the stable window. When
  the histogram gives a pre-warm window, the function is unloaded once idle and one instance is
  launched again at the pre-warm time. A backlog with no instance scales from zero at once.
- **Parking** (``park_after_s`` > 0; 0, the default, never parks): a function idle that long
  while its keep-alive still holds it has its ready instances *parked* (a newly deployed
  function's, not invoked yet, once each has been ready that long too: its first requests are
  expected soon, and its idle clock started at its first instance's readiness; a pre-warmed
  instance parks as soon as it is ready, to be resumed in a copy): they give up their GPU
  share (the scheduler frees their placement) and keep their weights in host memory, so bringing
  one back costs a copy to the device, not a cold start (PipeSwitch, OSDI 2020, and Torpor swap
  models between host and GPU memory in milliseconds). A scale-out resumes parked instances
  before it places new ones; when the keep-alive runs out they are retired with the rest.
  A scale-in of a function that keeps serving parks its victims too (a ready one, not one a
  migration is taking over from; a starting one is cancelled): a function that flaps
  1 -> 2 -> 1 with its bursts gets its second instance back in a weight copy, on the GPU it
  left, instead of a cold start wherever a new one finds room. Such an instance stays parked
  a keep-alive window (from when it was parked), then goes. A
  function with ``min_instances`` keeps them on the GPU, and so does one with a ready instance
  whose code cannot move its weights (InstanceReady ``parkable``). Live, the scheduler marks the
  placement parked and the node agent has the process offload its weights (docs/operations.md,
  Parking); a resume that no longer fits the GPU the instance left is a new instance elsewhere.
- **Migration** (:meth:`HorizontalPolicy.instance_migrating`): the scheduler's defragmentation
  moves an instance by launching its replacement on a fuller GPU and draining the old one once
  the replacement is ready (make before break: the function never waits for the launch). The
  replacement is *moving* until then: not counted and never a scale-in victim (the pair is one
  instance), cancelled with the old one when that one is retired first.
- **Initial scale.** A newly deployed function (:meth:`HorizontalPolicy.deployed`) gets
  ``initial_scale`` instances at once (Knative's ``initial-scale``, default 1), so its first
  requests do not all wait for a launch. Deployment counts as the start of an idle period, from
  the first instance's readiness (Knative counts a new revision's scale-down once its initial
  scale is reached): the instances stay for the keep-alive window unless requests come, and the
  wait for the first request is not recorded as an idle time. 0 leaves a new function at zero.
- **Restored** (:meth:`HorizontalPolicy.restored`): a function read back from stored state when
  the platform restarts starts an idle period then, without initial scale: the instances it
  had stay for the keep-alive window, and one with none stays at zero until requests come.
- **Unknown backlog** (missing consumer, monitoring error): the current count is held, never
  raised to the maximum nor dropped; no sample is recorded. It is still raised to
  ``min_instances``, and, so that requests are not stranded, to one instance when there is none
  and requests are known to be stored for the function (instances create the consumer when they
  bind).
- **Burst-window breach**: load over a window above the ready capacity yields a
  :class:`Breach` (at most one per ``breach_interval_s``).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from dilu.contracts.events import FunctionSpec, Profile
from dilu.services.common import models
from dilu.services.common.functions import PRIORITY_RANK, reclaimable_share

Mode = Literal["lazy", "eager", "kpa"]
MODES: tuple[str, ...] = ("lazy", "eager", "kpa")
InstanceState = Literal["starting", "ready", "draining", "parked", "moving"]
# Knative's container-concurrency-target-percentage default (serving config-autoscaler, 70): the
# KPA scales a function so its instances run at 70 % of their target concurrency.
TARGET_UTILIZATION = 0.7
# The scaler's tick (ms): every function's backlog sampled and decided on (Knative's autoscaler
# ticks every 2 s; the demo replays traces 10x faster, so its windows and this tick are shorter).
TICK_MS = 500.0
# What a decision's reason says when it gives a function its initial scale (dilu calibrate finds
# the deploy's tick by it).
INITIAL_SCALE_REASON = "initial scale"
PARK_SLO_SHARE = 0.5  # the largest share of its SLO a parked instance's resume may take (FunctionParams.parkable)
IDLE_BINS = 240  # the idle-time histogram's range in bins (4 hours of 1-minute bins, Shahrad et al.)
_EPS = 1e-9


@dataclass(frozen=True)
class HorizontalConfig:
    """Knobs of :class:`HorizontalPolicy` (times in seconds; shares 0..1).

    Defaults are Knative's KPA defaults (stable window 60 s, panic window 10 %, panic threshold
    200 %, max scale-up rate 1000, max scale-down rate 2), the Kubernetes HPA tolerance (0.1), and
    the hybrid histogram policy of Shahrad et al. (1-minute bins over 4 hours, pre-warm at the
    5th percentile minus 10 %, keep-alive to the 99th percentile plus 10 %, a histogram is
    representative when it has enough samples and its bin counts have a coefficient of variation
    of at least 2; otherwise the fixed 10-minute keep-alive common at providers applies).
    Compressed-time runs shrink the windows (e.g. stable 6 s, bins 1 s).
    """

    mode: Mode = "lazy"
    initial_scale: int = 1  # Knative's initial-scale default
    stable_window_s: float = 60.0
    panic_window_pct: float = 10.0
    panic_window_s: float = 0.0  # > 0 overrides panic_window_pct
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_down_delay_s: float = 0.0  # Knative's default; > 0 damps 1 -> 2 -> 1 flapping
    tolerance: float = 0.1
    headroom_min: float = 0.05
    lazy_max_hold_s: float = 0.0  # 0: one panic window
    keep_alive_s: float = 600.0
    scale_to_zero_grace_s: float = 30.0  # Knative's scale-to-zero-grace-period (kpa mode)
    idle_grace_s: float = 1.0
    idle_bin_s: float = 60.0
    idle_range_s: float = 0.0  # 0: IDLE_BINS bins of idle_bin_s (see idle_range)
    prewarm_percentile: float = 5.0
    keepalive_percentile: float = 99.0
    histogram_margin: float = 0.10
    histogram_min_samples: int = 10
    histogram_cv_min: float = 2.0
    breach_interval_s: float = 0.0  # 0: one panic window
    park_after_s: float = 0.0  # > 0: park an idle function's instances after this long (see Parking); 0: never
    target_utilization: float = TARGET_UTILIZATION  # 0..1: see Target utilisation

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"horizontal mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.stable_window_s <= 0 or self.panic_window <= 0 or self.panic_window > self.stable_window_s:
            raise ValueError("need 0 < panic window <= stable window")
        if self.initial_scale < 0:
            raise ValueError(f"initial_scale must be >= 0, got {self.initial_scale}")
        if self.panic_threshold <= 1.0 or self.max_scale_up_rate <= 1.0 or self.max_scale_down_rate <= 1.0:
            raise ValueError("panic threshold and max scale rates must be > 1")
        if not self.scale_to_zero_grace_s >= 0:
            raise ValueError(f"scale_to_zero_grace_s must be >= 0, got {self.scale_to_zero_grace_s}")
        if not (math.isfinite(self.park_after_s) and self.park_after_s >= 0):
            raise ValueError(f"park_after_s must be finite and >= 0, got {self.park_after_s}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")

    @property
    def panic_window(self) -> float:
        """Panic window in seconds."""
        return self.panic_window_s or self.stable_window_s * self.panic_window_pct / 100.0

    @property
    def idle_range(self) -> float:
        """Range of the idle-time histogram in seconds: ``idle_range_s``, or IDLE_BINS bins."""
        return self.idle_range_s or self.idle_bin_s * IDLE_BINS

    @property
    def lazy_hold(self) -> float:
        return self.lazy_max_hold_s or self.panic_window

    @property
    def breach_interval(self) -> float:
        return self.breach_interval_s or self.panic_window


@dataclass
class FunctionParams:
    """Per-function sizing: ``target`` in-flight requests per instance (> 0, e.g. its batch size);
    instance bounds; ``instance_rps``, one instance's capacity in requests/s (0: unknown);
    ``burst_target``/``burst_rps``: the same for an instance scaled up to its limit quota, which
    ``lazy`` mode sizes by (0: as at the request); ``initial_scale``: instances at deploy (-1:
    the config's); ``keep_alive_s``: a fixed keep-alive window chosen by the function's owner
    (0: the idle-time histogram and the config's fallback decide); ``resume_ms``: time to bring a
    parked instance back (:func:`models.resume_ms`) and ``slo_ms`` its SLO, both ms (0: unknown,
    then it is never parked); ``training``: a training job, which takes no requests and runs its
    ``min_instances``."""

    target: float = 1.0
    min_instances: int = 0
    max_instances: int = 8
    instance_rps: float = 0.0
    burst_target: float = 0.0
    burst_rps: float = 0.0
    initial_scale: int = -1
    keep_alive_s: float = 0.0
    resume_ms: float = 0.0
    slo_ms: float = 0.0
    training: bool = False

    @property
    def parkable(self) -> bool:
        """Whether a resume fits this function's SLO: at most ``PARK_SLO_SHARE`` of it, so the
        request that waits for one still has the rest (a batch-1 request takes a fifth of the
        SLO on a whole GPU, ``models.DEFAULT_SLO_FACTOR``)."""
        return 0 < self.resume_ms <= PARK_SLO_SHARE * self.slo_ms

    def __post_init__(self) -> None:
        if not self.target > 0 or self.min_instances < 0 or self.max_instances < max(1, self.min_instances):
            raise ValueError(f"need target > 0 and 0 <= min_instances <= max_instances >= 1, got {self}")
        if self.burst_target < 0 or self.instance_rps < 0 or self.burst_rps < 0 or self.keep_alive_s < 0:
            raise ValueError(f"need burst_target, instance_rps, burst_rps and keep_alive_s >= 0, got {self}")

    def sizing(self, mode: str, reach: float = 1.0) -> tuple[float, float]:
        """(in-flight target, requests/s) one instance is sized for under ``mode``: its request
        capacity, and in ``lazy`` mode the part ``reach`` (0..1, :func:`burst_reach`) of the way
        from there to its burst capacity (the vertical scaler grants a pressed instance its limit
        within milliseconds, where its GPU has the share to give). Capacity is taken as linear
        in the quota between the two measured points, the request's and the limit's."""
        if mode == "lazy" and self.burst_target > 0:
            r = min(1.0, max(0.0, reach))
            burst, rps = max(self.target, self.burst_target), max(self.instance_rps, self.burst_rps)
            return self.target + r * (burst - self.target), self.instance_rps + r * (rps - self.instance_rps)
        return self.target, self.instance_rps

    def elastic(self, mode: str) -> bool:
        """Whether ``mode`` sizes this function by a burst capacity above its request's: ``lazy``
        and a profile measured at a limit where it serves more in flight within the SLO."""
        return mode == "lazy" and self.burst_target > self.target

    def scaling_target(self, mode: str, reach: float, utilization: float) -> float:
        """The in-flight requests per instance the KPA scales by (> 0): :meth:`sizing`'s target,
        times ``utilization`` (0..1, :attr:`HorizontalConfig.target_utilization`) where the
        instance has no vertical headroom to absorb a burst (not :meth:`elastic`); an elastic
        one's burst buffer is its headroom between request and limit, so it is scaled at its
        full target (see the module's Target utilisation)."""
        target = self.sizing(mode, reach)[0]
        return target if self.elastic(mode) else target * utilization


# ---------------------------------------------------------------------- idle-time histogram


@dataclass(frozen=True)
class IdleWindows:
    """``prewarm_s``: unload after use and launch again this long after the idle period began
    (0: stay loaded); ``keep_alive_s``: keep one instance this long (after the pre-warm point);
    ``representative``: whether the histogram (True) or the fixed fallback (False) gave them."""

    prewarm_s: float
    keep_alive_s: float
    representative: bool


class IdleTimeHistogram:
    """Idle-time histogram of one function (Shahrad et al., USENIX ATC 2020, section 4.2).

    Idle times (seconds) fall in bins of ``bin_s`` up to ``range_s``; longer ones are counted
    out of bounds. :meth:`windows` gives the pre-warm and keep-alive windows from its head and
    tail percentiles with a safety margin, or the fixed keep-alive when the histogram is not
    representative (too few samples, bin counts too uniform — CV below ``cv_min`` — or mostly
    out of bounds, where the paper switches to ARIMA forecasts).
    """

    def __init__(self, bin_s: float = 60.0, range_s: float = 4 * 3600.0, *, head_pct: float = 5.0,
                 tail_pct: float = 99.0, margin: float = 0.10, min_samples: int = 10, cv_min: float = 2.0) -> None:
        if bin_s <= 0 or range_s < bin_s:
            raise ValueError("need 0 < bin_s <= range_s")
        self.bin_s, self.head_pct, self.tail_pct = bin_s, head_pct, tail_pct
        self.margin, self.min_samples, self.cv_min = margin, min_samples, cv_min
        self.counts = [0] * math.ceil(range_s / bin_s)
        self.out_of_bounds = 0
        self._windows: tuple[float, IdleWindows] | None = None  # (fallback, answer) since the last add

    @property
    def samples(self) -> int:
        return sum(self.counts) + self.out_of_bounds

    def add(self, idle_s: float) -> None:
        """Record one idle time (s). Raises ValueError for a negative or non-finite one."""
        if not (math.isfinite(idle_s) and idle_s >= 0):
            raise ValueError(f"idle time must be finite and >= 0 s, got {idle_s!r}")
        b = int(idle_s // self.bin_s)
        self._windows = None
        if b < len(self.counts):
            self.counts[b] += 1
        else:
            self.out_of_bounds += 1

    def representative(self) -> bool:
        n = sum(self.counts)
        if n < self.min_samples or self.out_of_bounds > n:
            return False
        mean = n / len(self.counts)
        var = sum((c - mean) ** 2 for c in self.counts) / len(self.counts)
        return math.sqrt(var) / mean >= self.cv_min

    def _percentile_bin(self, pct: float) -> int:
        need, seen = pct / 100.0 * sum(self.counts), 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= need and seen > 0:
                return i
        return len(self.counts) - 1

    def windows(self, fallback_keep_alive_s: float) -> IdleWindows:
        """Pre-warm and keep-alive windows (s), or ``(0, fallback)`` when not representative.
        Computed once per change of the histogram (every tick reads it; few ticks add to it)."""
        cached = self._windows
        if cached is not None and cached[0] == fallback_keep_alive_s:
            return cached[1]
        answer = self._compute_windows(fallback_keep_alive_s)
        self._windows = (fallback_keep_alive_s, answer)
        return answer

    def _compute_windows(self, fallback_keep_alive_s: float) -> IdleWindows:
        if not self.representative():
            return IdleWindows(0.0, fallback_keep_alive_s, False)
        head = self._percentile_bin(self.head_pct) * self.bin_s  # lower edge of the head bin
        tail = (self._percentile_bin(self.tail_pct) + 1) * self.bin_s  # upper edge of the tail bin
        prewarm = head * (1.0 - self.margin)
        return IdleWindows(prewarm, max(self.bin_s, tail * (1.0 + self.margin) - prewarm), True)


# ---------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Breach:
    """Load over a burst window above ready capacity. ``rate_rps``: arrivals over the window;
    ``capacity_rps``: ready instances x instance_rps (0 when unknown); ``queue_depth``: backlog."""

    function: str
    window_s: float
    rate_rps: float
    capacity_rps: float
    queue_depth: int
    panic: bool


@dataclass
class Decision:
    """One function's decision at one tick.

    ``current``: instances not draining (starting + ready; parked ones are not counted);
    ``desired``: the count aimed at; ``place``: new instances to ask the scheduler for;
    ``retire``: instance ids to cancel or drain (already marked draining in the policy), parked
    ones included; ``park``: ready instances to park, ``resume``: parked instances to bring back
    before any new one is placed (both already marked in the policy: parked, starting);
    ``direction``: out, in, zero, prewarm, park, resume or "" (no change); estimates are instance
    counts from the stable and panic windows; ``reach``: the least :func:`burst_reach` (0..1) of
    the ready instances the function was sized by (1 outside ``lazy`` mode); ``target``: the
    in-flight requests per instance the estimates divide by (0 when the backlog was unknown).
    """

    function: str
    now_s: float
    current: int
    ready: int
    desired: int
    stable_estimate: int = 0
    panic_estimate: int = 0
    panic: bool = False
    place: int = 0
    retire: list[str] = field(default_factory=list)
    park: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    direction: str = ""
    reason: str = ""
    breach: Breach | None = None
    reach: float = 1.0
    target: float = 0.0


@dataclass
class _Instance:
    instance_id: str
    state: InstanceState
    since_s: float
    busy_share: float = 0.0
    before_drain: InstanceState = "ready"
    resuming: bool = False  # starting again from parked: ready within a copy of its weights
    replaces: str = ""  # moving: the instance it takes over from once ready (see Migration)
    parkable: bool = True  # its code can move its weights to host memory and back (InstanceReady)


@dataclass
class _Function:
    name: str
    params: FunctionParams
    histogram: IdleTimeHistogram
    stable: _Window = field(default_factory=lambda: _Window())  # backlog over the stable window
    panic: _Window = field(default_factory=lambda: _Window())  # backlog over the panic window
    arrivals: deque = field(default_factory=deque)  # (t, count)
    arriving: int = 0  # entries of ``arrivals`` with a count > 0 (read every tick; kept, not scanned)
    instances: dict[str, _Instance] = field(default_factory=dict)
    backlog: float | None = None
    stored: int = 0
    idle_since: float | None = None
    active_before: bool = False
    fresh: bool = False  # deployed and not invoked yet (initial scale applies)
    warmed: bool = False  # has had an instance ready since it was deployed (its keep-alive runs from then)
    restored: bool = False  # restored after a restart and not invoked since (no initial scale)
    restored_at: float | None = None  # when restored: no scale-in before a full stable window after it
    panic_since: float | None = None
    panic_last: float | None = None
    max_panic: int = 0
    hold_since: float | None = None
    last_breach: float | None = None
    last_out_s: float | None = None

    def count(self, *states: str) -> int:
        return sum(1 for i in self.instances.values() if i.state in states)


def concurrency_target(batch: int, batch_latency_ms: float, slo_ms: float) -> float:
    """Requests in flight one instance holds and still meets the SLO (the KPA target): its
    batch times the batches that run back to back within the SLO (Little's law). Without a
    latency or SLO: the batch size."""
    b = max(1, batch)
    if batch_latency_ms <= 0 or slo_ms <= 0:
        return float(b)
    return float(b * max(1, math.floor(slo_ms / batch_latency_ms)))


class _Window:
    """Backlog samples (t s, value) newer than a cut-off, with their sum kept as they come and go:
    the mean over a window is O(1) per tick instead of a pass over every sample in it (the
    simulator decides for thousands of functions per tick). Times must not decrease."""

    __slots__ = ("_q", "_sum")

    def __init__(self) -> None:
        self._q: deque = deque()
        self._sum = 0.0

    def add(self, t_s: float, value: float) -> None:
        self._q.append((t_s, value))
        self._sum += value

    def trim(self, since_s: float) -> None:
        """Drop the samples with t <= ``since_s``."""
        q = self._q
        while q and q[0][0] <= since_s:
            self._sum -= q.popleft()[1]
        if not q:
            self._sum = 0.0  # no rounding drift carried past an empty window

    def mean_since(self, since_s: float) -> float:
        """Mean of the samples with t > ``since_s`` (0 when none); older ones are dropped."""
        self.trim(since_s)
        return self._sum / len(self._q) if self._q else 0.0


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


class HorizontalPolicy:
    """Instance counts for many functions. Unknown function names raise KeyError naming them."""

    def __init__(self, config: HorizontalConfig | None = None) -> None:
        self.config = config or HorizontalConfig()
        self._fns: dict[str, _Function] = {}

    # ------------------------------------------------------------------ functions and instances

    def add_function(self, name: str, params: FunctionParams | None = None) -> None:
        """Start tracking ``name`` (or update its params, keeping its history)."""
        if not name:
            raise ValueError("empty function name")
        fn = self._fns.get(name)
        if fn is None:
            self._fns[name] = self._new_function(name, params)
        elif params is not None:
            fn.params = params

    def _new_function(self, name: str, params: FunctionParams | None) -> _Function:
        """A function with no history: an empty idle-time histogram of the config's shape."""
        cfg = self.config
        hist = IdleTimeHistogram(cfg.idle_bin_s, cfg.idle_range, head_pct=cfg.prewarm_percentile,
                                 tail_pct=cfg.keepalive_percentile, margin=cfg.histogram_margin,
                                 min_samples=cfg.histogram_min_samples, cv_min=cfg.histogram_cv_min)
        return _Function(name, params or FunctionParams(), hist)

    def first_keep_alive_s(self) -> float:
        """How long (s) a newly deployed function that fixes no keep-alive of its own keeps its
        initial instances while no request comes: the pre-warm plus keep-alive of an empty
        idle-time history (the config's fallback ``keep_alive_s``; under :class:`KnativeKPA` the
        stable window plus the scale-to-zero grace), counted from its first instance's
        readiness. A replay waits at most this long after the deploy for the initial instances
        (:func:`cli.demo.warm_up_limit_s`), so it starts before any of them is scaled in."""
        w = self._windows(self._new_function("", None))
        return w.prewarm_s + w.keep_alive_s

    def deployed(self, name: str, now_s: float) -> None:
        """``name`` was just deployed (and can be placed): it gets the initial scale and keeps it
        through the keep-alive window unless requests come first, counted from its first
        instance's readiness (:meth:`instance_ready`; it does not run while that instance
        starts), or from now if none is placed. Has no effect on a function that has already
        seen a request. Raises KeyError for an unknown function."""
        f = self._fn(name)
        if f.active_before and not f.fresh:
            return
        f.fresh, f.active_before, f.idle_since, f.warmed = True, True, now_s, False

    def restored(self, name: str, now_s: float) -> None:
        """``name`` was restored at ``now_s`` from stored state (a restart of the platform), with
        the instances the placement table holds: its keep-alive runs from ``now_s`` (they are
        not scaled to zero at once for lack of history), it gets no initial scale (restored
        with no instance it stays at zero until requests come), and the wait for its next
        request is not recorded as an idle time; and for one stable window it is not scaled in
        (a restarted scaler has no history: its windows would read low and halve the count
        every tick). No effect on a function already deployed or invoked since. Raises KeyError
        for an unknown function."""
        f = self._fn(name)
        if f.active_before:
            return
        f.restored, f.active_before, f.idle_since, f.restored_at = True, True, now_s, now_s

    def remove_function(self, name: str) -> None:
        """Stop tracking ``name`` (undeployed); unknown names are ignored."""
        self._fns.pop(name, None)

    def functions(self) -> list[str]:
        return list(self._fns)

    def surplus_donor(self, starving: str) -> str | None:
        """The function that should give up one instance so that ``starving`` (which has none
        and found no room) gets its first: the one with the most ready instances, at least 2
        (a first instance serves requests no other instance can; a third does not). Ties: name.
        None when no function has a surplus."""
        best = sorted(((f.count("ready"), name) for name, f in self._fns.items() if name != starving),
                      key=lambda c: (-c[0], c[1]))
        return best[0][1] if best and best[0][0] >= 2 else None

    def params(self, name: str) -> FunctionParams:
        return self._fn(name).params

    def _fn(self, name: str) -> _Function:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"unknown function {name!r}") from None

    def instance_starting(self, fn: str, instance_id: str, now_s: float) -> None:
        """A placed or launched instance (cold start under way). Known instances keep their state."""
        self._fn(fn).instances.setdefault(instance_id, _Instance(instance_id, "starting", now_s))

    def instance_migrating(self, fn: str, instance_id: str, replaces: str, now_s: float) -> None:
        """``instance_id`` was placed to take over from ``replaces`` (the scheduler's
        defragmentation: relaunch on a fuller GPU, then drain the old one). Until it is ready it
        is *moving*: not counted (the pair is one instance of capacity), never a scale-in victim
        but retired with the rest at zero. When ``replaces`` is not a live instance it is an
        ordinary starting instance. Known instances that are no longer starting keep their state."""
        f = self._fn(fn)
        inst = f.instances.setdefault(instance_id, _Instance(instance_id, "starting", now_s))
        old = f.instances.get(replaces)
        if inst.state == "starting" and old is not None and old.state in ("starting", "ready"):
            inst.state, inst.replaces = "moving", replaces

    def instance_ready(self, fn: str, instance_id: str, now_s: float, parkable: bool = True) -> None:
        """The instance pulls requests. A draining one stays draining. A moving one is ready and
        the instance it replaces is counted as draining from now on (its drain is the scheduler's
        business: it marks it so on this same InstanceReady). ``parkable``: its code can move its
        weights off the GPU and back (InstanceReady says; a function with a ready instance that
        cannot is never parked)."""
        f = self._fn(fn)
        inst = f.instances.get(instance_id)
        if inst is None:
            f.instances[instance_id] = inst = _Instance(instance_id, "ready", now_s)
        inst.parkable = parkable
        if f.fresh and not f.warmed and f.idle_since is not None:
            # a new function's keep-alive runs from its first ready instance, as Knative counts
            # a new revision's scale-down once its initial scale is reached: a slow cold start
            # does not eat the keep-alive before any instance could serve
            f.idle_since, f.warmed = max(f.idle_since, now_s), True
        if inst.state in ("starting", "moving"):
            old = f.instances.get(inst.replaces) if inst.state == "moving" else None
            if old is not None and old.state in ("starting", "ready"):
                old.before_drain, old.state = old.state, "draining"
            inst.state, inst.since_s, inst.resuming, inst.replaces = "ready", now_s, False, ""
        elif inst.state != "ready":
            inst.before_drain = "ready"

    def instance_parked(self, fn: str, instance_id: str, now_s: float) -> None:
        """``instance_id`` is parked (restored from the placement table's ``parked`` flag): not
        counted, resumed by the next scale-out, retired at zero. Known instances keep their state."""
        self._fn(fn).instances.setdefault(instance_id, _Instance(instance_id, "parked", now_s))

    def instance_retired(self, fn: str, instance_id: str) -> None:
        """The instance is gone (drained, cancelled or crashed). Unknown ids are ignored. An
        instance moving in to replace it starts as an ordinary one."""
        f = self._fn(fn)
        f.instances.pop(instance_id, None)
        for inst in f.instances.values():
            if inst.state == "moving" and inst.replaces == instance_id:
                inst.state, inst.replaces = "starting", ""

    def retire_failed(self, fn: str, instance_id: str) -> None:
        """The scheduler refused to retire ``instance_id``: count it as it was before."""
        inst = self._fn(fn).instances.get(instance_id)
        if inst is not None and inst.state == "draining":
            inst.state = inst.before_drain

    def set_busy(self, fn: str, instance_id: str, busy_share: float) -> None:
        """Latest busy share (0..1) of an instance, used to pick scale-in victims."""
        inst = self._fn(fn).instances.get(instance_id)
        if inst is not None:
            inst.busy_share = busy_share

    def on_arrival(self, fn: str, now_s: float, backing_off: bool = False) -> list[str]:
        """A request for ``fn`` arrived at ``now_s``: when nothing of it is starting or ready and
        an instance is parked, resume one at once (returned, marked starting), as Knative's
        activator wakes a function at zero without waiting for the autoscaler's tick. Else [];
        also while ``backing_off`` (see :meth:`decide`)."""
        f = self._fn(fn)
        if backing_off or f.count("starting", "ready"):
            return []
        for inst in f.instances.values():
            if inst.state == "parked":
                inst.state, inst.since_s, inst.resuming = "starting", now_s, True
                return [inst.instance_id]
        return []

    def park_failed(self, fn: str, instance_id: str) -> None:
        """``instance_id`` could not be parked (it was serving, or the scheduler refused): count it
        as ready again."""
        inst = self._fn(fn).instances.get(instance_id)
        if inst is not None and inst.state == "parked":
            inst.state = "ready"

    def resume_failed(self, fn: str, instance_id: str) -> None:
        """The scheduler could not bring ``instance_id`` back (no room anywhere): it stays parked,
        and the next scale-out once the function's back-off is over tries again (the caller
        counts the refusal in its :class:`PlacementBackoff`, as for a refused placement)."""
        inst = self._fn(fn).instances.get(instance_id)
        if inst is not None and inst.state == "starting" and inst.resuming:
            inst.state, inst.resuming = "parked", False

    def instances(self, fn: str) -> dict[str, str]:
        """instance id -> state (starting, ready, draining, parked, moving)."""
        return {i: inst.state for i, inst in self._fn(fn).instances.items()}

    # ------------------------------------------------------------------ observations

    def record(self, fn: str, now_s: float, backlog: float | None, arrivals: int | None = None,
               stored: int = 0) -> None:
        """One tick's observation: ``backlog`` = pending + in-flight requests, instantaneous or
        averaged over the tick as Knative's queue proxy reports it (None: unknown, e.g. the
        consumer is missing); ``arrivals``: requests that arrived since the last tick;
        ``stored``: with an unknown backlog, requests known to be stored for the function anyway
        (e.g. counted on the stream's subject while its consumer does not exist yet).

        Raises ValueError for a negative backlog, arrival or stored count.
        """
        f = self._fn(fn)
        if stored < 0:
            raise ValueError(f"{fn}: stored must be >= 0, got {stored}")
        f.stored = stored if backlog is None else 0
        if backlog is None:
            f.backlog = None
            return
        if backlog < 0 or (arrivals is not None and arrivals < 0):
            raise ValueError(f"{fn}: backlog and arrivals must be >= 0, got {backlog}, {arrivals}")
        f.stable.add(now_s, float(backlog))
        f.panic.add(now_s, float(backlog))
        if arrivals is not None:
            f.arrivals.append((now_s, float(arrivals)))
            f.arriving += arrivals > 0
        horizon = now_s - self.config.stable_window_s
        f.stable.trim(horizon)
        f.panic.trim(now_s - self.config.panic_window)
        while f.arrivals and f.arrivals[0][0] <= horizon:
            f.arriving -= f.arrivals.popleft()[1] > 0
        self._track_idle(f, now_s, backlog, arrivals)
        f.backlog = backlog

    def _track_idle(self, f: _Function, now_s: float, backlog: float, arrivals: int | None) -> None:
        """An idle period is ticks with no backlog *and* no arrival: a short request that came
        and went between two ticks is traffic too (sampled backlog alone missed it, and a
        function under steady light load counted as idle, scaled to zero, and its histogram
        filled with idle times that were not)."""
        active = backlog > 0 or bool(arrivals)
        if not active and f.idle_since is None:
            f.idle_since = now_s
        elif active:
            if f.idle_since is not None and f.active_before and not (f.fresh or f.restored):
                f.histogram.add(now_s - f.idle_since)  # the wait for a first request is no idle time
            f.idle_since, f.active_before, f.fresh, f.restored = None, True, False, False

    def idle_windows(self, fn: str) -> IdleWindows:
        """The function's current pre-warm and keep-alive windows."""
        return self._windows(self._fn(fn))

    def _windows(self, f: _Function) -> IdleWindows:
        """A keep-alive the function's owner fixed wins (no pre-warm); else the histogram's."""
        if f.params.keep_alive_s > 0:
            return IdleWindows(0.0, f.params.keep_alive_s, False)
        return f.histogram.windows(self.config.keep_alive_s)

    def initial_scale(self, fn: str) -> int:
        """Instances ``fn`` gets at deploy: its own setting, else the config's."""
        p = self._fn(fn).params
        return p.initial_scale if p.initial_scale >= 0 else self.config.initial_scale

    # ------------------------------------------------------------------ decisions

    def decide(self, fn: str, now_s: float, headroom: float = 0.0, backing_off: bool = False,
               reach: Mapping[str, float] | None = None) -> Decision:
        """Decide ``fn``'s instance count now. ``headroom``: its vertical headroom (quota units,
        Σ over its instances, from :func:`vertical_headroom`); ``reach``: per instance id, how far
        0..1 it can rise towards its limit on its GPU (:func:`burst_reach`; 1 for one not in it).
        In ``lazy`` mode the function is sized by the least reach of its ready instances, and a
        scale-in retires the instance with the least reach first: the shared queue hands a burst
        to whichever instance pulls, so one pinned at its request serves its part at request
        capacity, and the instances kept are those that can rise. Victims in ``retire`` are marked
        draining at once, those in ``park`` parked (a parking policy's scale-in of a function that
        keeps serving: see Parking); the caller reports new instances with :meth:`instance_starting`.
        ``backing_off``: the function's placements back off now (:meth:`PlacementBackoff.blocked`,
        after a refused placement or resume): nothing is resumed or placed (``resume`` empty,
        ``place`` 0), since a resume is refused as a placement is, for want of room.
        """
        cfg, f = self.config, self._fn(fn)
        cur = f.count("starting", "ready")
        # a resuming instance serves within milliseconds (a copy, not a launch): sized as ready,
        # so a burst that meets it is held for the vertical scaler as at a ready one
        ready = sum(1 for i in f.instances.values() if i.state == "ready" or (i.state == "starting" and i.resuming))
        d = Decision(fn, now_s, cur, ready, cur)
        if f.backlog is None:
            return self._hold(f, d)
        reach = (reach or {}) if cfg.mode == "lazy" else {}
        least = min((reach.get(i.instance_id, 1.0) for i in f.instances.values() if i.state == "ready"), default=1.0)
        target = f.params.scaling_target(cfg.mode, least, cfg.target_utilization)
        d.reach, d.target = least, target
        stable_avg = f.stable.mean_since(now_s - cfg.stable_window_s)
        panic_avg = f.panic.mean_since(now_s - cfg.panic_window)
        desired, reason = self._kpa(f, d, now_s, stable_avg, panic_avg, target)
        if desired == 0 and f.arriving:
            # Knative averages concurrency over time: any request in the stable window makes
            # it > 0 and so desired >= 1; a backlog sampled at ticks can miss short requests
            desired, reason = 1, "requests arrived within the stable window"
        desired, reason = self._idle(f, now_s, desired, reason)
        if f.backlog > 0 and desired == 0:
            desired, reason = 1, "backlog with no instance: scale from zero"
        desired = min(max(desired, f.params.min_instances), f.params.max_instances)
        desired, reason = self._lazy(f, now_s, cur, ready, desired, headroom, reason)
        desired, reason = self._scale_down_delay(f, now_s, cur, desired, reason)
        desired, reason = self._after_restore(f, now_s, cur, desired, reason)
        d.desired, d.reason = desired, reason
        d.breach = self._breach(f, now_s, ready, stable_avg, panic_avg, least)
        if self._park_due(f, now_s, desired):
            self._park(f, d)
        else:
            self._act(f, d, backing_off, reach)
        return d

    def _park_due(self, f: _Function, now_s: float, desired: int) -> bool:
        """Whether ``f``'s instances are to be parked now (see Parking): it has been idle (no
        backlog, no arrival) for ``park_after_s`` and is still kept by its keep-alive (``desired``
        at most one instance, never below a ``min_instances`` it was given), with the instance
        the keep-alive keeps there already (a pre-warm still launches it, to park it once
        ready), and an instance due (:meth:`_to_park`)."""
        after = self.config.park_after_s
        if (after <= 0 or f.idle_since is None or f.backlog or f.params.min_instances > 0 or desired > 1
                or not f.params.parkable or f.count("starting", "ready", "parked") < desired
                or any(i.state == "ready" and not i.parkable for i in f.instances.values())):
            return False
        w = self._windows(f)
        idle_for = now_s - f.idle_since
        if not w.prewarm_s <= idle_for < w.prewarm_s + w.keep_alive_s:
            return False
        # all parked already (e.g. restored so after a restart, whose idle clock starts anew):
        # stays parked, not resumed before a request, until the keep-alive ends
        asleep = f.count("parked") > 0 and not f.count("starting", "ready")
        return asleep or (after <= idle_for and bool(self._to_park(f, now_s)))

    def _to_park(self, f: _Function, now_s: float) -> list[_Instance]:
        """``f``'s ready instances due for parking: all of them, but one that a migration's
        replacement is taking over from (parking it would leave the pair with nothing to hand
        over: its replacement takes its place when ready) and, while ``f`` is fresh (deployed,
        not invoked yet), one ready for less than ``park_after_s`` (see Parking)."""
        after = self.config.park_after_s
        replaced = {i.replaces for i in f.instances.values() if i.state == "moving"}
        return [i for i in f.instances.values()
                if i.state == "ready" and i.instance_id not in replaced
                and not (f.fresh and now_s - i.since_s < after)]

    def _park(self, f: _Function, d: Decision) -> None:
        """Park the instances of an idle ``f`` that are due (:meth:`_to_park`): no GPU share, its
        weights in host memory, brought back by the next scale-out before any new instance is
        placed."""
        for inst in self._to_park(f, d.now_s):
            inst.state, inst.since_s = "parked", d.now_s
            d.park.append(inst.instance_id)
        d.desired = d.current - len(d.park)
        if d.park:
            d.direction = "park"
            d.reason = f"idle {d.now_s - f.idle_since:.1f} s >= {self.config.park_after_s:g} s: parked"

    def _after_restore(self, f: _Function, now_s: float, cur: int, desired: int, reason: str) -> tuple[int, str]:
        """No scale-in within one stable window of a restore: the windows hold too little to
        judge the load by (scale-out is not held back)."""
        if f.restored_at is None or desired >= cur:
            return desired, reason
        since = now_s - f.restored_at
        if since >= self.config.stable_window_s:
            f.restored_at = None
            return desired, reason
        return cur, f"restored {since:.1f} s ago: no scale-in before a full stable window"

    def _hold(self, f: _Function, d: Decision) -> Decision:
        """Unknown backlog: hold, but never below ``min_instances`` nor, for a function just
        deployed, its initial scale (its consumer may not exist yet: the instance's binding creates
        it), and with requests stored and no instance start one (holding at zero would strand
        them). Never more: an unknown backlog is not a large one."""
        want = max(d.current, f.params.min_instances)
        d.reason = (f"training job (it takes no requests): its min_instances, {f.params.min_instances}"
                    if f.params.training else "backlog unknown: holding the current count")
        if f.fresh and want < self.initial_scale(f.name):
            want = self.initial_scale(f.name)
            d.reason = f"backlog unknown: {INITIAL_SCALE_REASON} {want}"
        if d.current == 0 and f.stored > 0:
            want = max(want, 1)
            d.reason = f"backlog unknown, {f.stored} requests stored and no instance: one instance"
        want = min(want, f.params.max_instances)
        if want > d.current:
            d.desired, d.place, d.direction = want, want - d.current, "out"
        return d

    def _kpa(self, f: _Function, d: Decision, now_s: float, stable_avg: float, panic_avg: float,
             target: float) -> tuple[int, str]:
        cfg = self.config
        ready_n = max(1, d.ready)
        max_up = math.ceil(cfg.max_scale_up_rate * ready_n)
        max_down = math.floor(ready_n / cfg.max_scale_down_rate)
        dspc = min(max(_ceil(stable_avg / target), max_down if d.ready else 0), max_up)
        dppc = min(max(_ceil(panic_avg / target), max_down if d.ready else 0), max_up)
        d.stable_estimate, d.panic_estimate = dspc, dppc
        if dppc / ready_n >= cfg.panic_threshold:
            f.panic_since = f.panic_since if f.panic_since is not None else now_s
            f.panic_last = now_s
        elif f.panic_last is not None and now_s >= f.panic_last + cfg.stable_window_s:
            f.panic_since = f.panic_last = None
            f.max_panic = 0
        if f.panic_since is not None:
            d.panic = True
            f.max_panic = max(f.max_panic, dppc, dspc, d.current)  # never down while panicking
            return f.max_panic, f"panic: window {panic_avg:.1f} in flight, target {target:g}"
        desired = dspc
        if d.current > 0 and desired != d.current:
            ratio = stable_avg / (d.current * target)
            if abs(ratio - 1.0) <= cfg.tolerance:
                return d.current, f"within tolerance ({ratio:.2f} of capacity)"
        return desired, f"stable: window {stable_avg:.1f} in flight, target {target:g}"

    def _idle(self, f: _Function, now_s: float, desired: int, reason: str) -> tuple[int, str]:
        """Keep-alive, pre-warm and scale to zero while the function has no backlog."""
        if f.idle_since is None or f.backlog or not f.active_before:
            return desired, reason
        w = self._windows(f)
        # a new function's keep-alive waits for its first ready instance (instance_ready)
        idle_for = 0.0 if f.fresh and not f.warmed and f.count("starting") else now_s - f.idle_since
        if w.prewarm_s > 0 and idle_for < w.prewarm_s:
            if idle_for >= self.config.idle_grace_s:
                return 0, f"idle {idle_for:.1f} s: unloaded until pre-warm at {w.prewarm_s:.1f} s"
            return desired, reason
        if idle_for >= w.prewarm_s + w.keep_alive_s:
            return 0, f"idle {idle_for:.1f} s >= keep-alive {w.prewarm_s + w.keep_alive_s:.1f} s"
        if f.restored and not f.count("starting", "ready"):
            return desired, reason  # nothing was running before the restart: nothing to keep alive
        if f.fresh:
            initial = self.initial_scale(f.name)
            n = max(desired, initial)
            return n, reason if desired >= n else f"{INITIAL_SCALE_REASON} {initial}"
        if w.prewarm_s > 0:
            return 1, f"pre-warmed for idle times ~{w.prewarm_s:.1f} s"
        return max(desired, 1), reason if desired else f"keep-alive ({w.keep_alive_s:.1f} s)"

    def _lazy(self, f: _Function, now_s: float, cur: int, ready: int, desired: int, headroom: float,
              reason: str) -> tuple[int, str]:
        cfg = self.config
        if cfg.mode != "lazy" or desired <= cur or ready == 0 or headroom < cfg.headroom_min:
            f.hold_since = None
            return desired, reason
        f.hold_since = f.hold_since if f.hold_since is not None else now_s
        if now_s - f.hold_since < cfg.lazy_hold:
            return cur, f"lazy: {headroom:.2f} vertical headroom left (wants {desired})"
        return desired, f"{reason}; headroom {headroom:.2f} unused for {now_s - f.hold_since:.1f} s"

    def _breach(self, f: _Function, now_s: float, ready: int, stable_avg: float, panic_avg: float,
                reach: float) -> Breach | None:
        cfg = self.config
        if ready == 0 and not f.backlog:
            return None  # nothing waiting and nothing to compare: old samples are no burst
        target, rps = f.params.sizing(cfg.mode, reach)
        capacity = ready * target
        panic = panic_avg >= cfg.panic_threshold * capacity and panic_avg > 0
        if not (panic or stable_avg > capacity):
            return None
        if f.last_breach is not None and now_s - f.last_breach < cfg.breach_interval:
            return None
        f.last_breach = now_s
        window = cfg.panic_window if panic else cfg.stable_window_s
        seen = [(t, n) for t, n in f.arrivals if t > now_s - window]
        rate = 0.0
        if len(seen) >= 2:  # each entry counts arrivals since the previous tick
            rate = sum(n for _, n in seen[1:]) / (seen[-1][0] - seen[0][0])
        return Breach(f.name, window, rate, ready * rps, math.ceil(f.backlog or 0), panic)

    def _scale_down_delay(self, f: _Function, now_s: float, cur: int, desired: int, reason: str) -> tuple[int, str]:
        """Knative's scale-down-delay: no scale-in to a non-zero count within
        ``scale_down_delay_s`` of the last scale-out. Load that just needed one more instance
        tends to return, and every 1 -> 2 -> 1 flap costs a cold start. Scale to zero is the
        keep-alive's business and is not delayed here."""
        since = now_s - f.last_out_s if f.last_out_s is not None else math.inf
        if 0 < desired < cur and since < self.config.scale_down_delay_s:
            return cur, f"scale-down delay: last scale-out {since:.1f} s ago (wants {desired})"
        return desired, reason

    def _act(self, f: _Function, d: Decision, backing_off: bool = False,
             reach: Mapping[str, float] | None = None) -> None:
        parked = [i for i in f.instances.values() if i.state == "parked"]
        if d.desired > d.current:
            f.last_out_s = d.now_s
            if backing_off:  # parked instances wait parked, and no new one is placed in their stead
                return
            # a parked instance comes back faster than a new one starts
            for inst in parked[: d.desired - d.current]:
                inst.state, inst.since_s, inst.resuming = "starting", d.now_s, True
                d.resume.append(inst.instance_id)
            d.place = d.desired - d.current - len(d.resume)
            d.direction = "resume" if not d.place else "prewarm" if d.current == 0 and not f.backlog else "out"
            return
        if d.desired < d.current:
            victims = self._victims(f, d.current - d.desired, reach or {})
            if d.desired > 0 and self._parks_on_scale_in(f):
                self._park_victims(f, d, victims)
            else:
                d.retire = victims
        if 0 < d.desired <= d.current:
            # parked by a scale-in while the function kept serving: kept a keep-alive window
            keep_s = self._windows(f).keep_alive_s
            d.retire += [i.instance_id for i in parked if d.now_s - i.since_s >= keep_s]
        if d.retire:
            gone = set(d.retire)  # a victim's replacement would only take its place: it goes too
            d.retire += [i.instance_id for i in f.instances.values() if i.state == "moving" and i.replaces in gone]
        if d.desired == 0:  # the keep-alive ran out (or a pre-warm unloads): parked and moving ones go too
            d.retire += [i.instance_id for i in f.instances.values()
                         if i.state in ("parked", "moving") and i.instance_id not in d.retire]
        for iid in d.retire:
            inst = f.instances[iid]
            inst.before_drain, inst.state = inst.state, "draining"
        if d.retire:
            d.direction = "zero" if d.desired == 0 else "in"

    def _parks_on_scale_in(self, f: _Function) -> bool:
        """Whether a scale-in of ``f`` parks its victims (see Parking): the policy parks, and
        ``f``'s resume fits its SLO and its ready instances' code can move their weights."""
        return (self.config.park_after_s > 0 and f.params.parkable
                and all(i.parkable for i in f.instances.values() if i.state == "ready"))

    @staticmethod
    def _park_victims(f: _Function, d: Decision, victims: list[str]) -> None:
        """Park the ready victims of a scale-in (``d.park``), retire the rest (``d.retire``):
        a starting one, and one a migration's replacement is taking over from."""
        replaced = {i.replaces for i in f.instances.values() if i.state == "moving"}
        for iid in victims:
            inst = f.instances[iid]
            if inst.state == "ready" and iid not in replaced:
                inst.state, inst.since_s = "parked", d.now_s
                d.park.append(iid)
            else:
                d.retire.append(iid)
        if d.park:
            d.direction = "park"

    @staticmethod
    def _victims(f: _Function, n: int, reach: Mapping[str, float]) -> list[str]:
        """Starting instances first (newest first), then ready ones by ``reach`` (see
        :meth:`decide`; empty outside lazy mode), then busy share, newest first."""
        live = [i for i in f.instances.values() if i.state in ("starting", "ready")]
        live.sort(key=lambda i: (i.state != "starting", reach.get(i.instance_id, 1.0),
                                 i.busy_share if i.state == "ready" else 0.0, -i.since_s))
        return [i.instance_id for i in live[:n]]


class KnativeKPA(HorizontalPolicy):
    """Knative's KPA as it ships: the horizontal-only baseline (``kpa`` mode).

    The same windows, panic, rates and tolerance as :class:`HorizontalPolicy`, with instances
    sized at the request (vertical headroom ignored), and Knative's scale to zero in place of
    the idle-time histogram: once the backlog has been 0 for a stable window the stable average
    reaches 0, and after ``scale_to_zero_grace_s`` more (``scale-to-zero-grace-period``, 30 s
    by default) the last instance goes (serving ``pkg/autoscaler/scaling/autoscaler.go`` and
    ``config-autoscaler``). No pre-warm. A keep-alive the function's owner fixed still wins, as
    Knative's ``scale-to-zero-pod-retention-period`` annotation does.
    """

    def _windows(self, f: _Function) -> IdleWindows:
        if f.params.keep_alive_s > 0:
            return IdleWindows(0.0, f.params.keep_alive_s, False)
        return IdleWindows(0.0, self.config.stable_window_s + self.config.scale_to_zero_grace_s, False)


def horizontal_policy(config: HorizontalConfig | None = None) -> HorizontalPolicy:
    """The horizontal policy implementation ``config.mode`` names: :class:`KnativeKPA` for
    ``kpa``, :class:`HorizontalPolicy` (dilu's, lazy or eager) otherwise. The live service and
    the simulator both build theirs here."""
    config = config or HorizontalConfig()
    return (KnativeKPA if config.mode == "kpa" else HorizontalPolicy)(config)


# ---------------------------------------------------------------------- tick order


def tick_order(limit_quota: float, memory_bytes: int, name: str) -> tuple[float, int, str]:
    """Sort key of a function within one tick: the largest instances first (limit quota 0..1,
    then device memory in bytes, then the name, so the order is total). When several functions
    place in one tick (their initial scale, a shared burst), the big ones are packed first:
    first-fit decreasing needs at most 11/9 of the optimal bins plus one (Dósa, 2007), first fit in
    deploy order up to 1.7 times as many. The live scaler and the simulator tick functions in this
    order, so their placements match."""
    return (-limit_quota, -memory_bytes, name)


# ---------------------------------------------------------------------- vertical headroom


@dataclass(frozen=True)
class InstanceShare:
    """One instance on one GPU as telemetry reports it (quotas 0..1)."""

    instance_id: str
    function: str
    priority: str
    quota: float
    request_quota: float
    limit_quota: float


def _gains(gpus: Mapping[object, Iterable[InstanceShare]]) -> Iterator[tuple[InstanceShare, float]]:
    """Each instance on each GPU with the quota it could still gain there: up to its limit, but
    only by what its GPU can give (the unallocated share, 1 − Σ quotas, plus what lower-priority
    instances hold above their floors: training above its request, best-effort all of it)."""
    rank = PRIORITY_RANK
    for insts in gpus.values():
        insts = list(insts)
        free = max(0.0, 1.0 - sum(i.quota for i in insts))
        for i in insts:
            r = rank.get(i.priority, 2)
            reclaimable = sum(reclaimable_share(j.priority, j.quota, j.request_quota)
                              for j in insts if rank.get(j.priority, 2) > r)
            yield i, min(max(0.0, i.limit_quota - i.quota), free + reclaimable)


def vertical_headroom(gpus: Mapping[object, Iterable[InstanceShare]]) -> dict[str, float]:
    """Per function: Σ over its instances of the quota it could still gain, in quota units.

    An instance can grow up to its limit, but only by what its GPU can give: the unallocated
    share (1 − Σ quotas) plus what lower-priority instances hold above their floors (training
    above its request; best-effort all of it). ``gpus`` maps a GPU key to its instances.
    """
    return vertical_room(gpus)[0]


def burst_reach(gpus: Mapping[object, Iterable[InstanceShare]]) -> dict[str, float]:
    """Per instance id: how far 0..1 it can rise from its request towards its limit on its GPU,
    ``(quota + gain − request) / (limit − request)`` with the gain of :func:`vertical_headroom`,
    clamped to 0..1; 1 for an instance whose limit is its request; the least over its GPUs for
    one on several.

    Lazy sizing (:meth:`FunctionParams.sizing`, :meth:`HorizontalPolicy.decide`) interpolates an
    instance's in-flight target by it. An instance sized at its limit on a GPU whose requests
    already sum to 1 can never be granted more than its request: sized so, a busy function
    scales in to instances that saturate, then out again, a cold start per flap."""
    return vertical_room(gpus)[1]


def vertical_room(gpus: Mapping[object, Iterable[InstanceShare]]) -> tuple[dict[str, float], dict[str, float]]:
    """(:func:`vertical_headroom`, :func:`burst_reach`) in one pass over ``gpus``."""
    headroom: dict[str, float] = {}
    reach: dict[str, float] = {}
    for i, gain in _gains(gpus):
        headroom[i.function] = headroom.get(i.function, 0.0) + gain
        span = i.limit_quota - i.request_quota
        r = 1.0 if span <= 1e-9 else min(1.0, max(0.0, (i.quota + gain - i.request_quota) / span))
        reach[i.instance_id] = min(r, reach.get(i.instance_id, 1.0))
    return headroom, reach


# ---------------------------------------------------------------------- profile -> parameters


def function_params(spec: FunctionSpec | None, profile: Profile | None, old: FunctionParams | None, *,
                    slo_ms: float = 0.0, fixed_target: float = 0.0) -> FunctionParams:
    """A function's sizing from what is known of it (pure; the service and the simulator share it).

    ``spec`` (FunctionDeployed) sets the instance bounds (``max_instances`` at least 1 and at
    least ``min_instances``), ``initial_scale`` and ``keep_alive_s``; ``profile`` (ProfileReady)
    sets the in-flight ``target`` (:func:`concurrency_target` of its batch and batch latency
    within ``slo_ms``, the function's SLO in ms, 0 when unknown) and ``instance_rps``, and, when
    it was measured at the limit quota (``limit_latency_ms`` > 0; older profiles lack it),
    ``burst_target``/``burst_rps`` at its burst batch; ``spec``'s kind sets ``training``. What
    neither gives keeps ``old``'s value (defaults without one: target 1, bounds 0..8, initial
    scale -1). ``spec``'s cold start gives ``resume_ms`` (:func:`models.resume_ms`; a spec without one, a user's function, its memory
    reservation at ``RESUME_BANDWIDTH_BYTES_PER_S``: more than its weights, so an upper bound)
    and ``slo_ms`` is kept for :attr:`FunctionParams.parkable`. ``fixed_target`` > 0 (an
    operator's) replaces every target and drops the burst target. Raises ValueError (from
    :class:`FunctionParams`) for inconsistent bounds."""
    target = old.target if old else 1.0
    rps = old.instance_rps if old else 0.0
    lo, hi = (old.min_instances, old.max_instances) if old else (0, 8)
    initial, keep_alive = (old.initial_scale, old.keep_alive_s) if old else (-1, 0.0)
    resume = old.resume_ms if old else 0.0
    training = old.training if old else False
    if spec is not None:
        training = spec.kind == "training"
        lo, hi = spec.min_instances, max(1, spec.max_instances, spec.min_instances)
        initial, keep_alive = spec.initial_scale, max(0.0, spec.keep_alive_s)
        # a user's function declares no cold start: its reservation bounds what a resume copies
        resume = (models.resume_ms(spec.cold_start_ms) if spec.cold_start_ms > 0
                  else spec.memory_bytes / models.RESUME_BANDWIDTH_BYTES_PER_S * 1000.0)
    burst_target = old.burst_target if old else 0.0
    burst_rps = old.burst_rps if old else 0.0
    if profile is not None:
        target = concurrency_target(profile.batch_size, profile.latency_ms, slo_ms)
        rps = max(0.0, profile.throughput_rps)
        burst_target, burst_rps = 0.0, 0.0
        if profile.limit_latency_ms > 0:  # measured at the limit quota (older profiles lack it)
            burst = max(profile.batch_size, profile.burst_batch)
            burst_target = concurrency_target(burst, profile.limit_latency_ms, slo_ms)
            burst_rps = max(0.0, profile.limit_throughput_rps)
    if fixed_target:  # an operator's fixed target sizes every instance the same
        target, burst_target = fixed_target, 0.0
    return FunctionParams(target=target, min_instances=lo, max_instances=hi, instance_rps=rps,
                          burst_target=burst_target, burst_rps=burst_rps, initial_scale=initial,
                          keep_alive_s=keep_alive, resume_ms=resume, training=training,
                          slo_ms=slo_ms if slo_ms > 0 else (old.slo_ms if old else 0.0))


# ---------------------------------------------------------------------- initial-scale gating


class InitialScaleGate:
    """When a function becomes placeable: deployed (live, not restored from stored state) and
    profiled, in either order, and not a training function (those are held at
    ``min_instances``). :meth:`deployed` and :meth:`profiled` return True exactly once per
    deployment, at the moment the second condition is met: the caller then starts the initial
    scale (:meth:`HorizontalPolicy.deployed`)."""

    def __init__(self) -> None:
        self._deployed: set[str] = set()
        self._profiled: set[str] = set()
        self._training: set[str] = set()
        self._started: set[str] = set()

    def training(self, fn: str, is_training: bool) -> None:
        """Mark ``fn`` as a training function (or not): training functions never open."""
        (self._training.add if is_training else self._training.discard)(fn)

    def is_training(self, fn: str) -> bool:
        return fn in self._training

    def deployed(self, fn: str) -> bool:
        """``fn`` was deployed live. True when its initial scale starts now."""
        self._deployed.add(fn)
        return self._open(fn)

    def profiled(self, fn: str) -> bool:
        """``fn`` has a profile (live or restored). True when its initial scale starts now."""
        self._profiled.add(fn)
        return self._open(fn)

    def _open(self, fn: str) -> bool:
        if fn in self._started or fn not in self._deployed or fn not in self._profiled or fn in self._training:
            return False
        self._started.add(fn)
        return True

    def forget(self, fn: str) -> None:
        """``fn`` was undeployed: a later deploy starts over."""
        for known in (self._deployed, self._profiled, self._training, self._started):
            known.discard(fn)


# ---------------------------------------------------------------------- placement back-off


class PlacementBackoff:
    """Per-function back-off after a refused placement or an instance that failed for good.

    The first delay is ``first_s`` (the scaler's tick), each further failure doubles it, up to
    ``max_s``; :meth:`clear` resets it (an instance placed, or one of the function ready again).
    Times are seconds on the caller's clock (``now_s``). Raises ValueError for a non-positive
    ``first_s`` or ``max_s``."""

    def __init__(self, first_s: float, max_s: float) -> None:
        if not (first_s > 0 and max_s > 0):
            raise ValueError(f"need first_s > 0 and max_s > 0, got {first_s}, {max_s}")
        self.first_s, self.max_s = first_s, max_s
        self._state: dict[str, tuple[float, float]] = {}  # fn -> (until, current delay)

    def failed(self, fn: str, now_s: float) -> float:
        """A placement of ``fn`` failed at ``now_s``: no new one before the returned delay (s)."""
        delay = self._state.get(fn, (0.0, 0.0))[1]
        delay = min(self.max_s, max(self.first_s, delay * 2))
        self._state[fn] = (now_s + delay, delay)
        return delay

    def blocked(self, fn: str, now_s: float) -> bool:
        """Whether ``fn`` must not be placed at ``now_s``."""
        return now_s < self._state.get(fn, (0.0, 0.0))[0]

    def delay(self, fn: str) -> float:
        """The current delay of ``fn`` in seconds (0 when not backing off)."""
        return self._state.get(fn, (0.0, 0.0))[1]

    def clear(self, fn: str) -> None:
        """Placement of ``fn`` succeeded (or it was undeployed): no back-off."""
        self._state.pop(fn, None)
