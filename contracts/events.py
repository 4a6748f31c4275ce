"""Typed events: the only thing Dilu's services share (DESIGN.md sections 4 and 5).

Rules that keep old and new services talking:
- every field added after the first release gets a default, so old decoders skip it and new
  decoders accept old messages (never set ``forbid_unknown_fields``);
- one event type per subject (see :mod:`dilu.contracts.subjects`), encoded as JSON;
- units are in the field names: ``_ms``, ``_us``, ``_ns`` (time), ``_bytes``; quotas and shares are
  fractions 0..1 of one GPU's compute (SM-time, DESIGN.md section 2).
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Bounds checked when an event is decoded (a malformed one is rejected and counted, never used).
# a quota or width: (0, 1], with the policies' float tolerance (sums such as 0.5900000000000001)
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1.000001)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**50)]  # memory sizes: up to 1 PiB
GpuIndex = Annotated[int, msgspec.Meta(ge=0, le=1023)]

FunctionKind = Literal["inference", "llm", "training"]
PriorityClass = Literal["latency-sensitive", "training", "best-effort"]


class Event(msgspec.Struct, kw_only=True):
    """Base of every event. ``ts_ns`` is the publisher's wall clock (Unix epoch ns) at publish."""

    ts_ns: int = 0


# --------------------------------------------------------------------------- functions and profiles


class Profile(msgspec.Struct, kw_only=True):
    """What the profiler found for one function.

    ``request_quota``: the guaranteed share (0..1) at which the function meets its SLO at
    ``batch_size``; ``limit_quota``: the share at which its burst batch (largest batch that
    still meets the SLO) runs; ``te``: throughput per quota (requests/s per unit of GPU) at
    the request setting; ``throughput_rps``/``latency_ms`` (p99): measured at the request
    setting; ``limit_throughput_rps``/``limit_latency_ms``: at the burst batch and the limit
    quota, i.e. an instance scaled up vertically (0: not measured); ``trials``: measurements the
    search made; ``backend``: what was measured (``surface``, ``emulated``, ``fake-driver``,
    ``gpu``).
    """

    function: str
    request_quota: float
    limit_quota: float
    batch_size: int
    burst_batch: int = 0
    te: float = 0.0
    throughput_rps: float = 0.0
    latency_ms: float = 0.0
    limit_throughput_rps: float = 0.0
    limit_latency_ms: float = 0.0
    trials: int = 0
    backend: str = "surface"


class FunctionSpec(msgspec.Struct, kw_only=True):
    """A deployed function, as stored in KV ``dilu-functions`` (key = ``token(name)``), the single
    source of truth every service rebuilds from. Written by ``dilu deploy`` from a spec file
    (``dilu.client.spec``), which validates it.

    - ``kind``: ``inference`` (one reply per request), ``llm`` (token chunks streamed, then the
      reply) or ``training`` (a long-running job that takes no requests).
    - ``entry``: the user's class, ``module:Name`` (module path relative to the function's code
      bundle, or an installed package); ``code``: the object-store key of that bundle in
      ``dilu-code`` (``sha256-<hex>``; empty: ``entry`` is importable on every node as it is).
      ``handler``: the older module form (``load(ctx)``/``predict(model, batch)``), used when
      ``entry`` is empty.
    - ``model``: the performance surface an emulated GPU times the function by (a catalogue name
      of :mod:`dilu.services.common.models`, e.g. ``resnet152``); empty: no emulated timing, so
      the function runs only on nodes that execute its code (real GPUs, CPU nodes).
    - ``slo_ms``: latency objective of one request from its scheduled send time; for ``llm`` the
      objective of a whole reply (derived from ``ttft_ms`` and ``tpot_ms``, see
      :func:`dilu.services.common.functions.request_slo_ms`); 0 for training.
    - ``memory_bytes``: device memory one instance holds (its reservation); ``cold_start_ms``:
      the model's load time on a fresh instance (emulated timing), excluding process start.
    - ``initial_scale``: instances started at deploy, before any request (Knative's
      ``initial-scale``; -1: the horizontal scaler's default); ``keep_alive_s``: how long an
      idle function keeps one instance (0: the scaler's policy decides).
    - ``profile``: a profile the operator gives (used as is, no trials); ``config``: string
      settings handed to the user's class (``ctx.config``).
    """

    name: str
    model: str = ""
    kind: FunctionKind = "inference"
    slo_ms: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    memory_bytes: int = 0
    handler: str = "dilu.services.node_agent.handlers.emulated"
    entry: str = ""
    code: str = ""
    priority: PriorityClass = "latency-sensitive"
    max_batch: int = 32
    min_instances: int = 0
    max_instances: int = 8
    initial_scale: int = -1
    keep_alive_s: float = 0.0
    cold_start_ms: float = 0.0
    profile: Profile | None = None
    config: dict[str, str] = {}


class FunctionDeployed(Event):
    """A function was deployed (or redeployed with a new spec); its spec is already in KV
    ``dilu-functions``."""

    spec: FunctionSpec


class FunctionUndeployed(Event):
    """A function was removed (its key deleted from ``dilu-functions``): the scheduler drains its
    instances, the horizontal scaler forgets it."""

    name: str


class ProfileReady(Event):
    """A profile is stored in the ``dilu-profiles`` KV bucket and ready to use."""

    profile: Profile


class ProfileRequest(Event):
    """Request-reply on ``dilu.v1.profiler.profile``: profile ``spec`` now."""

    spec: FunctionSpec


class ProfileReply(Event):
    ok: bool
    profile: Profile | None = None
    error: str = ""


class TrialRequest(Event):
    """Request-reply on ``dilu.v1.node.trial.<node>``: run one profiling trial on an emulated GPU.

    Runs ``repeats`` batches of ``batch`` for ``model`` at SM width ``quota`` paced by tokens to
    ``grant`` (fractions 0..1 of the GPU). ``grant`` 0 (the default, and every message from
    before the field existed) means ``grant = quota``: no pacing, the setting the A100 MPS
    surfaces were measured at. ``0 < grant < quota`` is an instance as deployed: width = its
    limit quota, paced to its request quota.
    """

    model: str
    batch: int
    quota: float
    repeats: int = 5
    gpu: int = -1
    grant: float = 0.0


class TrialReply(Event):
    """``latency_ms_p99`` / ``latency_ms_mean``: per batch, from the device timeline; throughput
    is requests/s (batch / latency, and for generative models requests of 32 tokens)."""

    ok: bool
    latency_ms_mean: float = 0.0
    latency_ms_p99: float = 0.0
    throughput_rps: float = 0.0
    error: str = ""


# --------------------------------------------------------------------------- placement


class Placement(msgspec.Struct, kw_only=True):
    """One instance placed on one GPU. Quotas are fractions 0..1 of that GPU's SM-time.

    ``width`` is the SM fraction the instance's kernels may occupy (the MPS active-thread
    percentage on a real GPU), fixed at launch; by default its limit quota. ``batch_size``: the
    largest batch the instance pulls (it takes what is queued, up to this). ``replaces``: set on
    an instance the scheduler's defragmentation launched to take over from another (that one is
    marked draining when this one is ready); "" otherwise. ``parked``: the horizontal scaler
    parked the idle instance (:class:`ParkRequest`): it pulls nothing and holds no SM share, its
    weights wait in host memory, and the scheduler does not count its demand on the GPU; it
    resumes on this GPU alone (its process is bound to it at launch).
    """

    instance_id: str
    function: str
    node: str
    gpu: GpuIndex
    request_quota: Fraction
    limit_quota: Fraction
    width: Fraction
    memory_bytes: Bytes
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    priority: PriorityClass = "latency-sensitive"
    model: str = ""
    handler: str = ""
    slo_ms: float = 0.0
    cold_start_ms: float = 0.0
    draining: bool = False
    replaces: str = ""  # a migration's replacement: the instance drained once this one is ready
    parked: bool = False  # idle, off the GPU, weights in host memory (ParkRequest)


class PlacementDecided(Event):
    """Informational copy of a placement-table change (the KV table drives launches).
    ``action``: ``place`` (a new instance), ``retire`` (marked draining), ``migrate`` (a
    replacement, see ``Placement.replaces``, or an instance placed again off a gone node),
    ``park`` / ``resume`` (:class:`ParkRequest`)."""

    placement: Placement
    action: Literal["place", "retire", "migrate", "park", "resume"] = "place"
    revision: int = 0


MAX_PLACE_COUNT = 64  # instances one PlaceRequest may ask for


class PlaceRequest(Event):
    """Request-reply on ``dilu.v1.scheduler.place``: place ``count`` new instances of ``function``
    (1..:data:`MAX_PLACE_COUNT`; ask again for more)."""

    function: str
    count: int = 1
    reason: str = ""


class PlaceReply(Event):
    ok: bool
    placements: list[Placement] = []
    error: str = ""


class AdmitRequest(Event):
    """Request-reply on ``dilu.v1.scheduler.admit``: could one instance of ``spec`` ever be
    placed (a node that can run it, a healthy GPU with its memory)? Asked by ``dilu deploy``
    before anything is stored, so a deploy that cannot succeed fails to the deployer."""

    spec: FunctionSpec


class AdmitReply(Event):
    """``ok``: some node could take an instance (``nodes``: how many); else ``error`` says why."""

    ok: bool
    nodes: int = 0
    error: str = ""


class RetireRequest(Event):
    """Request-reply on ``dilu.v1.scheduler.retire``: drain and remove one instance.

    With ``instance_id`` empty the scheduler picks the victim of ``function`` (the one whose
    removal leaves the least fragmentation; never a starting instance over a warm one); with
    ``room_for`` also set, only among those whose removal lets one instance of the function
    ``room_for`` fit where it ran, and it refuses when none would (retiring one then frees
    nothing that function can use).
    """

    function: str
    instance_id: str = ""
    reason: str = ""
    room_for: str = ""


class RetireReply(Event):
    ok: bool
    instance_id: str = ""
    error: str = ""


class ParkRequest(Event):
    """Request-reply on ``dilu.v1.scheduler.park``: park a ready, idle instance (``resume``
    false) or bring a parked one back (``resume`` true).

    Parking marks the placement ``parked``: the scheduler stops counting the instance's demand on
    its GPU and the node agent has the process stop pulling and move its weights to host memory.
    A resume re-seats the demand on the GPU the instance left when it still fits there (the
    agent has the process copy its weights back; it is ready again within
    :func:`~dilu.services.common.models.resume_ms`); when it does not fit, the scheduler places
    a new instance of the function instead (a cold start) and drains the parked one.
    """

    function: str
    instance_id: str
    resume: bool = False


class ParkReply(Event):
    """``ok``: done. ``relaunched``: on a resume that did not fit the instance's GPU, the new
    placement that replaces it (the parked instance is draining); None otherwise."""

    ok: bool
    relaunched: Placement | None = None
    error: str = ""


# --------------------------------------------------------------------------- instance lifecycle


class InstanceEvent(Event):
    """Base of the instance lifecycle events published by the node agent."""

    instance_id: str
    function: str
    node: str
    gpu: int


class InstanceLaunched(InstanceEvent):
    """The instance's process was started (its cold start begins)."""

    pid: int = 0


class InstanceReady(InstanceEvent):
    """The instance loaded its model and pulls requests. ``cold_start_ms``: launch to ready, or
    for a ``resumed`` instance, the resume signal to ready (its weights copied back from host
    memory). ``parkable``: its code can move its weights off the GPU and back (the emulated and
    built-in handlers can; a user's class when it has ``park`` and ``resume`` methods)."""

    cold_start_ms: float = 0.0
    resumed: bool = False
    parkable: bool = False


class InstanceParked(InstanceEvent):
    """The instance stopped pulling and moved its weights to host memory (its placement is
    ``parked``): it holds no SM share and no device memory but its CUDA context."""


class InstanceRetired(InstanceEvent):
    """The instance was drained and its process ended.

    ``reason``: ``retired`` (drained on the scheduler's word), ``crashed`` (it exited on its own;
    the agent launches it again), :data:`LOAD_FAILED` (its function could not be loaded: the
    agent does not launch it again), :data:`GAVE_UP` (it kept crashing: not launched again) or
    another word; ``error``: the instance's own one-line reason when it gave one (e.g. the
    function's import error), else empty.
    """

    reason: str = "retired"
    exit_code: int = 0
    error: str = ""


# InstanceRetired reasons after which the node agent launches the instance no more: the
# scheduler removes its placement, and `dilu deploy` reports the error to the deployer.
LOAD_FAILED = "load-failed"
GAVE_UP = "gave-up"


# --------------------------------------------------------------------------- telemetry and grants


class InstanceTelemetry(msgspec.Struct, kw_only=True):
    """One instance's counters over the last sampling window, read from its control block.

    ``busy_share``: fraction (0..1) of the window with one of its kernels on the device;
    ``sm_time_share`` = busy_share x width; ``wait_us``: time launches waited for tokens in the
    window; counters ending in ``_total`` are cumulative since launch. ``latency_ms_recent``:
    the instance's recent-latency average (ms from each request's scheduled send to the end of
    its batch; :func:`dilu.services.common.functions.recent_latency`, kept across windows, 0
    before its first request); ``queue_depth``: the requests of the batch it has in hand at the
    sample (0 when idle; not its function's work queue, which the horizontal scaler reads).
    ``memory_used_bytes``:
    device memory the instance holds through the interceptor's accounting, against its
    reservation ``memory_limit_bytes`` (0: none); ``oom_refusals``: allocations the interceptor
    refused with CUDA_ERROR_OUT_OF_MEMORY since launch.
    """

    instance_id: str
    function: str
    priority: PriorityClass = "latency-sensitive"
    quota: float = 0.0
    request_quota: float = 0.0
    limit_quota: float = 0.0
    width: float = 1.0
    busy_share: float = 0.0
    sm_time_share: float = 0.0
    launches_total: int = 0
    busy_us_total: int = 0
    wait_us_total: int = 0
    wait_us: int = 0
    cycles_total: int = 0
    last_cycle_us: int = 0
    baseline_cycle_us: int = 0
    slo_ms: float = 0.0
    latency_ms_recent: float = 0.0
    queue_depth: int = 0
    memory_used_bytes: int = 0
    memory_limit_bytes: int = 0
    oom_refusals: int = 0


class ProcessMemory(msgspec.Struct, kw_only=True):
    """Device memory one process holds on a GPU, as NVML reports it (``used_bytes``)."""

    pid: int
    used_bytes: int = 0


class NvmlSample(msgspec.Struct, kw_only=True):
    """What NVML says about one GPU at the end of a telemetry window (real or fake NVML).

    ``utilization_gpu``/``utilization_memory``: fractions 0..1 of NVML's last sample period in
    which a kernel ran / device memory was read or written; ``memory_used_bytes`` of
    ``memory_total_bytes``; ``power_w`` (W) and ``temperature_c`` (°C); ``throttle_reasons``: NVML's
    clock-event reason names that are active (``sw_power_cap``, ``hw_slowdown``, ...; idle is not
    listed); ``processes``: compute processes and the device memory each holds.
    """

    utilization_gpu: float = 0.0
    utilization_memory: float = 0.0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    power_w: float = 0.0
    temperature_c: float = 0.0
    throttle_reasons: list[str] = []
    processes: list[ProcessMemory] = []


class GpuTelemetry(Event):
    """Per-GPU telemetry from a node agent, every sampling period (``window_ms``).

    ``instances``: the interceptor's figures per instance; ``nvml``: the driver's view of the
    whole GPU, where NVML exists (None on a CPU node or when NVML could not be read).
    """

    node: str
    gpu: int
    window_ms: float
    instances: list[InstanceTelemetry] = []
    nvml: NvmlSample | None = None


class KernelCycleStretch(Event):
    """An instance's kernel-launch cycle took ``ratio`` x its baseline: contention."""

    node: str
    gpu: int
    instance_id: str
    function: str = ""
    span_us: int = 0
    baseline_us: int = 0
    ratio: float = 0.0
    detected_ns: int = 0


class TokenGrant(Event):
    """Set one instance's quota (fraction 0..1 of the GPU's SM-time). ``epoch`` increases per grant."""

    node: str
    gpu: int
    instance_id: str
    quota: float
    epoch: int = 0
    reason: str = ""
    cause_ns: int = 0


# --------------------------------------------------------------------------- nodes


class GpuInfo(msgspec.Struct, kw_only=True):
    """One GPU of a node, as NVML and the CUDA driver report it.

    ``index``: NVML index on the node (placements name it); ``uuid``: ``GPU-...`` (what
    ``CUDA_VISIBLE_DEVICES`` takes); ``memory_bytes``: total device memory; ``sms``: the driver's
    multiprocessor count; ``mig``: MIG mode enabled; ``compute_mode``: ``default``,
    ``exclusive-process`` or ``prohibited``; ``mps_client_limit``: clients the GPU takes at once
    (48 under MPS on Volta and later, NVIDIA MPS documentation; 0: no limit known);
    ``healthy``: False after a fatal Xid, an uncorrectable ECC error or when the GPU fell off
    the bus (``health_reason`` says which); an unhealthy GPU gets no new instance.
    """

    index: GpuIndex
    uuid: str
    name: str
    memory_bytes: Bytes
    sms: Count
    mig: bool = False
    compute_mode: str = "default"
    mps_client_limit: Count = 0
    healthy: bool = True
    health_reason: str = ""


class NodeInventory(Event):
    """A node agent's GPUs, published on ``dilu.v1.node.inventory.<node>`` and kept in the KV bucket
    ``dilu-nodes`` (key = node), refreshed every ``heartbeat_s``; a key older than the bucket's TTL
    means the node is gone.

    ``device``: ``nvml`` (real GPUs), ``emulated`` (the fake NVML and driver) or ``cpu``;
    ``agent_id``: one run of the agent (two agents claiming one node name are told apart by it);
    ``host``: the machine it runs on (host name and boot id) and ``pid`` its process there, so
    an agent restarted on the same machine can tell its dead predecessor from a live twin;
    ``driver_version``: NVML's driver version string; ``cuda_version``: the driver's CUDA version
    (``major.minor``); ``mps``: ``on`` (instances are MPS clients), ``off`` or ``unavailable``
    (MPS could not start: time-sliced, tokens alone).
    """

    node: str
    agent_id: str = ""
    host: str = ""
    pid: int = 0
    device: str = "emulated"
    driver_version: str = ""
    cuda_version: str = ""
    mps: str = "off"
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    started_ns: int = 0
    gpus: Annotated[list[GpuInfo], msgspec.Meta(max_length=1024)] = []


# --------------------------------------------------------------------------- horizontal scaling


class BurstWindowBreach(Event):
    """Load over a burst window exceeded capacity (``panic``: the short window did)."""

    function: str
    window_s: float
    rate_rps: float
    capacity_rps: float
    queue_depth: int = 0
    panic: bool = False


class FunctionStats(Event):
    """An instance's request counters over its last report period (about 1 s), published on
    ``dilu.v1.telemetry.function.<fn>.<instance>`` while it served anything; the node agent turns
    them into per-function Prometheus metrics.

    ``latency_ms``: each answered request's latency from its scheduled send time (at most
    :data:`STATS_MAX_LATENCIES` per report; the counts stay exact); ``ttft_ms``/``tpot_ms``: per
    streamed (``llm``) request, time to first token and mean time per output token;
    ``iterations``: training steps done in the period.
    """

    function: str
    instance_id: str
    node: str = ""
    ok: Count = 0
    errors: Count = 0
    cold_starts: Count = 0
    latency_ms: Annotated[list[float], msgspec.Meta(max_length=4096)] = []
    ttft_ms: Annotated[list[float], msgspec.Meta(max_length=4096)] = []
    tpot_ms: Annotated[list[float], msgspec.Meta(max_length=4096)] = []
    iterations: Count = 0
    period_ms: float = 0.0


STATS_MAX_LATENCIES = 1024  # latencies carried per FunctionStats report (one instance, one period)


class ScaleDecision(Event):
    """Informational: the horizontal scaler changed a function's instance count. ``direction``
    ``park``: idle instances parked (weights to host memory); ``resume``: parked ones brought back."""

    function: str
    direction: Literal["out", "in", "zero", "prewarm", "park", "resume"]
    count: int
    current: int = 0
    desired: int = 0
    reason: str = ""


class FunctionState(msgspec.Struct, kw_only=True):
    """The horizontal scaler's view of one function, kept in KV ``dilu-function-state`` (key =
    ``token(function)``) for ``dilu status`` and the gateway.

    ``instances``/``ready``: instances it counts (starting included) and those serving;
    ``desired``: its last target; ``placeable``: False while the scheduler refuses the function's
    instances (``reason`` says why, e.g. no GPU with room); ``decisions``: the last scale
    decisions carried out, newest last (at most :data:`STATE_DECISIONS`); ``updated_ns``: Unix ns.
    """

    function: str
    instances: Count = 0
    ready: Count = 0
    desired: Count = 0
    backlog: int = -1
    placeable: bool = True
    reason: str = ""
    decisions: list[ScaleDecision] = []
    updated_ns: int = 0


STATE_DECISIONS = 10


EVENT_TYPES: tuple[type[Event], ...] = (
    FunctionDeployed,
    FunctionUndeployed,
    ProfileReady,
    ProfileRequest,
    ProfileReply,
    TrialRequest,
    TrialReply,
    PlacementDecided,
    PlaceRequest,
    PlaceReply,
    AdmitRequest,
    AdmitReply,
    RetireRequest,
    RetireReply,
    ParkRequest,
    ParkReply,
    InstanceLaunched,
    InstanceReady,
    InstanceRetired,
    InstanceParked,
    GpuTelemetry,
    KernelCycleStretch,
    TokenGrant,
    BurstWindowBreach,
    ScaleDecision,
    NodeInventory,
    FunctionStats,
)
