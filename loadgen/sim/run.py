"""One simulated run per policy: the trace, the live policy objects and the surfaces wired into a
discrete-event simulation, reported with the live demo's :func:`report.build_report`.

What drives what, as in the live cluster (services/*/service.py):

- **Plan.** :func:`cli.demo.build_plan` (the same trace reading, K busiest functions, seeded
  arrivals with idle gaps kept, seeded model assignment) at speed-up 1: simulated time is trace
  time. Functions are deployed with :func:`cli.deploy.function_spec`, training jobs with
  :func:`cli.deploy.training_spec`.
- **Profiler.** :func:`profiler.policy.search_for` ask/tell, each trial answered from the model's
  surface as ``dilu profile`` answers it (:class:`profiler.surface.SurfaceBackend`), once per
  :func:`profiler.policy.cache_key`, as the service caches profiles; the trials are counted in
  ``profiler_trials``.
- **Scheduler.** :class:`scheduler.policy.Cluster` places an instance's :class:`Demand` (quotas by
  :func:`allocation_quotas` of the policy's allocation) and removes it at retirement; batches by
  :func:`allocation_batch`.
- **Node agent.** An instance starts at its initial grant (request or limit) fitted with
  :func:`node_agent.grants.fit_quota`; it is ready after process start + the model's
  :func:`models.cold_start_ms`; ready instances pull batches from the function's work queue.
  Every ``vertical_tick_ms`` (the agent's 250 ms telemetry) each GPU with instances sends its
  instances' :class:`InstanceTelemetry` to the vertical policy, with the fields as the node agent
  reads them from the control block: busy share = time on the device (waiting for tokens is not
  busy), the recent-latency average (:func:`functions.recent_latency`, kept across windows), the
  batch in hand as ``queue_depth``; an instance's kernel-launch cycles are the interceptor's
  (:class:`node.Cycles`), and one that closes stretched by ``STRETCH_RATIO`` or more is reported
  at the launch that closes it, as the node agent's next sample reports it.
- **Vertical scaler.** :func:`vertical_policy` of the policy's mode; its grants are fitted on the
  GPU as the node agent fits them, and a grant written while a batch runs paces the batch's
  kernels not yet launched (:meth:`Simulation._retime`); a retired instance is reported to it at once
  (:meth:`VerticalPolicy.on_retired`), as the node agent's InstanceRetired reports it live.
- **Horizontal scaler.** :func:`horizontal_policy` (windows of :func:`cli.demo.scaler_windows` at
  speed-up 1) with :func:`function_params` of each profile; every ``horizontal_tick_ms`` (its
  500 ms tick), in its :func:`tick_order` (largest instances first), each function records its
  backlog (waiting + in flight) and arrivals, decides
  with its :func:`vertical_headroom` and :func:`burst_reach`, and places (:class:`PlacementBackoff` after a refusal) or
  retires (draining: a busy instance finishes its batch, then leaves; an idle one leaves when its
  open fetch expires, Draining below), in the order the live scheduler serves a tick's requests
  (:func:`.requests.request_order`: its placements first, as the scaler sends them first).

Control loops tick on their own clocks, as the live services do: the horizontal scaler's from the
deploy, the node agent's telemetry and the scheduler's defragmentation rounds each at a phase of
its own. Without overheads every phase is 0; with them (a live node's run, :mod:`.overheads`)
each is drawn from ``overheads_seed``, since a live run meets its loops at any phase and a
decision on a threshold (a scale-in one tick before a burst or one after) turns on it. The
replay meets the horizontal tick at any phase too, yet starts as the last initial instance
is ready, as live: the deploy's launches take their process start moved by a jitter uniform over
one horizontal tick, centred on it, and the replay starts with them. Overheads measured from a
live run hold when that run met its loops (:class:`~.overheads.LoopTiming`): a simulation whose
deploy launches as many instances replays one of them instead (:func:`replayed_timing`): its
first request, and a defragmentation round, where that run's were after the deploy's tick, and
the horizontal tick at the measured period (it drifts by its own work), so the replay's
threshold decisions fall on the ticks the live run's fell on.

Draining: an idle instance told to stop (retired) leaves when its puller's open fetch expires,
a whole number of :data:`workqueue.FETCH_TIMEOUT_S` after it went idle, serving a request that
comes meanwhile if no ready instance is idle, as a live puller sees its stop only when its fetch
returns.

The replay starts when every function's initial instance is ready, as the demo starts it once
:class:`cli.deploy.WarmWatch` has seen them all (the latest of the deploy's launches, each up
by its launch order, :func:`deploy_start_ms`, then loading its weights; at most the demo's wait,
:func:`cli.demo.warm_up_limit_s`; ``warm_up_s`` fixes it instead).
Starting later would let a short keep-alive (Knative's) unload them before the first request.
Requests unanswered after max(30 s, 10 x SLO) time out, those left ``drain_s`` after the span
are timed out. GPU figures (active GPU·s, fragmentations, quota·s)
and training iterations are integrated from the replay's start to its end: the end of the span,
or the moment the last request ended if that is later (at most ``drain_s`` after the span), as
a live replay ends when its last answer is in. Counters (launches, scale-outs, retirements,
scale to zero, grants) count from the deploy, as a live run's, and stop at that end too.
Deterministic: same configuration and seed, same report, byte for byte.
"""
from __future__ import annotations

import bisect
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from dilu.cli.demo import horizontal_config, warm_up_limit_s
from dilu.cli.deploy import function_spec, training_spec
from dilu.contracts.events import InstanceTelemetry
from dilu.loadgen import report
from dilu.loadgen.arrivals import SPEEDUP_MAX, SPEEDUP_MIN
from dilu.loadgen.generator import Record, RunResult
from dilu.services.common import models
from dilu.services.common.console import PROGRESS_EVERY_S
from dilu.services.common.functions import GIB, default_priority, recent_latency, yields_share
from dilu.services.common.interrupt import raise_if_stopped
from dilu.services.common.policies import DEFRAG_INTERVAL_MIN_S, modes
from dilu.services.common.workqueue import FETCH_TIMEOUT_S
from dilu.services.horizontal_scaler.policy import (TICK_MS, Decision, InstanceShare, PlacementBackoff,
                                                    function_params, horizontal_policy, tick_order, vertical_room)
from dilu.services.horizontal_scaler.service import MAX_PLACE_COUNT
from dilu.services.node_agent.grants import fit_quota
from dilu.services.profiler.policy import NoFeasibleSetting, cache_key, search_for
from dilu.services.profiler.surface import SurfaceBackend, model_surface, run_search
from dilu.services.scheduler.policy import (Cluster, Demand, NoCapacity, Placed, Slot, allocation_batch,
                                           allocation_quotas)
from dilu.services.vertical_scaler.policy import VerticalConfig, vertical_policy

from .engine import EventLoop
from .node import Function, Gpu, Instance, batch_ms, iteration_ms, pace, train_load
from .overheads import LoopTiming, Overheads, Sampler
from .requests import request_order

GPU_MEMORY_BYTES = 40 * GIB  # the emulated A100 40 GB (node_agent.devices "a100-40gb" rounds to 40 GiB)
REQUEST_TIMEOUT_MIN_MS = 30_000.0  # cli.demo.REQUEST_TIMEOUT_MIN_S
TIMEOUT_SLO_FACTOR = 10.0
# Telemetry windows (3 s) with nothing busy, queued or starting on a GPU after which its telemetry
# pauses until something happens there: by then the vertical policy has released every idle
# instance to its floor (release_per_s 0.5 takes a limit of 1 to 0.1 in 1.8 s) and recovered
# training (recovery_per_s 0.5), so further windows would change nothing; under a policy that
# counts its windows in samples a GPU stays awake until they run out (windows_to_settle). Keeps an
# 8-hour run of thousands of GPUs from spending its time on GPUs nobody uses.
QUIET_WINDOWS = 12
RUN_ID = "sim"
CDF_POINTS = 200  # quantiles of latency / SLO kept per policy (the plots' CDF)


@dataclass
class SimConfig:
    """A simulated run. ``trace_dir``: Azure Functions 2019 format (None: the bundled sample);
    ``functions``: K busiest or ``"all"``; ``hours`` of trace replayed from ``start_minute``
    (None: the first); ``speedup``: trace time compressed as ``dilu demo --speedup`` does (the
    replay lasts ``hours`` / ``speedup``, the horizontal windows shrink with it, cold starts do
    not; 1: trace time); ``nodes`` x ``gpus_per_node`` GPUs of 40 GB; ``training_jobs``: fraction
    (0..1) of the GPUs running a training job; ``keep_alive_s``: the horizontal scaler's fallback
    keep-alive in trace seconds (None: its default, 10 min; Knative's KPA has none);
    ``park_after_s``: park an idle function's instances after this many trace seconds, every
    policy (the horizontal scaler's Parking; 0: never; None: as each policy does live,
    :meth:`PolicyModes.park_after_s`: dilu parks, the others never); ``defrag_interval_s``:
    how often the scheduler of a defragmenting policy (:attr:`PolicyModes.defrag`) defragments,
    in trace seconds (None: as it does live, :data:`DEFRAG_INTERVAL_S`; 0: never; the baselines
    never do); ``process_start_ms``:
    an instance's process start before its weights load (a cold start is that plus the weights
    at 4 GB/s); ``process_start_by_starting_ms``: if not empty, the process start instead by how
    many other instances are starting on the node at the launch (entry k for k, the last also
    for more; :attr:`Overheads.process_start_by_starting_ms`); ``process_start_initial_ms``:
    if not empty, when the deploy's launches are up instead, by launch order (all at once, beside
    each other; :attr:`Overheads.process_start_initial_ms`); ``overheads``: what a live node
    adds to each request and batch beyond the modelled GPU time (:mod:`.overheads`, measured by
    ``dilu calibrate``; None: nothing), drawn from streams seeded by ``overheads_seed`` (None:
    ``seed``; another value draws other overheads and control-loop phases over the same requests,
    as a live rerun would meet them: :func:`loop_phases`); ticks in ms; ``sample_s``: timeline
    resolution."""

    trace_dir: str | None = None
    functions: int | str = 16
    hours: float = 1.0
    nodes: int = 1
    gpus_per_node: int = 4
    seed: int = 1
    training_jobs: float = 0.0
    start_minute: int | None = None
    speedup: float = 1.0
    keep_alive_s: float | None = None
    park_after_s: float | None = None
    defrag_interval_s: float | None = None
    process_start_ms: float = models.PROCESS_START_MS
    process_start_by_starting_ms: tuple[float, ...] = ()
    process_start_initial_ms: tuple[float, ...] = ()
    overheads: Overheads | None = None
    overheads_seed: int | None = None
    vertical_tick_ms: float = 250.0
    horizontal_tick_ms: float = TICK_MS
    warm_up_s: float | None = None  # None: when the initial instances are ready (warm_up_ms)
    drain_s: float = 20.0
    sample_s: float = 10.0
    keep_records: bool = True

    def __post_init__(self) -> None:
        if not (self.hours > 0 and math.isfinite(self.hours)):
            raise ValueError(f"hours must be a positive number, got {self.hours}")
        if not (SPEEDUP_MIN <= self.speedup <= SPEEDUP_MAX):
            raise ValueError(f"speedup must be in [{SPEEDUP_MIN:g}, {SPEEDUP_MAX:g}], got {self.speedup}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"need at least 1 node and 1 GPU per node, got {self.nodes} x {self.gpus_per_node}")
        if self.keep_alive_s is not None and not (0 <= self.keep_alive_s <= 86_400):
            raise ValueError(f"keep_alive_s must be in [0, 86400] s, got {self.keep_alive_s}")
        if self.park_after_s is not None and not (0 <= self.park_after_s <= 86_400):
            raise ValueError(f"park_after_s must be in [0, 86400] s, got {self.park_after_s}")
        if self.defrag_interval_s is not None and not (
                self.defrag_interval_s == 0 or DEFRAG_INTERVAL_MIN_S <= self.defrag_interval_s <= 86_400):
            raise ValueError(f"defrag_interval_s must be 0 or in [{DEFRAG_INTERVAL_MIN_S:g}, 86400] s, "
                             f"got {self.defrag_interval_s}")
        for name, values in (("process_start_ms", (self.process_start_ms,)),
                             ("process_start_by_starting_ms", self.process_start_by_starting_ms),
                             ("process_start_initial_ms", self.process_start_initial_ms)):
            for ms in values:
                if not (0 <= ms <= models.PROCESS_START_MAX_MS):
                    raise ValueError(f"{name} must be in [0, {models.PROCESS_START_MAX_MS:g}] ms, got {ms}")
        if not 0.0 <= self.training_jobs <= 1.0:
            raise ValueError(f"training_jobs is a fraction of the GPUs (0..1), got {self.training_jobs}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class EmptySpan(ValueError):
    """The trace span asked for (hours from the start minute) holds no invocation."""


@dataclass
class Workload:
    """What every policy of one comparison replays: the plan and the deployed specs, profiled."""

    plan: object
    specs: list
    profiles: dict  # function -> (Profile | None, trials)


def prepare(cfg: SimConfig) -> Workload:
    """The replay plan (:func:`cli.demo.build_plan` at ``cfg.speedup``), the functions' specs with their
    seeded models, the training jobs, and each inference function's profile from the profiler's
    search on its surface. Raises TraceError for a bad trace, :class:`EmptySpan` for a span
    without invocations, ValueError for other bad settings."""
    from dilu.cli.demo import RunOptions, build_plan  # the demo's plan rule, not a copy of it

    opts = RunOptions(duration=cfg.hours * 3600.0 / cfg.speedup, speedup=cfg.speedup, seed=cfg.seed, trace_dir=cfg.trace_dir,
                      start_minute=cfg.start_minute, functions=cfg.functions, gpus=str(cfg.gpus_per_node),
                      nats_url=None, log_dir=None, training_jobs=0, progress=False)
    plan, chosen, _ = build_plan(opts, RUN_ID)
    if not plan.invocations:
        raise EmptySpan(f"the span ({cfg.hours:g} hours from the start minute) holds no invocation: "
                         f"give more --hours or another --start-minute")
    specs = [function_spec(f.name, chosen[f.name], peak_rps=f.peak_rps) for f in plan.functions]
    specs += [training_spec(f"train-{i}") for i in range(round(cfg.training_jobs * cfg.gpus))]
    profiles: dict = {}
    cache: dict = {}
    for s in specs:
        if s.profile is not None:
            profiles[s.name] = (s.profile, 0)
            continue
        key = cache_key(s)
        trials = 0  # a profile reused from the cache costs no trial, as in the profiler service
        if key not in cache:
            backend = SurfaceBackend(model_surface(s.model))
            try:
                cache[key] = run_search(search_for(s), backend)
            except NoFeasibleSetting:
                cache[key] = None
            trials = backend.trials
        res = cache[key]
        profiles[s.name] = (res.to_profile(s.name, "surface") if res is not None else None, trials)
    return Workload(plan, specs, profiles)


def deploy_start_ms(cfg: SimConfig, k: int, jitter_ms: float = 0.0) -> float:
    """When the process of the deploy's ``k``-th launch (0: its first) is up, ms after the deploy:
    entry k of ``process_start_initial_ms`` (the last also for more) when measured, else the
    longest of the process start table (each finds the others starting) or the constant; moved
    by ``jitter_ms`` (:func:`loop_phases`), at least 0."""
    table = cfg.process_start_initial_ms
    start = table[min(k, len(table) - 1)] if table else max(cfg.process_start_by_starting_ms,
                                                            default=cfg.process_start_ms)
    return max(0.0, start + jitter_ms)


def warm_up_ms(cfg: SimConfig, launches: Sequence[str], mode: str, jitter_ms: float = 0.0) -> float:
    """When the replay under the horizontal ``mode`` starts (ms after the deploy):
    ``cfg.warm_up_s`` if set, else when the deploy's launches (``launches``: their models, in
    launch order) are all ready: the latest of each one's process start (:func:`deploy_start_ms`,
    moved by ``jitter_ms``) plus its model's weight load, at most the demo's wait
    (:func:`cli.demo.warm_up_limit_s`: within a new function's keep-alive)."""
    if cfg.warm_up_s is not None:
        return cfg.warm_up_s * 1000.0
    ready = max((deploy_start_ms(cfg, k, jitter_ms) + models.cold_start_ms(m) for k, m in enumerate(launches)),
                default=deploy_start_ms(cfg, 0, jitter_ms))
    return min(ready, warm_up_limit_s(mode, cfg.speedup, cfg.keep_alive_s) * 1000.0)


def loop_phases(cfg: SimConfig, defrag_every_ms: float,
                timing: LoopTiming | None = None) -> tuple[float, float, float]:
    """(the deploy's jitter, first telemetry, first defragmentation round), ms on the simulated
    clock (module docstring, Control loops): (0, 0, ``defrag_every_ms``) without overheads; with
    them, the jitter uniform in [-tick/2, tick/2) of the horizontal tick, the others uniform in
    [0, tick) each, drawn from their own stream of ``overheads_seed`` (``seed`` when None), so the
    other draws do not move. A live run's measured ``timing`` (:func:`replayed_timing`) sets
    the jitter to 0 (the replay starts when that run's did) and the first defragmentation round
    at that run's phase, when it logged one."""
    if cfg.overheads is None:
        return 0.0, 0.0, defrag_every_ms
    rng = random.Random(f"phases-{cfg.seed if cfg.overheads_seed is None else cfg.overheads_seed}")
    jitter, telemetry, defrag = ((rng.random() - 0.5) * cfg.horizontal_tick_ms, rng.random() * cfg.vertical_tick_ms,
                                 defrag_every_ms * (1.0 - rng.random()))
    if timing is None:
        return jitter, telemetry, defrag
    if timing.defrag_ms is not None and defrag_every_ms:
        defrag = timing.defrag_ms % defrag_every_ms or defrag_every_ms
    return 0.0, telemetry, defrag


def replayed_timing(cfg: SimConfig, launches: int) -> LoopTiming | None:
    """The live run's loop timing this simulation replays: one of ``cfg.overheads``'s
    :attr:`~.overheads.Overheads.loop_timings` whose deploy launched ``launches`` instances of
    its initial scale, as this one's does (another plan meets its loops at other times), chosen
    by ``overheads_seed`` (``seed`` when None) on its own stream; None when there is none (the
    phases are drawn, :func:`loop_phases`)."""
    ov = cfg.overheads
    same = [t for t in ov.loop_timings if t.launches == launches] if ov is not None else []
    if not same:
        return None
    return random.Random(f"timing-{cfg.seed if cfg.overheads_seed is None else cfg.overheads_seed}").choice(same)


@dataclass
class SimFacts:
    """Simulator-only figures of one run (not in the Report): ``events`` processed, ``compute_s``
    the real seconds computing it took (the report's ``run.wall_s`` is simulated seconds),
    ``peak_active_gpus``, ``max_limit_sum`` (the largest Σ against γ on one GPU,
    :meth:`Cluster.limit_sum`), instances ``parks`` and ``resumes`` (on the GPU they left; parking,
    :class:`SimConfig`), ``resumes_refused`` (the GPU it left had no room), of which ``relaunches``
    placed a new instance elsewhere and retired the parked one (a cold start; the others found no
    GPU with room: the instance stayed parked and the function's placements back off), and ``resume_waits``
    (requests that waited for a resume: no launch, so not cold-start requests), ``migrations``
    (instances moved by defragmentation, every ``defrag_interval_s`` trace s; 0: none),
    ``warm_up_s`` (when the replay started: :func:`warm_up_ms`, or a live run's replayed
    :class:`~.overheads.LoopTiming`, then ``loop_timing_replayed``), ``horizontal_tick_ms`` (the
    tick in force: the measured one of the overheads, else the configured), ``stretches`` (per function, the
    kernel-cycle stretches reported to the vertical scaler over the whole run, as the live
    vertical scaler's debug ``stretch`` lines count them: :class:`node.Cycles`) and the ``timeline`` (t_s,
    active GPUs, cold-start requests so far, allocation and idle fragmentation over the sample)
    used by the plots."""

    events: int = 0
    compute_s: float = 0.0
    peak_active_gpus: int = 0
    max_limit_sum: float = 0.0
    unplaced: int = 0
    parks: int = 0
    resumes: int = 0
    resumes_refused: int = 0
    relaunches: int = 0
    migrations: int = 0
    defrag_interval_s: float = 0.0  # the interval in force, trace s (0: none)
    park_after_s: float = 0.0  # the parking delay in force, trace s (0: never)
    warm_up_s: float = 0.0  # when the replay started, simulated s after the deploy (warm_up_ms)
    loop_timing_replayed: bool = False
    horizontal_tick_ms: float = 0.0
    resume_waits: int = 0
    stretches: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)
    latency_slo_cdf: list = field(default_factory=list)


@dataclass
class _Cut:
    """The run's integrals at the replay's end (ms on the simulated clock; area, frag and
    consumed in GPU·ms; quota_ms per function; training iterations per function) and its
    counters then: the mechanism's and each function's instance launches (a live run stops
    counting when its last answer is in, so retirements in the drain after it are not its)."""

    at_ms: float
    area: float
    frag: float
    consumed: float
    quota_ms: dict
    train_iters: dict
    mechanism: report.Mechanism
    launches: dict


class Simulation:
    """One policy over one :class:`Workload` (see the module docstring). ``sleep_idle``: skip the
    horizontal ticks of functions asleep (:meth:`_horizontal_tick`); the report is the same
    either way (a test holds it so), only slower without."""

    sleep_idle = True

    def __init__(self, cfg: SimConfig, policy: str, work: Workload,
                 on_progress: Callable[[float, float], None] | None = None) -> None:
        self.cfg, self.policy, self.work = cfg, policy, work
        self.on_progress = on_progress  # (simulated s done, s in all), at most every PROGRESS_EVERY_S
        self._progress_at = time.monotonic()
        m = modes(policy)
        self.modes = m
        self.loop = EventLoop(0.0)
        self.cluster = Cluster([f"node{i}" for i in range(cfg.nodes)], cfg.gpus_per_node, GPU_MEMORY_BYTES)
        self.vertical = vertical_policy(VerticalConfig(mode=m.vertical))
        park = m.park_after_s() if cfg.park_after_s is None else cfg.park_after_s
        self.hconf = horizontal_config(m.horizontal, cfg.speedup, cfg.keep_alive_s, park)
        self.horizontal = horizontal_policy(self.hconf)
        every = m.defrag_interval_s(every_s=cfg.defrag_interval_s)  # trace s; the baselines never defragment
        self.defrag_every = every * 1000.0 / cfg.speedup  # ms; 0: never
        self.backoff = PlacementBackoff(cfg.horizontal_tick_ms / 1000.0, 30.0)
        self.gpus: dict[int, Gpu] = {}
        self.node_gpus: dict[str, list[Gpu]] = defaultdict(list)  # node name -> its GPUs in use so far
        self.awake: dict[int, Gpu] = {}  # GPUs whose telemetry is not paused (see QUIET_WINDOWS)
        self.vtick = self.htick = 0  # tick counters: tick k runs at k x its period
        self.instances: dict[str, Instance] = {}
        self.moved_out: set[str] = set()  # instances draining because their replacement is ready
        self.fns: dict[str, Function] = {}
        self.ticked: list[Function] = []  # functions with a profile, in horizontal tick order
        self.mech = report.Mechanism(vertical_reaction_ms_p50=None, vertical_reaction_ms_p99=None)  # not modelled
        self.facts = SimFacts(defrag_interval_s=every, park_after_s=park)
        self.deploy_launches = 0  # instances placed at the deploy so far (their launch order)
        self.seq = 0
        for s in work.specs:  # nothing is placed yet: the first horizontal tick places them
            self._deploy(s)
        launches = self._deploy_models()
        self.timing = replayed_timing(cfg, len(self._initial_scale_models()))
        self.phases = loop_phases(cfg, self.defrag_every, self.timing)
        ov = cfg.overheads
        # the live scaler's tick as measured (it sleeps its tick, then works), else the nominal one
        self.tick_ms = ov.horizontal_tick_ms if ov is not None and ov.horizontal_tick_ms else cfg.horizontal_tick_ms
        first = work.plan.invocations[0].scheduled_ns / 1e6 if work.plan.invocations else 0.0
        if self.timing is not None and cfg.warm_up_s is None:  # the replay starts as the measured run's did
            self.t0 = max(0.0, self.timing.first_request_ms - first)
        else:
            self.t0 = warm_up_ms(cfg, launches, m.horizontal, self.phases[0])
        self.facts.warm_up_s = round(self.t0 / 1000.0, 6)
        self.facts.loop_timing_replayed = self.timing is not None
        self.facts.horizontal_tick_ms = self.tick_ms
        self.span_end = self.t0 + work.plan.duration_s * 1000.0
        self.end = self.span_end + cfg.drain_s * 1000.0
        invs = work.plan.invocations
        self.inv = invs
        self.sched = [self.t0 + i.scheduled_ns / 1e6 for i in invs]
        self.done = [0.0] * len(invs)
        self.status = [""] * len(invs)
        self.cold = bytearray(len(invs))
        self.cold_total = 0
        self.live_req = 0.0
        self.acc_t = self.t0
        self.area = self.frag = 0.0
        self.consumed = 0.0
        self._sample_prev = (0.0, 0.0, 0.0)  # (area, frag area, consumed) at the last sample
        self.last_answer = 0.0
        self.finished = 0  # requests ended (answered, failed or timed out)
        self.cut: _Cut | None = None  # the integrals when the replay ended (None: at self.end)
        self.train_iters: dict[str, float] = {}
        self.by_fn = [self.fns[i.function] for i in invs]
        # each its own seeded stream: the same draws whatever else is random
        ov_seed = cfg.seed if cfg.overheads_seed is None else cfg.overheads_seed
        self.transport = Sampler(ov.transport_ms, f"transport-{ov_seed}") if ov else None
        self.batch_extra = Sampler(ov.batch_ms, f"batch-{ov_seed}") if ov else None
        self.pickup = Sampler(ov.pickup_ms, f"pickup-{ov_seed}") if ov and ov.pickup_ms else None
        self.dispatch = Sampler(ov.dispatch_ms, f"dispatch-{ov_seed}") if ov and ov.dispatch_ms else None
        # (function, batch size, modelled service ms) of each batch of the replay, when a caller
        # (dilu calibrate) sets a list here; None: not kept
        self.batch_log: list[tuple[str, int, float]] | None = None

    # ------------------------------------------------------------------ setup

    def _deploy(self, spec) -> None:
        profile, trials = self.work.profiles[spec.name]
        self.mech.profiler_trials += trials
        training = spec.kind == "training"
        slo = spec.slo_ms
        timeout = max(REQUEST_TIMEOUT_MIN_MS, TIMEOUT_SLO_FACTOR * slo)
        demand = None
        batch = 1
        if profile is not None:
            req, lim = allocation_quotas(self.modes.allocation, profile.request_quota, profile.limit_quota)
            demand = Demand(function=spec.name, request_quota=req, limit_quota=lim, memory_bytes=spec.memory_bytes,
                            kind="training" if training else "inference")
            batch = allocation_batch(self.modes.allocation, profile.batch_size, profile.burst_batch)
        f = Function(spec.name, spec, slo, timeout, batch, demand, training)
        self.fns[spec.name] = f
        if profile is not None:  # ticked in the live scaler's order
            bisect.insort(self.ticked, f, key=lambda g: tick_order(self.work.profiles[g.name][0].limit_quota,
                                                                   g.spec.memory_bytes, g.name))
        if training:
            self.loop.at(0.0, self._launch_training, f)
        elif demand is not None:
            self.horizontal.add_function(spec.name, function_params(spec, profile, None, slo_ms=slo))
            self.horizontal.deployed(spec.name, 0.0)

    def _deploy_models(self) -> list[str]:
        """The models of the instances the deploy launches, in launch order: the training jobs as
        they were deployed (their launches come first at 0 ms), then each inference function's
        initial scale in the horizontal tick order (:func:`tick_order`), as its first tick places
        them."""
        training = [f.model for f in self.fns.values() if f.training and f.demand is not None]
        return training + self._initial_scale_models()

    def _initial_scale_models(self) -> list[str]:
        """The models of the inference instances the deploy's first horizontal tick places, in
        its tick order (every function's initial scale)."""
        return [f.model for f in self.ticked if not f.training and f.demand is not None
                for _ in range(self.horizontal.initial_scale(f.name))]

    # ------------------------------------------------------------------ accounting

    def _account(self) -> None:
        """Integrate active GPUs and allocation fragmentation up to now (from the replay's start)."""
        now = self.loop.now
        if now > self.acc_t:
            dt = now - self.acc_t
            active = self.cluster.active
            self.area += active * dt
            self.frag += (active - self.live_req) * dt
            self.acc_t = now

    def _held_ms(self, inst: Instance, now: float) -> float:
        """Quota·ms ``inst`` has held at its grant since its last change, counted from the
        replay's start only (as a live report scrapes it, DESIGN.md section 8)."""
        return inst.grant * max(0.0, now - max(inst.quota_since, self.t0))

    def _set_grant(self, inst: Instance, q: float, count: bool) -> None:
        now = self.loop.now
        if abs(q - inst.grant) <= 1e-9:
            return
        inst.fn.quota_ms += self._held_ms(inst, now)
        inst.quota_since = now
        loaded = inst.training and inst.state == "ready"
        if inst.training:
            self._train_progress(inst)
        if loaded:
            inst.gpu.busy_width -= train_load(inst)
        inst.grant = q
        if loaded:
            inst.gpu.busy_width += train_load(inst)
        elif inst.inflight and now < inst.batch_to:
            self._retime(inst)
        self.mech.grant_changes += count

    def _fit(self, gpu: Gpu, inst: Instance, wanted: float, granted: bool = True) -> None:
        """Write ``wanted`` for ``inst`` as the node agent does: fitted so Σ quotas <= 1."""
        in_force = {i: o.grant for i, o in gpu.instances.items()}
        requests = {i: o.request for i, o in gpu.instances.items()}
        for iid, q in fit_quota(in_force, requests, inst.iid, min(1.0, max(0.0, wanted))):
            self._set_grant(gpu.instances[iid], q, granted)

    # ------------------------------------------------------------------ instances

    def _place(self, f: Function, slot: Slot | None = None) -> Instance | None:
        """Launch one instance of ``f`` where the placement policy puts it (``slot``: there, a
        migration's target); None when nothing can take it."""
        now = self.loop.now
        self.seq += 1
        iid = f"{f.name}-{self.seq}"
        if slot is not None:
            try:
                self.cluster.assign(iid, f.demand, [slot])
            except ValueError:
                return None
            slots = [slot]
        else:
            try:
                slots = self.cluster.place(iid, f.demand)
            except NoCapacity:
                self.facts.unplaced += 1
                return None
        self._account()
        gid = self.cluster.gpu_id(slots[0])
        gpu = self._gpu(gid, slots[0].node)
        d = f.demand
        self.live_req += d.request_quota
        self.facts.peak_active_gpus = max(self.facts.peak_active_gpus, self.cluster.active)
        self.facts.max_limit_sum = max(self.facts.max_limit_sum, round(self.cluster.gpus[gid].lim, 9))
        ready = now + self._process_start_ms(slots[0].node) + models.cold_start_ms(f.model)
        inst = Instance(iid, f, gpu, d.request_quota, d.limit_quota, 0.0, f.batch, ready, now, f.training,
                        f.spec.priority or default_priority(f.spec.kind))
        gpu.instances[iid] = inst
        self._wake(gpu)
        self.instances[iid] = inst
        f.instances[iid] = inst
        f.launches += 1
        self._fit(gpu, inst, d.request_quota if self.modes.initial_grant == "request" else d.limit_quota,
                  granted=False)
        inst.quota_since = now
        self.loop.at(ready, self._ready, inst)
        return inst

    def _gpu(self, gid: int, node: str) -> Gpu:
        """The simulated GPU of scheduler id ``gid`` on ``node``, made on first use."""
        gpu = self.gpus.get(gid)
        if gpu is None:
            gpu = self.gpus[gid] = Gpu(gid)
            self.node_gpus[node].append(gpu)
        return gpu

    def _process_start_ms(self, node: str) -> float:
        """The process start (ms) of an instance launched now on ``node``: the deploy's
        (:func:`deploy_start_ms`) at the deploy (0 ms); else by the instances already starting
        there when the config has a table for it (resumes are no process start), else the
        configured one."""
        if self.loop.now == 0.0:
            self.deploy_launches += 1
            return deploy_start_ms(self.cfg, self.deploy_launches - 1, self.phases[0])
        table = self.cfg.process_start_by_starting_ms
        if not table:
            return self.cfg.process_start_ms
        starting = sum(1 for g in self.node_gpus[node] for i in g.instances.values()
                       if i.state == "starting" and not i.resumed_ms)
        return table[min(starting, len(table) - 1)]

    def _launch_training(self, f: Function) -> None:
        inst = self._place(f)
        if inst is not None:
            inst.busy = True  # always busy once ready; counted in the GPU's busy width then

    def _ready(self, inst: Instance) -> None:
        if inst.state != "starting":
            return
        inst.state = "ready"
        if inst.training:
            inst.gpu.busy_width += train_load(inst)
            inst.train_since = self.loop.now
            return
        self.horizontal.instance_ready(inst.fn.name, inst.iid, self.loop.now / 1000.0)
        inst.fn.ready.append(inst)
        inst.fetch_at = self.loop.now  # its puller's first fetch
        old = inst.fn.instances.get(inst.replaces) if inst.replaces else None
        inst.replaces = ""
        if old is not None:  # a migration: the old instance drains now that its replacement serves
            self.moved_out.add(old.iid)  # the scheduler's drain, not a horizontal retirement
            self._retire(old)
        self._start_batch(inst)

    def _park(self, inst: Instance) -> bool:
        """Park a ready, idle instance: its placement and share are freed, it keeps its weights
        in host memory and its CUDA context on its GPU (``Cluster.park``). False when it is
        serving (then it stays)."""
        if inst.state != "ready" or inst.busy:
            return False
        now = self.loop.now
        self._account()
        f, gpu = inst.fn, inst.gpu
        f.quota_ms += self._held_ms(inst, now)
        inst.quota_since, inst.grant = now, 0.0
        self.cluster.park(inst.iid)
        self.live_req -= inst.request
        f.ready.remove(inst)
        self._leave_gpu(inst)
        inst.state = "parked"
        self.facts.parks += 1
        self.mech.parks += 1
        return True

    def _resume(self, inst: Instance) -> None:
        """Bring a parked instance back (its weights copied back from host memory,
        :func:`models.resume_ms`) where :meth:`Cluster.resume_target` says: the GPU it left; when
        that has no room, it is retired and a new instance is placed and launched instead (a cold
        start); when no GPU has room either, it stays parked and the function's placements and
        resumes back off (the live scheduler refuses that resume and the horizontal scaler does
        the same)."""
        now = self.loop.now
        f = inst.fn
        slot = self.cluster.resume_target(f.demand, self.cluster.slot(inst.gpu.gid), inst.iid)
        if slot is None:
            self.facts.resumes_refused += 1
            new = self._place(f)  # before the parked one goes: the function is not at zero
            if new is None:
                self.backoff.failed(f.name, now / 1000.0)
                self.horizontal.resume_failed(f.name, inst.iid)
                return
            self.horizontal.instance_starting(f.name, new.iid, now / 1000.0)
            self.mech.scale_outs += 1
            self.facts.relaunches += 1
            self._gone_parked(inst)
            return
        self._account()
        self.cluster.unpark(inst.iid)
        self.cluster.assign(inst.iid, f.demand, [slot], check=False)
        self.live_req += inst.request
        gpu = self._gpu(self.cluster.gpu_id(slot), slot.node)
        inst.gpu = gpu
        gpu.instances[inst.iid] = inst
        self._wake(gpu)
        inst.state = "starting"
        inst.resumed_ms = now + self.horizontal.params(f.name).resume_ms  # the policy's own estimate
        self._fit(gpu, inst, inst.request if self.modes.initial_grant == "request" else inst.width, granted=False)
        inst.quota_since = now
        self.facts.resumes += 1
        self.mech.resumes += 1
        self.loop.at(inst.resumed_ms, self._ready, inst)

    def _leave_gpu(self, inst: Instance) -> None:
        """Take ``inst`` off its GPU (retired or parked): the vertical policy is told, as the
        node agent's InstanceRetired tells it live, and its neighbours get the grants it gives."""
        now, gpu = self.loop.now, inst.gpu
        del gpu.instances[inst.iid]
        grants = self.vertical.on_retired(gpu.gid, now, inst.iid)
        if not gpu.instances:
            del self.gpus[gpu.gid]
            self.awake.pop(gpu.gid, None)
        else:
            self._wake(gpu)
            for g in grants:
                target = gpu.instances.get(g.instance_id)
                if target is not None:
                    self._fit(gpu, target, g.quota)

    def _gone_parked(self, inst: Instance) -> None:
        """A parked instance is retired: its process ends, and the memory it kept is freed."""
        f = inst.fn
        self.cluster.unpark(inst.iid)
        inst.state = "gone"
        del self.instances[inst.iid]
        del f.instances[inst.iid]
        self._count_retirement(inst)
        self.horizontal.instance_retired(f.name, inst.iid)
        self._unreplaced(inst)
        if not f.instances:
            self.mech.scale_to_zero += 1

    def _count_retirement(self, inst: Instance) -> None:
        """Count a retirement as the live horizontal scaler counts its own (``dilu_retirements``):
        an instance drained because a migration's replacement took over is not one."""
        if inst.iid in self.moved_out:
            self.moved_out.discard(inst.iid)
        else:
            self.mech.retirements += 1

    def _unreplaced(self, inst: Instance) -> None:
        """``inst`` is gone: a replacement moving in for it starts as an ordinary instance."""
        for other in inst.fn.instances.values():
            if other.replaces == inst.iid:
                other.replaces = ""

    def _retire(self, inst: Instance) -> None:
        """Drain: a starting instance is cancelled, a busy one finishes its batch first, an idle
        one leaves when its open fetch expires, serving what that fetch still takes
        (:meth:`_close_fetch`)."""
        if inst.state in ("draining", "gone"):
            return
        if inst.state == "parked":
            self._gone_parked(inst)
            return
        was = inst.state
        inst.state = "draining"
        if was == "ready":
            inst.fn.ready.remove(inst)
        if inst.busy:
            return
        if was == "ready":
            self._close_fetch(inst)
        else:
            self._gone(inst)

    def _close_fetch(self, inst: Instance) -> None:
        """An idle instance told to drain: its puller sees the stop only when its open fetch
        returns, every :data:`FETCH_TIMEOUT_S` since it began (``fetch_at``), so until then a
        request that arrives is still delivered to it, served, and then it leaves; else it
        leaves when the fetch expires (live, a drain ends a whole number of fetches after the
        puller went idle, workqueue.FETCH_TIMEOUT_S)."""
        now = self.loop.now
        period = FETCH_TIMEOUT_S * 1000.0
        left = period - (now - inst.fetch_at) % period
        inst.fn.closing.append(inst)
        self.loop.at(now + left, self._fetch_expired, inst)

    def _fetch_expired(self, inst: Instance) -> None:
        """A draining instance's open fetch returned empty: it leaves."""
        f = inst.fn
        if inst in f.closing:
            f.closing.remove(inst)
            self._gone(inst)

    def _take_closing(self, inst: Instance) -> None:
        """A request came to a draining instance's open fetch (:meth:`_close_fetch`): it serves
        what that fetch delivers, then leaves."""
        inst.busy = False
        self._start_batch(inst)
        if not inst.busy:  # another instance took it meanwhile
            self._gone(inst)

    def _gone(self, inst: Instance) -> None:
        now = self.loop.now
        self._account()
        f, gpu = inst.fn, inst.gpu
        if inst.training:
            self._train_progress(inst)
            if inst.state == "ready":
                gpu.busy_width -= train_load(inst)
        f.quota_ms += self._held_ms(inst, now)
        inst.state = "gone"
        self.cluster.remove(inst.iid)
        self.live_req -= inst.request
        del self.instances[inst.iid]
        del f.instances[inst.iid]
        self._leave_gpu(inst)
        self._count_retirement(inst)
        if not f.training:
            self.horizontal.instance_retired(f.name, inst.iid)
            self._unreplaced(inst)
            if not f.instances:
                self.mech.scale_to_zero += 1

    def _defrag_tick(self, _=None) -> None:
        """The scheduler's defragmentation round (its ``defrag_interval_s``): the placement
        policy's :meth:`Cluster.plan_round`, as the live scheduler plans it, applied as
        relaunch-then-drain. Only ready inference instances move (not one already moving, nor
        training: its progress would be lost); the old one drains once its replacement is ready,
        and a GPU holding only such leaving instances or starting ones takes no one."""
        now = self.loop.now
        # priced with what the live scheduler knows of a move: the spec's cold start (the model's
        # load); the process start is the node's, which it is not told
        placed = {iid: Placed(i.state, i.replaces, i.training, i.fn.spec.cold_start_ms, i.request)
                  for iid, i in self.instances.items()}
        plan = self.cluster.plan_round(placed)
        for m in plan.migrations:
            old = self.instances[m.instance_id]
            new = self._place(old.fn, m.target)
            if new is None:
                break
            new.replaces = old.iid
            self.horizontal.instance_migrating(old.fn.name, new.iid, old.iid, now / 1000.0)
            self.facts.migrations += 1
            self.mech.migrations += 1
        nxt = now + self.defrag_every
        if nxt <= self.end:
            self.loop.at(nxt, self._defrag_tick)

    # ------------------------------------------------------------------ requests

    def _arrive(self, i: int) -> None:
        f = self.by_fn[i]
        f.pending.append(i)
        f.arrivals += 1
        f.asleep = False
        nxt = i + 1
        if nxt < len(self.sched):
            self.loop.at(self.sched[nxt], self._arrive, nxt)
        for inst in f.ready:
            if not inst.busy:
                if self.dispatch is None:
                    self._start_batch(inst)
                else:  # the idle puller's fetch delivers and decodes it: busy meanwhile
                    inst.busy = True
                    self.loop.at(self.loop.now + self.dispatch(), self._picked_up, inst)
                break
        else:
            if f.closing:  # no ready instance is idle: a draining one's open fetch takes it
                inst = f.closing.pop(0)
                inst.busy = True
                self.loop.at(self.loop.now + (self.dispatch() if self.dispatch is not None else 0.0),
                             self._take_closing, inst)
            if self.hconf.park_after_s and not f.ready:
                now_s = self.loop.now / 1000.0
                for iid in self.horizontal.on_arrival(f.name, now_s, backing_off=self.backoff.blocked(f.name, now_s)):
                    self._resume(f.instances[iid])

    def _start_batch(self, inst: Instance) -> None:
        f = inst.fn
        pending = f.pending
        if not pending:
            return
        now = self.loop.now
        sched, limit = self.sched, f.timeout_ms
        reqs = inst.inflight = []
        while pending and len(reqs) < inst.batch:
            i = pending.popleft()
            if now - sched[i] > limit:
                self._finish(i, sched[i] + limit, "timeout", False)
            else:
                reqs.append(i)
        if not reqs:
            return
        gpu = inst.gpu
        stretched = inst.cycles.launch(now)
        base = batch_ms(f.model, len(reqs), inst.width)
        slow = pace(inst.width, inst.grant)
        gpu.busy_width += inst.width
        stretch = gpu.busy_width if gpu.busy_width > 1.0 else 1.0
        if slow > 1.0:  # paced: the token bucket lets the first kernels ride its burst
            rate = 1.0 / slow
            balance = min(models.BURST_MS, inst.tokens + (now - inst.batch_to) * rate)  # refilled since
            dur, inst.tokens = models.bucket_paced_ms(base, f.kernels, rate, balance, stretch)
        else:
            rate, balance, dur = 1.0, models.BURST_MS, base * stretch
            inst.tokens = models.BURST_MS
        inst.plan = (now, base, f.kernels, rate, balance, stretch, now)
        inst.busy = True
        if gpu.quiet:
            self._wake(gpu)
        inst.batch_from, inst.batch_busy = now, base * stretch
        if now >= self.t0:
            self.consumed += inst.width * base
        # the live node's own time for a batch (the instance is busy for it; first order, it also
        # holds its width on the GPU meanwhile)
        inst.batch_extra = self.batch_extra() if self.batch_extra is not None else 0.0
        self._time_batch(inst, now + dur, base * stretch)
        if stretched is not None and inst.state == "ready" and not yields_share(inst.priority):
            self.facts.stretches[f.name] = self.facts.stretches.get(f.name, 0) + 1
            for g in self.vertical.on_stretch(gpu.gid, now, inst.iid, stretched):
                target = gpu.instances.get(g.instance_id)
                if target is not None:
                    self._fit(gpu, target, g.quota)

    def _time_batch(self, inst: Instance, end: float, busy_left: float) -> None:
        """The batch in hand leaves the device at ``end`` (ms), ``busy_left`` ms of the time to
        then busy on it and the rest waiting for tokens: its token wait, kernel-launch cycle and
        window share follow, and its end is scheduled (an end scheduled before is void)."""
        now = self.loop.now
        self._accrue(inst, now)  # what ran as timed before is in the window counters
        # the batch's token wait is its time less its busy time: new, or moved by a re-timing
        self.mech.token_wait_ms += end - (inst.batch_to if inst.batch_to > now else now + inst.batch_busy)
        dur = end - inst.batch_from
        inst.batch_to = end
        inst.accrued_at = now
        inst.device_share = min(1.0, busy_left / (end - now)) if end > now else 1.0  # token waits are not busy
        inst.cycles.served(end, dur, dur - inst.batch_busy)
        inst.batch_seq += 1
        self.loop.at(end + inst.batch_extra, self._end_batch, (inst, inst.batch_seq))

    def _retime(self, inst: Instance) -> None:
        """A grant written while ``inst`` has a batch on the device paces the kernels not yet
        launched at the new rate, as the interceptor reads the grant at each launch and wakes a
        launch waiting for tokens (interceptor.c, refresh_grant); those launched run on."""
        now = self.loop.now
        since, busy, kernels, rate, balance, stretch, free = inst.plan
        new = 1.0 / pace(inst.width, inst.grant)
        if not kernels or new == rate:
            return
        charged, balance, free = models.bucket_charged(busy, kernels, rate, balance, now - since, stretch, free - since)
        free = max(now, since + free)
        left, kernels = busy * (kernels - charged) / kernels, kernels - charged
        inst.plan = (now, left, kernels, new, balance, stretch, free)
        if kernels:
            dur, inst.tokens = models.bucket_paced_ms(left, kernels, new, balance, stretch, free - now)
            self._time_batch(inst, now + dur, free - now + left * stretch)

    @staticmethod
    def _accrue(inst: Instance, upto_ms: float) -> None:
        """Put the batch in hand's busy and token wait up to ``upto_ms`` (at most its end on the
        device) into the window counters, as the interceptor charges them kernel by kernel."""
        t = min(upto_ms, inst.batch_to)
        if t > inst.accrued_at:
            span = t - inst.accrued_at
            inst.win_busy_ms += span * inst.device_share
            inst.win_wait_ms += span * (1.0 - inst.device_share)
            inst.accrued_at = t

    def _end_batch(self, arg: tuple[Instance, int]) -> None:
        inst, seq = arg
        if seq != inst.batch_seq:  # re-timed since: its end is elsewhere
            return
        now = self.loop.now
        if self.batch_log is not None and inst.batch_from >= self.t0:
            self.batch_log.append((inst.fn.name, len(inst.inflight), inst.batch_to - inst.batch_from))
        self._accrue(inst, now)
        inst.busy = False
        inst.gpu.busy_width -= inst.width
        ready_ms, sched, transport = inst.ready_ms, self.sched, self.transport
        for i in inst.inflight:
            self._finish(i, now + transport() if transport is not None else now, "ok", ready_ms > sched[i])
            if inst.resumed_ms > sched[i]:
                self.facts.resume_waits += 1
            inst.recent_ms = recent_latency(inst.recent_ms, now - sched[i], inst.answered)
            inst.answered += 1
        inst.win_served = True
        inst.inflight = []
        inst.fetch_at = now  # the puller's next fetch
        pickup = self.pickup() if self.pickup is not None and inst.state == "ready" and inst.fn.pending else 0.0
        if pickup > 0.0:  # the live puller acks, fetches what is queued then and decodes it meanwhile
            inst.busy = True  # takes no batch meanwhile; what arrives joins the next one
            self.loop.at(now + pickup, self._picked_up, inst)
        else:
            self._picked_up(inst)

    def _picked_up(self, inst: Instance) -> None:
        """After a batch (and the pickup of the next, :attr:`Overheads.pickup_ms`), or the dispatch
        of a request to it while idle (:attr:`Overheads.dispatch_ms`): the instance serves its
        queue, or leaves when it was drained meanwhile."""
        inst.busy = False
        if inst.state == "draining":
            self._gone(inst)
        elif inst.state == "ready":
            self._start_batch(inst)

    def _finish(self, i: int, at_ms: float, status: str, cold: bool) -> None:
        self.done[i] = at_ms
        self.status[i] = status
        if cold:
            self.cold[i] = 1
            self.cold_total += 1
        if at_ms > self.last_answer:
            self.last_answer = at_ms
        self.finished += 1
        if self.finished == len(self.sched) and self.loop.now >= self.span_end:
            self._take_cut()

    def _cut_if_done(self, _=None) -> None:
        """At the span's end: the replay ends here if every request has ended already."""
        if self.cut is None and self.finished == len(self.sched):
            self._take_cut()

    def _take_cut(self) -> None:
        """The replay ends now: keep the GPU integrals, quota·s, training iterations and counters
        so far (the loop runs on to ``end`` for the timeline alone)."""
        self._account()
        now = self.loop.now
        for inst in self.instances.values():
            if inst.training:
                self._train_progress(inst)
        quota = {name: f.quota_ms for name, f in self.fns.items()}
        for inst in self.instances.values():
            quota[inst.fn.name] += self._held_ms(inst, now)
        self.cut = _Cut(at_ms=now, area=self.area, frag=self.frag, consumed=self.consumed, quota_ms=quota,
                        train_iters=dict(self.train_iters), mechanism=msgspec.structs.replace(self.mech),
                        launches={name: f.launches for name, f in self.fns.items()})

    def _wake(self, gpu: Gpu) -> None:
        """Something happens on ``gpu``: its telemetry resumes; training progress is accounted up
        to now first (at the stretch that held while it was quiet)."""
        if gpu.gid not in self.awake:
            for inst in gpu.instances.values():
                if inst.training:
                    self._train_progress(inst)
            self.awake[gpu.gid] = gpu
        gpu.quiet = 0

    # ------------------------------------------------------------------ training

    def _train_progress(self, inst: Instance) -> None:
        """Iterations of a training instance since it was last accounted, at its grant and the
        GPU's stretch now (piecewise constant between telemetry windows and grant changes)."""
        now = self.loop.now
        if inst.state != "ready" or now <= inst.train_since:
            return
        start = max(inst.train_since, self.t0)
        if now > start:
            it = iteration_ms(inst.fn.model, inst.fn.spec.max_batch, inst.width)
            dt = now - start
            n = dt / (it * pace(inst.width, inst.grant) * inst.gpu.stretch())
            inst.iterations += n
            self.train_iters[inst.fn.name] = self.train_iters.get(inst.fn.name, 0.0) + n
            self.consumed += min(inst.grant, inst.width) * dt / inst.gpu.stretch()
        inst.train_since = now

    # ------------------------------------------------------------------ control ticks

    def _vertical_tick(self, _=None) -> None:
        now = self.loop.now
        window = self.cfg.vertical_tick_ms
        for gpu in list(self.awake.values()):
            active = False
            for inst in gpu.instances.values():
                if inst.training:
                    self._train_progress(inst)
                    continue
                if inst.inflight:
                    self._accrue(inst, now)
                if inst.win_busy_ms or inst.win_served or inst.fn.pending or inst.state == "starting":
                    active = True
            gpu.quiet = 0 if active else gpu.quiet + 1
            if gpu.quiet > QUIET_WINDOWS and not self.vertical.windows_to_settle(gpu.gid):
                del self.awake[gpu.gid]  # nothing busy, queued or starting: grants have settled
                continue
            rows = []
            for inst in gpu.instances.values():
                f = inst.fn
                if inst.training:
                    busy = 1.0 if inst.state == "ready" else 0.0
                else:
                    busy = min(1.0, inst.win_busy_ms / window)
                rows.append(InstanceTelemetry(
                    instance_id=inst.iid, function=f.name, priority=inst.priority, quota=inst.grant,
                    request_quota=inst.request, limit_quota=inst.width, width=inst.width, busy_share=busy,
                    sm_time_share=busy * inst.width, wait_us=int(inst.win_wait_ms * 1000), slo_ms=f.slo_ms,
                    latency_ms_recent=inst.recent_ms, queue_depth=len(inst.inflight) if inst.busy else 0))
                if not inst.training:
                    if inst.state != "starting":
                        self.horizontal.set_busy(f.name, inst.iid, busy)
                    inst.win_busy_ms = inst.win_wait_ms = 0.0
                    inst.win_served = False
            for g in self.vertical.on_telemetry(gpu.gid, now, rows):
                target = gpu.instances.get(g.instance_id)
                if target is not None:
                    self._fit(gpu, target, g.quota)
        self.vtick += 1
        nxt = self.phases[1] + self.vtick * window
        if nxt <= self.end:
            self.loop.at(nxt, self._vertical_tick)

    def _horizontal_tick(self, _=None) -> None:
        """Every function's tick, as the live scaler's (record the backlog, decide, act), except
        for functions asleep: at zero instances, with nothing waiting, no pre-warm to come and
        only zero samples in their windows, where a decision cannot change anything. Such a
        function wakes at its next arrival; the zero samples its skipped ticks would have recorded
        within the stable window are recorded then, so its windows hold what they would have.
        Tick k runs at k x ``tick_ms`` (the measured period with overheads, else the nominal)."""
        tick = self.tick_ms
        k = self.htick
        now = self.loop.now
        now_s = now / 1000.0
        hp = self.horizontal
        due = [f for f in self.ticked if not f.asleep and not f.training and f.demand is not None]
        headroom: dict[str, float] = {}
        reach: dict[str, float] = {}
        if self.hconf.mode == "lazy":
            gpus = {i.gpu.gid: i.gpu for f in due for i in f.instances.values() if i.state != "parked"}
            shares = {gid: [InstanceShare(i.iid, i.fn.name, i.priority, i.grant, i.request, i.width)
                            for i in gpu.instances.values()]
                      for gid, gpu in gpus.items()}
            headroom, reach = vertical_room(shares)
        window_ticks = self.hconf.stable_window_s * 1000.0 / tick
        decided: list[tuple[Function, Decision, int]] = []  # (function, its decision, backlog or arrivals)
        for f in due:
            if f.last_tick < k - 1:  # woken: the zero samples of the skipped ticks still in the window
                first = max(f.last_tick + 1, math.floor(k - window_ticks) + 1)
                for j in range(first, k):
                    hp.record(f.name, j * tick / 1000.0, 0, 0)
            backlog = len(f.pending) + sum(len(i.inflight) for i in f.instances.values() if i.busy)
            arrived = f.arrivals
            hp.record(f.name, now_s, backlog, arrived)
            f.arrivals = 0
            f.last_tick = k
            if backlog:
                f.last_busy = k
            d = hp.decide(f.name, now_s, headroom.get(f.name, 0.0), backing_off=self.backoff.blocked(f.name, now_s),
                          reach=reach)
            decided.append((f, d, backlog or arrived))
        # the tick's placements, parks, resumes and retirements in the order the live scheduler
        # serves them (requests.request_order): a placement sent before a park of the same tick
        # does not count the room that park frees
        acting = [(f, d) for f, d, _ in decided if d.place or d.park or d.resume or d.retire]
        for step, j in request_order([d for _, d in acting]) if acting else ():
            f, d = acting[j]
            if step == "place":
                self._scale_out(f, d, now_s)
            elif step == "park":
                for iid in d.park:
                    inst = f.instances.get(iid)
                    if inst is None or not self._park(inst):
                        hp.park_failed(f.name, iid)
                for iid in d.resume:
                    inst = f.instances.get(iid)
                    if inst is not None:
                        self._resume(inst)
            else:
                for iid in d.retire:
                    inst = f.instances.get(iid)
                    if inst is not None:
                        self._retire(inst)
        for f, d, active in decided:
            if (self.sleep_idle and not f.instances and not active and d.desired == 0 and not d.panic
                    and not d.place and hp.idle_windows(f.name).prewarm_s == 0
                    and k - f.last_busy >= window_ticks):  # every sample in the stable window is 0
                f.asleep = True
        self.htick = k + 1
        nxt = self.htick * tick
        if nxt <= self.end:
            self.loop.at(nxt, self._horizontal_tick)

    def _scale_out(self, f: Function, d: Decision, now_s: float) -> None:
        """Place the instances ``d`` asks for (at most :data:`MAX_PLACE_COUNT`, as the live scaler
        asks at a time); none placed backs the function off (:class:`PlacementBackoff`)."""
        placed = 0
        for _ in range(min(d.place, MAX_PLACE_COUNT)):
            inst = self._place(f)
            if inst is None:
                break
            self.horizontal.instance_starting(f.name, inst.iid, now_s)
            placed += 1
        if placed:
            self.backoff.clear(f.name)
            self.mech.scale_outs += placed
        else:
            self.backoff.failed(f.name, now_s)

    def _sample(self, _=None) -> None:
        self._account()
        now = self.loop.now
        pa, pf, pc = self._sample_prev
        darea = self.area - pa
        alloc = (self.frag - pf) / darea if darea > 0 else 0.0
        idle = max(0.0, 1.0 - (self.consumed - pc) / darea) if darea > 0 else 0.0
        if darea > 0 or self.facts.timeline:  # the first row covers the first interval
            self.facts.timeline.append((round((now - self.t0) / 1000.0, 3), self.cluster.active, self.cold_total,
                                        round(alloc, 6), round(idle, 6)))
        self._sample_prev = (self.area, self.frag, self.consumed)
        if self.on_progress is not None and time.monotonic() - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = time.monotonic()  # the printing only: nothing simulated reads it
            self.on_progress((now - self.t0) / 1000.0, (self.end - self.t0) / 1000.0)
        step = self.cfg.sample_s * 1000.0
        if now + step <= self.end:
            self.loop.at(now + step, self._sample)

    # ------------------------------------------------------------------ run

    def run(self) -> tuple[report.Report, SimFacts]:
        """Simulate to the end; the live demo's Report of the run and the simulator's own facts."""
        started = time.perf_counter()
        loop = self.loop
        loop.at(self.phases[1], self._vertical_tick)
        loop.at(0.0, self._horizontal_tick)
        if self.defrag_every:
            loop.at(self.phases[2], self._defrag_tick)
        if self.sched:
            loop.at(self.sched[0], self._arrive, 0)
        loop.run(self.t0, raise_if_stopped)
        self._account()
        self.area = self.frag = self.consumed = 0.0  # GPU figures count from the replay's start
        self._sample_prev = (0.0, 0.0, 0.0)
        loop.at(self.t0, self._sample)
        loop.at(self.span_end, self._cut_if_done)
        loop.run(self.end, raise_if_stopped)  # a stop whose KeyboardInterrupt was lost ends it too
        self._close()
        self.facts.events = loop.processed
        rep = self._report()
        self.facts.compute_s = round(time.perf_counter() - started, 3)
        return rep, self.facts

    def _close(self) -> None:
        """Account what is still running at the end; requests still unanswered time out."""
        self._account()
        now = self.loop.now
        for inst in list(self.instances.values()):
            f = inst.fn
            if inst.training:
                self._train_progress(inst)
            f.quota_ms += self._held_ms(inst, now)
            inst.quota_since = now
            for i in inst.inflight:
                self._finish(i, self.sched[i] + f.timeout_ms, "timeout", False)
            inst.inflight = []
        for f in self.fns.values():
            while f.pending:
                i = f.pending.popleft()
                self._finish(i, self.sched[i] + f.timeout_ms, "timeout", False)

    def _report(self) -> report.Report:
        t0 = self.t0
        plan = self.work.plan
        sent = len(self.sched) if not self.sched else sum(1 for s in self.status if s)
        records = []
        for k, inv in enumerate(self.inv):
            if not self.status[k]:  # never sent (arrived after the end): not offered
                continue
            done = int(round((self.done[k] - t0) * 1e6))
            records.append(Record(id=inv.id, function=inv.function, scheduled_ns=inv.scheduled_ns,
                                  sent_ns=inv.scheduled_ns, done_ns=done, status=self.status[k],
                                  cold_start=bool(self.cold[k])))
        ratios = sorted((self.done[k] - self.sched[k]) / f.slo_ms for k, f in enumerate(self.by_fn)
                        if self.status[k] == "ok" and f.slo_ms > 0)
        if ratios:
            n = len(ratios)
            self.facts.latency_slo_cdf = [[q / CDF_POINTS, round(ratios[min(n - 1, max(0, math.ceil(q / CDF_POINTS * n) - 1))], 6)]
                                          for q in range(1, CDF_POINTS + 1)]
        wall_s = max(plan.duration_s, (self.last_answer - t0) / 1000.0, 1e-3)
        result = RunResult(records=records, wall_s=round(wall_s, 6), started_unix_ns=0, late_sends=0,
                           late_threshold_ms=0.0, max_late_ms=0.0, not_sent=len(self.sched) - sent)
        meta = {s.name: report.FunctionMeta(model=s.model, slo_ms=s.slo_ms, kind=s.kind) for s in self.work.specs}
        if self.cut is None:  # the replay never ended before the drain did: it ends now
            self._take_cut()
        cut = self.cut
        per_fn = {name: report.FunctionFacts(instance_launches=cut.launches[name],
                                             quota_seconds=round(cut.quota_ms[name] / 1000.0, 6))
                  for name, f in self.fns.items()}
        training = {name: report.TrainingFacts(iterations=int(cut.train_iters.get(name, 0.0)),
                                               seconds=round((cut.at_ms - t0) / 1000.0, 6))
                    for name, f in self.fns.items() if f.training}
        area = cut.area
        mech = cut.mechanism
        mech.token_wait_ms = max(0.0, round(mech.token_wait_ms, 3))  # never "-0.0" from float noise
        facts = report.RunFacts(
            functions=per_fn, training=training, mechanism=mech,
            active_gpu_seconds=round(area / 1000.0, 6),
            allocation_fragmentation=round(min(1.0, max(0.0, cut.frag / area)), 6) if area else 0.0,
            idle_fragmentation=round(min(1.0, max(0.0, 1.0 - cut.consumed / area)), 6) if area else 0.0)
        info = report.run_info(plan, result, policy=self.policy, gpus=self.cfg.gpus,
                               training_jobs=sum(s.kind == "training" for s in self.work.specs),
                               park_after_s=self.facts.park_after_s, defrag_interval_s=self.facts.defrag_interval_s,
                               simulated=True)
        return report.build_report(records, meta, facts, info)


class Interrupted(Exception):
    """A run stopped by KeyboardInterrupt: ``partial`` is :func:`simulate`'s output for the
    policies that had finished (``{}`` in ``policies`` when none had), ``policy`` the one under
    way (None: still profiling)."""

    def __init__(self, partial: dict, policy: str | None) -> None:
        super().__init__(f"interrupted {'while profiling' if policy is None else 'during ' + policy}")
        self.partial, self.policy = partial, policy


def simulate(cfg: SimConfig, policies: list[str], progress=None, tick=None) -> dict:
    """Every policy over the same workload: ``{"policies": {name: report dict}, "sim": {...}}``
    (the format of ``dilu compare --json`` plus the simulator's own figures, in ``sim``:
    configuration, and per policy ``events``, ``compute_s``, ``peak_active_gpus``,
    ``max_limit_sum``, ``unplaced``, ``stretches`` (per function), the ``timeline`` rows ``[t_s, active GPUs, cold-start
    requests so far, allocation fragmentation, idle fragmentation]`` every ``sample_s`` and the
    ``latency_slo_cdf``: [fraction, latency / SLO] at 200 quantiles of the completed requests). ``progress(name)`` is called
    before each policy, ``tick(name, simulated s done, s in all)`` every 10 wall seconds within
    one (printing only: the run is the same without). Raises ValueError for an unknown policy or a
    bad span; :class:`Interrupted`, with the policies finished so far, on KeyboardInterrupt."""
    for p in policies:
        modes(p)
    reports: dict = {}
    facts: dict = {}
    work, current = None, None
    try:
        work = prepare(cfg)
        for p in policies:
            current = p
            if progress is not None:
                progress(p)
            on = None if tick is None else (lambda done, total, p=p: tick(p, done, total))
            rep, f = Simulation(cfg, p, work, on_progress=on).run()
            reports[p] = rep.to_dict()
            facts[p] = {"events": f.events, "compute_s": f.compute_s, "peak_active_gpus": f.peak_active_gpus,
                        "max_limit_sum": f.max_limit_sum, "unplaced": f.unplaced, "parks": f.parks,
                        "resumes": f.resumes, "resumes_refused": f.resumes_refused, "relaunches": f.relaunches,
                        "migrations": f.migrations, "defrag_interval_s": f.defrag_interval_s,
                        "park_after_s": f.park_after_s, "warm_up_s": f.warm_up_s,
                        "loop_timing_replayed": f.loop_timing_replayed, "horizontal_tick_ms": f.horizontal_tick_ms,
                        "resume_waits": f.resume_waits, "stretches": dict(sorted(f.stretches.items())),
                        "timeline": [list(r) for r in f.timeline], "latency_slo_cdf": f.latency_slo_cdf}
    except KeyboardInterrupt:
        partial = _output(cfg, work, reports, facts) if work is not None else {"policies": {}}
        raise Interrupted(partial, current) from None
    return _output(cfg, work, reports, facts)


def _output(cfg: SimConfig, work: Workload, reports: dict, facts: dict) -> dict:
    conf = {"nodes": cfg.nodes, "gpus_per_node": cfg.gpus_per_node, "hours": cfg.hours, "speedup": cfg.speedup,
            "functions": cfg.functions, "keep_alive_s": cfg.keep_alive_s, "park_after_s": cfg.park_after_s,
            "defrag_interval_s": cfg.defrag_interval_s,
            "process_start_ms": cfg.process_start_ms,
            "process_start_by_starting_ms": list(cfg.process_start_by_starting_ms),
            "process_start_initial_ms": list(cfg.process_start_initial_ms),
            "overheads": None if cfg.overheads is None else cfg.overheads.source,
            "overheads_seed": None if cfg.overheads is None else
            (cfg.seed if cfg.overheads_seed is None else cfg.overheads_seed),
            "seed": cfg.seed, "training_jobs": cfg.training_jobs, "vertical_tick_ms": cfg.vertical_tick_ms,
            "horizontal_tick_ms": cfg.horizontal_tick_ms,
            "drain_s": cfg.drain_s}
    return {"policies": reports, "sim": {"config": conf, "policies": facts}}
