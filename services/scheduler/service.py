"""The scheduler service: the thin asyncio shell around :mod:`.policy` (DESIGN.md section 4.5).

It is the single writer of the placement table, the JetStream KV bucket ``dilu-placement``
(key = instance id, value = :class:`~dilu.contracts.events.Placement` JSON). Node agents watch that
bucket and launch or drain instances; PlacementDecided events are for information only.

- The cluster is the node agents' inventories (section 4.0): the KV bucket ``dilu-nodes`` (key =
  node token, value = :class:`~dilu.contracts.events.NodeInventory`), created if it does not
  exist yet with :data:`~dilu.services.common.nodes.NODES_KV_CONFIG` (as the agents do). On
  start every inventory is read and the cluster built from it; then the bucket is watched: a new
  node joins, a changed inventory updates its GPUs (health, MPS client limit, memory), a deleted
  or purged entry makes the node leave. Every ``sweep_interval_s`` the liveness rule
  (:func:`.inventory.stale_nodes`) runs on the scheduler's monotonic clock: a node whose inventory
  was not received within ``node_ttl_s`` leaves (an entry read at start counts from the time the
  KV store took it).
- When a node leaves (or a GPU vanishes from its inventory), its instances are placed again: each
  placement is deleted (compare-and-set on its revision) and a new placement of the same function
  (same quotas, batch, ...; a new instance id) is created on a GPU the policy chooses, published as
  PlacementDecided ``migrate``. Draining ones are just deleted. When nothing fits, that is logged
  and counted (``dilu_scheduler_displaced_total{outcome="no-capacity"}``); the horizontal scaler
  asks again. Placements naming a node that has no inventory (yet) are kept in the table and
  reserved nowhere; if that node has not appeared within ``node_ttl_s`` of the scheduler's start
  they are placed again the same way (at once when the node is known but the GPU is not).
- Learns functions from FunctionDeployed (``dilu.v1.function.deployed.*``) and their quotas from
  ProfileReady (``dilu.v1.profile.ready.*``), or from the ``dilu-profiles`` bucket when a place
  request names a function whose profile it has not seen.
- ``dilu.v1.scheduler.place`` (PlaceRequest -> PlaceReply): decides GPUs with the policy and writes
  each new placement with ``create`` (fails if the key exists). Width = limit quota. With no node
  known it answers ok=false at once.
- ``dilu.v1.scheduler.retire`` (RetireRequest -> RetireReply): marks the placement ``draining`` with
  a compare-and-set on its revision; the key is deleted (again compare-and-set) when the node
  agent's InstanceRetired arrives (``dilu.v1.instance.retired.*``). The capacity stays reserved
  while the instance drains. An InstanceRetired from the placement's node with reason
  ``load-failed`` or ``gave-up`` (the agent will not launch it again) deletes the placement too,
  draining or not. Without ``instance_id`` the victim is never a parked instance (it holds no
  quota on a GPU, so retiring it frees too little room).
- ``dilu.v1.scheduler.park`` (ParkRequest -> ParkReply): parking an idle inference instance sets
  ``parked`` on its placement (compare-and-set) and takes its demand off the GPU, so other
  instances may be placed there; the node agent sees the flag and has the process move its
  weights to host memory. A parked placement stays in the table and holds only the memory its
  process keeps on its GPU (its CUDA context, ``Cluster.park``): no quota, not an orphan, never
  moved by defragmentation. A resume re-seats it on the GPU it
  left (its process is bound to that GPU at launch) when it still fits there, clearing
  ``parked``; otherwise a new instance of the function is placed wherever the policy finds room
  (``relaunched`` in the reply, a cold start) and the parked one is drained, or its entry
  deleted when its node is gone (no agent will report it retired). With no room anywhere the
  resume is refused and the instance stays parked. A parked instance that is draining on a node
  gone for good (see the orphans above) is deleted by the sweep, for the same reason.
  ``dilu_scheduler_parks_total{action}`` counts parks, resumes and relaunches.
- Defragmentation (``defrag_interval_s`` > 0; the dilu policies set it): every interval, the
  policy's planner proposes migrations that empty whole GPUs, only when the GPU-seconds gained
  exceed the migrations' cost (:func:`.policy.migration_price_gpu_s`); a GPU whose instances are
  all leaving (draining, or being replaced) or still starting takes no one. Each is applied make before
  break: a new placement on the target with ``replaces`` naming the old instance (PlacementDecided
  ``migrate``), and the old one marked draining when the new one's InstanceReady arrives. If the
  replacement never becomes ready (its node fails), the old instance simply stays. A scheduler
  that starts with a migration under way drains the old instance at once: the replacement's
  InstanceReady may have come while it was down.
- Decisions are serialised by one lock, so concurrent requests never see a half-applied state.
  A failed compare-and-set means the table changed under us: state is rebuilt from the bucket and
  the request is answered with an error to retry. On start, state is rebuilt from the bucket.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import msgspec
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE
from prometheus_client import Counter, Gauge

from dilu.contracts import subjects
from dilu.contracts.events import (
    GAVE_UP,
    LOAD_FAILED,
    MAX_PLACE_COUNT,
    AdmitReply,
    AdmitRequest,
    FunctionDeployed,
    FunctionSpec,
    FunctionUndeployed,
    InstanceReady,
    InstanceRetired,
    NodeInventory,
    ParkReply,
    ParkRequest,
    PlaceReply,
    PlaceRequest,
    Placement,
    PlacementDecided,
    Profile,
    ProfileReady,
    RetireReply,
    RetireRequest,
)

from ..common.bus import Bus
from ..common.metrics import MALFORMED
from ..common.kvkeys import kv_keys
from ..common.kvwatch import KvFollower
from ..common.jsresources import PLACEMENT_KV_CONFIG, PROFILES_KV_CONFIG, ensure_kv
from ..common.nodes import nodes_bucket
from ..common.functions import runs_on
from .inventory import NodeChange, Roster, admission, inventory_age_s, orphans_due
from .policy import Cluster, Demand, NoCapacity, Placed, Slot, allocation_batch, allocation_quotas, parked_bytes

PLACEMENTS = Counter("dilu_scheduler_placements", "Instances placed", ["function"])
RETIREMENTS = Counter("dilu_scheduler_retirements", "Instances marked draining", ["function"])
REFUSALS = Counter("dilu_scheduler_refusals", "Place/retire requests answered ok=false", ["reason"])
CONFLICTS = Counter("dilu_scheduler_cas_conflicts", "Compare-and-set failures on the placement table")
MIGRATIONS = Counter("dilu_scheduler_migrations", "Instances moved by defragmentation")
NODES = Gauge("dilu_scheduler_nodes", "Nodes with a live inventory in dilu-nodes")
NODE_CHANGES = Counter("dilu_scheduler_node_changes", "Nodes that joined, changed or left", ["action"])
DISPLACED = Counter("dilu_scheduler_displaced", "Placements of a gone node (or GPU) handled",
                    ["outcome"])  # placed | no-capacity | dropped-draining
PARKS = Counter("dilu_scheduler_parks", "Instances parked, resumed on their GPU, or relaunched elsewhere",
                ["action"])  # park | resume | relaunch
NO_NODES = "no nodes: no node agent has published an inventory to dilu-nodes"
RETRY = "placement table changed under the scheduler; state rebuilt, retry"


def new_instance_id(function: str) -> str:
    """A fresh instance id: the function's subject token and 10 random hex digits."""
    return f"{subjects.token(function)}-{uuid.uuid4().hex[:10]}"


def demand_of(p: Placement) -> Demand:
    """The policy's view of a stored placement."""
    return Demand(function=p.function, request_quota=p.request_quota, limit_quota=p.limit_quota,
                  memory_bytes=p.memory_bytes, kind="training" if p.priority == "training" else "inference")


class TableConflict(RuntimeError):
    """The placement table changed under the scheduler (compare-and-set failed)."""


class SchedulerService:
    """See the module docstring. ``gamma`` caps Σ limit quotas per GPU; ``allocation`` is one of
    :data:`~.policy.ALLOCATIONS`; ``node_ttl_s``: a node whose inventory is older is gone;
    ``sweep_interval_s``: how often liveness is checked; ``clock``: monotonic seconds (tests).

    ``placements`` holds every entry of the table, parked ones included; ``cluster`` holds only
    the demand that is on a GPU now, so parked instances (and orphans) are in the first and not
    the second (a parked one is there only as the memory its process keeps, ``cluster.parked``):
    every ``cluster.remove`` of a placement is guarded by membership."""

    name = "scheduler"

    def __init__(self, gamma: float = 1.5, defrag_interval_s: float = 0.0, allocation: str = "dilu", *,
                 node_ttl_s: float = subjects.NODE_TTL_S, sweep_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        allocation_quotas(allocation, 0.5, 0.5)  # reject an unknown allocation at start
        self.allocation = allocation
        self.gamma = gamma
        self.defrag_interval_s = defrag_interval_s
        self.node_ttl_s = node_ttl_s
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        self.roster = Roster(node_ttl_s)
        self.cluster = self._new_cluster()
        self.functions: dict[str, FunctionSpec] = {}
        self.profiles: dict[str, Profile] = {}
        self.placements: dict[str, tuple[Placement, int]] = {}  # id -> (placement, KV revision)
        self.orphans: dict[str, str] = {}  # placed instance ids not in the cluster -> why
        self.warm: set[str] = set()
        self.lock = asyncio.Lock()
        self.bus: Bus | None = None
        self.kv = None
        self.kv_profiles = None
        self.kv_nodes = None
        self.node_revs: dict[str, int] = {}  # dilu-nodes key -> last revision handled
        self.node_keys: dict[str, str] = {}  # dilu-nodes key -> node name
        self._bad_inventory: dict[str, str] = {}  # dilu-nodes key -> why its entry was skipped
        self.started_s = 0.0
        self._tasks: list[asyncio.Task] = []
        self._nodes_watch: KvFollower | None = None
        self._ready = False

    def _new_cluster(self) -> Cluster:
        cluster = Cluster.empty(gamma=self.gamma)
        for node, caps in self.roster.capacities.items():
            cluster.add_node(node, caps)
        return cluster

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        replicas = bus.options.replicas  # existing buckets are bound as they are, differences warned
        self.kv, _ = await ensure_kv(bus.js, PLACEMENT_KV_CONFIG, replicas=replicas, log=bus.log)
        self.kv_profiles, _ = await ensure_kv(bus.js, PROFILES_KV_CONFIG, replicas=replicas, log=bus.log)
        self.kv_nodes = await nodes_bucket(bus.js, replicas=replicas, log=bus.log)  # NODES_KV_CONFIG
        self.started_s = self.clock()
        await self.load_inventories()
        await self.rebuild()
        async with self.lock:  # a migration under way when the scheduler stopped: its end was missed
            await self._settle_migrations(assume_ready=True)
        p = subjects.PREFIX  # wildcard patterns written out (the subject helpers sanitise "*")
        await bus.subscribe(f"{p}.function.deployed.*", FunctionDeployed, self._on_deployed)
        await bus.subscribe(f"{p}.function.undeployed.*", FunctionUndeployed, self._on_undeployed)
        await bus.subscribe(f"{p}.profile.ready.*", ProfileReady, self._on_profile)
        await bus.subscribe(f"{p}.instance.ready.*", InstanceReady, self._on_ready)
        await bus.subscribe(f"{p}.instance.retired.*", InstanceRetired, self._on_retired)
        await bus.serve(subjects.SCHEDULER_PLACE, PlaceRequest, self._on_place)
        await bus.serve(subjects.SCHEDULER_RETIRE, RetireRequest, self._on_retire)
        await bus.serve(subjects.SCHEDULER_PARK, ParkRequest, self._on_park)
        await bus.serve(subjects.SCHEDULER_ADMIT, AdmitRequest, self._on_admit)
        # entries already read above (same revision) are skipped; a NATS restart is watched through
        self._nodes_watch = KvFollower(bus.nc, self.kv_nodes, self._on_node_entry, log=bus.log,
                                       what=subjects.NODES_BUCKET)
        await self._nodes_watch.start()
        self._tasks.append(asyncio.create_task(self._sweep_loop()))
        if self.defrag_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._defrag_loop()))
        bus.log.info("placement policy", allocation=self.allocation, gamma=self.gamma,
                     defrag_interval_s=self.defrag_interval_s or "off")
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self._nodes_watch is not None:  # the node entry in hand is applied, no later one
            await self._nodes_watch.stop()
        async with self.lock:  # let a decision in flight finish its writes, then stop the loops
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------------ nodes

    async def load_inventories(self) -> None:
        """Read every inventory in ``dilu-nodes`` (on start): each node joins the roster, last seen
        as long ago as the KV store took its entry (the stream message's time, which
        ``KeyValue.get`` does not return; hence the stream-level get)."""
        now, wall = self.clock(), time.time()
        stream, prefix = f"KV_{subjects.NODES_BUCKET}", f"$KV.{subjects.NODES_BUCKET}."
        for key in await kv_keys(self.bus.js, subjects.NODES_BUCKET):
            try:
                msg = await self.bus.js.get_msg(stream, subject=prefix + key)
            except NotFoundError:
                continue
            headers = msg.headers or {}
            if headers.get(KV_OP) in (KV_DEL, KV_PURGE) or headers.get(KV_MARKER_REASON) or not msg.data:
                continue  # deleted: its marker is still in the stream
            self.node_revs[key] = msg.seq
            inv = self._decode_inventory(key, msg.data)
            if inv is not None:
                stored_s = msg.time.timestamp() if msg.time else None
                self._log_change(self.roster.observe(inv, now - inventory_age_s(wall, stored_s, inv.ts_ns)))
        NODES.set(len(self.roster))

    def _decode_inventory(self, key: str, raw: bytes) -> NodeInventory | None:
        try:
            inv = msgspec.json.decode(raw, type=NodeInventory)
            error = "" if subjects.token(inv.node) == key else f"node {inv.node!r}: the key is not subjects.token(node)"
            if len({g.index for g in inv.gpus}) != len(inv.gpus):
                error = error or f"node {inv.node!r}: a GPU index is listed twice"
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            inv, error = None, f"{type(exc).__name__}: {exc}"
        if error:
            MALFORMED.labels(self.name, f"kv:{subjects.NODES_BUCKET}").inc()
            if self._bad_inventory.get(key) != error:  # logged once per key and error, counted each time
                self.bus.log.warning("node inventory skipped", key=key, error=error)
            self._bad_inventory[key] = error
            return None
        self._bad_inventory.pop(key, None)
        self.node_keys[key] = inv.node
        return inv

    async def _on_node_entry(self, entry) -> None:
        """One entry of ``dilu-nodes``: puts are heartbeats, joins and changes; deletes and purges
        are leaves. Entries already handled (same revision or older) are skipped: the watch
        delivers each key's latest entry again after a NATS restart (KvFollower)."""
        key = entry.key
        if entry.revision is not None:
            if entry.revision <= self.node_revs.get(key, 0):
                return
            self.node_revs[key] = entry.revision
        if entry.operation in (KV_DEL, KV_PURGE):
            node = self.node_keys.get(key)
            if node is None:
                return
            why = "inventory deleted from dilu-nodes" if entry.operation == KV_DEL else "inventory purged from dilu-nodes"
            async with self.lock:
                await self._apply_change(self.roster.forget(node, why))
            return
        inv = self._decode_inventory(key, entry.value)
        if inv is None:
            return
        async with self.lock:
            await self._apply_change(self.roster.observe(inv, self.clock()))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except Exception as exc:  # logged; the next sweep tries again
                self.bus.log.warning("node sweep failed", error=f"{type(exc).__name__}: {exc}")

    async def sweep(self) -> None:
        """Apply the liveness rule now, and place again the orphans whose node is not coming."""
        async with self.lock:
            now = self.clock()
            for change in self.roster.expire(now):
                await self._apply_change(change)
            due = orphans_due(self.started_s, now, self.node_ttl_s)
            for iid in list(self.orphans):
                if iid not in self.orphans:  # a conflict rebuilt the state meanwhile
                    continue
                p = self.placements[iid][0]
                if p.node in self.roster:  # known node, unknown GPU
                    await self._place_again(iid, self.orphans[iid])
                elif due:
                    await self._place_again(iid, f"node {p.node} has published no inventory within "
                                                 f"{self.node_ttl_s:g} s of the scheduler's start")
            if due:
                await self._drop_parked_draining()

    async def _drop_parked_draining(self) -> None:
        """Delete the draining parked placements whose node is gone (not in the roster, once the
        scheduler has waited its TTL since start): no agent will report them retired, and holding
        no quota they were never displaced like the others. Hold the lock."""
        gone = [i for i, (p, _) in self.placements.items() if p.parked and p.draining and p.node not in self.roster]
        for iid in gone:
            if iid not in self.placements:  # a conflict rebuilt the state meanwhile
                continue
            if not await self._forget(iid):
                return  # the table changed: rebuilt; the next sweep looks again
            DISPLACED.labels("dropped-draining").inc()
            self.bus.log.info("draining parked instance of a gone node dropped", instance=iid)

    def _log_change(self, change: NodeChange | None) -> None:
        if change is None:
            return
        NODE_CHANGES.labels(change.action).inc()
        log = self.bus.log.warning if change.action == "leave" else self.bus.log.info
        verb = {"join": "node joined", "update": "node changed", "leave": "node left"}[change.action]
        log(verb, node=change.node, reasons=list(change.reasons))

    async def _apply_change(self, change: NodeChange | None) -> None:
        """Apply a roster change to the cluster and place the displaced instances again (under the lock)."""
        if change is None:
            return
        self._log_change(change)
        NODES.set(len(self.roster))
        displaced: list[str] = []
        if change.action == "join":
            if change.node in self.cluster.node_index:  # already there (never expected): take the new GPUs
                displaced = self.cluster.update_node(change.node, change.gpus)
            else:
                self.cluster.add_node(change.node, change.gpus)
            for iid in [i for i in self.orphans if self.placements[i][0].node == change.node]:
                if not self._seat(self.placements[iid][0]):  # seated: _seat took it off the orphans
                    displaced.append(iid)
            for iid, (p, _) in self.placements.items():  # parked processes it kept (an agent restarted)
                if p.parked and p.node == change.node and iid not in self.cluster.parked:
                    self._seat(p)
        elif change.action == "update":
            displaced = self.cluster.update_node(change.node, change.gpus)
            bad = self.cluster.violations()
            if bad:
                self.bus.log.warning("a node's GPUs now hold more than they offer", node=change.node, violations=bad[:5])
        elif change.node in self.cluster.node_index:
            displaced = self.cluster.remove_node(change.node)
        displaced.sort(key=lambda i: -self.placements[i][0].request_quota if i in self.placements else 0)
        why = f"node {change.node} {'left' if change.action == 'leave' else 'changed'}: {'; '.join(change.reasons)}"
        for iid in displaced:  # orphans until placed again: a failure half-way is retried by the sweep
            self.orphans[iid] = why
        for iid in displaced:
            await self._place_again(iid, why)

    def _seat(self, p: Placement) -> bool:
        """Reserve a stored placement in the cluster; False (and an orphan entry) when its node or
        GPU is not in the inventory. A parked placement holds only the memory its process keeps
        (``Cluster.hold``; nothing when its GPU is not known: its resume checks the node then):
        True, and never an orphan."""
        if p.parked:
            self.orphans.pop(p.instance_id, None)
            try:
                self.cluster.hold(p.instance_id, Slot(p.node, p.gpu), parked_bytes(demand_of(p)))
            except (KeyError, IndexError):
                pass
            return True
        try:
            self.cluster.assign(p.instance_id, demand_of(p), [Slot(p.node, p.gpu)], check=False)
        except KeyError:
            self.orphans[p.instance_id] = f"node {p.node} has published no inventory"
            return False
        except IndexError as exc:
            self.orphans[p.instance_id] = str(exc)
            return False
        self.orphans.pop(p.instance_id, None)
        return True

    async def _place_again(self, iid: str, why: str) -> None:
        """Delete a displaced placement (compare-and-set) and place its function again (under the lock)."""
        known = self.placements.get(iid)
        if known is None:
            return
        p, rev = known
        try:
            await self.kv.delete(iid, last=rev)
        except APIError:  # wrong last revision: the table changed under us
            CONFLICTS.inc()
            await self.rebuild()
            return
        del self.placements[iid]
        self.orphans.pop(iid, None)
        self.warm.discard(iid)
        if iid in self.cluster.instances:
            self.cluster.remove(iid)
        self.cluster.unpark(iid)
        if p.draining:
            DISPLACED.labels("dropped-draining").inc()
            self.bus.log.info("draining instance dropped", instance=iid, function=p.function, reason=why)
            return
        demand = demand_of(p)
        try:
            (g,) = self.cluster.choose(demand)
        except NoCapacity as exc:
            DISPLACED.labels("no-capacity").inc()
            self.bus.log.warning("displaced instance not placed again: no capacity", instance=iid,
                                 function=p.function, reason=why, error=str(exc))
            return
        slot = self.cluster.slot(g)
        new_id = new_instance_id(p.function)
        new = msgspec.structs.replace(p, instance_id=new_id, node=slot.node, gpu=slot.gpu, draining=False)
        try:
            new_rev = await self.kv.create(new_id, msgspec.json.encode(new))
        except KeyWrongLastSequenceError:
            CONFLICTS.inc()
            await self.rebuild()
            return
        except Exception:  # e.g. a timeout: the entry may exist or not; read the table again
            await self.rebuild()
            raise
        self.cluster.assign(new_id, demand, [slot], check=False)
        self.placements[new_id] = (new, new_rev)
        DISPLACED.labels("placed").inc()
        self.bus.log.info("instance placed again", instance=iid, new_instance=new_id, function=p.function,
                          node=slot.node, gpu=slot.gpu, reason=why)
        await self.bus.publish(subjects.placement_decided(p.function),
                               PlacementDecided(placement=new, action="migrate", revision=new_rev))

    # ------------------------------------------------------------------ state

    async def rebuild(self) -> None:
        """Rebuild the cluster state from the inventories and the placement table (on start and
        after a conflict). Placements whose node or GPU is not in the inventory are kept as
        orphans (see :meth:`sweep`); parked ones hold their process's memory only (:meth:`_seat`);
        entries that fail to decode are logged and skipped."""
        self.cluster = self._new_cluster()
        self.placements = {}
        self.orphans = {}
        keys = await kv_keys(self.bus.js, subjects.PLACEMENT_BUCKET)
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):  # deleted: its marker is still in the stream
                continue
            try:
                p = msgspec.json.decode(entry.value, type=Placement)
                demand_of(p)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                self.bus.log.warning("placement entry skipped", key=key, error=f"{type(exc).__name__}: {exc}")
                continue
            if p.instance_id in self.placements:
                self.bus.log.warning("placement entry skipped", key=key, error="instance id stored twice")
                continue
            self.placements[p.instance_id] = (p, entry.revision)
            self._seat(p)
        bad = self.cluster.violations()
        if bad:
            self.bus.log.error("placement table breaks GPU caps", violations=bad[:5])
        if self.orphans:
            self.bus.log.warning("placements on nodes or GPUs not in the inventory", count=len(self.orphans),
                                 examples=dict(list(self.orphans.items())[:5]))
        parked = sum(p.parked for p, _ in self.placements.values())
        self.bus.log.info("state rebuilt", instances=len(self.placements), parked=parked, orphans=len(self.orphans),
                          nodes=len(self.roster), active_gpus=self.cluster.active)

    async def _spec_for(self, fn: str) -> FunctionSpec | None:
        """The function's spec: from FunctionDeployed, else from the ``dilu-functions`` bucket
        (FunctionSpec or FunctionDeployed JSON) when it exists, so a restarted scheduler knows it."""
        if fn in self.functions:
            return self.functions[fn]
        try:
            kv = await self.bus.js.key_value(subjects.FUNCTIONS_BUCKET)
            raw = (await kv.get(subjects.token(fn))).value
        except (BucketNotFoundError, KeyNotFoundError):
            return None
        for kind in (FunctionSpec, FunctionDeployed):
            try:
                obj = msgspec.json.decode(raw, type=kind)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            spec = obj if isinstance(obj, FunctionSpec) else obj.spec
            self.functions[fn] = spec
            return spec
        return None

    async def _profile_for(self, fn: str) -> Profile | None:
        if fn in self.profiles:
            return self.profiles[fn]
        try:
            entry = await self.kv_profiles.get(subjects.token(fn))
            self.profiles[fn] = msgspec.json.decode(entry.value, type=Profile)
        except (KeyNotFoundError, BucketNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return self.profiles[fn]

    # ------------------------------------------------------------------ events

    async def _on_deployed(self, ev: FunctionDeployed, _msg) -> None:
        self.functions[ev.spec.name] = ev.spec

    async def _on_undeployed(self, ev: FunctionUndeployed, _msg) -> None:
        """Drain every instance of the function and forget it (its spec is gone from KV)."""
        async with self.lock:
            self.functions.pop(ev.name, None)
            self.profiles.pop(ev.name, None)
            live = [i for i, (p, _) in self.placements.items() if p.function == ev.name and not p.draining]
            for iid in live:
                if not await self._drain(iid):
                    break
        self.bus.log.info("function undeployed: draining its instances", function=ev.name, instances=len(live))

    async def _on_admit(self, req: AdmitRequest, _msg) -> AdmitReply:
        """Whether some node could ever take an instance of the spec (see inventory.admission)."""
        nodes, reason = admission(req.spec, self.roster.inventories)
        if not nodes:
            return self._refuse(AdmitReply, "not-admitted", f"function {req.spec.name!r} cannot be placed: {reason}")
        return AdmitReply(ok=True, nodes=len(nodes))

    async def _on_profile(self, ev: ProfileReady, _msg) -> None:
        self.profiles[ev.profile.function] = ev.profile

    async def _on_ready(self, ev: InstanceReady, _msg) -> None:
        self.warm.add(ev.instance_id)
        known = self.placements.get(ev.instance_id)
        if known is None or not known[0].replaces or known[0].draining:
            return
        async with self.lock:  # a migration's replacement serves: the instance it replaces drains
            old = self.placements.get(known[0].replaces)
            if old is not None and not old[0].draining:
                await self._drain(known[0].replaces)

    async def _on_retired(self, ev: InstanceRetired, _msg) -> None:
        async with self.lock:
            self.warm.discard(ev.instance_id)
            known = self.placements.get(ev.instance_id)
            if known is None:
                return
            p, rev = known
            failed = ev.reason in (LOAD_FAILED, GAVE_UP) and ev.node == p.node
            if not p.draining and not failed:  # it ended without being retired (a crash): the agent relaunches it
                self.bus.log.warning("instance ended while placed", instance=ev.instance_id, reason=ev.reason)
                return
            if failed:  # the agent launches it no more: its capacity comes back
                self.bus.log.warning("instance failed for good: placement removed", instance=ev.instance_id,
                                     function=ev.function, reason=ev.reason, error=ev.error)
            await self._forget(ev.instance_id)

    async def _forget(self, iid: str) -> bool:
        """Delete placement ``iid`` from the table (compare-and-set on its revision) and from the
        state, giving back its capacity if it held any (an orphan holds none, a parked one the
        memory its process kept). False on a table conflict (state rebuilt). Hold the lock."""
        _, rev = self.placements[iid]
        try:
            await self.kv.delete(iid, last=rev)
        except APIError:  # wrong last revision (KV delete raises the plain API error)
            CONFLICTS.inc()
            await self.rebuild()
            return False
        del self.placements[iid]
        self.orphans.pop(iid, None)
        self.warm.discard(iid)
        if iid in self.cluster.instances:
            self.cluster.remove(iid)
        self.cluster.unpark(iid)
        return True

    # ------------------------------------------------------------------ requests

    async def _on_place(self, req: PlaceRequest, _msg) -> PlaceReply:
        if req.count < 1 or req.count > MAX_PLACE_COUNT:
            return self._refuse(PlaceReply, "bad-count", f"count must be 1..{MAX_PLACE_COUNT}, got {req.count}")
        async with self.lock:
            if not self.cluster.node_index:
                return self._refuse(PlaceReply, "no-nodes", NO_NODES)
            spec = await self._spec_for(req.function)
            if spec is None:
                return self._refuse(PlaceReply, "unknown-function", f"unknown function {req.function!r}: not deployed")
            profile = await self._profile_for(req.function)
            if profile is None:
                return self._refuse(PlaceReply, "no-profile",
                                    f"function {req.function!r} has no profile yet; retry after its ProfileReady")
            demand = self._demand(spec, profile)
            placed: list[Placement] = []
            for _ in range(req.count):
                try:
                    placed.append(await self._place_one(spec, profile, demand))
                except NoCapacity as exc:
                    REFUSALS.labels("no-capacity").inc()
                    return PlaceReply(ok=False, placements=placed, error=str(exc))
                except TableConflict as exc:
                    return PlaceReply(ok=False, placements=placed, error=str(exc))
        return PlaceReply(ok=True, placements=placed)

    def _unfit_gpus(self, spec: FunctionSpec) -> set[int]:
        """GPUs of nodes that cannot run ``spec`` (e.g. user code on an emulated node)."""
        out: set[int] = set()
        for name, inv in self.roster.inventories.items():
            if runs_on(spec, inv.device) is not None and name in self.cluster.node_index:
                out.update(self.cluster.gpu_id(s) for s in self.cluster.node_slots(name))
        return out

    async def _place_one(self, spec: FunctionSpec, profile: Profile, demand: Demand) -> Placement:
        (g,) = self.cluster.choose(demand, exclude=self._unfit_gpus(spec) or None)
        slot = self.cluster.slot(g)
        p = Placement(
            instance_id=new_instance_id(spec.name), function=spec.name, node=slot.node, gpu=slot.gpu,
            request_quota=demand.request_quota, limit_quota=demand.limit_quota, width=demand.limit_quota,
            memory_bytes=demand.memory_bytes, priority=spec.priority,
            batch_size=allocation_batch(self.allocation, profile.batch_size, profile.burst_batch),
            model=spec.model, handler=spec.handler, slo_ms=spec.slo_ms, cold_start_ms=spec.cold_start_ms,
        )
        await self._create(p, demand)
        return p

    async def _create(self, p: Placement, demand: Demand) -> None:
        """Write the new placement ``p`` (``create``: fails if its key exists), reserve ``demand``
        on its GPU and publish PlacementDecided ``place``. Raises TableConflict (state rebuilt)
        when the key exists. Hold the lock, and choose the GPU under it."""
        try:
            rev = await self.kv.create(p.instance_id, msgspec.json.encode(p))
        except KeyWrongLastSequenceError:
            CONFLICTS.inc()
            await self.rebuild()
            raise TableConflict(RETRY) from None
        self.cluster.assign(p.instance_id, demand, [Slot(p.node, p.gpu)])
        self.placements[p.instance_id] = (p, rev)
        PLACEMENTS.labels(p.function).inc()
        await self.bus.publish(subjects.placement_decided(p.function),
                               PlacementDecided(placement=p, action="place", revision=rev))

    def _demand(self, spec, profile) -> Demand:
        """What one instance of ``spec`` asks of a GPU under this scheduler's allocation."""
        request, limit = allocation_quotas(self.allocation, profile.request_quota, profile.limit_quota)
        return Demand(function=spec.name, request_quota=request, limit_quota=limit,
                      memory_bytes=spec.memory_bytes, kind=spec.kind)

    async def _on_retire(self, req: RetireRequest, _msg) -> RetireReply:
        async with self.lock:
            if req.instance_id:
                known = self.placements.get(req.instance_id)
                if known is None or known[0].function != req.function:
                    return self._refuse(RetireReply, "unknown-instance",
                                        f"no instance {req.instance_id!r} of function {req.function!r}")
                victim = req.instance_id
            else:
                # never a parked one: it holds no quota on a GPU, and the policy knows it not
                live = [i for i, (p, _) in self.placements.items()
                        if p.function == req.function and not p.draining and not p.parked]
                if not live:
                    return self._refuse(RetireReply, "no-instance", f"function {req.function!r} has no live instance")
                if req.room_for:  # only a victim whose removal lets that function in
                    spec, profile = await self._spec_for(req.room_for), await self._profile_for(req.room_for)
                    if spec is None or profile is None:
                        return self._refuse(RetireReply, "unknown-function",
                                            f"room for {req.room_for!r}: not deployed or not profiled")
                    need = self._demand(spec, profile)
                    live = [i for i in live if i in self.orphans or self.cluster.frees_room(i, need)]
                    if not live:
                        return self._refuse(RetireReply, "no-room", f"no instance of {req.function!r} "
                                            f"frees room for one of {req.room_for!r}")
                # an instance whose node has no inventory goes first; else the policy's choice
                orphaned = [i for i in live if i in self.orphans]
                victim = orphaned[-1] if orphaned else self.cluster.choose_victim(live, self.warm)
            if not await self._drain(victim):
                return self._refuse(RetireReply, "conflict", "placement table changed under the scheduler; retry")
        return RetireReply(ok=True, instance_id=victim)

    async def _drain(self, iid: str) -> bool:
        """Mark placement ``iid`` draining in the table (the agent drains and retires it); True
        when done or already draining, False on a table conflict (state rebuilt). Hold the lock."""
        p, rev = self.placements[iid]
        if p.draining:
            return True
        drained = msgspec.structs.replace(p, draining=True)
        try:
            new_rev = await self.kv.update(iid, msgspec.json.encode(drained), last=rev)
        except KeyWrongLastSequenceError:
            CONFLICTS.inc()
            await self.rebuild()
            return False
        self.placements[iid] = (drained, new_rev)
        RETIREMENTS.labels(p.function).inc()
        await self.bus.publish(subjects.placement_decided(p.function),
                               PlacementDecided(placement=drained, action="retire", revision=new_rev))
        return True

    # ------------------------------------------------------------------ defragmentation

    async def _settle_migrations(self, *, assume_ready: bool) -> None:
        """Drain every instance a live replacement replaces once that replacement is ready
        (:meth:`_on_ready` does it at once; this catches one it missed, after a table conflict).
        ``assume_ready``: on start, when whether a replacement became ready while the scheduler
        was down cannot be known: the old instance is drained anyway (at worst its function
        waits for the replacement's launch), since otherwise the horizontal scaler, which counts
        it as draining once the replacement is ready, would never retire it. Hold the lock."""
        for iid, (p, _) in list(self.placements.items()):
            if not p.replaces or p.draining:
                continue
            old = self.placements.get(p.replaces)
            if old is None or old[0].draining or not (assume_ready or iid in self.warm):
                continue
            if not await self._drain(p.replaces):
                return  # the table changed: rebuilt; the next round looks again

    async def _defrag_loop(self) -> None:
        while True:
            await asyncio.sleep(self.defrag_interval_s)
            try:
                await self.defragment()
            except Exception as exc:  # logged; the next round tries again
                self.bus.log.warning("defragmentation failed", error=f"{type(exc).__name__}: {exc}")

    async def defragment(self) -> int:
        """Plan and apply one round of migrations; returns how many instances were moved.

        Only ready inference instances move: not one draining (it is leaving anyway), starting,
        already being replaced, training (its progress would be lost), or parked (it holds no
        quota, and its process can resume only on its own GPU). Each move places the
        replacement (``replaces`` set) and leaves the old instance serving; :meth:`_on_ready`
        drains it once the replacement is ready (make before break: no request waits for the
        launch). The horizontal scaler counts the pair as one instance.
        """
        async with self.lock:
            await self._settle_migrations(assume_ready=False)
            placed = {i: Placed("draining" if p.draining else "parked" if p.parked else "ready" if i in self.warm
                                else "starting", p.replaces, p.priority == "training", p.cold_start_ms, p.request_quota)
                      for i, (p, _) in self.placements.items()}
            plan = self.cluster.plan_round(placed)
            self.bus.log.debug("defragmentation planned", placements=len(placed), active_gpus=self.cluster.active,
                               moves=len(plan.migrations))
            moved = 0
            for m in plan.migrations:
                old, _ = self.placements[m.instance_id]
                new_id = new_instance_id(old.function)
                new = msgspec.structs.replace(old, instance_id=new_id, node=m.target.node, gpu=m.target.gpu,
                                              replaces=m.instance_id)
                try:
                    self.cluster.assign(new_id, demand_of(new), [m.target])
                except ValueError:  # the table moved since planning: stop this round
                    break
                try:
                    new_rev = await self.kv.create(new_id, msgspec.json.encode(new))
                except KeyWrongLastSequenceError:
                    CONFLICTS.inc()
                    await self.rebuild()
                    break
                self.placements[new_id] = (new, new_rev)
                moved += 1
                MIGRATIONS.inc()
                await self.bus.publish(subjects.placement_decided(old.function),
                                       PlacementDecided(placement=new, action="migrate", revision=new_rev))
            if moved:
                self.bus.log.info("defragmented", moved=moved, freed=len(plan.freed),
                                  gain_gpu_s=plan.gain_gpu_s, cost_gpu_s=plan.cost_gpu_s)
            return moved

    # ------------------------------------------------------------------ parking

    async def _on_park(self, req: ParkRequest, _msg) -> ParkReply:
        """Park an idle instance or resume a parked one (:class:`ParkRequest`). Refused (ok false,
        ``error`` one line): an instance not in the table or not of ``function``, a draining one;
        see :meth:`_park` and :meth:`_resume` for the rest. Repeating a request is harmless."""
        async with self.lock:
            known = self.placements.get(req.instance_id)
            if known is None or known[0].function != req.function:
                return self._refuse(ParkReply, "unknown-instance",
                                    f"no instance {req.instance_id!r} of function {req.function!r}")
            if known[0].draining:
                return self._refuse(ParkReply, "draining", f"instance {req.instance_id!r} is draining")
            if req.resume:
                return await self._resume(req.instance_id)
            return await self._park(req.instance_id)

    async def _park(self, iid: str) -> ParkReply:
        """Mark ``iid`` parked and take its demand off its GPU, so others may be placed there, all
        but the memory its process keeps (``Cluster.park``). Refused for a training instance (it
        is never idle: it works without requests) and for one in a migration (its pair's
        make-before-break needs it serving). Hold the lock."""
        p, _ = self.placements[iid]
        if p.parked:
            return ParkReply(ok=True)  # parked already: a repeated request
        if p.priority == "training":
            return self._refuse(ParkReply, "training", f"instance {iid!r} is a training job: only idle "
                                                       "inference instances park")
        why = self._migrating(iid)
        if why:
            return self._refuse(ParkReply, "migrating", why)
        if not await self._set_parked(iid, True):
            return self._refuse(ParkReply, "conflict", RETRY)
        if iid in self.cluster.instances:  # an orphan is in no GPU
            self.cluster.park(iid)
        self.orphans.pop(iid, None)  # parked: the sweep does not place it again, a resume will
        self.warm.discard(iid)  # it is ready again only after the resume's InstanceReady
        PARKS.labels("park").inc()
        return ParkReply(ok=True)

    def _migrating(self, iid: str) -> str:
        """Why ``iid`` is part of a migration in progress ("" when it is not): it replaces an
        instance still placed, or a live placement replaces it."""
        p, _ = self.placements[iid]
        if p.replaces and p.replaces in self.placements:
            return f"instance {iid!r} is replacing {p.replaces!r} (a migration in progress)"
        for other, (q, _) in self.placements.items():
            if q.replaces == iid and not q.draining:
                return f"instance {iid!r} is being replaced by {other!r} (a migration in progress)"
        return ""

    async def _resume(self, iid: str) -> ParkReply:
        """Bring parked ``iid`` back on the GPU it left when it fits there; else relaunch
        (:meth:`_relaunch`). An instance that is not parked: ok (a repeated request). Hold the lock."""
        p, _ = self.placements[iid]
        if not p.parked:
            return ParkReply(ok=True)
        demand = demand_of(p)
        slot = self._resume_slot(p, demand)
        if slot is None:
            return await self._relaunch(iid)
        if not await self._set_parked(iid, False):
            return self._refuse(ParkReply, "conflict", RETRY)
        self.cluster.unpark(iid)
        self.cluster.assign(iid, demand, [slot], check=False)  # resume_target checked it fits
        PARKS.labels("resume").inc()
        return ParkReply(ok=True)

    def _resume_slot(self, p: Placement, demand: Demand) -> Slot | None:
        """The GPU parked ``p`` left, when its node and GPU are still there and can take it back
        (the process is bound to that GPU at launch, so nowhere else); None otherwise."""
        try:
            return self.cluster.resume_target(demand, Slot(p.node, p.gpu), p.instance_id)
        except (KeyError, IndexError):  # its node left, or the GPU is gone from its inventory
            return None

    async def _relaunch(self, iid: str) -> ParkReply:
        """A resume that cannot happen on the parked instance's own GPU: place a new instance of
        its function (same quotas, batch, ...; a new id) where the policy finds room, a cold
        start, then retire the parked one (:meth:`_retire_parked`). Refused "no-capacity" when
        no GPU can take it (the instance stays parked), "conflict" on a table conflict. Hold the lock."""
        p, _ = self.placements[iid]
        spec = await self._spec_for(p.function)
        demand = demand_of(p)
        try:
            (g,) = self.cluster.choose(demand, exclude=(self._unfit_gpus(spec) if spec else None) or None)
        except NoCapacity as exc:
            return self._refuse(ParkReply, "no-capacity", f"instance {iid!r} cannot resume: its GPU "
                                                          f"{p.node}/{p.gpu} has no room for it and {exc}")
        slot = self.cluster.slot(g)
        new = msgspec.structs.replace(p, instance_id=new_instance_id(p.function), node=slot.node, gpu=slot.gpu,
                                      parked=False, draining=False, replaces="")
        try:
            await self._create(new, demand)
        except TableConflict as exc:
            return self._refuse(ParkReply, "conflict", str(exc))
        if not await self._retire_parked(iid):
            self.bus.log.warning("parked instance relaunched but not retired: table conflicts",
                                 instance=iid, new_instance=new.instance_id)
        PARKS.labels("relaunch").inc()
        self.bus.log.info("parked instance relaunched elsewhere", instance=iid, new_instance=new.instance_id,
                          node=new.node, gpu=new.gpu)
        return ParkReply(ok=True, relaunched=new)

    async def _retire_parked(self, iid: str) -> bool:
        """Retire a parked instance that was relaunched: mark it draining when its node is live
        (the agent ends the process and reports InstanceRetired, then it is deleted), delete its
        entry when the node is gone (no agent will report it). Tried twice, since a conflict
        rebuilds the state and the second try reads it afresh; False if both failed. Hold the lock."""
        for _ in range(2):
            known = self.placements.get(iid)
            if known is None:
                return True  # gone already
            if known[0].node in self.cluster.node_index:
                done = await self._drain(iid)
            else:
                done = await self._forget(iid)
            if done:
                return True
        return False

    async def _set_parked(self, iid: str, parked: bool) -> bool:
        """Write ``parked`` into placement ``iid`` (compare-and-set on its revision: the agent acts
        on the flag) and publish PlacementDecided ``park`` or ``resume``. False on a table
        conflict (state rebuilt). Hold the lock."""
        p, rev = self.placements[iid]
        new = msgspec.structs.replace(p, parked=parked)
        try:
            new_rev = await self.kv.update(iid, msgspec.json.encode(new), last=rev)
        except KeyWrongLastSequenceError:
            CONFLICTS.inc()
            await self.rebuild()
            return False
        self.placements[iid] = (new, new_rev)
        await self.bus.publish(subjects.placement_decided(p.function),
                               PlacementDecided(placement=new, action="park" if parked else "resume",
                                                revision=new_rev))
        return True

    def _refuse(self, kind, reason: str, error: str):
        REFUSALS.labels(reason).inc()
        self.bus.log.info("request refused", reason=reason, error=error)
        return kind(ok=False, error=error)
