"""The horizontal scaler service against a real nats-server, with a fake scheduler and node agent."""
from __future__ import annotations

import asyncio
import itertools

import msgspec
import nats
import pytest
from prometheus_client import REGISTRY
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    BurstWindowBreach,
    FunctionDeployed,
    FunctionSpec,
    GpuTelemetry,
    InstanceLaunched,
    InstanceReady,
    InstanceRetired,
    InstanceTelemetry,
    ParkReply,
    ParkRequest,
    Placement,
    PlacementDecided,
    PlaceReply,
    Profile,
    ProfileReady,
    PlaceRequest,
    RetireReply,
    RetireRequest,
    ScaleDecision,
)
from dilu.services.common.jsresources import PLACEMENT_KV_CONFIG, ensure_kv
from dilu.services.common.runner import serve
from dilu.services.horizontal_scaler.policy import HorizontalConfig
from dilu.services.horizontal_scaler.service import HorizontalScaler, consumer_name
from dilu.services.common.bus import settle

pytestmark = pytest.mark.nats
FN = "resnet.v1"  # a dot: the consumer name and subjects must use the sanitised token


class FakeCluster:
    """Answers place/retire like the scheduler and announces lifecycle events like a node agent."""

    def __init__(self, nc):
        self.nc = nc
        self.ids = itertools.count()
        self.placed: list[PlaceRequest] = []
        self.retired: list[RetireRequest] = []
        self.live: dict[str, str] = {}
        self.decisions: list[ScaleDecision] = []
        self.breaches: list[BurstWindowBreach] = []
        self.parkable = False  # what its InstanceReady says of the instances' code
        self.parks: list[ParkRequest] = []
        self.relaunch = False  # a resume does not fit the instance's GPU: a new instance instead

    async def start(self):
        await self.nc.subscribe(subjects.SCHEDULER_PLACE, cb=self.on_place)
        await self.nc.subscribe(subjects.SCHEDULER_RETIRE, cb=self.on_retire)
        await self.nc.subscribe(subjects.SCHEDULER_PARK, cb=self.on_park)
        await self.nc.subscribe(f"{subjects.PREFIX}.scale.decided.*", cb=self.on_decision)
        await self.nc.subscribe(f"{subjects.PREFIX}.event.burst_window_breach.*", cb=self.on_breach)
        await settle(self.nc)

    async def on_place(self, msg):
        req = decode(msg.data, PlaceRequest)
        self.placed.append(req)
        out = []
        for _ in range(req.count):
            iid = f"i{next(self.ids)}"
            out.append(Placement(instance_id=iid, function=req.function, node="n0", gpu=0, request_quota=0.3,
                                 limit_quota=0.6, width=0.6, memory_bytes=1))
            self.live[iid] = req.function
        await self.nc.publish(msg.reply, encode(PlaceReply(ok=True, placements=out)))
        for p in out:
            ev = dict(instance_id=p.instance_id, function=p.function, node="n0", gpu=0)
            await self.nc.publish(subjects.instance_state("launched", "n0"), encode(InstanceLaunched(**ev)))
            await self.nc.publish(subjects.instance_state("ready", "n0"), encode(InstanceReady(**ev, parkable=self.parkable)))

    async def on_park(self, msg):
        req = decode(msg.data, ParkRequest)
        self.parks.append(req)
        relaunched = None
        if req.resume and self.relaunch:
            iid = f"i{next(self.ids)}"
            relaunched = Placement(instance_id=iid, function=req.function, node="n0", gpu=1, request_quota=0.3,
                                   limit_quota=0.6, width=0.6, memory_bytes=1)
            self.live[iid] = req.function
        ok = req.instance_id in self.live  # an instance it does not know: refused (no room anywhere, say)
        await self.nc.publish(msg.reply, encode(ParkReply(ok=ok, relaunched=relaunched)))
        if req.resume and ok:
            iid = relaunched.instance_id if relaunched else req.instance_id
            ev = dict(instance_id=iid, function=req.function, node="n0", gpu=0)
            await self.nc.publish(subjects.instance_state("ready", "n0"), encode(InstanceReady(
                **ev, resumed=relaunched is None, parkable=self.parkable)))

    async def on_retire(self, msg):
        req = decode(msg.data, RetireRequest)
        self.retired.append(req)
        ok = self.live.pop(req.instance_id, None) is not None
        await self.nc.publish(msg.reply, encode(RetireReply(ok=ok, instance_id=req.instance_id)))
        if ok:
            await self.nc.publish(subjects.instance_state("retired", "n0"), encode(InstanceRetired(
                instance_id=req.instance_id, function=req.function, node="n0", gpu=0)))

    async def on_breach(self, msg):
        self.breaches.append(decode(msg.data, BurstWindowBreach))

    async def on_decision(self, msg):
        self.decisions.append(decode(msg.data, ScaleDecision))


async def until(pred, timeout=10.0, step=0.05):
    for _ in range(int(timeout / step)):
        if pred():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


async def setup(nats_url, with_consumer=True, tick_s=0.1, place_backoff_max_s=10.0, **config):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=subjects.INVOKE_STREAM, subjects=[subjects.INVOKE_SUBJECTS],
                                     retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.MEMORY))
    if with_consumer:
        await js.add_consumer(subjects.INVOKE_STREAM, ConsumerConfig(
            durable_name=consumer_name(FN), filter_subject=subjects.invoke(FN), ack_policy=AckPolicy.EXPLICIT))
    cluster = FakeCluster(nc)
    await cluster.start()
    # target utilisation 1: a request in flight wants one instance (the parking and migration cases count them)
    cfg = HorizontalConfig(**{"mode": "lazy", "stable_window_s": 2.0, "panic_window_pct": 25.0, "keep_alive_s": 1.5,
                              "target_utilization": 1.0, **config})
    scaler = HorizontalScaler(cfg, tick_s=tick_s, place_backoff_max_s=place_backoff_max_s)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(scaler, nats_url, shutdown=shutdown, install_signals=False))
    await until(scaler.ready)
    spec = FunctionSpec(name=FN, model="resnet50", slo_ms=100.0, max_instances=4)
    await nc.publish(subjects.function_deployed(FN), encode(FunctionDeployed(spec=spec)))
    await settle(nc)
    await until(lambda: FN in scaler.policy.functions())
    return nc, js, cluster, scaler, shutdown, task


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_total", {"function": FN}) or 0.0


def resume_counts() -> dict[str, float]:
    """FN's ``dilu_resumes_total`` by outcome (per function, as the other counters are)."""
    return {o: REGISTRY.get_sample_value("dilu_resumes_total", {"function": FN, "outcome": o}) or 0.0
            for o in ("resumed", "relaunched", "refused")}


async def test_burst_scales_out_then_idle_function_scales_to_zero_after_keep_alive(nats_url):
    before = {n: counter(n) for n in ("dilu_scale_outs", "dilu_retirements", "dilu_scale_to_zero")}
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url)
    await asyncio.sleep(0.5)
    assert cluster.placed == []  # nothing queued, never invoked: no instance
    for k in range(6):
        await js.publish(subjects.invoke(FN), b"req-%d" % k)
    await until(lambda: len(cluster.live) >= 2)
    out = [d for d in cluster.decisions if d.direction == "out"]
    assert out and all(r.function == FN for r in cluster.placed)
    assert len(cluster.live) <= 4  # the function's max_instances
    assert cluster.breaches and cluster.breaches[0].function == FN and cluster.breaches[0].queue_depth >= 1

    # the instances serve everything: pull and acknowledge
    sub = await js.pull_subscribe(subjects.invoke(FN), durable=consumer_name(FN), stream=subjects.INVOKE_STREAM)
    msgs = await sub.fetch(6, timeout=5)
    for m in msgs:
        await m.ack()
    served_at = asyncio.get_running_loop().time()
    await until(lambda: not cluster.live, timeout=15.0)
    gone_at = asyncio.get_running_loop().time()
    assert gone_at - served_at >= 1.5 - 0.2  # not before the keep-alive
    # the ScaleDecision is published after the retirement is answered: it may trail it
    await until(lambda: any(d.direction == "zero" for d in cluster.decisions))
    assert {r.instance_id for r in cluster.retired} == {f"i{k}" for k in range(sum(r.count for r in cluster.placed))}
    await until(lambda: not scaler.policy.instances(FN))  # the retired events arrived
    added = sum(r.count for r in cluster.placed)
    assert counter("dilu_scale_outs") - before["dilu_scale_outs"] == added
    assert counter("dilu_retirements") - before["dilu_retirements"] == added
    assert counter("dilu_scale_to_zero") - before["dilu_scale_to_zero"] == 1
    await nc.close()
    shutdown.set()
    await task


async def test_missing_consumer_holds_the_scale_and_never_goes_to_max(nats_url):
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url, with_consumer=False)
    for k in range(20):  # requests stored while the function's consumer does not exist
        await js.publish(subjects.invoke(FN), b"x")
    await until(lambda: scaler.backlog_errors >= 8)
    # one instance, so the stored requests are not stranded (its binding creates the consumer) ...
    assert [r.count for r in cluster.placed] == [1] and cluster.retired == []
    errors = scaler.backlog_errors
    await until(lambda: scaler.backlog_errors >= errors + 5)
    assert [r.count for r in cluster.placed] == [1]  # ... and then held: never the maximum
    # the consumer appears: the backlog is read again and the function scales on it, up to its max
    await js.add_consumer(subjects.INVOKE_STREAM, ConsumerConfig(
        durable_name=consumer_name(FN), filter_subject=subjects.invoke(FN), ack_policy=AckPolicy.EXPLICIT))
    await until(lambda: len(cluster.live) == 4)
    await asyncio.sleep(0.5)
    assert len(cluster.live) == 4
    await nc.close()
    shutdown.set()
    await task


async def test_a_long_request_in_flight_keeps_its_instance_past_the_keep_alive(nats_url):
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url)
    await js.publish(subjects.invoke(FN), b"slow")
    await until(lambda: cluster.live)
    sub = await js.pull_subscribe(subjects.invoke(FN), durable=consumer_name(FN), stream=subjects.INVOKE_STREAM)
    (msg,) = await sub.fetch(1, timeout=5)  # in flight (unacknowledged) for 3 s, keep-alive 1.5 s
    await asyncio.sleep(3.0)
    assert cluster.retired == [] and cluster.live
    await msg.ack()
    await until(lambda: not cluster.live, timeout=10.0)
    # the ScaleDecision is published after the retirement is answered: it may trail it
    await until(lambda: any(d.direction == "zero" for d in cluster.decisions))
    await nc.close()
    shutdown.set()
    await task


async def test_training_function_is_held_at_its_min_instances_without_a_backlog(nats_url):
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url)
    spec = FunctionSpec(name="train-bert", model="bert", kind="training", priority="training", min_instances=1)
    await nc.publish(subjects.function_deployed(spec.name), encode(FunctionDeployed(spec=spec)))
    await until(lambda: any(r.function == spec.name for r in cluster.placed))
    await asyncio.sleep(1.0)
    assert [r.count for r in cluster.placed if r.function == spec.name] == [1]
    assert scaler.backlog_errors == 0 and not any(r.function == spec.name for r in cluster.retired)
    await nc.close()
    shutdown.set()
    await task


async def test_profiled_function_gets_its_initial_instance_and_burst_sizing(nats_url):
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url)
    try:
        await asyncio.sleep(0.3)
        assert cluster.placed == []  # deployed but not placeable yet: no profile
        prof = Profile(function=FN, request_quota=0.2, limit_quota=0.6, batch_size=4, burst_batch=8, latency_ms=40.0,
                       throughput_rps=100.0, limit_latency_ms=20.0, limit_throughput_rps=200.0)
        await nc.publish(subjects.profile_ready(FN), encode(ProfileReady(profile=prof)))
        await until(lambda: len(cluster.live) == 1)  # the initial scale, before any request
        assert cluster.decisions[0].direction == "prewarm" and "initial scale" in cluster.decisions[0].reason
        params = scaler.policy.params(FN)
        # SLO 100 ms: batch 4 x floor(100/40) at the request, burst batch 8 x floor(100/20) at the limit
        assert (params.target, params.burst_target, params.burst_rps) == (8.0, 40.0, 200.0)
        await asyncio.sleep(0.5)
        assert len(cluster.placed) == 1  # held at one while unused, not re-placed
    finally:
        shutdown.set()
        await task
        await nc.close()


async def test_a_migration_is_one_instance_until_its_replacement_is_ready(nats_url):
    """The scheduler's defragmentation (PlacementDecided ``migrate`` with ``replaces``): the
    scaler neither retires the replacement nor the old instance while the replacement starts,
    and counts the old one as draining once the replacement is ready."""
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url)
    try:
        await js.publish(subjects.invoke(FN), b"one")
        await until(lambda: cluster.live)
        (old,) = list(cluster.live)
        await until(lambda: scaler.policy.instances(FN) == {old: "ready"})
        new = Placement(instance_id="moved", function=FN, node="n0", gpu=1, request_quota=0.3, limit_quota=0.6,
                        width=0.6, memory_bytes=1, replaces=old)
        ev = dict(instance_id="moved", function=FN, node="n0", gpu=1)
        await nc.publish(subjects.placement_decided(FN), encode(PlacementDecided(placement=new, action="migrate")))
        await nc.publish(subjects.instance_state("launched", "n0"), encode(InstanceLaunched(**ev)))
        await until(lambda: scaler.policy.instances(FN).get("moved") == "moving")
        await asyncio.sleep(0.5)  # a few ticks with the request still queued
        assert cluster.retired == [] and scaler.policy.instances(FN) == {old: "ready", "moved": "moving"}
        await nc.publish(subjects.instance_state("ready", "n0"), encode(InstanceReady(**ev)))
        await until(lambda: scaler.policy.instances(FN) == {old: "draining", "moved": "ready"})
        assert cluster.retired == []  # the old one's drain is the scheduler's
    finally:
        shutdown.set()
        await task
        await nc.close()


async def parkable_spec(nc, scaler):
    """Deploy FN again with a cold start whose resume (a third of it) fits half its 100 ms SLO."""
    spec = FunctionSpec(name=FN, model="resnet50", slo_ms=100.0, max_instances=4, cold_start_ms=30.0)
    await nc.publish(subjects.function_deployed(FN), encode(FunctionDeployed(spec=spec)))
    await until(lambda: scaler.policy.params(FN).parkable)


async def serve_all(js, n):
    sub = await js.pull_subscribe(subjects.invoke(FN), durable=consumer_name(FN), stream=subjects.INVOKE_STREAM)
    for m in await sub.fetch(n, timeout=5):
        await m.ack()
    await sub.unsubscribe()


@pytest.mark.parametrize("relaunch", [False, True])
async def test_an_idle_function_is_parked_and_a_request_resumes_it_without_a_new_placement(nats_url, relaunch):
    """Parking live: the scaler asks the scheduler to park the idle function's instance, and the
    next request resumes it (ParkRequest resume) rather than placing a new one; when the
    scheduler relaunched it elsewhere instead, the new instance is counted and the parked one
    forgotten. The counters the report reads say so: one park for the one instance parked, one
    resume under its outcome."""
    before = resume_counts()
    parks_before = counter("dilu_parks")
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url, keep_alive_s=30.0, park_after_s=0.5)
    cluster.parkable, cluster.relaunch = True, relaunch
    try:
        await parkable_spec(nc, scaler)
        await js.publish(subjects.invoke(FN), b"one")
        await until(lambda: cluster.live)
        (first,) = list(cluster.live)
        await serve_all(js, 1)
        await until(lambda: scaler.policy.instances(FN) == {first: "parked"})
        # the policy marks it parked when it decides; the ParkRequest follows on the bus
        await until(lambda: any(d.direction == "park" for d in cluster.decisions))
        assert [(p.instance_id, p.resume) for p in cluster.parks] == [(first, False)]
        assert counter("dilu_parks") - parks_before == 1  # counted when its decision is published
        await js.publish(subjects.invoke(FN), b"two")
        await until(lambda: len(cluster.parks) == 2)
        assert cluster.parks[1].instance_id == first and cluster.parks[1].resume
        if relaunch:
            (new,) = [i for i in cluster.live if i != first]
            await until(lambda: scaler.policy.instances(FN) == {new: "ready"})
        else:
            await until(lambda: scaler.policy.instances(FN) == {first: "ready"})
        assert [r.count for r in cluster.placed] == [1]  # no PlaceRequest: the resume brought it back
        await until(lambda: any(d.direction == "resume" for d in cluster.decisions))
        outcome = "relaunched" if relaunch else "resumed"
        assert {k: v - before[k] for k, v in resume_counts().items()} == {
            "resumed": 0, "relaunched": 0, "refused": 0, outcome: 1}
    finally:
        shutdown.set()
        await task
        await nc.close()


async def test_a_request_for_a_parked_function_resumes_it_without_waiting_for_a_tick(nats_url):
    """While a function is all parked the scaler listens on its invocation subject: the request
    itself resumes an instance (the decision says so), as Knative's activator wakes a function."""
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url, tick_s=1.0, keep_alive_s=60.0, park_after_s=0.5)
    cluster.parkable = True
    try:
        await parkable_spec(nc, scaler)
        await js.publish(subjects.invoke(FN), b"one")
        await until(lambda: cluster.live)
        (first,) = list(cluster.live)
        await serve_all(js, 1)
        await until(lambda: scaler.policy.instances(FN) == {first: "parked"} and FN in scaler._wakers)
        await js.publish(subjects.invoke(FN), b"two")
        await until(lambda: len(cluster.parks) == 2)
        assert cluster.parks[1].resume and cluster.parks[1].instance_id == first
        await until(lambda: any(d.direction == "resume" for d in cluster.decisions))
        woke = [d for d in cluster.decisions if d.direction == "resume"]
        assert woke[0].reason == "a request for a parked function"  # not the next tick's
        await until(lambda: FN not in scaler._wakers)  # serving again: it listens no more
    finally:
        shutdown.set()
        await task
        await nc.close()


async def test_a_refused_resume_backs_off_as_a_refused_placement(nats_url):
    """The scheduler refuses to resume the parked instance (no room anywhere): it stays parked and
    the function backs off as after a refused placement: no ParkRequest and no PlaceRequest until
    the delay (a tick at first, then doubling) is over, then one more try. The ticks are driven
    here at chosen times on the scaler's clock; its own loop never ticks (tick_s 1000)."""
    before = resume_counts()
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url, tick_s=1000.0, place_backoff_max_s=8000.0,
                                                          keep_alive_s=3600.0)
    try:
        scaler.policy.instance_parked(FN, "gone", 0.0)  # unknown to the scheduler: its resume is refused
        await js.publish(subjects.invoke(FN), b"one")  # a backlog: one instance wanted
        t = scaler._now() + 1.0
        await scaler.tick(FN, t)
        assert [(p.instance_id, p.resume) for p in cluster.parks] == [("gone", True)]
        assert scaler.policy.instances(FN) == {"gone": "parked"}
        for later in (1.0, 500.0, 999.0):  # within the first delay, one tick (1000 s)
            d = await scaler.tick(FN, t + later)
            assert d.resume == [] and d.desired >= 1
        assert len(cluster.parks) == 1 and cluster.placed == []
        await scaler.tick(FN, t + 1000.0)  # over: asked again, refused again, for twice as long
        assert len(cluster.parks) == 2 and cluster.placed == []
        await scaler.tick(FN, t + 2999.0)
        assert len(cluster.parks) == 2 and scaler.policy.instances(FN) == {"gone": "parked"}
        assert resume_counts()["refused"] - before["refused"] == 2
    finally:
        shutdown.set()
        await task
        await nc.close()


async def test_an_instance_whose_code_cannot_park_is_never_parked(nats_url):
    nc, js, cluster, scaler, shutdown, task = await setup(nats_url, keep_alive_s=30.0, park_after_s=0.3)
    try:
        await parkable_spec(nc, scaler)
        await js.publish(subjects.invoke(FN), b"one")
        await until(lambda: cluster.live)
        await serve_all(js, 1)
        await asyncio.sleep(1.5)
        assert cluster.parks == [] and list(scaler.policy.instances(FN).values()) == ["ready"]
    finally:
        shutdown.set()
        await task
        await nc.close()


def test_ticks_place_the_largest_instances_first():
    scaler = HorizontalScaler(HorizontalConfig(mode="lazy"))
    for name, limit, mem in (("small", 0.2, 1), ("llm", 0.5, 18), ("mid", 0.5, 4), ("unprofiled", 0.0, 0)):
        scaler._learn(name, spec=FunctionSpec(name=name, model="resnet50", memory_bytes=mem))
        if limit:
            scaler._learn(name, profile=Profile(function=name, request_quota=0.1, limit_quota=limit, batch_size=1))
    # first-fit decreasing: by limit quota, then memory
    assert sorted(scaler.policy.functions(), key=scaler._size) == ["llm", "mid", "small", "unprofiled"]


async def test_a_restored_instance_whose_placement_vanishes_unheard_of_is_forgotten(nats_url):
    """At start the scaler counts each placement in the table as a running instance. The
    scheduler can delete one that no process ever ran (its GPU gone from a node that came back
    smaller) with no InstanceRetired to follow: the scaler looks such placements up again and
    forgets the vanished one, while one that showed a sign of life (a telemetry row) stays even
    once its entry is gone (its InstanceRetired will say when it ends)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    kv, _ = await ensure_kv(js, PLACEMENT_KV_CONFIG, replicas=None)
    functions = await js.create_key_value(bucket=subjects.FUNCTIONS_BUCKET)
    spec = FunctionSpec(name=FN, slo_ms=100.0, model="resnet152", min_instances=2)
    await functions.put(subjects.token(FN), msgspec.json.encode(spec))

    def placement(iid: str, gpu: int) -> bytes:
        return msgspec.json.encode(Placement(instance_id=iid, function=FN, node="n1", gpu=gpu, request_quota=0.3,
                                      limit_quota=0.5, width=0.5, memory_bytes=1 << 30))

    await kv.put("ghost", placement("ghost", 2))
    await kv.put("alive", placement("alive", 0))
    scaler = HorizontalScaler(tick_s=60.0, reconcile_s=0.1)  # no tick meanwhile: only the bookkeeping
    stop = asyncio.Event()
    task = asyncio.create_task(serve(scaler, nats_url, shutdown=stop, install_signals=False))
    while not scaler.ready():
        await asyncio.sleep(0.02)
    assert scaler.policy.instances(FN) == {"ghost": "ready", "alive": "ready"}
    row = InstanceTelemetry(instance_id="alive", function=FN, quota=0.3, request_quota=0.3, limit_quota=0.5,
                            width=0.5)
    await nc.publish(subjects.telemetry_gpu("n1", 0), encode(GpuTelemetry(node="n1", gpu=0, window_ms=1000.0, instances=[row])))
    await settle(nc)
    await kv.delete("ghost")
    await kv.delete("alive")
    for _ in range(100):
        if "ghost" not in scaler.policy.instances(FN):
            break
        await asyncio.sleep(0.05)
    assert scaler.policy.instances(FN) == {"alive": "ready"}
    stop.set()
    await task
    await nc.close()


async def test_at_debug_level_each_tick_logs_what_the_function_was_sized_by(nats_url):
    """DILU_LOG_LEVEL=debug (docs/operations.md, Logs): every tick logs the function's backlog,
    instances, decision, the least burst reach of its ready instances and the in-flight target
    it was sized by; at info it logs none of it."""
    from structlog.testing import capture_logs

    from dilu.services.common import logging as dlog

    nc, js, cluster, scaler, shutdown, task = await setup(nats_url, tick_s=1000.0)
    try:
        await js.publish(subjects.invoke(FN), b"one")
        with capture_logs() as quiet:
            await scaler.tick(FN, scaler._now() + 1.0)
        dlog.configure("horizontal_scaler", "debug")
        with capture_logs() as logs:
            d = await scaler.tick(FN, scaler._now() + 2.0)
        assert not [e for e in quiet if e["event"] == "tick"]
        (line,) = [e for e in logs if e["event"] == "tick"]
        assert line["function"] == FN and line["backlog"] == 1 and line["desired"] == d.desired >= 1
        assert line["reach"] == d.reach and line["target"] == round(d.target, 2) > 0
    finally:
        dlog.configure("horizontal_scaler", "info")
        shutdown.set()
        await task
        await nc.close()
