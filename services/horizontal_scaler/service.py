"""The horizontal scaler service: a thin asyncio shell around :class:`HorizontalPolicy`.

Learns, from the bus:

- functions from ``dilu.v1.function.deployed.*`` (FunctionDeployed: instance bounds) and their
  sizing from ``dilu.v1.profile.ready.*`` (ProfileReady: target in-flight requests per instance =
  the profiled batch size, instance capacity = profiled throughput);
- that a function can be placed once it is both deployed and profiled (in either order): it
  then gets its initial scale (``--initial-scale``, Knative's, default 1) before any request;
- instances from ``dilu.v1.instance.{launched,ready,retired}.*`` and from its own placements, and
  a defragmenting migration's replacement from ``dilu.v1.placement.decided.*`` (PlacementDecided
  ``migrate`` with ``replaces``: the pair counts as one instance until the replacement is ready);
- vertical headroom from ``dilu.v1.telemetry.gpu.*.*`` (quota against limit per instance, what
  each GPU could give; telemetry older than ``telemetry_stale_s`` is ignored).

On start it rebuilds what it can from JetStream KV (``dilu-functions``, ``dilu-profiles`` and the
placement table ``dilu-placement``), so a restarted scaler does not forget running instances;
each function so restored starts its keep-alive then (:meth:`HorizontalPolicy.restored`).

Every tick (``tick_s``), per function (ticks of one function never overlap; training functions
have no invocations and are only held at their ``min_instances``):

1. backlog = ``num_pending + num_ack_pending`` of the durable pull consumer ``fn-<function>`` on
   stream ``DILU_INVOKE``, read from one listing of the stream's consumers per tick serving every
   function (pending plus in flight, so a long request keeps its instance and a
   request held by a dead instance still counts); a missing consumer or a monitoring error is an
   *unknown* backlog, counted in ``dilu_backlog_errors`` and logged once per outage (a warning;
   a function whose consumer no instance has created yet is logged at info), and the
   policy holds the current count (except that a function with no instance and requests stored
   on its subject gets one instance: instances create the consumer when they bind);
2. the policy decides; scale-out asks ``dilu.v1.scheduler.place`` (PlaceRequest -> PlaceReply;
   at most ``MAX_PLACE_COUNT`` at once; after a refusal the function backs off, doubling up to
   ``place_backoff_max_s``, and so it does after an instance of it is retired as
   ``load-failed`` or ``gave-up``, its FunctionState then not placeable with that error until
   an instance is ready); scale-in asks ``dilu.v1.scheduler.retire`` per victim (RetireRequest
   -> RetireReply; the scheduler drains it, or cancels a starting one); a refused retirement is
   counted back, except one of an instance the scheduler does not know, which is forgotten;
3. publishes ScaleDecision on ``dilu.v1.scale.decided.<fn>`` for what was done and
   BurstWindowBreach on ``dilu.v1.event.burst_window_breach.<fn>``.

Parking (``--park-after-s``): the policy's ``park`` and ``resume`` go to the scheduler
(``dilu.v1.scheduler.park``). While a function has parked instances and none starting or ready,
the scaler listens on its invocation subject (a plain subscription beside the work queue, as
Knative's activator sits in front of a function at zero): its first request resumes a parked
instance at once (:meth:`HorizontalPolicy.on_arrival`), not at the next tick. A resume the
scheduler refuses (no room anywhere) backs the function off as a refused placement does: no
resume and no placement of it, on a tick or on a request, until the delay is over.

Mechanism counters (DESIGN.md section 8): ``dilu_scale_outs`` (instances added),
``dilu_retirements`` (instances removed, cancellations included), ``dilu_scale_to_zero``,
``dilu_parks`` (instances the scheduler parked, one per instance) and ``dilu_resumes{function,outcome}``
(``resumed`` on the GPU it left, ``relaunched`` elsewhere, also a scale-out, or ``refused``), all
per function.

``--mode`` (what ``dilu demo --policy`` selects, see services/common/policies.py): ``lazy`` for
dilu (scale out only once the vertical headroom is used); ``kpa`` for horizontal-only (Knative's KPA
as it ships: on load alone, scale to zero a stable window plus a grace period after the last
request); ``eager`` for static-mps and exclusive (on load alone, dilu's keep-alive and pre-warm).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import ConsumerInfo
from prometheus_client import Counter, Gauge

from dilu.contracts import MalformedEvent, subjects
from dilu.contracts.events import (
    GAVE_UP,
    LOAD_FAILED,
    MAX_PLACE_COUNT,
    BurstWindowBreach,
    FunctionDeployed,
    FunctionUndeployed,
    FunctionSpec,
    GpuTelemetry,
    InstanceLaunched,
    InstanceReady,
    InstanceRetired,
    ParkReply,
    ParkRequest,
    Placement,
    PlacementDecided,
    PlaceReply,
    PlaceRequest,
    Profile,
    ProfileReady,
    RetireReply,
    RetireRequest,
    ScaleDecision,
)
from dilu.services.common.bus import Bus
from dilu.services.common.kvkeys import kv_keys

from .state import FunctionStateStore
from .policy import (TICK_MS, Decision, HorizontalConfig, InitialScaleGate, InstanceShare, PlacementBackoff,
                     function_params, horizontal_policy, tick_order, vertical_room)

# The reason logged for a resume decided when a request arrives, off the tick (dilu calibrate
# times the tick by the other decisions).
WAKE_REASON = "a request for a parked function"

SCALE_OUTS = Counter("dilu_scale_outs", "Instances added by the horizontal scaler", ["function"])
RETIREMENTS = Counter("dilu_retirements", "Instances removed (drained or cancelled) by the horizontal scaler", ["function"])
SCALE_TO_ZERO = Counter("dilu_scale_to_zero", "Times a function was scaled to zero instances", ["function"])
DECISIONS = Counter("dilu_scale_decisions", "Scale decisions carried out", ["function", "direction"])
BACKLOG_ERRORS = Counter("dilu_backlog_errors", "Ticks whose backlog could not be read (scale held)", ["function", "kind"])
PREEMPTIONS = Counter("dilu_preemptions", "Surplus instances retired so a starved function gets its first", ["function"])
PARKS = Counter("dilu_parks", "Instances parked (their weights moved to host memory)", ["function"])
RESUMES = Counter("dilu_resumes", "Parked instances brought back", ["function", "outcome"])  # resumed | relaunched | refused
PLACE_FAILURES = Counter("dilu_place_failures", "Scale-outs the scheduler refused or did not answer", ["function"])
BREACHES = Counter("dilu_burst_window_breaches", "Burst windows whose load exceeded capacity", ["function", "panic"])
DESIRED = Gauge("dilu_desired_instances", "Instances the horizontal scaler aims at", ["function"])
BACKLOG = Gauge("dilu_backlog", "Requests pending plus in flight", ["function"])


NO_INSTANCE = "no instance"  # how the scheduler's refusal to retire an instance it lacks begins


def consumer_name(function: str) -> str:
    """Durable consumer of ``function`` on the invocation stream: ``fn-<token(function)>``."""
    return f"fn-{subjects.token(function)}"


@dataclass
class _Counts:
    """Cumulative consumer counters, to turn them into arrivals per tick."""

    delivered: int
    pending: int


@dataclass(frozen=True)
class _Consumers:
    """One listing of the invocation stream's consumers: ``infos`` by consumer name, or why there
    is none (``kind`` "missing": no stream; "error": the listing failed)."""

    infos: dict[str, ConsumerInfo] | None
    kind: str = ""
    why: str = ""


_CONSUMER_PAGE = 256  # nats-server's page size for CONSUMER.LIST
# How often an instance restored from the placement table, and not heard of since, is looked up
# there again: the scheduler may delete such a placement without any process having run it (its
# GPU gone from a node that came back smaller), and no InstanceRetired will ever say so.
RECONCILE_S = 5.0


class HorizontalScaler:
    """Service object for :func:`dilu.services.common.runner.serve`.

    ``target`` > 0 overrides every function's in-flight target (otherwise its profiled batch
    size, 1 before a profile). Times are seconds.
    """

    name = "horizontal_scaler"

    def __init__(self, config: HorizontalConfig | None = None, *, tick_s: float = TICK_MS / 1000.0, target: float = 0.0,
                 request_timeout_s: float = 5.0, telemetry_stale_s: float = 10.0,
                 place_backoff_max_s: float = 10.0, reconcile_s: float = RECONCILE_S) -> None:
        if tick_s <= 0 or request_timeout_s <= 0:
            raise ValueError("tick_s and request_timeout_s must be > 0")
        self.policy = horizontal_policy(config)
        self.tick_s, self.target, self.timeout = tick_s, target, request_timeout_s
        self.telemetry_stale_s, self.place_backoff_max_s = telemetry_stale_s, place_backoff_max_s
        self.reconcile_s = reconcile_s
        self.bus: Bus | None = None
        self._gpus: dict[tuple[str, int], tuple[float, list[InstanceShare]]] = {}
        self._counts: dict[str, _Counts] = {}
        self._missing: set[str] = set()  # functions whose backlog is unknown now (logged once)
        self._read: set[str] = set()  # functions whose consumer was read once: missing later is an outage
        self._specs: dict[str, FunctionSpec] = {}
        self._profiles: dict[str, Profile] = {}
        self._gate = InitialScaleGate()  # deployed live + profiled -> initial scale (training: never)
        self._busy: set[str] = set()
        self._backoff = PlacementBackoff(tick_s, place_backoff_max_s)
        self._load_failed: dict[str, str] = {}  # fn -> its instances' load error, until one is ready
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self.backlog_errors = 0
        self.decisions: list[Decision] = []  # recent decisions carried out (bounded), for inspection
        self.state = FunctionStateStore()  # KV dilu-function-state, for dilu status and the gateway
        self._undeployed: set[str] = set()  # undeployed and not deployed since: late events ignored
        self._wakers: dict[str, object] = {}  # fn -> its invocation subscription while all parked
        self._unconfirmed: dict[str, str] = {}  # instance -> function: restored, no sign of life yet

    # ------------------------------------------------------------------ lifecycle

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        p = subjects.PREFIX
        await bus.subscribe(f"{p}.function.deployed.*", FunctionDeployed, self._on_deployed)
        await bus.subscribe(f"{p}.function.undeployed.*", FunctionUndeployed, self._on_undeployed)
        await bus.subscribe(f"{p}.profile.ready.*", ProfileReady, self._on_profile)
        await bus.subscribe(f"{p}.instance.launched.*", InstanceLaunched, self._on_launched)
        await bus.subscribe(f"{p}.instance.ready.*", InstanceReady, self._on_ready)
        await bus.subscribe(f"{p}.instance.retired.*", InstanceRetired, self._on_retired)
        await bus.subscribe(f"{p}.placement.decided.*", PlacementDecided, self._on_placement)
        await bus.subscribe(f"{p}.telemetry.gpu.*.*", GpuTelemetry, self._on_telemetry)
        await self.state.open(bus.js, replicas=bus.options.replicas, log=bus.log)
        await self._rebuild()
        self._loop_task = asyncio.create_task(self._loop(), name="horizontal-scaler-tick")
        if self._unconfirmed:
            task = asyncio.create_task(self._reconcile_loop(), name="horizontal-scaler-reconcile")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for fn in list(self._wakers):
            await self._unwatch(fn)
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._loop_task, *self._tasks] if t is not None), return_exceptions=True)

    def ready(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    # ------------------------------------------------------------------ learning

    def _learn(self, fn: str, spec: FunctionSpec | None = None, profile: Profile | None = None) -> None:
        if profile is None and spec is not None and fn in self._profiles:
            profile = self._profiles[fn]  # a redeploy (new SLO) re-derives the target
        if profile is not None:
            self._profiles[fn] = profile
        if spec is not None:
            self._specs[fn] = spec
        if spec is not None:
            self._gate.training(fn, spec.kind == "training")
        old = self.policy.params(fn) if fn in self.policy.functions() else None
        known = self._specs.get(fn)
        self.policy.add_function(fn, function_params(spec, profile, old, slo_ms=known.slo_ms if known else 0.0,
                                                     fixed_target=self.target))
        if profile is not None and self._gate.profiled(fn):
            self.policy.deployed(fn, self._now())

    async def _on_deployed(self, ev: FunctionDeployed, _msg) -> None:
        self._undeployed.discard(ev.spec.name)
        self._learn(ev.spec.name, spec=ev.spec)
        if self._gate.deployed(ev.spec.name):  # deployed live and profiled: placeable now
            self.policy.deployed(ev.spec.name, self._now())

    async def _on_undeployed(self, ev: FunctionUndeployed, _msg) -> None:
        """Forget the function (the scheduler drains its instances); its state entry goes too."""
        fn = ev.name
        self.policy.remove_function(fn)
        for known in (self._specs, self._profiles, self._counts, self._load_failed):
            known.pop(fn, None)
        self._backoff.clear(fn)
        self._gate.forget(fn)
        self._missing.discard(fn)
        self._read.discard(fn)
        self._undeployed.add(fn)
        try:
            await self.state.forget(fn)
        except Exception as exc:  # the entry is informational: a stale one harms nothing
            self.bus.log.warning("could not delete function state", function=fn, error=repr(exc))

    async def _on_profile(self, ev: ProfileReady, _msg) -> None:
        self._learn(ev.profile.function, profile=ev.profile)  # placeable once also deployed live

    def _known(self, fn: str) -> None:
        if fn not in self.policy.functions() and fn not in self._undeployed:
            self._learn(fn)

    async def _on_launched(self, ev: InstanceLaunched, _msg) -> None:
        self._unconfirmed.pop(ev.instance_id, None)
        self._known(ev.function)
        if ev.function not in self.policy.functions():  # undeployed: its instances are draining
            return
        self.policy.instance_starting(ev.function, ev.instance_id, self._now())

    async def _on_placement(self, ev: PlacementDecided, _msg) -> None:
        """A defragmenting migration's replacement (``replaces`` set): counted with the instance it
        replaces as one until it is ready (the scheduler then drains the old one)."""
        pl = ev.placement
        if ev.action != "migrate" or not pl.replaces or pl.function not in self.policy.functions():
            return
        self.policy.instance_migrating(pl.function, pl.instance_id, pl.replaces, self._now())

    async def _on_ready(self, ev: InstanceReady, _msg) -> None:
        self._unconfirmed.pop(ev.instance_id, None)
        self._known(ev.function)
        if ev.function not in self.policy.functions():
            return
        self.policy.instance_ready(ev.function, ev.instance_id, self._now(), parkable=ev.parkable)
        if self._load_failed.pop(ev.function, None) is not None:  # its function loads again
            self._backoff.clear(ev.function)
            self.state.placeable(ev.function, True)

    async def _on_retired(self, ev: InstanceRetired, _msg) -> None:
        self._unconfirmed.pop(ev.instance_id, None)
        if ev.function not in self.policy.functions():
            return
        self.policy.instance_retired(ev.function, ev.instance_id)
        if ev.reason in (LOAD_FAILED, GAVE_UP):
            self._failed_instance(ev)

    def _failed_instance(self, ev: InstanceRetired) -> None:
        """An instance of the function failed for good (its function does not load, or it kept
        crashing; the scheduler removed its placement): back off as after a refused placement,
        so a broken function is not placed again in a tight loop, and say why in its state."""
        assert self.bus is not None
        fn, error = ev.function, ev.error or ev.reason
        self._load_failed[fn] = error
        delay = self._backoff.failed(fn, self._now())
        self.state.placeable(fn, False, error)
        self.bus.log.warning("instance failed for good; backing off", function=fn, instance=ev.instance_id,
                             reason=ev.reason, error=error, retry_in_s=delay)

    async def _on_telemetry(self, ev: GpuTelemetry, _msg) -> None:
        shares = [InstanceShare(t.instance_id, t.function, t.priority, t.quota, t.request_quota, t.limit_quota)
                  for t in ev.instances]
        self._gpus[(ev.node, ev.gpu)] = (self._now(), shares)
        for t in ev.instances:
            self._unconfirmed.pop(t.instance_id, None)
            if t.function in self.policy.functions():
                self.policy.set_busy(t.function, t.instance_id, t.busy_share)

    def _room(self, now: float) -> tuple[dict[str, float], dict[str, float]]:
        """From fresh telemetry: each function's vertical headroom and each instance's burst
        reach (the policy's :func:`vertical_headroom` and :func:`burst_reach`)."""
        fresh = {k: shares for k, (at, shares) in self._gpus.items() if now - at <= self.telemetry_stale_s}
        return vertical_room(fresh)

    async def _rebuild(self) -> None:
        """Functions, profiles and placed instances from JetStream KV (best effort)."""
        assert self.bus is not None
        for bucket, kind in ((subjects.FUNCTIONS_BUCKET, "spec"), (subjects.PROFILES_BUCKET, "profile"),
                             (subjects.PLACEMENT_BUCKET, "placement")):
            for raw in await self._kv_values(bucket):
                try:
                    self._restore(kind, raw)
                except (MalformedEvent, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                    self.bus.log.warning("skipped a stored entry", bucket=bucket, error=str(exc))
        now = self._now()
        for fn in self.policy.functions():  # keep-alive from now: no history is no idleness
            self.policy.restored(fn, now)

    def _restore(self, kind: str, raw: bytes) -> None:
        if kind == "spec":
            try:
                spec = msgspec.json.decode(raw, type=FunctionSpec)
            except (msgspec.DecodeError, msgspec.ValidationError):
                spec = msgspec.json.decode(raw, type=FunctionDeployed).spec
            self._learn(spec.name, spec=spec)
        elif kind == "profile":
            prof = msgspec.json.decode(raw, type=Profile)
            if prof.function in self._specs:  # a profile outlives its function's undeploy
                self._learn(prof.function, profile=prof)
        else:
            pl = msgspec.json.decode(raw, type=Placement)
            if not pl.draining:
                self._known(pl.function)
                self._unconfirmed[pl.instance_id] = pl.function
                if pl.parked:
                    self.policy.instance_parked(pl.function, pl.instance_id, self._now())
                else:  # whether its code can park is not stored: it is not parked until it says so again
                    self.policy.instance_ready(pl.function, pl.instance_id, self._now(), parkable=False)

    async def _reconcile_loop(self) -> None:
        """Every ``reconcile_s`` (:data:`RECONCILE_S`), until none is left: forget each restored instance whose
        placement is gone from the table before it showed any sign of life (launched, ready,
        retired, or a row in a GPU's telemetry). Left counted, such a ghost would read as a ready
        instance for ever: a scale-in could retire the function's only live one and never scale
        out again."""
        assert self.bus is not None
        while self._unconfirmed:
            await asyncio.sleep(self.reconcile_s)
            try:
                kv = await self.bus.js.key_value(subjects.PLACEMENT_BUCKET)
            except Exception as exc:  # KV trouble: look again next time
                self.bus.log.warning("could not read bucket", bucket=subjects.PLACEMENT_BUCKET, error=repr(exc))
                continue
            for iid, fn in list(self._unconfirmed.items()):
                try:
                    await kv.get(iid)
                    continue
                except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                    pass
                except Exception as exc:
                    self.bus.log.warning("could not read a placement", instance=iid, error=repr(exc))
                    continue
                if self._unconfirmed.pop(iid, None) is None:  # a sign of life came meanwhile
                    continue
                if fn in self.policy.functions():
                    self.policy.instance_retired(fn, iid)
                self.bus.log.info("restored instance forgotten: its placement is gone", function=fn, instance=iid)

    async def _kv_values(self, bucket: str) -> list[bytes]:
        assert self.bus is not None
        try:
            kv = await self.bus.js.key_value(bucket)
            keys = await kv_keys(self.bus.js, bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NoKeysError, nats.js.errors.NotFoundError):
            return []
        except Exception as exc:  # KV trouble must not stop the scaler from starting
            self.bus.log.warning("could not read bucket", bucket=bucket, error=repr(exc))
            return []
        out = []
        for key in keys:
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):  # deleted since
                continue
            if entry.value:
                out.append(entry.value)
        return out

    # ------------------------------------------------------------------ ticking

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = self._now()
            headroom, reach = self._room(now)
            due = [fn for fn in sorted(self.policy.functions(), key=self._size) if fn not in self._busy]
            # one listing of the consumers serves every function's backlog this tick
            consumers = await self._consumers() if any(not self._gate.is_training(fn) for fn in due) else None
            for fn in due:  # a function whose last tick still talks to the scheduler waits
                self._busy.add(fn)
                task = asyncio.create_task(self._tick_guarded(fn, now, headroom.get(fn, 0.0), reach, consumers))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _size(self, fn: str) -> tuple[float, int, str]:
        """Tick order (:func:`tick_order`) of ``fn`` from its profile and spec (0 until known)."""
        prof, spec = self._profiles.get(fn), self._specs.get(fn)
        return tick_order(prof.limit_quota if prof else 0.0, spec.memory_bytes if spec else 0, fn)

    async def _tick_guarded(self, fn: str, now: float, headroom: float, reach: Mapping[str, float],
                            consumers: _Consumers | None) -> None:
        try:
            await self.tick(fn, now, headroom, consumers, reach=reach)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one function's trouble must not stop the others
            assert self.bus is not None
            self.bus.log.error("tick failed", function=fn, error=repr(exc))
        finally:
            self._busy.discard(fn)

    async def tick(self, fn: str, now: float, headroom: float = 0.0, consumers: _Consumers | None = None, *,
                   reach: Mapping[str, float] | None = None) -> Decision:
        """One function's tick: observe its backlog, decide, carry the decision out.

        ``headroom`` and ``reach``: as :meth:`HorizontalPolicy.decide` takes them; ``consumers``:
        this tick's listing of the stream's consumers (read here when None)."""
        if self._gate.is_training(fn):  # no invocations to count: it runs its min_instances
            backlog, arrivals, stored = None, None, 0
        else:
            backlog, arrivals = self._backlog(fn, consumers if consumers is not None else await self._consumers())
            stored = await self._stored(fn) if backlog is None else 0
        self.policy.record(fn, now, backlog, arrivals, stored=stored)
        d = self.policy.decide(fn, now, headroom, backing_off=self._backoff.blocked(fn, now), reach=reach)
        DESIRED.labels(fn).set(d.desired)
        assert self.bus is not None
        self.bus.log.debug("tick", function=fn, backlog=backlog, ready=d.ready, current=d.current, desired=d.desired,
                           panic=d.panic, reach=round(d.reach, 3), target=round(d.target, 2),
                           headroom=round(headroom, 3))
        if d.breach is not None:
            await self._publish_breach(d)
        if d.park:
            await self._park(fn, d)
        if d.resume:
            await self._resume(fn, d, now)
        if d.place:
            await self._place(fn, d, now)
        if d.retire:
            await self._retire(fn, d)
        if fn in self.policy.functions():  # not undeployed meanwhile
            await self.state.observe(fn, instances=self.policy.instances(fn), desired=d.desired, backlog=backlog)
        await self._watch_parked(fn)
        return d

    # ------------------------------------------------------------------ waking parked functions

    async def _watch_parked(self, fn: str) -> None:
        """Listen on ``fn``'s invocation subject exactly while all it has are parked instances."""
        states = self.policy.instances(fn).values() if fn in self.policy.functions() else ()
        asleep = "parked" in states and not any(s in ("starting", "ready") for s in states)
        if asleep and fn not in self._wakers:
            assert self.bus is not None

            async def on_request(_msg, fn=fn) -> None:  # not awaited here: the wake unsubscribes this
                task = asyncio.create_task(self._wake(fn))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

            self._wakers[fn] = await self.bus.nc.subscribe(subjects.invoke(fn), cb=on_request)
        elif not asleep and fn in self._wakers:
            await self._unwatch(fn)

    async def _unwatch(self, fn: str) -> None:
        sub = self._wakers.pop(fn, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is closing: nothing to undo
                pass

    async def _wake(self, fn: str) -> None:
        """A request for all-parked ``fn``: resume one instance now. A tick of ``fn`` under way
        handles it instead (its backlog counts the request)."""
        if fn in self._busy or fn not in self.policy.functions():
            return
        now = self._now()
        ids = self.policy.on_arrival(fn, now, backing_off=self._backoff.blocked(fn, now))
        if not ids:
            return
        self._busy.add(fn)
        try:
            await self._unwatch(fn)
            d = Decision(fn, now, 0, 0, 1, direction="resume", reason=WAKE_REASON)
            d.resume = ids
            await self._resume(fn, d, now)
            await self._watch_parked(fn)  # refused: it listens again
        finally:
            self._busy.discard(fn)

    async def _consumers(self) -> _Consumers:
        """List the invocation stream's consumers (one request per 256 of them); never raises."""
        assert self.bus is not None
        infos: dict[str, ConsumerInfo] = {}
        try:
            while True:
                page = await asyncio.wait_for(self.bus.js.consumers_info(subjects.INVOKE_STREAM, offset=len(infos)),
                                              self.timeout)
                infos.update((i.name, i) for i in page)
                if len(page) < _CONSUMER_PAGE:
                    return _Consumers(infos)
        except nats.js.errors.NotFoundError as exc:
            return _Consumers(None, "missing", f"no stream {subjects.INVOKE_STREAM}: {exc.description}")
        except (asyncio.TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError,
                nats.errors.ConnectionClosedError) as exc:
            return _Consumers(None, "error", repr(exc))

    def _backlog(self, fn: str, consumers: _Consumers) -> tuple[int | None, int | None]:
        assert self.bus is not None
        name = consumer_name(fn)
        if consumers.infos is None:
            return self._no_backlog(fn, consumers.kind, consumers.why)
        info = consumers.infos.get(name)
        if info is None:
            return self._no_backlog(fn, "missing", f"no consumer {name!r} on {subjects.INVOKE_STREAM}",
                                    not_yet=fn not in self._read)
        if fn in self._missing:
            self._missing.discard(fn)
            if fn in self._read:
                self.bus.log.info("backlog readable again", function=fn, consumer=name)
        self._read.add(fn)
        pending, in_flight = int(info.num_pending or 0), int(info.num_ack_pending or 0)
        delivered = int(info.delivered.consumer_seq or 0) if info.delivered else 0
        prev = self._counts.get(fn)
        self._counts[fn] = _Counts(delivered, pending)
        arrivals = max(0, (delivered - prev.delivered) + (pending - prev.pending)) if prev else None
        BACKLOG.labels(fn).set(pending + in_flight)
        return pending + in_flight, arrivals

    async def _stored(self, fn: str) -> int:
        """Requests stored on the stream for ``fn``'s subject (work queue: not yet acknowledged);
        0 when that cannot be read either."""
        assert self.bus is not None
        subject = subjects.invoke(fn)
        try:
            info = await self.bus.js.stream_info(subjects.INVOKE_STREAM, subjects_filter=subject)
        except Exception:  # no stream, no JetStream: nothing known to be stored
            return 0
        return int((info.state.subjects or {}).get(subject, 0))

    def _no_backlog(self, fn: str, kind: str, why: str, not_yet: bool = False) -> tuple[None, None]:
        """Count a tick whose backlog cannot be read and log it once per outage; ``not_yet``: the
        function's consumer was never read, as before its first instance binds (info, not a warning)."""
        assert self.bus is not None
        self.backlog_errors += 1
        BACKLOG_ERRORS.labels(fn, kind).inc()
        if fn not in self._missing:  # once per outage, not once per tick
            self._missing.add(fn)
            if not_yet:  # deployed, no instance bound yet: as expected
                self.bus.log.info("no backlog yet: the function's first instance creates its consumer", function=fn)
            else:
                self.bus.log.warning("backlog unknown: holding the current scale", function=fn, error=why)
        self._counts.pop(fn, None)
        return None, None

    async def _place(self, fn: str, d: Decision, now: float) -> None:
        assert self.bus is not None
        try:  # the policy places nothing while the function backs off (decide's backing_off)
            count = min(d.place, MAX_PLACE_COUNT)  # the next tick asks for the rest
            reply = await self.bus.request(subjects.SCHEDULER_PLACE, PlaceRequest(function=fn, count=count, reason=d.reason),
                                           PlaceReply, timeout=self.timeout)
            error = "" if reply.ok else (reply.error or "refused")
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, MalformedEvent) as exc:
            reply, error = None, repr(exc)
        placed = [p for p in reply.placements if p.function == fn] if reply is not None and reply.ok else []
        for p in placed:
            self.policy.instance_starting(fn, p.instance_id, now)
        failing = self._load_failed.get(fn)  # placed, but its instances have not loaded yet
        self.state.placeable(fn, bool(placed) and failing is None, error or failing or "no placements")
        if placed:
            if failing is None:  # a function still failing to load keeps its growing delay
                self._backoff.clear(fn)
            SCALE_OUTS.labels(fn).inc(len(placed))
            await self._decided(fn, d, d.direction, len(placed))
        else:
            PLACE_FAILURES.labels(fn).inc()
            self._backoff.failed(fn, now)
            self.bus.log.warning("scale-out not placed", function=fn, count=d.place, error=error or "no placements")
            if d.current == 0:
                await self._make_room(fn)

    async def _ask_park(self, fn: str, iid: str, resume: bool) -> tuple[ParkReply | None, str]:
        """One ParkRequest; (the reply when ok, else None, and the error)."""
        assert self.bus is not None
        try:
            reply = await self.bus.request(subjects.SCHEDULER_PARK, ParkRequest(function=fn, instance_id=iid, resume=resume),
                                           ParkReply, timeout=self.timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, MalformedEvent) as exc:
            return None, repr(exc)
        return (reply, "") if reply.ok else (None, reply.error or "refused")

    async def _park(self, fn: str, d: Decision) -> None:
        """Ask the scheduler to park each instance the policy marked parked; one refused (or
        unanswered) counts as ready again."""
        assert self.bus is not None
        results = await asyncio.gather(*(self._ask_park(fn, iid, False) for iid in d.park))
        done = 0
        for iid, (reply, error) in zip(d.park, results):
            if reply is None:
                self.policy.park_failed(fn, iid)
                self.bus.log.warning("park refused", function=fn, instance=iid, error=error)
            else:
                done += 1
        if done:
            PARKS.labels(fn).inc(done)
            await self._decided(fn, d, "park", done)

    async def _resume(self, fn: str, d: Decision, now: float) -> None:
        """Bring back each parked instance the policy marked starting. The scheduler resumes it
        on the GPU it left, or places a new instance (``relaunched``: counted starting, the
        parked one retired); refused (no room anywhere) or unanswered, it stays parked and the
        function's placements and resumes back off as after a refused placement (the policy
        resumes nothing while :meth:`PlacementBackoff.blocked`)."""
        assert self.bus is not None
        results = await asyncio.gather(*(self._ask_park(fn, iid, True) for iid in d.resume))
        done = 0
        for iid, (reply, error) in zip(d.resume, results):
            if reply is None:
                RESUMES.labels(fn, "refused").inc()
                self.policy.resume_failed(fn, iid)
                self._backoff.failed(fn, now)
                self.bus.log.warning("resume refused", function=fn, instance=iid, error=error)
                continue
            done += 1
            if reply.relaunched is not None:  # a new instance: a scale-out, as the simulator counts it
                RESUMES.labels(fn, "relaunched").inc()
                SCALE_OUTS.labels(fn).inc()
                self.policy.instance_retired(fn, iid)
                self.policy.instance_starting(fn, reply.relaunched.instance_id, now)
            else:
                RESUMES.labels(fn, "resumed").inc()
        if done:
            await self._decided(fn, d, "resume", done)

    async def _make_room(self, fn: str) -> None:
        """``fn`` has no instance and no GPU can take one: retire one surplus instance of the
        function holding the most, so its queue is not starved (the scheduler picks the victim,
        one whose removal lets ``fn`` in, and refuses when none would)."""
        donor = self.policy.surplus_donor(fn)
        if donor is None:
            return
        assert self.bus is not None
        try:
            reply = await self.bus.request(subjects.SCHEDULER_RETIRE, RetireRequest(
                function=donor, reason=f"room for the first instance of {fn}", room_for=fn), RetireReply,
                timeout=self.timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, MalformedEvent) as exc:
            self.bus.log.warning("could not make room", function=fn, donor=donor, error=repr(exc))
            return
        if reply.ok:
            PREEMPTIONS.labels(donor).inc()
            RETIREMENTS.labels(donor).inc()
            self.bus.log.info("surplus instance retired to make room", function=fn, donor=donor,
                              instance=reply.instance_id)

    async def _retire(self, fn: str, d: Decision) -> None:
        results = await asyncio.gather(*(self._retire_one(fn, iid, d.reason) for iid in d.retire))
        done = sum(results)
        if done:
            RETIREMENTS.labels(fn).inc(done)
            zero = d.direction == "zero" and done == len(d.retire)
            if zero:
                SCALE_TO_ZERO.labels(fn).inc()
            await self._decided(fn, d, "zero" if zero else "in", done)

    async def _retire_one(self, fn: str, iid: str, reason: str) -> bool:
        assert self.bus is not None
        try:
            reply = await self.bus.request(subjects.SCHEDULER_RETIRE, RetireRequest(function=fn, instance_id=iid, reason=reason),
                                           RetireReply, timeout=self.timeout)
            if reply.ok:
                return True
            error = reply.error or "refused"
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, MalformedEvent) as exc:
            error = repr(exc)
        if error.startswith(NO_INSTANCE):  # the scheduler has no such placement: nothing to retry
            self.policy.instance_retired(fn, iid)
            self.bus.log.info("instance unknown to the scheduler: forgotten", function=fn, instance=iid, error=error)
            return False
        self.policy.retire_failed(fn, iid)
        self.bus.log.warning("retirement refused", function=fn, instance=iid, error=error)
        return False

    async def _decided(self, fn: str, d: Decision, direction: str, count: int) -> None:
        assert self.bus is not None
        DECISIONS.labels(fn, direction).inc()
        self.bus.log.info("scale decided", function=fn, direction=direction, count=count, current=d.current,
                          desired=d.desired, reason=d.reason)
        self.decisions = (self.decisions + [d])[-200:]
        event = ScaleDecision(function=fn, direction=direction, count=count, current=d.current, desired=d.desired,
                              reason=d.reason, ts_ns=time.time_ns())
        self.state.decided(event)
        await self.bus.publish(subjects.scale_decided(fn), event)

    async def _publish_breach(self, d: Decision) -> None:
        assert self.bus is not None and d.breach is not None
        b = d.breach
        BREACHES.labels(b.function, str(b.panic).lower()).inc()
        await self.bus.publish(subjects.burst_window_breach(b.function), BurstWindowBreach(
            function=b.function, window_s=b.window_s, rate_rps=b.rate_rps, capacity_rps=b.capacity_rps,
            queue_depth=b.queue_depth, panic=b.panic))
