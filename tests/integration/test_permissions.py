"""Least privilege on a real nats-server configured by ``dilu creds``: each role's allowed flows
work and its forbidden ones are refused (the server's "Permissions Violation", awaited through
the client's error callback, never a sleep)."""
import asyncio
import os
import time
from contextlib import asynccontextmanager

import nats
import nats.errors
import pytest
from click.testing import CliRunner
from nats.js.api import KeyValueConfig

from dilu.cli.creds import AUTH_CONF, creds, ensure_creds, role_creds
from dilu.contracts import subjects as sj
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsconn import NatsOptions, connect, creds_kwargs
from dilu.services.common.natsserver import EmbeddedNats
from dilu.services.common import bundle
from dilu.contracts import events as ev
from dilu.services.common.permissions import NODE_SCOPED, ROLES, inbox_prefix, pattern, permissions
from dilu.services.common.workqueue import answer_queued, consumer_name, ensure_consumer, ensure_stream
from dilu.services.common.bus import settle

pytestmark = pytest.mark.nats

NODES = ["n1", "n2"]
CALLERS = ["alice", "bob"]
WAIT_S = 5.0  # an upper bound on the server's answer, not a pacing


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    ensure_creds(root, NODES, CALLERS)
    with EmbeddedNats(config=root / AUTH_CONF, log_path=root / "nats-server.log") as server:
        yield root, server.url


class Conn:
    """A connection as one role, with the errors the server sent it."""

    def __init__(self, nc, errors: asyncio.Queue):
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream()

    async def refused(self, subject: str) -> str:
        """Wait for the server's permissions violation naming ``subject``."""
        deadline = time.monotonic() + WAIT_S
        seen = []
        while True:
            try:
                err = await asyncio.wait_for(self.errors.get(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pytest.fail(f"no permissions violation for {subject!r} within {WAIT_S} s; errors: {seen}")
            text = str(err)
            seen.append(text)
            if "permissions violation" in text.lower() and f'"{subject.lower()}"' in text.lower():  # nats-py lowercases
                return text

    def clean(self) -> bool:
        return self.errors.empty()


@asynccontextmanager
async def as_role(secured, role: str, node: str | None = None, *, caller: str | None = None):
    root, url = secured
    errors: asyncio.Queue = asyncio.Queue()

    async def on_error(exc):
        errors.put_nowait(exc)

    path = root / "creds" / f"caller.{caller}.creds" if caller else role_creds(root, role, node, NODES)
    opts = NatsOptions(servers=(url,), creds=path, inbox_prefix=permissions(role, node, caller=caller).inbox_prefix)
    nc = await connect(opts, name=f"test-{role}", error_cb=on_error)
    try:
        yield Conn(nc, errors)
    finally:
        await nc.close()


async def delivered(sender: Conn, subject: str, sub) -> str:
    """Publish on ``subject`` and return the subject ``sub`` received (its subscriber settled
    its SUB first: :func:`settle`, not a bare flush)."""
    await sender.nc.publish(subject, b"{}")
    await settle(sender.nc)
    try:
        return (await sub.next_msg(timeout=WAIT_S)).subject
    except nats.errors.TimeoutError:
        pytest.fail(f"{subject} not delivered; sender errors: {list(sender.errors._queue)}")


async def answer(asker: Conn, subject: str) -> bytes:
    """A request's reply (its responder settled its SUB first)."""
    try:
        return (await asker.nc.request(subject, b"{}", timeout=WAIT_S)).data
    except nats.errors.TimeoutError:
        pytest.fail(f"no answer on {subject}; errors: {list(asker.errors._queue)}")


def test_creds_files_are_private_seeds_and_a_rerun_keeps_them(tmp_path):
    first = CliRunner().invoke(creds, ["--out", str(tmp_path), "--nodes", "a,b"])
    assert first.exit_code == 0, first.output
    path = tmp_path / "creds" / "node-agent.a.creds"
    assert path.stat().st_mode & 0o777 == 0o600
    assert "BEGIN USER NKEY SEED" in path.read_text() and "nkeys_seed_str" in creds_kwargs(path)
    before = {p.name: p.read_text() for p in (tmp_path / "creds").iterdir()}
    again = CliRunner().invoke(creds, ["--out", str(tmp_path), "--nodes", "a,b"])
    assert again.exit_code == 0, again.output
    assert {p.name: p.read_text() for p in (tmp_path / "creds").iterdir()} == before
    # one node: node-scoped roles get the plain name; another node's key is never put in its place
    one = tmp_path / "one"
    assert CliRunner().invoke(creds, ["--out", str(one), "--nodes", "x"]).exit_code == 0
    assert "node x" in (one / "creds" / "node-agent.creds").read_text()
    clash = CliRunner().invoke(creds, ["--out", str(one), "--nodes", "y"])
    assert clash.exit_code == 1 and "never replaced" in clash.output and len(clash.output.strip().splitlines()) == 1
    bad = CliRunner().invoke(creds, ["--out", str(tmp_path / "z"), "--nodes", "a,,b"])
    assert bad.exit_code == 2 and "distinct node names" in bad.output


async def test_a_connection_without_credentials_or_with_unknown_ones_is_refused(secured, tmp_path):
    _, url = secured
    async def quiet(_exc):
        pass

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=WAIT_S,
                           error_cb=quiet)
    # nor with a key the server does not know
    stranger = tmp_path / "stranger.creds"
    ensure_creds(tmp_path, ["n1"])
    stranger.write_text((tmp_path / "creds" / "caller.creds").read_text())
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect(NatsOptions(servers=(url,), creds=stranger), name="stranger", allow_reconnect=False,
                      max_reconnect_attempts=0, connect_timeout=WAIT_S, error_cb=quiet)


async def test_integrator_reads_events_and_publishes_nothing(secured):
    async with as_role(secured, "integrator") as integ, as_role(secured, "node-agent", "n1") as agent:
        sub = await integ.nc.subscribe(f"{sj.PREFIX}.telemetry.gpu.*.*")
        await settle(integ.nc)
        assert await delivered(agent, sj.telemetry_gpu("n1", 0), sub) == sj.telemetry_gpu("n1", 0)
        for subject in (sj.telemetry_gpu("n1", 0), sj.invoke("f"), sj.SCHEDULER_PLACE):
            await integ.nc.publish(subject, b"{}")
            await integ.refused(subject)
        for patt in (sj.INVOKE_SUBJECTS, "_INBOX.>", f"{inbox_prefix('caller')}.>"):
            await integ.nc.subscribe(patt)
            await integ.refused(patt)


async def test_node_agent_is_confined_to_its_node(secured):
    async with as_role(secured, "node-agent", "n1") as agent, as_role(secured, "vertical-scaler", "n1") as vs:
        sub = await vs.nc.subscribe(f"{sj.PREFIX}.telemetry.gpu.n1.*")
        await settle(vs.nc)
        assert await delivered(agent, sj.telemetry_gpu("n1", 0), sub) == sj.telemetry_gpu("n1", 0)
        for subject in (sj.telemetry_gpu("n2", 0), sj.kernel_cycle_stretch("n2", 0), sj.instance_state("ready", "n2"),
                        sj.node_inventory("n2"), sj.grant_issued("n1", 0)):
            await agent.nc.publish(subject, b"{}")
            await agent.refused(subject)
        for patt in (f"{sj.PREFIX}.grant.issued.n2.*", sj.node_trial("n2"), f"{sj.PREFIX}.grant.issued.>"):
            await agent.nc.subscribe(patt)
            await agent.refused(patt)
        # its own key of dilu-nodes, not another node's
        kv = await agent.js.create_key_value(KeyValueConfig(bucket=sj.NODES_BUCKET))
        await kv.put("n1", b"{}")
        assert (await kv.get("n1")).value == b"{}"
        put = asyncio.ensure_future(kv.put("n2", b"{}"))
        await agent.refused(f"$KV.{sj.NODES_BUCKET}.n2")
        put.cancel()


async def test_only_the_vertical_scaler_of_a_node_grants_on_it(secured):
    async with (as_role(secured, "vertical-scaler", "n1") as vs1, as_role(secured, "node-agent", "n1") as agent,
                as_role(secured, "instance") as inst, as_role(secured, "scheduler") as sched):
        sub = await agent.nc.subscribe(f"{sj.PREFIX}.grant.issued.n1.*")
        await settle(agent.nc)
        assert await delivered(vs1, sj.grant_issued("n1", 2), sub) == sj.grant_issued("n1", 2)
        await vs1.nc.publish(sj.grant_issued("n2", 2), b"{}")
        await vs1.refused(sj.grant_issued("n2", 2))
        for other in (inst, sched):
            await other.nc.publish(sj.grant_issued("n1", 0), b"{}")
            await other.refused(sj.grant_issued("n1", 0))


async def test_only_the_scheduler_writes_the_placement_table(secured):
    async with as_role(secured, "scheduler") as sched:
        kv = await sched.js.create_key_value(KeyValueConfig(bucket=sj.PLACEMENT_BUCKET, history=5))
        await kv.put("i-1", b"{}")
    for role, node in (("node-agent", "n1"), ("horizontal-scaler", None), ("operator", None), ("instance", None)):
        async with as_role(secured, role, node) as other:
            subject = f"$KV.{sj.PLACEMENT_BUCKET}.i-1"
            put = asyncio.ensure_future(other.js.publish(subject, b"forged", timeout=WAIT_S))
            await other.refused(subject)
            put.cancel()
    async with as_role(secured, "node-agent", "n1") as agent:  # it reads the table
        kv = await agent.js.key_value(sj.PLACEMENT_BUCKET)
        assert (await kv.get("i-1")).value == b"{}"


async def test_the_data_plane_caller_operator_instance(secured):
    """operator creates the queue and admits; a caller invokes; an instance pulls, acks and replies
    to that caller's inbox, which no other caller can read; an instance cannot grant."""
    async with (as_role(secured, "operator") as op, as_role(secured, "scheduler") as sched,
                as_role(secured, "caller") as caller, as_role(secured, "instance") as inst,
                as_role(secured, "gateway") as gw):
        # the operator's admission request is answered by the scheduler (allow_responses)
        async def admit(msg):
            await msg.respond(b'{"ok":true}')
        await sched.nc.subscribe(sj.SCHEDULER_ADMIT, cb=admit)
        await settle(sched.nc)
        assert await answer(op, sj.SCHEDULER_ADMIT) == b'{"ok":true}'
        fkv = await op.js.create_key_value(KeyValueConfig(bucket=sj.FUNCTIONS_BUCKET))
        await fkv.put("echo", b"{}")
        await ensure_stream(op.js)
        await ensure_consumer(op.js, "echo")
        # a caller cannot deploy
        put = asyncio.ensure_future(caller.js.publish(f"$KV.{sj.FUNCTIONS_BUCKET}.echo", b"x", timeout=WAIT_S))
        await caller.refused(f"$KV.{sj.FUNCTIONS_BUCKET}.echo")
        put.cancel()

        client = InvokeClient(caller.nc, caller.js)
        await client.start()
        call = asyncio.ensure_future(client.invoke("echo", b"hi", request_id="r1", scheduled_ns=time.time_ns(),
                                                   timeout_s=WAIT_S * 2))
        assert (await (await inst.js.key_value(sj.FUNCTIONS_BUCKET)).get("echo")).value == b"{}"
        psub = await inst.js.pull_subscribe_bind(durable=consumer_name("echo"), stream=sj.INVOKE_STREAM)
        (msg,) = await psub.fetch(1, timeout=WAIT_S)
        assert msg.headers[sj.H_REPLY_TO].startswith(inbox_prefix("caller") + ".")
        await msg.ack()
        await inst.nc.publish(msg.headers[sj.H_REPLY_TO], b"HI",
                              headers={sj.H_REQUEST_ID: "r1", sj.H_STATUS: "ok", sj.H_INSTANCE: "i-1"})
        result = await call
        assert result.status == "ok" and result.payload == b"HI"
        await client.close()

        # nobody else reads the caller's replies; the caller reads no one else's
        for other, patt in ((gw, f"{inbox_prefix('caller')}.>"), (caller, f"{inbox_prefix('gateway')}.>"),
                               (caller, "_INBOX.>"), (inst, f"{inbox_prefix('caller')}.>")):
            await other.nc.subscribe(patt)
            await other.refused(patt)
        # an instance publishes only replies (and its stats): no grant, no event, no invocation
        for subject in (sj.grant_issued("n1", 0), sj.placement_decided("echo"), sj.SCHEDULER_PLACE):
            await inst.nc.publish(subject, b"{}")
            await inst.refused(subject)


async def test_a_withdrawal_goes_from_any_caller_to_the_instances_and_no_one_else(secured):
    """Callers, the gateway and the operator withdraw calls on ``dilu.v1.cancel.<fn>``;
    instances hear them; a caller cannot listen there (the payloads are others' reply subjects)."""
    async with (as_role(secured, "caller") as caller, as_role(secured, "gateway") as gw,
                as_role(secured, "operator") as op, as_role(secured, "instance") as inst):
        sub = await inst.nc.subscribe(sj.CANCEL_SUBJECTS)
        await settle(inst.nc)
        for sender in (caller, gw, op):
            assert await delivered(sender, sj.cancel("echo"), sub) == sj.cancel("echo")
        for listener in (caller, gw):
            await listener.nc.subscribe(sj.CANCEL_SUBJECTS)
            await listener.refused(sj.CANCEL_SUBJECTS)
        await inst.nc.publish(sj.cancel("echo"), b"x")  # an instance withdraws nothing
        await inst.refused(sj.cancel("echo"))


async def test_a_trial_request_from_the_profiler_reaches_its_node_only(secured):
    async with (as_role(secured, "profiler") as prof, as_role(secured, "node-agent", "n1") as agent,
                as_role(secured, "horizontal-scaler") as hs):
        async def trial(msg):
            await msg.respond(b"measured")
        await agent.nc.subscribe(sj.node_trial("n1"), cb=trial)
        await settle(agent.nc)
        assert await answer(prof, sj.node_trial("n1")) == b"measured"
        await hs.nc.publish(sj.node_trial("n1"), b"{}")
        await hs.refused(sj.node_trial("n1"))


async def test_the_operator_uploads_code_that_an_instance_fetches_and_cannot_change(secured, tmp_path):
    folder = tmp_path / "fn"
    folder.mkdir()
    (folder / "handler.py").write_text("def predict(x):\n    return x\n")
    async with as_role(secured, "operator") as op, as_role(secured, "instance") as inst:
        key = await bundle.upload(op.js, folder)
        got = await bundle.fetch(inst.js, key, root=tmp_path / "cache")
        assert (got / "handler.py").read_text().startswith("def predict")
        subject = f"$O.{sj.CODE_BUCKET}.M.forged"
        put = asyncio.ensure_future(inst.js.publish(subject, b"{}", timeout=WAIT_S))
        await inst.refused(subject)
        put.cancel()


def test_the_matrix_scopes_each_node_role_to_its_node_and_the_integrator_to_events():
    for role in ("node-agent", "vertical-scaler"):
        perms = permissions(role, "n1")
        # every Dilu subject it may use names node n1 (instances' stats aside: the agent aggregates them)
        ours = [s for s in perms.publish + perms.subscribe if s.startswith(sj.PREFIX) and s != pattern(ev.FunctionStats)]
        assert ours and all("n1" in s.split(".") for s in ours), ours
        assert [s for s in perms.publish if s.startswith("$KV.")] in ([], [f"$KV.{sj.NODES_BUCKET}.n1"])
        with pytest.raises(ValueError, match="per node"):
            permissions(role)
    integ = permissions("integrator")
    assert integ.publish == () and set(integ.subscribe) == set(sj.SUBJECT_EVENTS) and integ.inbox_prefix is None
    writers = [r for r in ROLES if any(s.startswith(f"$KV.{sj.PLACEMENT_BUCKET}.") for s in
                                       permissions(r, "n1" if r in NODE_SCOPED else None).publish)]
    assert writers == ["scheduler"]
    prefixes = {permissions(r, "n1" if r in NODE_SCOPED else None).inbox_prefix for r in ROLES if r != "integrator"}
    assert len(prefixes) == len(ROLES) - 1, "every role reads replies under its own prefix"


async def test_a_caller_cannot_touch_the_functions_consumers(secured):
    async with as_role(secured, "operator") as op, as_role(secured, "caller") as caller:
        await ensure_stream(op.js)
        await ensure_consumer(op.js, "victim")
        for subject in (f"$JS.API.CONSUMER.DELETE.{sj.INVOKE_STREAM}.{consumer_name('victim')}",
                        f"$JS.API.CONSUMER.CREATE.{sj.INVOKE_STREAM}.spy.{sj.invoke('victim')}",
                        f"$JS.API.CONSUMER.MSG.NEXT.{sj.INVOKE_STREAM}.{consumer_name('victim')}"):
            await caller.nc.publish(subject, b"{}")
            await caller.refused(subject)
        assert (await op.js.consumer_info(sj.INVOKE_STREAM, consumer_name("victim"))).name == consumer_name("victim")


async def queued_call(op, caller, function: str, request_id: str, *, timeout_s: float):
    """The operator makes ``function``'s queue; ``caller`` invokes it: (its client, the call)."""
    await ensure_stream(op.js)
    await ensure_consumer(op.js, function)
    client = InvokeClient(caller.nc, caller.js)
    await client.start()
    return client, asyncio.ensure_future(client.invoke(function, b"hi", request_id=request_id,
                                                       scheduled_ns=time.time_ns(), timeout_s=timeout_s))


async def test_named_callers_read_only_their_own_replies(secured):
    async with (as_role(secured, "operator") as op, as_role(secured, "caller", caller="alice") as alice,
                as_role(secured, "caller", caller="bob") as bob, as_role(secured, "caller") as anyone,
                as_role(secured, "instance") as inst):
        client, call = await queued_call(op, alice, "named", "a1", timeout_s=WAIT_S * 2)
        psub = await inst.js.pull_subscribe_bind(durable=consumer_name("named"), stream=sj.INVOKE_STREAM)
        (msg,) = await psub.fetch(1, timeout=WAIT_S)
        assert msg.headers[sj.H_REPLY_TO].startswith(inbox_prefix("caller", caller="alice") + ".")
        await msg.ack()
        await inst.nc.publish(msg.headers[sj.H_REPLY_TO], b"for alice",
                              headers={sj.H_REQUEST_ID: "a1", sj.H_STATUS: "ok", sj.H_INSTANCE: "i-1"})
        assert (await call).payload == b"for alice"
        await client.close()
        alices = f"{inbox_prefix('caller', caller='alice')}.>"
        for other in (bob, anyone):
            await other.nc.subscribe(alices)
            await other.refused(alices)
        await alice.nc.subscribe(f"{inbox_prefix('caller')}.>")
        await alice.refused(f"{inbox_prefix('caller')}.>")


async def test_the_operator_answers_a_named_callers_queued_request_when_undeploying(secured):
    """Undeploy answers what is still queued: the operator may pull from a function's consumer and
    reply to any caller's inbox, a named caller's included (as an instance may)."""
    async with as_role(secured, "operator") as op, as_role(secured, "caller", caller="alice") as alice:
        client, call = await queued_call(op, alice, "leaving", "a2", timeout_s=WAIT_S * 4)
        while not (await op.js.consumer_info(sj.INVOKE_STREAM, consumer_name("leaving"))).num_pending:
            await asyncio.sleep(0.05)
        assert await answer_queued(op.nc, op.js, "leaving", sj.ERROR_UNDEPLOYED) == 1
        result = await call
        assert result.status == "error" and result.error == sj.ERROR_UNDEPLOYED
        await client.close()
        # and, the consumer deleted, it may pull what is left through an ephemeral one of its own
        await op.js.delete_consumer(sj.INVOKE_STREAM, consumer_name("leaving"))
        assert await answer_queued(op.nc, op.js, "leaving", sj.ERROR_UNDEPLOYED, orphans=True) == 0
        assert all(c.config.filter_subject != sj.invoke("leaving") for c in await op.js.consumers_info(sj.INVOKE_STREAM))


def test_dilu_events_tail_on_a_forbidden_subject_ends_at_once_with_the_reason(secured):
    """The integrator may not read the data plane: `dilu events tail` says so and exits, not waits."""
    from click.testing import CliRunner

    from dilu.cli.events import events
    root, url = secured
    res = CliRunner().invoke(events, ["tail", "--nats-url", url, "--creds", str(role_creds(root, "integrator", None, NODES)),
                                      "--subject", "dilu.v1.invoke.>"])
    assert res.exit_code == 6, res.output  # NATS refused these credentials, as for every command
    lines = [line for line in res.output.splitlines() if "listening on" not in line]
    assert len(lines) == 1 and "permissions violation" in lines[0].lower(), res.output
    assert "the data plane's invocations are not events" in lines[0]


def test_dilu_events_tail_with_the_operators_credentials_is_one_line_not_one_per_subject(secured):
    """The operator may not read the event subjects: each of the ~20 subscriptions is refused, and
    `dilu events tail` says so once, naming the credentials to use, with exit 6."""
    from click.testing import CliRunner

    from dilu.cli.events import events
    root, url = secured
    res = CliRunner().invoke(events, ["tail", "--nats-url", url, "--creds", str(role_creds(root, "operator", None, NODES))])
    assert res.exit_code == 6, res.output
    errors = [line for line in res.output.splitlines() if "listening on" not in line]
    assert len(errors) == 1 and errors[0].startswith("Error: ") and "integrator.creds" in errors[0], res.output


@pytest.mark.parametrize("role", ["integrator", "caller", None])
def test_a_command_run_with_another_roles_credentials_says_so_not_unreachable(secured, role):
    """`dilu status` with the integrator's credentials (the server refuses the client's first
    subscription), a caller's (it refuses the status's requests) or none (it refuses the
    connection): one line with the reason and exit 6, not a wait for a timeout reported as
    "NATS unreachable" (exit 5), and no traceback."""
    import subprocess
    import sys

    root, url = secured
    creds = ["--creds", str(role_creds(root, role, None, NODES))] if role else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILU_")}
    proc = subprocess.run([sys.executable, "-m", "dilu.cli.main", "status", "--nats-url", url, *creds],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 6, proc.stderr
    # (JSON lines are the client's own log, e.g. of what other tests left in the buckets)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1 and "refused" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    if role:
        assert "permissions violation" in proc.stderr.lower() and "status need the operator's" in proc.stderr


async def test_the_client_library_refuses_another_roles_credentials_with_not_permitted(secured):
    from dilu.client import AsyncClient, NotPermitted
    root, url = secured
    with pytest.raises(NotPermitted, match="another role"):
        await AsyncClient.connect(url, creds=role_creds(root, "integrator", None, NODES))
    # the operator's are fine on the same server
    client = await AsyncClient.connect(url, creds=role_creds(root, "operator", None, NODES))
    await client.close()


def test_adding_a_node_keeps_the_first_nodes_key(tmp_path):
    first = {i.node: i.public_key for i in ensure_creds(tmp_path, ["n1"]) if i.role == "node-agent"}
    second = {i.node: i.public_key for i in ensure_creds(tmp_path, ["n1", "n2"]) if i.role == "node-agent"}
    assert second["n1"] == first["n1"] and second["n2"] != first["n1"]


async def test_the_client_library_takes_credentials_as_dilu_does(secured, monkeypatch):
    """``AsyncClient.connect`` (and ``Client``) on a server that admits Dilu's roles only: the
    operator's file by ``creds=`` or by ``DILU_NATS_CREDS``, the URL by ``DILU_NATS_URL``, as the
    command line reads them; none gives the one-line NotPermitted naming the remedy (the server
    was reached, and refused the connection)."""
    from dilu.client import AsyncClient, Client
    from dilu.client.errors import NotPermitted

    root, url = secured
    operator = role_creds(root, "operator")
    monkeypatch.delenv("DILU_NATS_CREDS", raising=False)
    with pytest.raises(NotPermitted, match="DILU_NATS_CREDS"):
        await AsyncClient.connect(url, connect_attempts=1)
    c = await AsyncClient.connect(url, creds=operator)
    assert await c.functions() == {}
    await c.close()
    monkeypatch.setenv("DILU_NATS_CREDS", str(operator))
    monkeypatch.setenv("DILU_NATS_URL", url)
    c = await AsyncClient.connect()
    assert c.options.creds == operator and c.options.url == url
    await c.close()
    with Client() as blocking:
        assert blocking.functions() == {}


async def test_the_server_dilu_up_starts_carries_the_shipped_configs_max_payload(tmp_path):
    """``dilu up``'s own server takes messages as large as the shipped NATS configurations do
    (8 MiB, not nats-server's 1 MiB default), its authorization include still in force."""
    from dilu.services.common.natsserver import MAX_PAYLOAD_BYTES

    ensure_creds(tmp_path, ["n1"])
    with EmbeddedNats(config=tmp_path / AUTH_CONF, max_payload_bytes=MAX_PAYLOAD_BYTES,
                      store_dir=tmp_path / "store") as server:
        nc = await connect(NatsOptions(servers=(server.url,), creds=role_creds(tmp_path, "operator")), name="op")
        assert nc.max_payload == MAX_PAYLOAD_BYTES == 8 << 20
        await nc.close()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=WAIT_S,
                               error_cb=_quiet)


async def _quiet(_exc):
    pass
