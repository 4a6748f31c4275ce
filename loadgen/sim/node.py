"""GPUs and instances of the simulated cluster, timed as the emulated node times them (DESIGN.md
section 7, handlers/emulated.py):

- an instance runs at SM width w = the limit quota it was placed with, paced to its grant q;
- a batch of b requests alone at width w lasts L(b, w) (:func:`models.latency_ms`); paced to
  q < w its kernels are launched as the interceptor's token bucket lets them
  (:func:`models.bucket_paced_ms`: about L(b, w) * w / q, less the burst), and a grant written
  while it runs paces the kernels not yet launched (:func:`models.bucket_charged`: the
  interceptor reads the grant at each launch);
- when the widths of the instances busy at once on one GPU sum to W > 1, each progresses W times
  slower (the contention that kernel-cycle stretch detects). First order: the stretch of a batch
  is fixed when it starts, from the instances busy at that instant;
- an instance's kernel-launch cycles are the interceptor's (:class:`Cycles`): batches with idle
  gaps of at most ``CYCLE_GAP_MS`` between them are one cycle, and a cycle ``STRETCH_RATIO``
  times its baseline reads as a stretch, whether a neighbour slowed it or its own queue kept it
  busy;
- a training job always has work; paced to q it holds its width w a fraction q/w of the time, so
  it adds min(q, w) to the busy widths (:func:`train_load`; first order: the mean, not each
  kernel); its iterations last ``TRAIN_PASSES`` x L(b, w), paced and stretched alike;
- the SM-time a batch consumes is w x L(b, w) (the work; pacing and contention spread it out).
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache

from dilu.services.common import models
from dilu.services.common.functions import SAMPLE_MS, STRETCH_RATIO
from dilu.services.node_agent.handlers.emulated import TRAIN_PASSES

@lru_cache(maxsize=None)
def batch_ms(model: str, batch: int, width: float) -> float:
    """Unpaced, uncontended latency (ms) of a batch at ``width`` (the surface, cached)."""
    return models.latency_ms(model, batch, width)


@lru_cache(maxsize=None)
def iteration_ms(model: str, batch: int, width: float) -> float:
    """Unpaced, uncontended duration (ms) of one training iteration at ``width``."""
    return TRAIN_PASSES * models.latency_ms(model, batch, width)


def pace(width: float, grant: float) -> float:
    """How much longer work takes paced to ``grant`` at ``width`` (>= 1): the interceptor's rule,
    :func:`models.pacing_stretch` (one truth with the profiler); a zero grant (none written yet)
    counts as unpaced."""
    return models.pacing_stretch(width, grant) if grant > 0 else 1.0


def train_load(inst: "Instance") -> float:
    """What an always-busy training instance adds to its GPU's busy widths (0..1). The fake driver
    counts a process's width only while its kernels run, and a job paced to grant q < w runs them
    a fraction q/w of the time, so on average it holds min(q, w); with no grant written yet, w."""
    return min(inst.grant, inst.width) if inst.grant > 0 else inst.width


class Cycles:
    """One instance's kernel-launch cycles as the interceptor delimits them and its node agent
    tests them for stretch (times in ms on the simulated clock).

    A batch is one burst of launches ended by a synchronisation (handlers/emulated.py); a cycle
    runs from a launch after an idle gap longer than ``models.CYCLE_GAP_MS`` to the end of the
    last batch before the next such gap, so batches that follow each other closer than that are
    one cycle (interceptor.c, ``note_cycle``). The baseline is the shortest of the first
    ``models.WARM_CYCLES`` cycles, then a shorter cycle (at least half of it) or a drift of
    span / ``models.BASELINE_DRIFT_MS`` towards each cycle. A cycle closes at the next launch;
    the node agent's next sample tests it (``accounting.stretch``): its span less the token wait
    of the last ``SAMPLE_MS``, over the baseline, at least ``STRETCH_RATIO``. A busy instance
    whose queue keeps it launching (live: 0.7 ms from one batch to the next, the pickup) thus
    reads as stretched, as live."""

    __slots__ = ("start", "end", "count", "baseline", "tail_wait")

    def __init__(self) -> None:
        self.start = -1.0  # first launch of the cycle under way (-1: none yet)
        self.end = 0.0  # when the last batch's work left the device
        self.count = 0
        self.baseline = 0.0
        self.tail_wait = 0.0  # token wait within the last SAMPLE_MS before ``end``

    def launch(self, now: float) -> float | None:
        """A batch's first launch at ``now``: closes the cycle under way if an idle gap longer
        than the cycle gap came before it; returns that cycle's stretch ratio when it is one
        (>= ``STRETCH_RATIO``), else None."""
        if self.start < 0.0:
            self.start = now
            return None
        if now - self.end <= models.CYCLE_GAP_MS:
            return None
        span = self.end - self.start
        self.count += 1
        if self.baseline <= 0.0 or (span < self.baseline and (self.count <= models.WARM_CYCLES
                                                              or 2.0 * span >= self.baseline)):
            self.baseline = span
        else:
            self.baseline += (span - self.baseline) * min(1.0, (now - self.start) / models.BASELINE_DRIFT_MS)
        self.start = now
        ratio = max(0.0, span - self.tail_wait) / self.baseline if self.baseline > 0.0 else 0.0
        return ratio if ratio >= STRETCH_RATIO else None

    def served(self, end: float, dur: float, wait: float) -> None:
        """The batch launched last leaves the device at ``end`` after ``dur`` ms, ``wait`` of
        them waiting for tokens (spread evenly over it, first order)."""
        self.end = end
        self.tail_wait = wait * min(1.0, SAMPLE_MS / dur) if dur > 0.0 else 0.0


class Gpu:
    """One GPU: its scheduler id ``gid``, the instances on it, the Σ widths of those busy now."""

    __slots__ = ("gid", "instances", "busy_width", "consumed_ms", "quiet")

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.instances: dict[str, Instance] = {}
        self.busy_width = 0.0
        self.consumed_ms = 0.0  # SM-time consumed (ms x fraction of the GPU)
        self.quiet = 0  # telemetry windows in a row with nothing happening

    def stretch(self) -> float:
        """The slow-down of everything busy on this GPU now (>= 1)."""
        return self.busy_width if self.busy_width > 1.0 else 1.0


class Instance:
    """One instance: ``state`` starting | ready | draining | parked | gone; ``width`` its limit quota as
    placed; ``grant`` the quota in force; ``batch`` the largest batch it pulls; ``ready_ms`` when
    its cold start ends. Window counters (``win_*``: busy ms on the device, token-wait ms, whether
    a batch ended) and ``recent_ms`` feed the next telemetry; a batch's busy and wait go into them
    as time passes (``accrued_at``), so one that spans windows is busy in each. ``tokens``: its
    token bucket's balance (ms of busy time) at ``batch_to`` (its last batch's end), as the
    interceptor keeps it (:func:`models.bucket_paced_ms`); full when it starts; a grant written
    while a batch is in hand paces its kernels not yet launched (``plan``). ``fetch_at``: when its puller's
    current fetch began (ms; at its readiness and at each batch's end): an idle puller's fetch
    waits :data:`workqueue.FETCH_TIMEOUT_S` at a time, and a drain is seen only when it returns."""

    __slots__ = ("iid", "fn", "gpu", "request", "width", "grant", "batch", "ready_ms", "state", "busy",
                 "inflight", "quota_since", "win_busy_ms", "win_wait_ms", "win_served", "training",
                 "iterations", "train_since", "priority", "tokens", "resumed_ms", "replaces",
                 "recent_ms", "answered", "batch_to", "accrued_at", "device_share", "cycles", "fetch_at",
                 "batch_from", "batch_busy", "batch_seq", "batch_extra", "plan")

    def __init__(self, iid: str, fn, gpu: Gpu, request: float, width: float, grant: float, batch: int,
                 ready_ms: float, now_ms: float, training: bool, priority: str) -> None:
        self.iid = iid
        self.fn = fn
        self.gpu = gpu
        self.request = request
        self.width = width
        self.grant = grant
        self.batch = batch
        self.ready_ms = ready_ms
        self.state = "starting"
        self.busy = False
        self.inflight: list[int] = []
        self.quota_since = now_ms
        self.win_busy_ms = 0.0
        self.win_wait_ms = 0.0
        self.win_served = False
        self.training = training
        self.iterations = 0.0
        self.train_since = ready_ms
        self.priority = priority
        self.tokens = models.BURST_MS
        self.resumed_ms = 0.0  # when its last resume from parking ended (0: never parked)
        self.replaces = ""  # a migration's replacement: the instance it drains once ready
        self.recent_ms = 0.0  # recent-latency average (functions.recent_latency), as its process keeps it
        self.answered = 0  # requests averaged into it
        self.batch_to = 0.0  # when the batch in hand leaves the device (ms)
        self.batch_from = 0.0  # when it started (ms)
        self.batch_busy = 0.0  # its busy time on the device, stretched (ms; the rest waits for tokens)
        self.batch_seq = 0  # its timing's version: a grant written mid-batch re-times it (run.py)
        self.batch_extra = 0.0  # the live node's own time after it (ms)
        # its kernels' pacing from the last grant on: (since ms, busy ms left, kernels left, rate,
        # balance then, stretch, device free of earlier kernels at ms); see models.bucket_charged
        self.plan: tuple = ()
        self.accrued_at = 0.0  # its busy and wait are in the window counters up to here (ms)
        self.device_share = 1.0  # of its time on the device: busy (the rest waits for tokens)
        self.cycles = Cycles()
        self.fetch_at = ready_ms


class Function:
    """A deployed function as the simulator serves it: its spec and profile, the requests waiting
    for an instance (the work queue, oldest first), its live instances and counters."""

    __slots__ = ("name", "spec", "model", "slo_ms", "timeout_ms", "batch", "demand", "pending", "ready",
                 "instances", "arrivals", "launches", "quota_ms", "training", "asleep", "last_tick", "last_busy",
                 "kernels", "closing")

    def __init__(self, name: str, spec, slo_ms: float, timeout_ms: float, batch: int, demand, training: bool) -> None:
        self.name = name
        self.spec = spec
        self.model = spec.model
        self.kernels = models.kernels_per_batch(spec.model)  # a batch's kernels under the interceptor
        self.slo_ms = slo_ms
        self.timeout_ms = timeout_ms
        self.batch = batch
        self.demand = demand
        self.pending: deque[int] = deque()
        self.ready: list[Instance] = []  # ready, not draining: they pull from ``pending``
        self.closing: list[Instance] = []  # draining while idle: their open fetch still takes a request
        self.instances: dict[str, Instance] = {}
        self.arrivals = 0
        self.launches = 0
        self.quota_ms = 0.0
        self.training = training
        self.asleep = False  # skipped by the horizontal ticks while nothing can change (run.py)
        self.last_tick = -1  # index of the last horizontal tick that recorded a sample for it
        self.last_busy = -1  # index of the last horizontal tick that recorded a backlog > 0
