"""Instance faults across the node agent, the scheduler and the horizontal scaler (real
nats-server; a CPU node agent runs real instance processes of misbehaving handlers from
tests/fault_handlers):

- an instance whose function cannot load says ``FAILED <reason>``, is retired as load-failed
  with that reason and is not launched again; one that keeps crashing is retired as gave-up;
- a ``predict`` answering a str fails that request alone, the instance keeps serving;
- the scheduler removes the placement of a load-failed (or gave-up) instance;
- the horizontal scaler keeps restored functions for their keep-alive, forgets an instance the
  scheduler does not know, backs off from a function whose instances fail to load (and says so
  in its FunctionState), and asks for at most MAX_PLACE_COUNT instances at once.
"""
from __future__ import annotations

import asyncio
import subprocess
import itertools
import time
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.api import KeyValueConfig, StorageType

from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.nodes import nodes_bucket
from dilu.services.common.runner import running, serve
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.horizontal_scaler.policy import HorizontalConfig
from dilu.services.horizontal_scaler.service import HorizontalScaler
from dilu.services.node_agent import service as agent_service
from dilu.services.node_agent.service import NodeAgent
from dilu.services.scheduler.service import SchedulerService
from dilu.services.common.bus import settle
from scheduler_helpers import deploy, inventory, place, table, wait_for

pytestmark = pytest.mark.nats
TESTS = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- node agent


class Agent:
    """A CPU node agent ``n1`` and a record of its instances' lifecycle events."""

    def __init__(self, url: str):
        self.url = url
        self.agent = NodeAgent(node="n1", gpus=0, nats=url)
        self.shutdown = asyncio.Event()
        self.events: dict[str, list] = {"launched": [], "ready": [], "retired": []}

    async def __aenter__(self):
        self.task = asyncio.create_task(serve(self.agent, self.url, shutdown=self.shutdown, install_signals=False))
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await ensure_stream(self.js)  # as the instances create it
        kinds = {"launched": ev.InstanceLaunched, "ready": ev.InstanceReady, "retired": ev.InstanceRetired}
        for state, kind in kinds.items():
            async def cb(msg, state=state, kind=kind):
                self.events[state].append(decode(msg.data, kind))
            await self.nc.subscribe(subjects.instance_state(state, "n1"), cb=cb)
        await wait_for(self.agent.ready, "agent started")
        self.kv = await self.js.key_value(subjects.PLACEMENT_BUCKET)
        return self

    async def put(self, iid: str, fn: str, handler: str) -> None:
        p = ev.Placement(instance_id=iid, function=fn, node="n1", gpu=0, request_quota=0.5, limit_quota=0.5,
                         width=0.5, memory_bytes=1, batch_size=1, handler=handler)
        await self.kv.put(iid, encode(p))

    async def __aexit__(self, *exc):
        self.shutdown.set()
        await asyncio.wait_for(self.task, 40)
        await self.nc.drain()


@pytest.fixture
def handlers_importable(monkeypatch):
    """Instances import tests/fault_handlers; restarts come quickly."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setattr(agent_service, "RESTART_DELAY_S", 0.1)


async def test_failures_to_load_and_crash_loops_are_retired_with_their_error(nats_url, handlers_importable):
    async with Agent(nats_url) as a:
        await a.put("bad", "missing", "fault_handlers.no_such_module")
        await a.put("loop", "crashing", "fault_handlers.exits")
        await wait_for(lambda: len(a.events["retired"]) >= 1 + agent_service.MAX_RESTARTS + 1, "both retired for good",
                       timeout_s=60)
        by = {iid: [r for r in a.events["retired"] if r.instance_id == iid] for iid in ("bad", "loop")}
        (load,) = by["bad"]
        assert load.reason == ev.LOAD_FAILED and "fault_handlers.no_such_module" in load.error
        assert [r.reason for r in by["loop"]] == ["crashed"] * agent_service.MAX_RESTARTS + [ev.GAVE_UP]
        assert by["loop"][-1].error == "exit code 3"
        await asyncio.sleep(3 * agent_service.RESTART_DELAY_S)  # a relaunch would come by now
        launches = [e.instance_id for e in a.events["launched"]]
        assert launches.count("bad") == 1 and launches.count("loop") == 1 + agent_service.MAX_RESTARTS
        assert not a.agent.instances


async def test_a_crash_is_noticed_when_the_process_ends_though_a_child_holds_its_stdout(nats_url, handlers_importable):
    async with Agent(nats_url) as a:
        await a.put("o1", "orphaned", "fault_handlers.orphan")
        await wait_for(lambda: a.events["launched"], "launched", timeout_s=60)
        # the READY wait is 90 s and the child holds the pipe for 60 s: only the exit can tell
        try:
            first = await wait_for(lambda: a.events["retired"], "the crash noticed", timeout_s=20)
        finally:  # the children the crashing instances left (one per launch)
            subprocess.run(["pkill", "-f", "dilu-orphan-child"], check=False)
        assert first[0].instance_id == "o1" and first[0].reason == "crashed" and first[0].exit_code == 4


async def test_a_str_answer_fails_its_request_and_the_instance_keeps_serving(nats_url, handlers_importable):
    async with Agent(nats_url) as a:
        await ensure_consumer(a.js, "strings")
        await a.put("s1", "strings", "fault_handlers.strings")
        await wait_for(lambda: a.events["ready"], "instance ready", timeout_s=60)
        client = InvokeClient(a.nc, a.js)
        await client.start()
        bad = await client.invoke("strings", b"str", request_id="r1", scheduled_ns=time.time_ns(), timeout_s=30)
        good = await client.invoke("strings", b"bytes", request_id="r2", scheduled_ns=time.time_ns(), timeout_s=30)
        await client.close()
        assert bad.status == "error" and "predict returned str for request r1; expected bytes" in bad.error
        assert good.status == "ok" and good.payload == b"bytes" and good.instance == "s1"
        assert a.events["retired"] == [] and len(a.events["launched"]) == 1


# ------------------------------------------------------------------------------- scheduler


async def test_the_scheduler_frees_the_placement_of_an_instance_that_failed_for_good(nats_url):
    nc = await nats.connect(nats_url)
    svc = SchedulerService(node_ttl_s=3600)
    async with running(svc, nats_url):
        kv = await nodes_bucket(nc.jetstream())
        await kv.put("node0", encode(inventory("node0", gpus=1)))
        await wait_for(lambda: "node0" in svc.cluster.node_index, "node joined")
        await deploy(nc, svc, "f")
        reply = await place(nc, "f", count=2)
        assert reply.ok, reply.error
        crashed, failed = reply.placements
        for p, reason in ((crashed, "crashed"), (failed, ev.LOAD_FAILED)):
            await nc.publish(subjects.instance_state("retired", p.node), encode(ev.InstanceRetired(
                instance_id=p.instance_id, function="f", node=p.node, gpu=p.gpu, reason=reason, error="boom")))
        await wait_for(lambda: failed.instance_id not in svc.placements, "failed placement removed")
        assert set(await table(nc.jetstream())) == {crashed.instance_id}  # a crash is relaunched: it stays
        assert set(svc.cluster.instances) == {crashed.instance_id}
    await nc.close()


# ------------------------------------------------------------------------------- horizontal scaler

FN = "f"


class FakeScheduler:
    """Answers place (``refuse_retire``: retire too) as the scheduler would; records requests."""

    def __init__(self, nc, *, load_fails: bool = False):
        self.nc, self.load_fails = nc, load_fails
        self.ids = itertools.count()
        self.placed: list[tuple[float, ev.PlaceRequest]] = []
        self.retired: list[ev.RetireRequest] = []

    async def start(self):
        await self.nc.subscribe(subjects.SCHEDULER_PLACE, cb=self.on_place)
        await self.nc.subscribe(subjects.SCHEDULER_RETIRE, cb=self.on_retire)
        await settle(self.nc)

    async def on_place(self, msg):
        req = decode(msg.data, ev.PlaceRequest)
        self.placed.append((time.monotonic(), req))
        out = [ev.Placement(instance_id=f"i{next(self.ids)}", function=req.function, node="n0", gpu=0,
                            request_quota=0.1, limit_quota=0.1, width=0.1, memory_bytes=1) for _ in range(req.count)]
        await self.nc.publish(msg.reply, encode(ev.PlaceReply(ok=True, placements=out)))
        if self.load_fails:
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self.fail(out)))

    async def fail(self, placements):
        """Each instance fails to load, as a node agent reports it (after its launch took a while)."""
        for p in placements:
            await self.nc.publish(subjects.instance_state("retired", "n0"), encode(ev.InstanceRetired(
                instance_id=p.instance_id, function=p.function, node="n0", gpu=0, reason=ev.LOAD_FAILED,
                exit_code=1, error="importing 'app' failed: ModuleNotFoundError")))

    async def on_retire(self, msg):
        req = decode(msg.data, ev.RetireRequest)
        self.retired.append(req)
        error = f"no instance {req.instance_id!r} of function {req.function!r}"
        await self.nc.publish(msg.reply, encode(ev.RetireReply(ok=False, error=error)))


async def scaler_up(nats_url, *, load_fails=False, stored=(), **cfg):
    """A fake scheduler, then (with ``stored`` placements in KV) the scaler, then FN deployed
    live unless it is stored. Returns (nc, fake, scaler, shutdown, task)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js, storage=StorageType.MEMORY)
    await ensure_consumer(js, FN)
    fake = FakeScheduler(nc, load_fails=load_fails)
    await fake.start()
    spec = ev.FunctionSpec(name=FN, model="resnet50", max_instances=200, **cfg.pop("spec", {}))
    profile = ev.Profile(function=FN, request_quota=0.1, limit_quota=0.1, batch_size=1)
    if stored:
        for bucket, key, value in ((subjects.FUNCTIONS_BUCKET, FN, spec), (subjects.PROFILES_BUCKET, FN, profile),
                                   *((subjects.PLACEMENT_BUCKET, p.instance_id, p) for p in stored)):
            kv = await js.create_key_value(KeyValueConfig(bucket=bucket))
            await kv.put(key, msgspec.json.encode(value))
    scaler = HorizontalScaler(HorizontalConfig(stable_window_s=2.0, **cfg), tick_s=0.1, place_backoff_max_s=10.0)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(scaler, nats_url, shutdown=shutdown, install_signals=False))
    await wait_for(scaler.ready, "scaler started")
    if not stored:
        await nc.publish(subjects.function_deployed(FN), encode(ev.FunctionDeployed(spec=spec)))
        await nc.publish(subjects.profile_ready(FN), encode(ev.ProfileReady(profile=profile)))
    return nc, fake, scaler, shutdown, task


async def scaler_down(nc, shutdown, task):
    shutdown.set()
    await task
    await nc.close()


async def test_restored_functions_keep_their_instances_for_the_keep_alive(nats_url):
    stored = [ev.Placement(instance_id="old", function=FN, node="n0", gpu=0, request_quota=0.1, limit_quota=0.1,
                           width=0.1, memory_bytes=1)]
    nc, fake, scaler, shutdown, task = await scaler_up(nats_url, stored=stored, keep_alive_s=1.5)
    try:
        assert scaler.policy.instances(FN) == {"old": "ready"}
        await asyncio.sleep(0.6)  # several ticks with an empty backlog: no history is no idleness
        assert fake.retired == [] and fake.placed == []
        # after the keep-alive it goes; the scheduler no longer knows it: forgotten, not retried
        await wait_for(lambda: fake.retired, "retired after the keep-alive")
        await wait_for(lambda: not scaler.policy.instances(FN), "unknown instance forgotten")
        await asyncio.sleep(0.5)
        assert [r.instance_id for r in fake.retired] == ["old"] and fake.placed == []
    finally:
        await scaler_down(nc, shutdown, task)


async def test_a_function_whose_instances_fail_to_load_backs_off_and_is_not_placeable(nats_url):
    nc, fake, scaler, shutdown, task = await scaler_up(nats_url, load_fails=True, keep_alive_s=60.0)
    try:
        await wait_for(lambda: len(fake.placed) >= 4, "four placements", timeout_s=30)
        gaps = [b[0] - a[0] for a, b in zip(fake.placed, fake.placed[1:])]
        # back-off after each failure doubles from the tick: 0.1, 0.2, 0.4 s at least
        assert gaps[2] >= 0.35, gaps
        kv = await nc.jetstream().key_value(subjects.FUNCTION_STATE_BUCKET)
        state = msgspec.json.decode((await kv.get(subjects.token(FN))).value, type=ev.FunctionState)
        assert not state.placeable and "ModuleNotFoundError" in state.reason
    finally:
        await scaler_down(nc, shutdown, task)


async def test_a_scale_out_asks_for_at_most_max_place_count(nats_url):
    nc, fake, scaler, shutdown, task = await scaler_up(nats_url, spec=dict(initial_scale=100), keep_alive_s=60.0)
    try:
        await wait_for(lambda: sum(r.count for _, r in fake.placed) >= 100, "the initial scale placed")
        counts = [r.count for _, r in fake.placed]
        assert counts[0] == ev.MAX_PLACE_COUNT and max(counts) <= ev.MAX_PLACE_COUNT and sum(counts) == 100
    finally:
        await scaler_down(nc, shutdown, task)
