"""The client library against a real nats-server and stand-in services (tests/client_fakes.py):
deploy and each way it fails, calling functions (errors, timeouts, streaming), undeploy and
status, and the blocking client."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from client_fakes import FAKE_PROFILE, FakeInstance, FakeServices, put_state, spec_toml
from dilu.client import admin
from dilu.client.aio import AsyncClient
from dilu.client.errors import (
    BadRequest,
    DeployError,
    FunctionError,
    InvocationTimeout,
    NoCapacity,
    NotAdmitted,
    NotDeployed,
    Unreachable,
)
from dilu.client.spec import load_spec, parse_spec
from dilu.client.sync import Client
from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import workqueue
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsserver import free_port
from dilu.services.common.nodes import nodes_bucket

pytestmark = pytest.mark.nats


@pytest.fixture
async def client(nats_url):
    c = await AsyncClient.connect(nats_url)
    yield c
    await c.close()


async def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def loaded(name="echo", **kw):
    return parse_spec(spec_toml(name, **kw))


async def deployed(nc, name="echo", *, kind="inference", extra="initial_scale = 0",
                   instance: bool = True) -> FakeInstance | None:
    """Deploy ``name`` with stand-in services and (``instance``) start a fake instance of it."""
    fakes = await FakeServices(nc, ready=False).start()
    try:
        await admin.deploy(nc, loaded(name, kind=kind, extra=extra))
    finally:
        await fakes.stop()
    return await FakeInstance(nc, name).start() if instance else None


# ---------------------------------------------------------------- deploy


async def test_deploy_uploads_admits_profiles_stores_announces_and_waits_for_the_instance(nc, services, tmp_path):
    (tmp_path / "model.py").write_text("class Model:\n    pass\n")
    text = f'name = "cls"\nentry = "model:Model"\nslo_ms = 100.0\nmemory_bytes = 1000000\ninitial_scale = 1\n'
    (tmp_path / "function.toml").write_text(text)
    spec_file = load_spec(tmp_path / "function.toml")
    announced = []

    async def on_deployed(msg):
        announced.append(msg)
    sub = await nc.subscribe(subjects.function_deployed("cls"), cb=on_deployed)
    result = await admin.deploy(nc, spec_file, wait_ready_s=10)
    assert result.code.startswith("sha256-") and result.spec.code == result.code
    assert spec_file.spec.code == ""  # the caller's spec is left as it was
    store = await nc.jetstream().object_store(subjects.CODE_BUCKET)
    assert (await store.get_info(result.code)).size > 0
    assert services.admitted[0].code == result.code and services.profiled[0].code == result.code
    assert result.profile.request_quota == FAKE_PROFILE["request_quota"]
    kv = await nc.jetstream().key_value(subjects.FUNCTIONS_BUCKET)
    stored = msgspec.json.decode((await kv.get("cls")).value, type=ev.FunctionSpec)
    assert stored == result.spec
    async def heard():
        return bool(announced)
    await wait_for(heard)
    assert decode(announced[0].data, ev.FunctionDeployed).spec == result.spec
    info = await nc.jetstream().consumer_info(subjects.INVOKE_STREAM, workqueue.consumer_name("cls"))
    assert info.config.filter_subject == subjects.invoke("cls")
    assert result.ready is not None and result.ready.instance_id == "cls-i1"
    assert (result.ready.node, result.ready.gpu, result.ready.cold_start_ms) == ("node-a", 1, 1234.0)
    await sub.unsubscribe()


async def test_operator_profile_reaches_the_profiler_and_comes_back(nc, services):
    extra = "initial_scale = 0\n[profile]\nrequest_quota = 0.25\nlimit_quota = 0.5\nbatch_size = 2"
    result = await admin.deploy(nc, loaded(extra=extra))
    assert services.profiled[0].profile.backend == "operator"
    assert (result.profile.request_quota, result.profile.batch_size) == (0.25, 2)
    assert result.ready is None and result.waited_s == 0.0  # initial scale 0: nothing to wait for


async def test_no_instance_in_time_is_reported_not_an_error(nc):
    fakes = await FakeServices(nc, ready=False).start()
    result = await admin.deploy(nc, loaded(extra="initial_scale = 1"), wait_ready_s=0.5)
    assert result.ready is None and result.waited_s >= 0.5
    await fakes.stop()


async def test_redeploy_of_a_running_function_does_not_wait(nc, services):
    first = await admin.deploy(nc, loaded(extra="initial_scale = 1"), wait_ready_s=10)
    assert first.ready is not None
    again = await admin.deploy(nc, loaded(extra="initial_scale = 1\nmax_instances = 3"), wait_ready_s=10)
    assert again.existing_instances == 1 and again.ready is None and again.spec.max_instances == 3


@pytest.mark.parametrize("missing, message", [("scheduler", "no scheduler answering"),
                                              ("profiler", "no profiler answering")])
async def test_deploy_names_the_service_that_does_not_answer(nc, missing, message):
    fakes = await FakeServices(nc).start(**{missing: False})
    with pytest.raises(DeployError, match=message):
        await admin.deploy(nc, loaded())
    await fakes.stop()
    assert await (AsyncClient(nc, owns_connection=False)).functions() == {}  # nothing stored


async def test_refused_admission_reaches_the_deployer_before_profiling(nc):
    fakes = await FakeServices(nc, admit_error="no node has a GPU with 80 GB free").start()
    with pytest.raises(NotAdmitted, match="^function .echo. cannot be placed: no node has a GPU with 80 GB free$"):
        await admin.deploy(nc, loaded())  # a DeployError too
    assert fakes.profiled == [] and fakes.deployed == []
    await fakes.stop()


async def test_failed_profiling_reaches_the_deployer(nc):
    fakes = await FakeServices(nc, profile_error="no setting meets the SLO of 500 ms").start()
    with pytest.raises(DeployError, match="profiling echo failed: no setting meets the SLO of 500 ms"):
        await admin.deploy(nc, loaded())
    assert fakes.deployed == []
    await fakes.stop()


async def test_a_missing_code_folder_fails_the_deploy(nc, services, tmp_path):
    with pytest.raises(DeployError, match="does not exist"):
        await admin.deploy(nc, loaded(), code_dir=tmp_path / "gone")
    assert services.admitted == []


async def test_a_profiler_that_never_answers_times_the_deploy_out(nc):
    fakes = await FakeServices(nc).start(profiler=False)

    async def silent(msg):  # takes the request, never answers
        pass
    sub = await nc.subscribe(subjects.PROFILER_PROFILE, cb=silent)
    with pytest.raises(DeployError, match="the profiler did not answer within 0.5 s"):
        await admin.deploy(nc, loaded(), timeout_s=0.5)
    assert fakes.deployed == []
    await sub.unsubscribe()
    await fakes.stop()


async def test_a_service_answering_garbage_is_a_deploy_error(nc):
    async def garbage(msg):
        await msg.respond(b"not json")

    sub = await nc.subscribe(subjects.SCHEDULER_ADMIT, cb=garbage)
    with pytest.raises(DeployError, match="scheduler sent a malformed reply"):
        await admin.deploy(nc, loaded())
    await sub.unsubscribe()


# ---------------------------------------------------------------- calling


async def test_unreachable_nats_fails_fast_with_one_line():
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(Unreachable, match=f"cannot reach NATS at {url}"):
        await AsyncClient.connect(url, connect_attempts=1)
    assert time.monotonic() - started < 10


async def test_calls_to_a_function_never_deployed_fail_before_publishing(nc, client):
    with pytest.raises(NotDeployed, match="'ghost' is not deployed"):
        await client.invoke("ghost", b"x")
    with pytest.raises(NotDeployed):
        async for _ in client.stream("ghost", b"x"):
            pass
    with pytest.raises(NotDeployed):
        await client.function("ghost")
    with pytest.raises(NotDeployed):
        await admin.undeploy(nc, "ghost")


async def test_invoke_returns_the_reply_and_its_instance(nc, client):
    inst = await deployed(nc)
    reply = await client.invoke("echo", b"hi", timeout_s=10)
    assert reply.payload == b"echo:hi" and reply.instance == "inst-1" and not reply.cold_start
    assert reply.latency_ms > 0 and reply.chunks == 0 and reply.ttft_ms is None
    assert (await client.function("echo")).name == "echo"
    assert set(await client.functions()) == {"echo"}
    await inst.stop()


async def test_the_function_error_message_reaches_the_caller(nc, client):
    inst = await deployed(nc)
    with pytest.raises(FunctionError, match="^ValueError: image is not a JPEG$"):
        await client.invoke("echo", b"fail:image is not a JPEG", timeout_s=10)
    await inst.stop()


async def test_no_reply_in_time_is_a_timeout(nc, client):
    await deployed(nc, extra="initial_scale = 0")
    with pytest.raises(InvocationTimeout, match="within 0.5 s"):
        await client.invoke("echo", b"hang", timeout_s=0.5)  # taken, never answered


async def test_bad_arguments_are_bad_requests(nc, client):
    await deployed(nc)
    with pytest.raises(BadRequest, match="bytes"):
        await client.invoke("echo", "text")
    for bad in (0, -1, float("nan"), float("inf"), 1e308):  # 1e308 s overflowed the deadline
        with pytest.raises(BadRequest, match=r"timeout_s must be a number of seconds in \(0, 3600\]"):
            await client.invoke("echo", b"x", timeout_s=bad)


async def test_training_functions_take_no_requests(nc, client):
    fakes = await FakeServices(nc, ready=False).start()
    await admin.deploy(nc, loaded("job", kind="training"), wait_ready_s=0.2)
    with pytest.raises(BadRequest, match="training job"):
        await client.invoke("job", b"x")
    result = await admin.undeploy(nc, "job", wait_s=1)
    assert result.kind == "training" and result.cleaned  # no queue to remove is no error
    await fakes.stop()


async def test_an_unplaceable_function_without_instances_is_refused_before_publishing(nc, nats_url, services):
    await admin.deploy(nc, loaded(extra="initial_scale = 0"))
    await put_state(nc.jetstream(), ev.FunctionState(function="echo", placeable=False, reason="no GPU has 90 GB"))
    async with await AsyncClient.connect(nats_url) as c:
        async def state_known():
            return c._states.peek("echo") is not None
        await wait_for(state_known)  # the client's watch of dilu-function-state caught up
        with pytest.raises(NoCapacity, match="cannot be placed now and has no instance: no GPU has 90 GB"):
            await c.invoke("echo", b"x", timeout_s=5)
    assert await workqueue.backlog(nc.jetstream(), "echo") == 0  # nothing was published


async def test_a_full_stream_is_no_capacity(nc, client):
    await deployed(nc, instance=False)  # requests stay stored
    js = nc.jetstream()  # an operator shrinks the stream (ensure_stream never changes an existing one)
    await js.update_stream((await js.stream_info(subjects.INVOKE_STREAM)).config.evolve(max_bytes=4096))
    for _ in range(20):
        try:
            await client.invoke("echo", b"x" * 1000, timeout_s=0.2)
        except InvocationTimeout:  # stored, never answered
            continue
        except NoCapacity as exc:
            assert "not accepted" in str(exc)
            break
    else:
        pytest.fail("a full stream never refused a request")


async def test_a_function_deployed_after_connecting_is_found(nc, client, services):
    with pytest.raises(NotDeployed):
        await client.function("late")
    await admin.deploy(nc, loaded("late", extra="initial_scale = 0"))
    assert (await client.function("late")).name == "late"  # read once on the miss


async def test_the_watch_forgets_an_undeployed_function(nc, nats_url, services):
    await admin.deploy(nc, loaded("gone", extra="initial_scale = 0"))
    async with await AsyncClient.connect(nats_url) as c:
        assert (await c.function("gone")).name == "gone"
        assert c._specs.watching and c._specs.peek("gone") is not None  # answered from the watch's cache
        await admin.undeploy(nc, "gone", wait_s=0)

        async def forgotten():
            return c._specs.peek("gone") is None
        await wait_for(forgotten)  # the watch delivered the delete
        with pytest.raises(NotDeployed):
            await c.invoke("gone", b"x")


# ---------------------------------------------------------------- streaming


async def test_stream_yields_chunks_in_order_and_the_reply_counts_them(nc, client):
    inst = await deployed(nc, "chat", kind="llm")
    s = client.stream("chat", b"stream:Hel,lo, wor,ld", timeout_s=10)
    chunks = [c async for c in s]
    assert chunks == [b"Hel", b"lo", b" wor", b"ld"]
    assert s.reply.payload == b"Hello world" and s.reply.chunks == 4
    assert 0 < s.reply.ttft_ms <= s.reply.latency_ms and s.reply.tpot_ms >= 0
    reply = await client.invoke("chat", b"stream:a,b,c", timeout_s=10)
    assert reply.payload == b"abc" and reply.chunks == 3
    await inst.stop()


async def test_a_restreamed_request_adds_only_chunks_not_seen_and_strays_are_ignored(nc, client):
    inst = await deployed(nc, "chat", kind="llm")
    chunks = [c async for c in client.stream("chat", b"restream:a,b,c,d,e", timeout_s=10)]
    assert chunks == [b"a", b"b", b"c", b"d", b"e"]
    await inst.stop()


async def test_a_stream_that_fails_raises_after_its_chunks(nc, client):
    inst = await deployed(nc, "chat", kind="llm")
    got = []
    with pytest.raises(FunctionError, match="generation broke"):
        async for c in client.stream("chat", b"chunkfail:x,y", timeout_s=10):
            got.append(c)
    assert got == [b"x", b"y"]
    await inst.stop()


async def test_streaming_a_plain_function_yields_its_reply_once(nc, client):
    inst = await deployed(nc)
    assert [c async for c in client.stream("echo", b"z", timeout_s=10)] == [b"echo:z"]
    await inst.stop()


# ---------------------------------------------------------------- undeploy and status


async def test_undeploy_waits_for_the_instances_then_removes_the_queue(nc, services):
    await admin.deploy(nc, loaded(extra="initial_scale = 1"), wait_ready_s=10)
    js = nc.jetstream()
    await js.publish(subjects.invoke("echo"), b"queued")  # a request no instance will take now
    result = await admin.undeploy(nc, "echo", wait_s=10)
    assert services.undeployed == ["echo"]
    assert result.cleaned and result.remaining_instances == 0
    with pytest.raises(workqueue.ConsumerMissing):
        await workqueue.backlog(js, "echo")
    assert (await js.stream_info(subjects.INVOKE_STREAM)).state.messages == 0
    with pytest.raises(NotDeployed):
        await admin.undeploy(nc, "echo")


async def test_undeploy_answers_queued_callers_at_once_not_at_their_timeout(nc, services, client):
    """A caller whose request waits in the queue when the function is undeployed gets NotDeployed
    from the undeploy, long before its own timeout; a request past its caller's deadline is
    dropped unanswered (nobody reads it)."""
    await admin.deploy(nc, loaded(extra="initial_scale = 0"))  # no instance: the requests wait
    call = asyncio.create_task(client.invoke("echo", b"waiting", timeout_s=600))
    gone = await nc.subscribe("expired-inbox")
    await nc.jetstream().publish(subjects.invoke("echo"), b"late", headers={
        subjects.H_REQUEST_ID: "late", subjects.H_REPLY_TO: "expired-inbox", subjects.H_SCHEDULED_NS: "1",
        subjects.H_DEADLINE_NS: str(time.time_ns() - 1)})

    async def both_queued():
        return await workqueue.backlog(nc.jetstream(), "echo") == 2
    await wait_for(both_queued)
    result = await admin.undeploy(nc, "echo", wait_s=5)
    assert result.answered == 1 and result.cleaned
    with pytest.raises(NotDeployed, match="undeployed before the request was answered"):
        await asyncio.wait_for(call, 5)  # answered by the undeploy: the 600 s timeout never comes into it
    with pytest.raises(asyncio.TimeoutError):
        await gone.next_msg(timeout=0.3)


async def test_undeploy_answers_a_request_its_drained_instance_held_unanswered(nc, services, client):
    """A request an instance took and never answered (the drain's end killed it mid-request) is
    answered by the undeploy once no instance is left, not left to its caller's timeout."""
    await admin.deploy(nc, loaded(extra="initial_scale = 1"), wait_ready_s=10)
    call = asyncio.create_task(client.invoke("echo", b"long", timeout_s=600))
    held = await nc.jetstream().pull_subscribe_bind(durable=workqueue.consumer_name("echo"),
                                                    stream=subjects.INVOKE_STREAM)
    (msg,) = await held.fetch(1, timeout=5)  # taken, never acknowledged: its instance is gone
    result = await admin.undeploy(nc, "echo", wait_s=10)
    assert result.cleaned and result.answered == 1
    with pytest.raises(NotDeployed, match="undeployed before the request was answered"):
        await asyncio.wait_for(call, 5)
    assert (await nc.jetstream().stream_info(subjects.INVOKE_STREAM)).state.messages == 0
    left = await nc.jetstream().consumers_info(subjects.INVOKE_STREAM)
    assert all(c.config.filter_subject != subjects.invoke("echo") for c in left)  # the ephemeral puller too


async def test_undeploy_leaves_the_queue_while_instances_drain(nc):
    fakes = await FakeServices(nc, drain_delay_s=30).start()
    await admin.deploy(nc, loaded(extra="initial_scale = 1"), wait_ready_s=10)
    result = await admin.undeploy(nc, "echo", wait_s=0.3)
    assert result.remaining_instances == 1 and not result.cleaned
    assert await workqueue.backlog(nc.jetstream(), "echo") == 0  # the consumer is still there
    await fakes.stop()


async def test_status_reports_nodes_functions_instances_grants_backlog_and_decisions(nc, services):
    js = nc.jetstream()
    gpu = ev.GpuInfo(index=1, uuid="GPU-1", name="A100", memory_bytes=40 * 2**30, sms=108)
    await (await nodes_bucket(js)).put("node-a", encode(ev.NodeInventory(node="node-a", gpus=[gpu])))
    await admin.deploy(nc, loaded(extra="initial_scale = 1"), wait_ready_s=10)
    await js.publish(subjects.invoke("echo"), b"waiting", headers={subjects.H_REQUEST_ID: "r"})
    decision = ev.ScaleDecision(function="echo", direction="out", count=1, reason="burst")
    await put_state(js, ev.FunctionState(function="echo", instances=1, ready=1, decisions=[decision]))
    telemetry = ev.GpuTelemetry(node="node-a", gpu=1, window_ms=100,
                                instances=[ev.InstanceTelemetry(instance_id="echo-i1", function="echo", quota=0.45)])

    async def publish_telemetry():
        while True:
            await nc.publish(subjects.telemetry_gpu("node-a", 1), encode(telemetry))
            await asyncio.sleep(0.1)
    pub = asyncio.create_task(publish_telemetry())
    st = await admin.status(nc, telemetry_s=5)
    pub.cancel()
    assert [n.inventory.node for n in st.nodes] == ["node-a"] and st.nodes[0].inventory.gpus[0].name == "A100"
    [fn] = st.functions
    assert fn.name == "echo" and fn.spec.slo_ms == 500.0 and fn.profile.batch_size == FAKE_PROFILE["batch_size"]
    [inst] = fn.instances
    assert (inst.instance_id, inst.node, inst.gpu, inst.request_quota, inst.limit_quota) == ("echo-i1", "node-a", 1,
                                                                                            0.3, 0.6)
    assert inst.grant == 0.45
    assert fn.backlog == 1
    assert fn.state.decisions[0].reason == "burst"
    assert msgspec.json.decode(msgspec.json.encode(st), type=admin.Status) == st  # JSON round trip


async def test_status_of_an_empty_cluster_is_empty(nc):
    st = await admin.status(nc, telemetry_s=0.1)
    assert st.nodes == [] and st.functions == []


# ---------------------------------------------------------------- the blocking client


async def test_the_sync_client_invokes_and_streams_from_a_plain_thread(nc, nats_url):
    inst = await deployed(nc, "chat", kind="llm")

    def script():
        with Client(nats_url) as c:
            reply = c.invoke("chat", b"plain", timeout_s=10)
            with c.stream("chat", b"stream:x,y,z", timeout_s=10) as s:
                chunks = list(s)
            try:
                c.invoke("nope", b"")
            except NotDeployed as exc:
                missing = str(exc)
            return reply, chunks, s.reply, missing, sorted(c.functions())

    reply, chunks, final, missing, names = await asyncio.to_thread(script)
    assert reply.payload == b"echo:plain" and chunks == [b"x", b"y", b"z"] and final.payload == b"xyz"
    assert "'nope' is not deployed" in missing and names == ["chat"]
    await inst.stop()


def test_the_sync_client_says_when_nats_is_unreachable():
    with pytest.raises(Unreachable, match="cannot reach NATS"):
        Client(f"nats://127.0.0.1:{free_port()}", connect_attempts=1)


# ---------------------------------------------------------------- the data plane's caller side (InvokeClient)


async def test_invoke_client_counts_chunks_in_order_and_ignores_repeats_and_strays(nc):
    inst = await deployed(nc, "chat", kind="llm")
    client = InvokeClient(nc, nc.jetstream())
    await client.start(ensure=False)
    got = []
    sent_ns = time.time_ns()
    result = await client.invoke("chat", b"restream:a,b,c", request_id="r1", scheduled_ns=sent_ns, timeout_s=10,
                                 on_chunk=got.append)
    assert result.status == "ok" and result.payload == b"abc" and got == [b"a", b"b", b"c"]
    assert result.chunks == 3 and sent_ns < result.first_chunk_ns <= result.last_chunk_ns <= result.done_ns
    assert client.stats.chunks == 3 and client.stats.ignored_chunks == 3  # a and b again, and the stray
    await client.close()
    await inst.stop()


async def test_invoke_client_forgets_a_cancelled_call(nc):
    inst = await deployed(nc)
    client = InvokeClient(nc, nc.jetstream())
    await client.start(ensure=False)
    call = asyncio.create_task(client.invoke("echo", b"hang", request_id="r1", scheduled_ns=time.time_ns(),
                                             timeout_s=30))

    async def taken():
        return inst.served == [b"hang"]
    await wait_for(taken)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    s = client.stats
    assert client.outstanding == 0 and s.cancelled == 1 and s.sent == s.ok + s.error + s.timeout + s.dropped
    await client.close()
    await inst.stop()


async def test_an_instance_that_cannot_load_fails_the_deploy_with_its_error(nc):
    fakes = await FakeServices(nc, ready=False).start()  # the node launches nothing itself

    async def fail_to_load(msg):  # the node agent's word once the instance printed FAILED
        spec = decode(msg.data, ev.FunctionDeployed).spec
        await nc.publish(subjects.instance_state("retired", "n1"), encode(ev.InstanceRetired(
            instance_id="i1", function=spec.name, node="n1", gpu=0, reason=ev.LOAD_FAILED, exit_code=1,
            error="ImportError: no module named 'app'")))

    sub = await nc.subscribe(subjects.function_deployed("echo"), cb=fail_to_load)
    with pytest.raises(DeployError, match=r"echo: its instance on n1 could not start \(load-failed\): ImportError"):
        await admin.deploy(nc, loaded(), wait_ready_s=20)  # initial_scale unset: the scaler's default is due
    await sub.unsubscribe()
    await fakes.stop()


async def test_a_payload_over_what_nats_carries_is_bad_input_before_it_is_sent(nc, client, services):
    await deployed(nc, instance=False)
    too_big = b"x" * nc.max_payload
    with pytest.raises(BadRequest, match=f"{len(too_big)} bytes; the NATS server carries at most"):
        await client.invoke("echo", too_big, timeout_s=5)
    with pytest.raises(BadRequest):
        async for _ in client.stream("echo", too_big, timeout_s=5):
            pass


async def test_a_client_that_does_not_reconnect_fails_its_work_at_once_when_nats_goes():
    """The CLI's client (reconnect=False): a call in progress when the server stops ends then
    with Unreachable (exit 5), not at its timeout."""
    from dilu.client.errors import Unreachable
    from dilu.services.common.natsserver import EmbeddedNats

    server = EmbeddedNats().start()
    try:
        c = await AsyncClient.connect(server.url, reconnect=False, connect_attempts=1)
        asyncio.get_running_loop().call_later(0.3, server.stop)
        with pytest.raises(Unreachable, match="lost the connection"):
            await asyncio.wait_for(c.unless_refused(asyncio.sleep(600)), 30)
        await c.close()
    finally:
        server.stop()
