"""The node agent: runs instances on its GPUs, owns their control blocks, publishes telemetry.

- Discovers its GPUs through NVML and the CUDA driver (:mod:`.devices`: the real libraries on a GPU
  node, the project's fake ones on an emulated node, by the same code) and keeps a
  :class:`NodeInventory` in KV ``dilu-nodes`` with a heartbeat every ``NODE_HEARTBEAT_S``; GPU health
  comes from NVML. It refuses to run under a node name another live agent holds (an agent
  restarted on the same host takes over at once), and stops if another agent takes its name
  later (two agents with one name would launch the same instances).
- Watches the placement table (JetStream KV ``dilu-placement``, the single source of truth) and
  launches, drains and retires the instances placed on this node.
- Creates each instance's control block (request quota as the fail-safe rate, width fixed at
  launch) and launches the instance process under the interceptor on the node's (emulated) GPU.
- Samples every block every ``sample_ms``: heartbeats it, detects kernel-cycle stretch and
  publishes :class:`KernelCycleStretch` at once; every ``telemetry_ms`` publishes one
  :class:`GpuTelemetry` per GPU and advances the GPU-cost integrals (exported as Prometheus
  counters, which the demo's report reads).
- An instance that exits on its own is launched again (same id, after ``RESTART_DELAY_S``) only
  while the table still places it on this node and not draining, at most ``MAX_RESTARTS``
  times; then it is retired as ``gave-up``. One that prints ``FAILED <reason>`` before ``READY``
  (its function cannot load) is retired as ``load-failed`` at once. Both InstanceRetired carry
  the error, and the scheduler removes their placements. An instance drained while still
  launching is stopped, never taken for a crash.
- Writes each :class:`TokenGrant` from the vertical scaler into the instance's block, and each
  new instance's initial grant, fitted so the quotas in force on a GPU never sum above 1
  (:func:`.grants.fit_quota`: neighbours above their requests are lowered first); exports
  ``dilu_gpu_quota_sum`` {gpu} (Σ in force now) and ``dilu_gpu_quota_sum_max`` {gpu} (the
  largest Σ ever written). Telemetry lists every instance holding a block, launching and
  draining ones too, so the vertical scaler counts their quotas.
- Exports per-function Prometheus metrics (:mod:`.function_metrics`) from the
  :class:`FunctionStats` its own instances publish (those naming this node).
- Parks and resumes instances as the table says (``Placement.parked``, set by the scheduler on
  the horizontal scaler's ParkRequest): SIGUSR1 has the process finish its batch, stop pulling
  and move its weights to host memory (it prints ``PARKED``: the agent publishes
  InstanceParked, leaves it out of telemetry and GPU-time accounting and hands its quota to its
  neighbours); SIGUSR2 has it copy them back (``READY`` again: InstanceReady with ``resumed``,
  its request quota written again). A parked placement with no process (the agent restarted, or
  the parked process died) is launched afresh when it is resumed.
- Serves profiling trials (``dilu.v1.node.trial.<node>``) on a trial worker under the interceptor
  (emulated GPUs only: a trial replays a model's kernels on the fake driver).

Stopping the agent (SIGTERM) drains and stops its instances (each answers the batch in hand;
queued requests wait in the work queue) and keeps their placements: an agent started again on the
node within ``NODE_TTL_S`` relaunches them; after that the scheduler places them on other nodes.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from hdrh.histogram import HdrHistogram
from prometheus_client import Counter, Gauge

from dilu.contracts import MalformedEvent, decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import logging as dlog
from dilu.services.common.bus import Bus
from dilu.services.common.functions import SAMPLE_MS
from dilu.services.common.metrics import MALFORMED
from dilu.services.common.natsconn import DEFAULT_URL, ENV_NATS, NatsOptions
from dilu.services.common.jsresources import PLACEMENT_KV_CONFIG, ensure_kv
from dilu.services.common.kvwatch import KvFollower
from dilu.services.common.nodes import nodes_bucket
from dilu.services.common.runner import StartFailed

from . import devices, segments
from .mps import FAILURE_WINDOW_S as MPS_FAILURE_WINDOW_S
from .mps import server_failed as mps_server_failed
from .accounting import Counters, GpuCost, Slot, sample_loop_stalled, stretch, window_use
from .claim import claim_refusal, host_identity
from .function_metrics import FunctionMetrics
from .function_metrics import problem as stats_problem
from .grants import fit_quota, quota_sum
from .instance import (AGENT_PID_ENV, DRAIN_TIMEOUT_S, FAILED_PREFIX, PARK_FAILED_PREFIX, PARK_SIGNAL, PARKABLE_WORD,
                       PARKED_LINE, READY_LINE, RESUME_SIGNAL)

LAUNCHES = Counter("dilu_instance_launches", "Instances launched", ["function"])
GRANT_CHANGES = Counter("dilu_grant_changes", "TokenGrants that changed an instance's quota")
TOKEN_WAIT_MS = Counter("dilu_token_wait_ms", "Time kernel launches waited for tokens (ms, summed)")
ACTIVE_GPU_S = Counter("dilu_active_gpu_seconds", "Seconds of GPUs holding at least one instance")
ALLOC_FRAG_S = Counter("dilu_allocation_frag_gpu_seconds", "Integral of (1 - sum request quotas) over active GPUs")
IDLE_FRAG_S = Counter("dilu_idle_frag_gpu_seconds", "Integral of (1 - sum SM-time shares) over active GPUs")
QUOTA_S = Counter("dilu_quota_seconds", "Integral of granted quota over time", ["function"])
STRETCHES = Counter("dilu_kernel_cycle_stretches", "Kernel-cycle stretch events published")
INSTANCES = Gauge("dilu_instances", "Instances on this node", ["state"])
REACTION_MS = Gauge("dilu_vertical_reaction_ms", "Stretch detected -> grant written to the control block (ms)", ["quantile"])
GPU_HEALTHY = Gauge("dilu_gpu_healthy", "1 while NVML reports the GPU healthy", ["gpu"])
QUOTA_SUM = Gauge("dilu_gpu_quota_sum", "Sum of the quotas in force on the GPU now (fraction of its SM-time)", ["gpu"])
QUOTA_SUM_MAX = Gauge("dilu_gpu_quota_sum_max", "Largest sum of quotas in force ever written on the GPU", ["gpu"])
OOM_REFUSALS = Counter("dilu_instance_oom_refusals", "Device allocations the interceptor refused past a reservation", ["function"])

FUNCTION_STATS_SUBJECTS = f"{subjects.PREFIX}.telemetry.function.*.*"  # every instance's FunctionStats
READY_TIMEOUT_S = 180.0
MAX_RESTARTS = 3
RESTART_DELAY_S = 1.0


EXIT_READ_GRACE_S = 0.5  # after an instance's exit: for the lines it wrote before it to be read
EXIT_POLL_S = 0.1  # how often an instance's exit is looked for


async def process_exit(proc: asyncio.subprocess.Process) -> int:
    """``proc``'s exit code once it has ended. Not ``proc.wait()``: in Python 3.11 that also waits
    until every pipe of the process is closed, which a child of it may keep open for ever; the
    return code is known as soon as the process is reaped."""
    while proc.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)
    return proc.returncode


@dataclass
class ManagedInstance:
    placement: ev.Placement
    state: str = "launching"  # launching -> ready (<-> parked) -> draining -> gone
    proc: asyncio.subprocess.Process | None = None
    cb: object | None = None
    cb_path: str = ""
    quota: float = 0.0
    launched_ns: int = 0
    last: Counters | None = None
    window_start: Counters | None = None
    snap: object | None = None  # the control block's last snapshot (CbSnapshot)
    oom_seen: int = 0  # allocation refusals already counted
    tasks: list[asyncio.Task] = field(default_factory=list)
    ready_seen: bool = False  # its READY line was read
    parkable: bool = False  # its READY line said its code can park
    resume_ns: int = 0  # when it was signalled to resume (wall ns); 0: no resume pending
    failed: str = ""  # the reason of its FAILED line, if any


class NodeAgent:
    """The node agent service (see module doc).

    ``device``: auto | nvml | emulated (:func:`.devices.open_device`); ``gpus``: GPUs to use (None:
    all, or 4 on an emulated node; 0: a CPU node running torch handlers); ``emulated_model``,
    ``memory_bytes``, ``sms``: the emulated GPUs' model and overrides; ``mps_dir``: the MPS
    daemon's pipe and log directories on a real GPU; ``heartbeat_s``: how often
    the inventory is refreshed in ``dilu-nodes``.
    """

    name = "node_agent"

    def __init__(
        self,
        node: str = "node0",
        gpus: int | None = 4,
        device: str = "auto",
        emulated_model: str = devices.DEFAULT_EMULATED,
        memory_bytes: int | None = None,
        sms: int | None = None,
        mps_dir: Path | None = None,
        sample_ms: float = SAMPLE_MS,
        telemetry_ms: float = 250.0,
        initial_grant: str = "request",
        nats: NatsOptions | str = DEFAULT_URL,
        instance_creds: Path | None = None,
        heartbeat_s: float = subjects.NODE_HEARTBEAT_S,
    ) -> None:
        self.node = node
        # instances connect as themselves (the instance role), not with the agent's credentials
        self.instance_nats = NatsOptions.of(nats).with_creds(instance_creds)
        self.cpu = gpus == 0
        self.device_args = dict(mode=device, node=node, gpus=gpus, emulated_model=emulated_model,
                                memory_bytes=memory_bytes, sms=sms, mps_dir=mps_dir)
        self.device: devices.Device | None = None
        self.gpus: list[devices.Gpu] = []
        self.agent_id = uuid.uuid4().hex
        self.host = host_identity()
        self.heartbeat_s = heartbeat_s
        self._inv_kv = None
        self._inv_rev = 0
        self._started_ns = time.time_ns()
        self.sample_s = sample_ms / 1000.0
        self._round_s = time.monotonic()  # when the sample loop last completed a round (monotonic s)
        self.telemetry_every = max(1, round(telemetry_ms / sample_ms))
        self.initial_grant = initial_grant
        self.instances: dict[str, ManagedInstance] = {}
        self.cost = GpuCost()
        self.bus: Bus | None = None
        self.log = dlog.get(self.name, node=node)  # lazy: the level run() configures later holds
        self._tasks: list[asyncio.Task] = []
        self._draining: set[asyncio.Task] = set()  # retirements the placement table asked for, in progress
        self._placements_watch: KvFollower | None = None
        self._stopping = False
        self._trial = None
        self._trial_lock = asyncio.Lock()
        self._started = False
        self._reaction = HdrHistogram(1, 60_000_000, 3)  # µs
        self._restarts: dict[str, int] = {}
        self._last_error: dict[str, str] = {}  # instance -> its last FAILED line
        self._placements: dict[str, ev.Placement] = {}  # this node's placements in the table now
        self._crashes: dict[int, list[float]] = {}  # GPU -> recent instance crash times (monotonic s)
        self._mps_servers: set[int] = set()  # MPS server PIDs at the last heartbeat
        self._mps_failed_at: dict[int, float] = {}  # GPU -> when its MPS server failed (monotonic s)
        self.request_stop = lambda: None  # the runner makes this stop the service
        self.function_metrics = FunctionMetrics()
        self.quota_sum_max: dict[int, float] = {}  # GPU -> largest Σ quotas in force ever written

    # ------------------------------------------------------------------ lifecycle

    def ready(self) -> bool:
        """Started, not stopping, and the sample loop has completed a round lately (a stuck loop
        means no telemetry and no stretch detection: see accounting.sample_loop_stalled)."""
        return self._started and not self._stopping and \
            not sample_loop_stalled(self._round_s, time.monotonic(), self.sample_s)

    async def start(self, bus: Bus) -> None:
        """Discover the GPUs, claim the node name in ``dilu-nodes``, then follow placements.
        Raises StartFailed (one line) when the device cannot run here or the name is taken."""
        self.bus = bus
        swept = await asyncio.to_thread(segments.sweep_dead)
        if swept:
            self.log.info("removed shared-memory segments of dead agents", count=len(swept))
        try:
            self.device = await asyncio.to_thread(devices.open_device, **self.device_args)
        except devices.DeviceError as exc:
            raise StartFailed(str(exc)) from None
        self.gpus = self.device.gpus if not self.cpu else [devices.Gpu(0, "cpu", "cpu", 0, 0)]
        if not self.cpu:
            from dilu.interceptor import native

            try:  # fail now, with what to run, if the native parts are not built
                native.interceptor_lib()
            except native.NativeMissing as exc:
                raise StartFailed(str(exc)) from None
        await self._claim_node()
        await bus.subscribe(f"{subjects.PREFIX}.grant.issued.{subjects.token(self.node)}.*", ev.TokenGrant, self._on_grant)
        await bus.serve(subjects.node_trial(self.node), ev.TrialRequest, self._on_trial)
        await bus.subscribe(FUNCTION_STATS_SUBJECTS, ev.FunctionStats, self._on_function_stats)
        kv = await self._placement_bucket()
        self._placements_watch = KvFollower(bus.nc, kv, self._on_entry, log=self.log, what=subjects.PLACEMENT_BUCKET)
        await self._placements_watch.start()  # a NATS restart is watched through (see KvFollower)
        self._tasks.append(asyncio.create_task(self._sample_loop()))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        self._started = True
        self.log.info("node agent started", device=self.device.kind, mps=self.device.mps_state,
                      gpus=[f"{g.index}:{g.name}:{g.uuid}" for g in self.device.gpus])

    async def stop(self) -> None:
        """Drain and retire every instance, then stop the loops (the runner drains NATS after)."""
        self._stopping = True
        if self._placements_watch is not None:  # the placement in hand is applied, no later one
            await self._placements_watch.stop()
        await asyncio.gather(*(self._end_parked(i) if i.state == "parked" else self._retire(i, "node stopping")
                               for i in list(self.instances.values())), *self._draining, return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._trial is not None:
            await self._trial.close()
        if self.device is not None:
            self.device.close()

    # ------------------------------------------------------------------ inventory

    def inventory(self) -> ev.NodeInventory:
        """This node's NodeInventory now (health as last polled)."""
        d = self.device
        return ev.NodeInventory(node=self.node, agent_id=self.agent_id, host=self.host, pid=os.getpid(),
                                device=d.kind, driver_version=d.driver_version,
                                cuda_version=d.cuda_version, mps=d.mps_state, heartbeat_s=self.heartbeat_s,
                                started_ns=self._started_ns, gpus=d.inventory(), ts_ns=time.time_ns())

    async def _claim_node(self) -> None:
        """Put the first inventory, unless another live agent holds this node name (see
        .claim.claim_refusal). Raises StartFailed then."""
        self._inv_kv = await nodes_bucket(self.bus.js, replicas=self.bus.options.replicas, log=self.bus.log)
        key = subjects.token(self.node)
        try:
            held = decode((await self._inv_kv.get(key)).value, ev.NodeInventory)
        except (KeyNotFoundError, MalformedEvent):
            held = None
        refusal = claim_refusal(held, agent_id=self.agent_id, host=self.host, now_ns=time.time_ns(),
                                ttl_s=subjects.NODE_TTL_S)
        if refusal:
            raise StartFailed(refusal)
        inv = self.inventory()
        self._inv_rev = await self._inv_kv.put(key, encode(inv))
        await self.bus.publish(subjects.node_inventory(self.node), inv)

    async def _heartbeat_loop(self) -> None:
        """Every ``heartbeat_s``: poll GPU health, re-put the inventory (compare-and-set on our own
        revision, so a second agent under our name is noticed) and publish it."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                for g in await asyncio.to_thread(self.device.health):
                    self.log.error("GPU unhealthy: it gets no new instance", gpu=g.index, uuid=g.uuid, reason=g.reason)
                for g in self.device.gpus:
                    GPU_HEALTHY.labels(str(g.index)).set(1 if g.healthy else 0)
                if self.device.mps is not None and self.device.mps.state == "on":
                    self._mps_servers = await asyncio.to_thread(self.device.mps.servers)
                inv = self.inventory()
                try:
                    self._inv_rev = await self._inv_kv.update(subjects.token(self.node), encode(inv), last=self._inv_rev)
                except KeyWrongLastSequenceError:
                    if await self._lost_name():
                        return
                    self._inv_rev = await self._inv_kv.put(subjects.token(self.node), encode(inv))
                await self.bus.publish(subjects.node_inventory(self.node), inv)
            except Exception as exc:  # NATS away for a while: the next beat tries again
                self.log.warning("inventory heartbeat failed", error=repr(exc))

    async def _lost_name(self) -> bool:
        """Another agent wrote our key: if it is a different agent, stop this one (True)."""
        try:
            other = decode((await self._inv_kv.get(subjects.token(self.node))).value, ev.NodeInventory)
        except (KeyNotFoundError, MalformedEvent):
            return False  # expired or purged: just put ours again
        if other.agent_id == self.agent_id:
            return False
        self.log.error("another agent took this node name; stopping", node=self.node, other_agent=other.agent_id)
        self.request_stop()
        return True

    async def _placement_bucket(self):
        # created with the scheduler's settings when missing (either may start first); an existing
        # bucket is bound as it is, differences warned about
        kv, _found = await ensure_kv(self.bus.js, PLACEMENT_KV_CONFIG, replicas=self.bus.options.replicas,
                                     log=self.bus.log)
        return kv

    # ------------------------------------------------------------------ placements

    async def _on_entry(self, entry) -> None:
        if entry.operation in ("DEL", "PURGE"):
            self._placements.pop(entry.key, None)
            self._forget(entry.key)  # also when it runs nowhere now (crashed, awaiting relaunch)
            inst = self.instances.get(entry.key)
            if inst is not None:
                self._retire_soon(inst, "placement removed")
            return
        try:
            placement = decode(entry.value, ev.Placement)
            if placement.instance_id != entry.key:  # deleting the key must stop the instance
                raise MalformedEvent(f"instance_id {placement.instance_id!r} is not the key")
        except MalformedEvent as exc:
            MALFORMED.labels(self.name, f"kv:{subjects.PLACEMENT_BUCKET}").inc()
            self.log.warning("malformed placement rejected", key=entry.key, reason=str(exc))
            return
        if placement.node != self.node:
            self._placements.pop(placement.instance_id, None)
            return
        self._placements[placement.instance_id] = placement
        inst = self.instances.get(placement.instance_id)
        if inst is not None and not placement.draining:
            self._follow_park(inst, placement)
            return
        if placement.draining:
            if inst is not None:
                self._retire_soon(inst, "drained by scheduler")
            elif not self._stopping:  # nothing runs it (it crashed, or ended before): say so, the scheduler frees it
                await self._publish_instance("retired", ev.InstanceRetired(
                    instance_id=placement.instance_id, function=placement.function, node=self.node,
                    gpu=placement.gpu, reason="retired"))
            return
        if inst is None and not self._stopping and not placement.parked:  # parked, no process: launched on resume
            if not 0 <= placement.gpu < len(self.gpus):
                MALFORMED.labels(self.name, f"kv:{subjects.PLACEMENT_BUCKET}").inc()
                self.log.warning("placement names a GPU this node lacks", instance=placement.instance_id, gpu=placement.gpu)
                return
            if not self.gpus[placement.gpu].healthy:
                self.log.warning("placement on an unhealthy GPU not launched", instance=placement.instance_id,
                                 gpu=placement.gpu, reason=self.gpus[placement.gpu].reason)
                return
            await self._launch(placement)

    def _retire_soon(self, inst: ManagedInstance, reason: str) -> None:
        """Retire ``inst`` in a task of its own: a drain takes up to ``DRAIN_TIMEOUT_S``, and the
        placement entries after this one (launches among them) must not wait for it. :meth:`stop`
        waits for these tasks."""
        task = asyncio.create_task(self._retire(inst, reason))
        self._draining.add(task)  # held while it runs (the loop keeps only weak references)
        task.add_done_callback(self._draining.discard)

    def _follow_park(self, inst: ManagedInstance, p: ev.Placement) -> None:
        """The table parked or resumed ``inst``: signal its process (SIGUSR1 park, SIGUSR2
        resume); its stdout says when it is done (:meth:`_on_line`). A process still loading
        applies the signal once loaded."""
        was = inst.placement.parked
        inst.placement = p
        if p.parked == was or inst.proc is None or inst.proc.returncode is not None:
            return
        if not p.parked:
            inst.resume_ns = time.time_ns()
        try:
            inst.proc.send_signal(PARK_SIGNAL if p.parked else RESUME_SIGNAL)
        except ProcessLookupError:  # it just ended: its exit is handled there
            return
        self.log.info("instance parking" if p.parked else "instance resuming", instance=p.instance_id)

    async def _launch(self, p: ev.Placement) -> None:
        """Start the instance of placement ``p``. A failure before its process runs (its control
        block, its environment, the exec) leaves nothing behind: no instance entry, no block."""
        inst = ManagedInstance(placement=p, launched_ns=time.time_ns())
        self.instances[p.instance_id] = inst
        try:
            await self._start_process(inst)
        except Exception:
            self.instances.pop(p.instance_id, None)
            self._free_block(inst)
            raise
        if inst.state != "launching":  # drained or removed while its process was being started
            await self._abandon(inst)
            return
        LAUNCHES.labels(p.function).inc()
        await self._publish_instance("launched", ev.InstanceLaunched(
            instance_id=p.instance_id, function=p.function, node=self.node, gpu=p.gpu, pid=inst.proc.pid))
        inst.tasks.append(asyncio.create_task(self._await_ready(inst)))
        self.log.info("instance launched", instance=p.instance_id, function=p.function, gpu=p.gpu, quota=inst.quota,
                      width=p.width)

    async def _abandon(self, inst: ManagedInstance) -> None:
        """Stop the process and free the block of an instance retired (InstanceRetired already
        published) before its launch finished: it has served nothing, so no drain."""
        if inst.proc is not None and inst.proc.returncode is None:
            try:
                inst.proc.kill()
            except ProcessLookupError:
                pass
            await process_exit(inst.proc)
        self._free_block(inst)
        self.log.info("instance launch abandoned: its placement was drained", instance=inst.placement.instance_id)

    def _placement_live(self, instance_id: str) -> ev.Placement | None:
        """The table's placement of ``instance_id`` if it is on this node and not draining."""
        p = self._placements.get(instance_id)
        return p if p is not None and p.node == self.node and not p.draining else None

    async def _start_process(self, inst: ManagedInstance) -> None:
        """The instance's control block, environment and process (see :meth:`_launch`)."""
        p = inst.placement
        quota = p.request_quota if self.initial_grant == "request" else p.limit_quota
        gpu = self.gpus[p.gpu]
        env = dict(os.environ)
        device = self.device.handler_device
        if not self.cpu:
            from dilu.interceptor import native
            from dilu.interceptor.control_block import ControlBlock

            inst.cb_path = segments.control_block_path(self.node, p.instance_id)
            inst.cb = ControlBlock.create(inst.cb_path, p.instance_id, request_quota=p.request_quota, width=p.width,
                                          memory_limit_bytes=p.memory_bytes)
            self._apply_quota(inst, quota)
            env = native.interceptor_env(inst.cb_path, width=p.width, request_quota=p.request_quota, base=env)
            env = self.device.gpu_env(env, gpu, width=p.width, memory_bytes=p.memory_bytes)
        else:
            inst.quota = quota
        for key in ENV_NATS:  # never the agent's own credentials
            env.pop(key, None)
        env.update(self.instance_nats.env())
        env[AGENT_PID_ENV] = str(os.getpid())  # the instance exits at once if it started orphaned
        args = [
            sys.executable, "-m", "dilu.services.node_agent.instance",
            "--instance-id", p.instance_id, "--function", p.function, "--model", p.model or "none",
            "--handler", p.handler or "dilu.services.node_agent.handlers.emulated",
            "--batch-size", str(max(1, p.batch_size)), "--width", f"{max(0.01, min(1.0, p.width)):.4f}",
            "--device", device, "--nats-url", self.instance_nats.url, "--node", self.node,
        ]
        if inst.cb_path:
            args += ["--cb", inst.cb_path]
        # same process group as the agent: whoever stops the agent's group stops its instances too
        inst.proc = await asyncio.create_subprocess_exec(*args, env=env, stdout=asyncio.subprocess.PIPE)

    async def _await_ready(self, inst: ManagedInstance) -> None:
        """Follow the instance's stdout (``READY``, ``FAILED <reason>``) while waiting for its
        process to exit, then handle an exit the agent did not ask for (see :meth:`_exited`).
        The exit is noticed when the process ends, not when its stdout closes: a child of the
        instance may hold the pipe open for ever. Lines written before the exit are read first
        (within :data:`EXIT_READ_GRACE_S`); the pipe is drained aside after that."""
        proc = inst.proc
        reader = asyncio.create_task(self._follow_stdout(inst))
        inst.tasks.append(reader)
        code = await process_exit(proc)
        try:
            await asyncio.wait_for(asyncio.shield(reader), EXIT_READ_GRACE_S)
        except asyncio.TimeoutError:  # a child holds the pipe: keep draining it, decide now
            self.log.warning("instance exited but its stdout is still open (a child of it holds it)",
                             instance=inst.placement.instance_id, exit_code=code)
        await self._exited(inst, code, inst.failed, inst.ready_seen)

    async def _follow_stdout(self, inst: ManagedInstance) -> None:
        """Read the instance's stdout until it closes, recording READY and FAILED on ``inst``;
        a READY not seen within READY_TIMEOUT_S is logged (the instance is retired)."""
        proc, p = inst.proc, inst.placement
        try:
            while not inst.ready_seen:
                line = await asyncio.wait_for(proc.stdout.readline(), timeout=READY_TIMEOUT_S)
                if not line:
                    return
                inst.ready_seen, inst.failed = await self._on_line(inst, line, inst.failed)
        except asyncio.TimeoutError:
            self.log.error("instance not ready in time; retiring", instance=p.instance_id)
        # keep reading stdout so the pipe never blocks the instance, until it closes
        while proc.stdout and (line := await proc.stdout.readline()):
            inst.ready_seen, inst.failed = await self._on_line(inst, line, inst.failed, ready=inst.ready_seen)

    async def _on_line(self, inst: ManagedInstance, line: bytes, failed: str, ready: bool = False) -> tuple[bool, str]:
        """One stdout line of the instance: (READY seen, its FAILED reason so far)."""
        p = inst.placement
        text = line.decode(errors="replace").strip()
        if text.startswith(FAILED_PREFIX):
            return ready, text[len(FAILED_PREFIX):].strip() or "no reason given"
        word, _, rest = text.partition(" ")
        if word == READY_LINE:
            await self._instance_ready(inst, parkable=rest.strip() == PARKABLE_WORD)
            return True, failed
        if text == PARKED_LINE:
            await self._instance_parked(inst)
        elif text.startswith(PARK_FAILED_PREFIX):
            self.log.warning("instance could not park", instance=p.instance_id,
                             error=text[len(PARK_FAILED_PREFIX):].strip())
        return ready, failed

    async def _instance_ready(self, inst: ManagedInstance, parkable: bool) -> None:
        """A READY line: the instance's first (InstanceReady with its cold start) or the end of a
        resume (InstanceReady ``resumed``, with the resume's duration; its request quota is
        written again). A READY repeated while serving says nothing new."""
        p = inst.placement
        inst.parkable = parkable
        if inst.state == "launching":  # not for one being drained already
            inst.state = "ready"
            cold_ms = (time.time_ns() - inst.launched_ns) / 1e6
            await self._publish_instance("ready", ev.InstanceReady(
                instance_id=p.instance_id, function=p.function, node=self.node, gpu=p.gpu, cold_start_ms=cold_ms,
                parkable=parkable))
            self.log.info("instance ready", instance=p.instance_id, cold_start_ms=round(cold_ms, 1))
        elif inst.state in ("ready", "parked") and inst.resume_ns and not p.parked:
            resume_ms = (time.time_ns() - inst.resume_ns) / 1e6
            inst.resume_ns = 0
            if inst.state == "parked":
                inst.state = "ready"
                inst.window_start = inst.last  # its telemetry starts afresh, not over the parked span
                if inst.cb is not None:
                    self._apply_quota(inst, p.request_quota if self.initial_grant == "request" else p.limit_quota)
            await self._publish_instance("ready", ev.InstanceReady(
                instance_id=p.instance_id, function=p.function, node=self.node, gpu=p.gpu, cold_start_ms=resume_ms,
                resumed=True, parkable=parkable))
            self.log.info("instance resumed", instance=p.instance_id, resume_ms=round(resume_ms, 1))

    async def _instance_parked(self, inst: ManagedInstance) -> None:
        """A PARKED line: the instance holds no SM share now (its quota no longer counts on the
        GPU, so neighbours may be granted it) and no weights on the device."""
        p = inst.placement
        if inst.state not in ("launching", "ready"):
            return
        inst.state, inst.quota = "parked", 0.0
        self._note_quota_sum(p.gpu)
        await self._publish_instance("parked", ev.InstanceParked(
            instance_id=p.instance_id, function=p.function, node=self.node, gpu=p.gpu))
        self.log.info("instance parked", instance=p.instance_id)

    async def _exited(self, inst: ManagedInstance, code: int, failed: str, ready: bool) -> None:
        """The instance's process ended. Asked to (being drained, or retired already, or the
        agent stopping): nothing to do, :meth:`_retire` finishes it. Otherwise: before
        ``READY`` with a ``FAILED`` line, its function cannot load: retired as LOAD_FAILED and
        not launched again; else a crash, relaunched (:meth:`_relaunch`) up to ``MAX_RESTARTS``
        times and then retired as GAVE_UP. Those two InstanceRetired carry the error."""
        p = inst.placement
        if inst.state == "parked" and not self._stopping:
            await self._lost_parked(inst, code)
            return
        if inst.state not in ("launching", "ready") or self._stopping:
            return
        self.log.warning("instance exited unexpectedly", instance=p.instance_id, exit_code=code, error=failed)
        if failed and not ready:
            self.log.error("instance cannot load its function; not relaunched", instance=p.instance_id, error=failed)
            await self._finish(inst, ev.LOAD_FAILED, code, error=failed)
            self._forget(p.instance_id)
            return
        if failed:
            self._last_error[p.instance_id] = failed
        mps_failure = await self._mps_failed(p.gpu)
        n = self._restarts.get(p.instance_id, 0) + (not mps_failure)
        self._restarts[p.instance_id] = n
        if n > MAX_RESTARTS:
            error = self._last_error.get(p.instance_id) or f"exit code {code}"
            self.log.error("instance keeps crashing; not relaunched", instance=p.instance_id, restarts=n - 1, error=error)
            await self._finish(inst, ev.GAVE_UP, code, error=error)
            self._forget(p.instance_id)
            return
        await self._finish(inst, "mps server failed" if mps_failure else "crashed", code, error=failed)
        await self._relaunch(p)

    async def _end_parked(self, inst: ManagedInstance) -> None:
        """The agent stops with ``inst`` parked: end its process (nothing in hand: it exits at
        once) but report no retirement, so its placement stays parked for the horizontal scaler
        to resume (the next agent launches it then) or retire."""
        proc = inst.proc
        self._drop_process(inst)
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(process_exit(proc), timeout=DRAIN_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
            except ProcessLookupError:
                pass

    def _drop_process(self, inst: ManagedInstance) -> None:
        """Forget ``inst``'s process and free its block, its placement untouched (parked)."""
        p = inst.placement
        inst.state = "gone"
        self.instances.pop(p.instance_id, None)
        self._free_block(inst)

    def _free_block(self, inst: ManagedInstance) -> None:
        """Close and delete ``inst``'s control block (if it has one); its quota leaves the GPU's sum."""
        if inst.cb is not None:
            inst.cb.close()
            Path(inst.cb_path).unlink(missing_ok=True)
            inst.cb = None
            self._note_quota_sum(inst.placement.gpu)

    async def _lost_parked(self, inst: ManagedInstance, code: int) -> None:
        """A parked instance's process ended on its own. It served nothing and its placement stays
        parked: only the process and its block go; a resume launches it afresh (a cold start)."""
        p = inst.placement
        self.log.warning("parked instance exited; launched again when resumed", instance=p.instance_id, exit_code=code)
        self._drop_process(inst)
        live = self._placement_live(p.instance_id)
        if live is not None and not live.parked and not self._stopping:  # resumed meanwhile
            await self._launch(live)

    def _forget(self, instance_id: str) -> None:
        """Drop what the agent keeps about ``instance_id`` across relaunches (its restart count
        and last error): once it is retired for good nothing per instance may stay, or a node
        that runs instances for months grows with each one."""
        self._restarts.pop(instance_id, None)
        self._last_error.pop(instance_id, None)

    async def _mps_failed(self, gpu: int) -> bool:
        """Whether this crash is part of an MPS server failure on ``gpu`` (every client of the
        server fails at once: see .mps.server_failed); the clients that crash with it within
        the failure window are part of the same failure. Logged once per failure."""
        mps = self.device.mps if self.device is not None else None
        if mps is None or mps.state != "on":
            return False
        now = time.monotonic()
        if now - self._mps_failed_at.get(gpu, float("-inf")) <= MPS_FAILURE_WINDOW_S:
            return True
        crashes = self._crashes.setdefault(gpu, [])
        crashes[:] = [t for t in crashes if now - t <= MPS_FAILURE_WINDOW_S] + [now]
        servers = await asyncio.to_thread(mps.servers)
        failed = mps_server_failed(crashes, now, self._mps_servers, servers)
        self._mps_servers = servers
        if failed:
            self._mps_failed_at[gpu] = now
            self.log.error("MPS server failed: relaunching the GPU's clients", gpu=gpu)
        return failed

    async def _relaunch(self, p: ev.Placement) -> None:
        """A crashed instance keeps its placement: launch it again after ``RESTART_DELAY_S``,
        only while the table still places it on this node and not draining (a placement
        drained or removed meanwhile ends it for good), as the table now has it."""
        await asyncio.sleep(RESTART_DELAY_S)
        if self._stopping or p.instance_id in self.instances:
            return
        live = self._placement_live(p.instance_id)
        if live is None:
            self.log.info("crashed instance not relaunched: its placement is gone or draining", instance=p.instance_id)
            self._forget(p.instance_id)
            return
        if live.parked:  # parked meanwhile: launched when it is resumed
            return
        await self._launch(live)

    async def _retire(self, inst: ManagedInstance, reason: str) -> None:
        """Drain: SIGTERM (the instance finishes its batch and stops pulling), SIGKILL after
        ``DRAIN_TIMEOUT_S``; then publish InstanceRetired and remove the block."""
        if inst.state in ("draining", "gone"):
            return
        inst.state = "draining"
        proc = inst.proc
        code = 0
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(process_exit(proc), timeout=DRAIN_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
                code = await process_exit(proc)
            except ProcessLookupError:
                pass
        await self._finish(inst, reason, code if code is not None else 0)
        self._forget(inst.placement.instance_id)  # retired for good: not relaunched

    async def _finish(self, inst: ManagedInstance, reason: str, code: int, error: str = "") -> None:
        if inst.state == "gone":
            return
        inst.state = "gone"
        p = inst.placement
        self.instances.pop(p.instance_id, None)
        self._free_block(inst)
        await self._publish_instance("retired", ev.InstanceRetired(
            instance_id=p.instance_id, function=p.function, node=self.node, gpu=p.gpu, reason=reason, exit_code=code or 0,
            error=error))
        self.log.info("instance retired", instance=p.instance_id, reason=reason, exit_code=code)

    async def _publish_instance(self, state: str, event: ev.InstanceEvent) -> None:
        if self.bus and self.bus.nc.is_connected:
            await self.bus.publish(subjects.instance_state(state, self.node), event)

    # ------------------------------------------------------------------ grants

    async def _on_function_stats(self, stats: ev.FunctionStats, msg) -> None:
        """An instance's FunctionStats: exported when it names this node (other nodes' reports
        are theirs); one that makes no sense is rejected and counted as malformed."""
        if stats.node != self.node:
            return
        reason = stats_problem(stats)
        if reason:
            MALFORMED.labels(self.name, FUNCTION_STATS_SUBJECTS).inc()
            self.log.warning("function stats rejected", subject=msg.subject, reason=reason)
            return
        self.function_metrics.observe(stats)

    async def _on_grant(self, grant: ev.TokenGrant, _msg) -> None:
        inst = self.instances.get(grant.instance_id)
        if inst is None or inst.cb is None or inst.state in ("gone", "parked"):  # parked: it holds no share
            return
        if not 0.0 < grant.quota <= 1.0:
            raise ValueError(f"grant quota {grant.quota} outside (0, 1]")
        before = inst.quota
        self._apply_quota(inst, grant.quota)
        if abs(inst.quota - before) > 1e-6:
            GRANT_CHANGES.inc()
        if inst.quota < grant.quota - 1e-6:
            self.log.info("grant clamped to what the GPU's other instances hold", instance=grant.instance_id,
                          gpu=inst.placement.gpu, granted=grant.quota, written=round(inst.quota, 6))
        if grant.cause_ns:  # a reaction to a stretch this agent detected: time it end to end
            self._reaction.record_value(max(1, (time.time_ns() - grant.cause_ns) // 1000))
            for q in (50.0, 99.0):
                REACTION_MS.labels(f"{q / 100:g}").set(self._reaction.get_value_at_percentile(q) / 1000.0)

    def _holding(self, gpu: int) -> list[ManagedInstance]:
        """The instances with a control block on ``gpu`` holding a share (launching, ready or
        draining; not parked)."""
        return [i for i in self.instances.values()
                if i.placement.gpu == gpu and i.cb is not None and i.state not in ("gone", "parked")]

    def _apply_quota(self, inst: ManagedInstance, wanted: float) -> None:
        """Write ``wanted`` (fraction 0..1) into ``inst``'s block as far as it fits: the quotas
        in force on its GPU never sum above 1 (:func:`.grants.fit_quota`); neighbours lowered
        are written first. Synchronous: no other grant interleaves. Raises ValueError for a
        quota outside [0, 1]."""
        gpu = inst.placement.gpu
        holding = [i for i in self._holding(gpu) if i is not inst]
        in_force = {i.placement.instance_id: i.quota for i in holding}
        requests = {i.placement.instance_id: i.placement.request_quota for i in holding + [inst]}
        by_id = {i.placement.instance_id: i for i in holding + [inst]}
        for iid, q in fit_quota(in_force, requests, inst.placement.instance_id, wanted):
            target = by_id[iid]
            target.cb.write_grant(q)
            target.quota = q
            if target is not inst:
                self.log.info("quota taken back for a neighbour", instance=iid, gpu=gpu, quota=round(q, 6),
                              for_instance=inst.placement.instance_id)
            self._note_quota_sum(gpu)

    def _note_quota_sum(self, gpu: int) -> None:
        """Export Σ quotas in force on ``gpu`` now and the largest Σ ever written."""
        total = quota_sum({i.placement.instance_id: i.quota for i in self._holding(gpu)})
        self.quota_sum_max[gpu] = top = max(self.quota_sum_max.get(gpu, 0.0), total)
        QUOTA_SUM.labels(str(gpu)).set(total)
        QUOTA_SUM_MAX.labels(str(gpu)).set(top)

    # ------------------------------------------------------------------ sampling

    def _counters(self, inst: ManagedInstance, now_ns: int) -> Counters | None:
        if inst.cb is None:
            return None
        s = inst.snap = inst.cb.snapshot()
        return Counters(at_ns=now_ns, busy_us=s.busy_us, wait_us=s.wait_us, launches=s.launches,
                        cycles=s.cycles, last_cycle_us=s.last_cycle_us, baseline_cycle_us=s.baseline_cycle_us)

    async def _sample_loop(self) -> None:
        tick = 0
        last_window_ns = time.monotonic_ns()
        self._round_s = time.monotonic()
        while True:
            await asyncio.sleep(self.sample_s)
            tick += 1
            now = time.monotonic_ns()
            for inst in list(self.instances.values()):
                try:
                    await self._sample(inst, now)
                except Exception as exc:  # one bad block must not stop telemetry for the others
                    self.log.warning("sample failed", instance=inst.placement.instance_id, error=repr(exc))
            if tick % self.telemetry_every == 0:
                await self._publish_window((now - last_window_ns) / 1e9)
                last_window_ns = now
            self._round_s = time.monotonic()

    async def _sample(self, inst: ManagedInstance, now: int) -> None:
        if inst.cb is None or inst.state == "gone":
            return
        inst.cb.heartbeat()
        cur = self._counters(inst, now)
        if inst.last is not None:
            r = stretch(inst.last, cur)
            if r is not None and inst.state == "ready":
                STRETCHES.inc()
                p = inst.placement
                await self.bus.publish(subjects.kernel_cycle_stretch(self.node, p.gpu), ev.KernelCycleStretch(
                    node=self.node, gpu=p.gpu, instance_id=p.instance_id, function=p.function,
                    span_us=cur.last_cycle_us, baseline_us=cur.baseline_cycle_us, ratio=r, detected_ns=time.time_ns()))
        inst.last = cur
        if inst.window_start is None:
            inst.window_start = cur

    async def _publish_window(self, dt_s: float) -> None:
        per_gpu: list[list[Slot]] = [[] for _ in self.gpus]
        per_gpu_tel: list[list[ev.InstanceTelemetry]] = [[] for _ in self.gpus]
        states = {"launching": 0, "ready": 0, "draining": 0, "parked": 0}
        for inst in list(self.instances.values()):
            p = inst.placement
            states[inst.state] = states.get(inst.state, 0) + 1
            if inst.state == "parked":  # off the GPU: no share, no telemetry, no GPU time
                inst.window_start = inst.last
                continue
            use_share, wait_us, tel = 0.0, 0, None
            if inst.last is not None and inst.window_start is not None:
                use = window_use(inst.window_start, inst.last)
                use_share, wait_us = use.busy_share, use.wait_us
                snap = inst.snap  # the latest sample's snapshot: no second read of the block
                tel = ev.InstanceTelemetry(
                    instance_id=p.instance_id, function=p.function, priority=p.priority, quota=inst.quota,
                    request_quota=p.request_quota, limit_quota=p.limit_quota, width=p.width,
                    busy_share=use.busy_share, sm_time_share=use.busy_share * p.width,
                    launches_total=inst.last.launches, busy_us_total=inst.last.busy_us,
                    wait_us_total=inst.last.wait_us, wait_us=use.wait_us, cycles_total=inst.last.cycles,
                    last_cycle_us=inst.last.last_cycle_us, baseline_cycle_us=inst.last.baseline_cycle_us,
                    slo_ms=p.slo_ms, latency_ms_recent=(snap.latency_us_ewma / 1000.0) if snap else 0.0,
                    queue_depth=snap.queue_depth if snap else 0,
                    memory_used_bytes=snap.memory_used_bytes if snap else 0,
                    memory_limit_bytes=snap.memory_limit_bytes if snap else 0,
                    oom_refusals=snap.oom_refusals if snap else 0)
                if snap and snap.oom_refusals > inst.oom_seen:
                    OOM_REFUSALS.labels(p.function).inc(snap.oom_refusals - inst.oom_seen)
                    inst.oom_seen = snap.oom_refusals
                inst.window_start = inst.last
            TOKEN_WAIT_MS.inc(wait_us / 1000.0)
            per_gpu[p.gpu].append(Slot(p.function, p.request_quota, inst.quota, use_share * p.width))
            if tel is None and inst.cb is not None and inst.state != "gone":  # not sampled yet: its quota still counts
                tel = ev.InstanceTelemetry(
                    instance_id=p.instance_id, function=p.function, priority=p.priority, quota=inst.quota,
                    request_quota=p.request_quota, limit_quota=p.limit_quota, width=p.width, slo_ms=p.slo_ms)
            if tel is not None and inst.state != "gone":  # launching and draining ones hold their quota too
                per_gpu_tel[p.gpu].append(tel)
        before = (self.cost.active_gpu_seconds, self.cost.allocation_frag_seconds, self.cost.idle_frag_seconds,
                  dict(self.cost.quota_seconds))
        self.cost.advance(dt_s, per_gpu)
        ACTIVE_GPU_S.inc(self.cost.active_gpu_seconds - before[0])
        ALLOC_FRAG_S.inc(self.cost.allocation_frag_seconds - before[1])
        IDLE_FRAG_S.inc(self.cost.idle_frag_seconds - before[2])
        for fn, q in self.cost.quota_seconds.items():
            QUOTA_S.labels(fn).inc(q - before[3].get(fn, 0.0))
        for state, n in states.items():
            INSTANCES.labels(state).set(n)
        samples = await asyncio.to_thread(lambda: [self.device.sample(g.index) for g in self.gpus]) if not self.cpu else []
        for g in self.gpus:
            if per_gpu_tel[g.index]:
                await self.bus.publish(subjects.telemetry_gpu(self.node, g.index), ev.GpuTelemetry(
                    node=self.node, gpu=g.index, window_ms=dt_s * 1000.0, instances=per_gpu_tel[g.index],
                    nvml=samples[g.index] if samples else None))

    # ------------------------------------------------------------------ profiling trials

    async def _on_trial(self, req: ev.TrialRequest, _msg) -> ev.TrialReply:
        if req.batch < 1 or not 0.0 < req.quota <= 1.0 or req.repeats < 1:
            return ev.TrialReply(ok=False, error=f"need batch >= 1, 0 < quota <= 1, repeats >= 1; got {req}")
        if self.cpu:
            return ev.TrialReply(ok=False, error="this node has no GPU to run trials on")
        if self.device.kind != "emulated":
            return ev.TrialReply(ok=False, error="trials replay model kernels on emulated GPUs only; "
                                                 "profile with the profiler's --backend surface on a real GPU node")
        from .trial import TrialWorker

        async with self._trial_lock:
            if self._trial is None:
                gpu = self.gpus[req.gpu] if 0 <= req.gpu < len(self.gpus) else self.gpus[-1]
                self._trial = TrialWorker(self.node, lambda env: self.device.gpu_env(env, gpu, width=1.0, memory_bytes=0))
                await self._trial.start()
            return await self._trial.run(req)

