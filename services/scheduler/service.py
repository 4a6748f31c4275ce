"""The scheduler service: the thin asyncio shell around :mod:`.policy` (DESIGN.md section 4.5).

It is the single writer of the placement table, the JetStream KV bucket ``dilu-placement``
(key = instance id, value = :class:`~dilu.contracts.events.Placement` JSON). Node agents watch that
bucket and launch or drain instances; PlacementDecided events are for information only.

- Learns functions from FunctionDeployed (``dilu.v1.function.deployed.*``) and their quotas from
  ProfileReady (``dilu.v1.profile.ready.*``), or from the ``dilu-profiles`` bucket when a place
  request names a function whose profile it has not seen.
- ``dilu.v1.scheduler.place`` (PlaceRequest -> PlaceReply): decides GPUs with the policy and writes
  each new placement with ``create`` (fails if the key exists). Width = limit quota.
- ``dilu.v1.scheduler.retire`` (RetireRequest -> RetireReply): marks the placement ``draining`` with
  a compare-and-set on its revision; the key is deleted (again compare-and-set) when the node
  agent's InstanceRetired arrives (``dilu.v1.instance.retired.*``). The capacity stays reserved
  while the instance drains.
- Defragmentation (``defrag_interval_s`` > 0): every interval, the policy's planner proposes
  migrations that empty whole GPUs; each is applied as relaunch-then-drain (a new placement on the
  target, the old one marked draining), only when the GPU-seconds gained exceed the migrations'
  cost (cold start × request quota + ``MIGRATION_DISRUPTION_S`` × request quota, per instance).
- Decisions are serialised by one lock, so concurrent requests never see a half-applied state.
  A failed compare-and-set means the table changed under us: state is rebuilt from the bucket and
  the request is answered with an error to retry. On start, state is rebuilt from the bucket.
"""
from __future__ import annotations

import asyncio
import uuid

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, BucketNotFoundError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from prometheus_client import Counter

from dilu.contracts import subjects
from dilu.contracts.events import (
    FunctionDeployed,
    FunctionSpec,
    InstanceReady,
    InstanceRetired,
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
from ..common.kvkeys import kv_keys
from .policy import Cluster, Demand, NoCapacity, Slot, allocation_batch, allocation_quotas

GB = 10**9
MAX_PLACE_COUNT = 64  # instances one request may ask for (a whole rack of GPUs at most)
PLACEMENTS = Counter("dilu_scheduler_placements", "Instances placed", ["function"])
RETIREMENTS = Counter("dilu_scheduler_retirements", "Instances marked draining", ["function"])
REFUSALS = Counter("dilu_scheduler_refusals", "Place/retire requests answered ok=false", ["reason"])
CONFLICTS = Counter("dilu_scheduler_cas_conflicts", "Compare-and-set failures on the placement table")
MIGRATIONS = Counter("dilu_scheduler_migrations", "Instances moved by defragmentation")
MIGRATION_DISRUPTION_S = 5.0  # allowance for the drain and warm-up of a moved instance, in s at its quota
DEFRAG_GAIN_PER_GPU_S = 300.0  # a freed GPU is assumed to stay free this long (s)


def migration_cost_gpu_s(p: Placement) -> float:
    """GPU-seconds one migration costs: while the new instance starts, its quota is held twice."""
    return (p.cold_start_ms / 1000 + MIGRATION_DISRUPTION_S) * p.request_quota


def demand_of(p: Placement) -> Demand:
    """The policy's view of a stored placement."""
    return Demand(function=p.function, request_quota=p.request_quota, limit_quota=p.limit_quota,
                  memory_bytes=p.memory_bytes, kind="training" if p.priority == "training" else "inference")


class TableConflict(RuntimeError):
    """The placement table changed under the scheduler (compare-and-set failed)."""


class SchedulerService:
    """See the module docstring. ``nodes`` × ``gpus`` GPUs of ``gpu_memory_bytes`` each; ``gamma``
    caps Σ limit quotas per GPU."""

    name = "scheduler"

    def __init__(self, nodes: list[str], gpus: int = 4, gpu_memory_bytes: int = 40 * GB, gamma: float = 1.5,
                 defrag_interval_s: float = 0.0, allocation: str = "dilu") -> None:
        allocation_quotas(allocation, 0.5, 0.5)  # reject an unknown allocation at start
        self.allocation = allocation
        self.defrag_interval_s = defrag_interval_s
        self._defrag_task: asyncio.Task | None = None
        self.cluster_args = (list(nodes), gpus, gpu_memory_bytes, gamma)
        self.cluster = self._new_cluster()
        self.functions: dict[str, FunctionSpec] = {}
        self.profiles: dict[str, Profile] = {}
        self.placements: dict[str, tuple[Placement, int]] = {}  # id -> (placement, KV revision)
        self.warm: set[str] = set()
        self.lock = asyncio.Lock()
        self.bus: Bus | None = None
        self.kv = None
        self.kv_profiles = None
        self._ready = False

    def _new_cluster(self) -> Cluster:
        nodes, gpus, mem, gamma = self.cluster_args
        return Cluster(nodes, gpus, mem, gamma=gamma)

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        self.kv = await bus.js.create_key_value(KeyValueConfig(bucket=subjects.PLACEMENT_BUCKET, history=5))
        self.kv_profiles = await bus.js.create_key_value(KeyValueConfig(bucket=subjects.PROFILES_BUCKET, history=5))
        await self.rebuild()
        p = subjects.PREFIX  # wildcard patterns written out (the subject helpers sanitise "*")
        await bus.subscribe(f"{p}.function.deployed.*", FunctionDeployed, self._on_deployed)
        await bus.subscribe(f"{p}.profile.ready.*", ProfileReady, self._on_profile)
        await bus.subscribe(f"{p}.instance.ready.*", InstanceReady, self._on_ready)
        await bus.subscribe(f"{p}.instance.retired.*", InstanceRetired, self._on_retired)
        await bus.serve(subjects.SCHEDULER_PLACE, PlaceRequest, self._on_place)
        await bus.serve(subjects.SCHEDULER_RETIRE, RetireRequest, self._on_retire)
        if self.defrag_interval_s > 0:
            self._defrag_task = asyncio.create_task(self._defrag_loop())
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self._defrag_task:
            self._defrag_task.cancel()
            await asyncio.gather(self._defrag_task, return_exceptions=True)
        async with self.lock:  # let a decision in flight finish its writes
            pass

    def ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------------ state

    async def rebuild(self) -> None:
        """Rebuild the cluster state from the placement table (on start and after a conflict).
        Entries that fail to decode or name an unknown GPU are logged and skipped."""
        self.cluster = self._new_cluster()
        self.placements = {}
        keys = await kv_keys(self.bus.js, subjects.PLACEMENT_BUCKET)
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):  # deleted: its marker is still in the stream
                continue
            try:
                p = msgspec.json.decode(entry.value, type=Placement)
                self.cluster.assign(p.instance_id, demand_of(p), [Slot(p.node, p.gpu)], check=False)
            except (msgspec.DecodeError, msgspec.ValidationError, KeyError, IndexError, ValueError) as exc:
                self.bus.log.warning("placement entry skipped", key=key, error=f"{type(exc).__name__}: {exc}")
                continue
            self.placements[p.instance_id] = (p, entry.revision)
        bad = self.cluster.violations()
        if bad:
            self.bus.log.error("placement table breaks GPU caps", violations=bad[:5])
        self.bus.log.info("state rebuilt", instances=len(self.placements), active_gpus=self.cluster.active)

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

    async def _on_profile(self, ev: ProfileReady, _msg) -> None:
        self.profiles[ev.profile.function] = ev.profile

    async def _on_ready(self, ev: InstanceReady, _msg) -> None:
        self.warm.add(ev.instance_id)

    async def _on_retired(self, ev: InstanceRetired, _msg) -> None:
        async with self.lock:
            self.warm.discard(ev.instance_id)
            known = self.placements.get(ev.instance_id)
            if known is None:
                return
            p, rev = known
            if not p.draining:  # it ended without being retired (a crash): the agent relaunches it
                self.bus.log.warning("instance ended while placed", instance=ev.instance_id, reason=ev.reason)
                return
            try:
                await self.kv.delete(ev.instance_id, last=rev)
            except APIError:  # wrong last revision (KV delete raises the plain API error)
                CONFLICTS.inc()
                await self.rebuild()
                return
            del self.placements[ev.instance_id]
            self.cluster.remove(ev.instance_id)

    # ------------------------------------------------------------------ requests

    async def _on_place(self, req: PlaceRequest, _msg) -> PlaceReply:
        if req.count < 1 or req.count > MAX_PLACE_COUNT:
            return self._refuse(PlaceReply, "bad-count", f"count must be 1..{MAX_PLACE_COUNT}, got {req.count}")
        async with self.lock:
            spec = await self._spec_for(req.function)
            if spec is None:
                return self._refuse(PlaceReply, "unknown-function", f"unknown function {req.function!r}: not deployed")
            profile = await self._profile_for(req.function)
            if profile is None:
                return self._refuse(PlaceReply, "no-profile",
                                    f"function {req.function!r} has no profile yet; retry after its ProfileReady")
            request, limit = allocation_quotas(self.allocation, profile.request_quota, profile.limit_quota)
            demand = Demand(function=spec.name, request_quota=request, limit_quota=limit,
                            memory_bytes=spec.memory_bytes, kind=spec.kind)
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

    async def _place_one(self, spec: FunctionSpec, profile: Profile, demand: Demand) -> Placement:
        iid = f"{subjects.token(spec.name)}-{uuid.uuid4().hex[:10]}"
        (g,) = self.cluster.choose(demand)
        slot = self.cluster.slot(g)
        p = Placement(
            instance_id=iid, function=spec.name, node=slot.node, gpu=slot.gpu,
            request_quota=demand.request_quota, limit_quota=demand.limit_quota, width=demand.limit_quota,
            memory_bytes=demand.memory_bytes, priority=spec.priority,
            batch_size=allocation_batch(self.allocation, profile.batch_size, profile.burst_batch),
            model=spec.model, handler=spec.handler, slo_ms=spec.slo_ms, cold_start_ms=spec.cold_start_ms,
        )
        try:
            rev = await self.kv.create(iid, msgspec.json.encode(p))
        except KeyWrongLastSequenceError:
            CONFLICTS.inc()
            await self.rebuild()
            raise TableConflict("placement table changed under the scheduler; state rebuilt, retry") from None
        self.cluster.assign(iid, demand, [slot])
        self.placements[iid] = (p, rev)
        PLACEMENTS.labels(spec.name).inc()
        await self.bus.publish(subjects.placement_decided(spec.name),
                               PlacementDecided(placement=p, action="place", revision=rev))
        return p

    async def _on_retire(self, req: RetireRequest, _msg) -> RetireReply:
        async with self.lock:
            if req.instance_id:
                known = self.placements.get(req.instance_id)
                if known is None or known[0].function != req.function:
                    return self._refuse(RetireReply, "unknown-instance",
                                        f"no instance {req.instance_id!r} of function {req.function!r}")
                victim = req.instance_id
            else:
                live = [i for i, (p, _) in self.placements.items() if p.function == req.function and not p.draining]
                if not live:
                    return self._refuse(RetireReply, "no-instance", f"function {req.function!r} has no live instance")
                victim = self.cluster.choose_victim(live, self.warm)
            p, rev = self.placements[victim]
            if p.draining:
                return RetireReply(ok=True, instance_id=victim)  # already draining: idempotent
            drained = msgspec.structs.replace(p, draining=True)
            try:
                new_rev = await self.kv.update(victim, msgspec.json.encode(drained), last=rev)
            except KeyWrongLastSequenceError:
                CONFLICTS.inc()
                await self.rebuild()
                return self._refuse(RetireReply, "conflict", "placement table changed under the scheduler; retry")
            self.placements[victim] = (drained, new_rev)
            RETIREMENTS.labels(p.function).inc()
            await self.bus.publish(subjects.placement_decided(p.function),
                                   PlacementDecided(placement=drained, action="retire", revision=new_rev))
        return RetireReply(ok=True, instance_id=victim)

    # ------------------------------------------------------------------ defragmentation

    async def _defrag_loop(self) -> None:
        while True:
            await asyncio.sleep(self.defrag_interval_s)
            try:
                await self.defragment()
            except Exception as exc:  # logged; the next round tries again
                self.bus.log.warning("defragmentation failed", error=f"{type(exc).__name__}: {exc}")

    async def defragment(self) -> int:
        """Plan and apply one round of migrations; returns how many instances were moved.

        Draining instances are not moved (they are leaving anyway), nor are their GPUs emptied
        by the plan: the planner only sees instances that are live.
        """
        async with self.lock:
            live = {i: p for i, (p, _) in self.placements.items() if not p.draining}
            costs = {i: migration_cost_gpu_s(p) for i, p in live.items()}
            costs.update({i: float("inf") for i, (p, _) in self.placements.items() if p.draining})
            plan = self.cluster.plan_defrag(costs, gain_per_gpu_s=DEFRAG_GAIN_PER_GPU_S)
            moved = 0
            for m in plan.migrations:
                old, rev = self.placements[m.instance_id]
                new_id = f"{subjects.token(old.function)}-{uuid.uuid4().hex[:10]}"
                new = msgspec.structs.replace(old, instance_id=new_id, node=m.target.node, gpu=m.target.gpu)
                try:
                    self.cluster.assign(new_id, demand_of(new), [m.target])
                except ValueError:  # the table moved since planning: stop this round
                    break
                try:
                    new_rev = await self.kv.create(new_id, msgspec.json.encode(new))
                    drained = msgspec.structs.replace(old, draining=True)
                    old_rev = await self.kv.update(m.instance_id, msgspec.json.encode(drained), last=rev)
                except KeyWrongLastSequenceError:
                    CONFLICTS.inc()
                    await self.rebuild()
                    break
                self.placements[new_id] = (new, new_rev)
                self.placements[m.instance_id] = (drained, old_rev)
                moved += 1
                MIGRATIONS.inc()
                await self.bus.publish(subjects.placement_decided(old.function),
                                       PlacementDecided(placement=new, action="migrate", revision=new_rev))
            if moved:
                self.bus.log.info("defragmented", moved=moved, freed=len(plan.freed),
                                  gain_gpu_s=plan.gain_gpu_s, cost_gpu_s=plan.cost_gpu_s)
            return moved

    def _refuse(self, kind, reason: str, error: str):
        REFUSALS.labels(reason).inc()
        self.bus.log.info("request refused", reason=reason, error=error)
        return kind(ok=False, error=error)
