"""Instance processes launched the way the node agent launches them, against a real nats-server,
on device cpu: a user's class from a code bundle answering invocations, an llm class streaming
its chunks then the final reply (and failing mid-stream), a training class reporting iterations,
a function that cannot load, and the node agent's per-function metrics."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time

import nats
import pytest
from nats.js.api import KeyValueConfig
from prometheus_client import REGISTRY

from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import bundle
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.runner import serve
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.node_agent.runtime import EMULATED_HANDLER
from dilu.services.node_agent.service import FUNCTION_STATS_SUBJECTS, NodeAgent
from dilu.services.common.bus import settle

pytestmark = pytest.mark.nats

APP = '''
import time


class Upper:
    """inference: upper-cases each payload and appends ctx.config["suffix"]."""

    def __init__(self, ctx):
        print("loading weights")  # user code printing on stdout must not reach the agent's READY channel
        self.suffix = ctx.config.get("suffix", "").encode()

    def predict(self, batch):
        print("READY")  # nor fake the line
        return [b.upper() + self.suffix for b in batch]


class Words:
    """llm: streams each payload's words, one per step; a payload "fail ..." raises mid-stream."""

    def __init__(self, ctx):
        pass

    def generate(self, batch):
        words = [p.decode().split() for p in batch]
        for i in range(max(len(w) for w in words)):
            if any(w[0] == "fail" for w in words) and i == 1:
                raise ValueError("stream broke")
            yield [(w[i] + " ").encode() if i < len(w) else None for w in words]


class Trainer:
    """training: a step of 5 ms of sleep."""

    def __init__(self, ctx):
        self.batch = ctx.batch_size

    def train_step(self):
        time.sleep(0.005)
'''


class Env:
    """A NATS connection, the code bundle of APP stored in dilu-code, specs in dilu-functions."""

    def __init__(self, url: str, tmp_path):
        self.url, self.tmp = url, tmp_path

    async def __aenter__(self):
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await ensure_stream(self.js)
        code = self.tmp / "code"
        code.mkdir()
        (code / "app.py").write_text(textwrap.dedent(APP))
        self.code = await bundle.upload(self.js, code)
        self.kv = await self.js.create_key_value(KeyValueConfig(bucket=subjects.FUNCTIONS_BUCKET))
        self.stats: list[ev.FunctionStats] = []
        await self.nc.subscribe(FUNCTION_STATS_SUBJECTS, cb=self._on_stats)
        self.procs: list[asyncio.subprocess.Process] = []
        return self

    async def _on_stats(self, msg):
        self.stats.append(decode(msg.data, ev.FunctionStats))

    async def deploy(self, **kw) -> ev.FunctionSpec:
        spec = ev.FunctionSpec(code=self.code, memory_bytes=1, **kw)
        await self.kv.put(subjects.token(spec.name), encode(spec))
        await ensure_consumer(self.js, spec.name)
        return spec

    async def launch(self, iid: str, fn: str, *, batch: int = 4, ready: bool = True):
        """Start an instance as the node agent does (same arguments, device cpu)."""
        env = dict(os.environ, DILU_CODE_CACHE=str(self.tmp / "cache"))
        log = open(self.tmp / f"{iid}.log", "wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dilu.services.node_agent.instance", "--instance-id", iid, "--function", fn,
            "--model", "none", "--handler", EMULATED_HANDLER, "--batch-size", str(batch), "--width", "1.0000",
            "--device", "cpu", "--nats-url", self.url, "--node", "n1",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=log)
        proc.log_path = self.tmp / f"{iid}.log"
        self.procs.append(proc)
        if ready:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line == b"READY\n", f"no READY: {line!r}\n{proc.log_path.read_text()}"
        return proc

    async def stop(self, proc) -> int:
        proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(proc.wait(), 30)

    async def stats_until(self, fn: str, pred, timeout: float = 15.0) -> list[ev.FunctionStats]:
        deadline = time.monotonic() + timeout
        while True:
            got = [s for s in self.stats if s.function == fn]
            if pred(got):
                return got
            assert time.monotonic() < deadline, f"stats of {fn} never matched: {got}"
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc):
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await self.nc.drain()


async def raw_invoke(env: Env, fn: str, payload: bytes, rid: str) -> list:
    """Publish one request and collect every message to its inbox until the final reply."""
    inbox = env.nc.new_inbox()
    got: list = []
    done = asyncio.Event()

    async def cb(msg):
        got.append(msg)
        if msg.headers.get(subjects.H_STATUS) != subjects.STATUS_CHUNK:
            done.set()

    sub = await env.nc.subscribe(inbox, cb=cb)
    await settle(env.nc)
    await env.js.publish(subjects.invoke(fn), payload, headers={
        subjects.H_REQUEST_ID: rid, subjects.H_SCHEDULED_NS: str(time.time_ns()), subjects.H_REPLY_TO: inbox})
    await asyncio.wait_for(done.wait(), 30)
    await sub.unsubscribe()
    return got


async def test_a_users_class_from_its_bundle_answers_invocations(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="upper", entry="app:Upper", slo_ms=1000.0, config={"suffix": "!"})
        client = InvokeClient(env.nc, env.js)
        await client.start()

        async def call(i):
            return await client.invoke("upper", b"req%d" % i, request_id=f"r{i}", scheduled_ns=time.time_ns(), timeout_s=60)

        early = [asyncio.create_task(call(i)) for i in range(3)]  # stored before the instance exists
        await asyncio.sleep(0.2)
        proc = await env.launch("u1", "upper")
        results = await asyncio.gather(*early, *(call(i) for i in range(3, 6)))
        assert [r.payload for r in results] == [b"REQ%d!" % i for i in range(6)]
        assert [r.cold_start for r in results] == [True] * 3 + [False] * 3
        stats = await env.stats_until("upper", lambda s: sum(x.ok for x in s) == 6)
        assert sum(x.cold_starts for x in stats) == 3 and sum(x.errors for x in stats) == 0
        assert len([v for x in stats for v in x.latency_ms]) == 6
        assert all(x.instance_id == "u1" and x.node == "n1" and x.period_ms > 0 for x in stats)
        assert await env.stop(proc) == 0
        await client.close()


async def test_an_llm_class_streams_chunks_in_order_then_the_reply(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="words", entry="app:Words", kind="llm", ttft_ms=500.0, tpot_ms=100.0)
        proc = await env.launch("w1", "words")
        msgs = await raw_invoke(env, "words", b"one two three", "ok1")
        assert [m.headers[subjects.H_STATUS] for m in msgs] == ["chunk"] * 3 + ["ok"]
        assert [m.headers[subjects.H_CHUNK] for m in msgs] == ["0", "1", "2", "3"]
        assert [m.data for m in msgs] == [b"one ", b"two ", b"three ", b"one two three "]
        assert all(m.headers[subjects.H_INSTANCE] == "w1" and m.headers[subjects.H_REQUEST_ID] == "ok1" for m in msgs)

        broken = await raw_invoke(env, "words", b"fail here", "bad1")  # raises after its first chunk
        assert [m.headers[subjects.H_STATUS] for m in broken] == ["chunk", "error"]
        assert broken[-1].headers[subjects.H_CHUNK] == "1"
        assert "ValueError: stream broke" in broken[-1].headers[subjects.H_ERROR]

        stats = await env.stats_until("words", lambda s: sum(x.ok + x.errors for x in s) == 2)
        assert sum(x.errors for x in stats) == 1
        ttft = [v for x in stats for v in x.ttft_ms]
        assert len(ttft) == 1 and len([v for x in stats for v in x.tpot_ms]) == 1  # the request that finished
        assert await env.stop(proc) == 0


async def test_a_training_instance_reports_its_iterations(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="trainer", entry="app:Trainer", kind="training", priority="training")
        proc = await env.launch("t1", "trainer")
        await env.stats_until("trainer", lambda s: sum(x.iterations for x in s) >= 10)
        assert await env.stop(proc) == 0  # drained: the step in hand finished
        logged = [json.loads(line) for line in proc.log_path.read_text().splitlines() if "training stopped" in line]
        assert len(logged) == 1
        # every iteration is reported, the last partial period included
        stats = await env.stats_until("trainer", lambda s: sum(x.iterations for x in s) == logged[0]["iterations"])
        assert all(x.ok == 0 and not x.latency_ms for x in stats)


@pytest.mark.parametrize("spec,reason", [
    (dict(entry="app:Upper", code="sha256-" + "0" * 64), "is not in the 'dilu-code' object store"),
    (dict(entry="app:Upper", kind="llm", ttft_ms=1.0, tpot_ms=1.0), "has no generate method (kind llm)"),
])
async def test_a_function_that_cannot_load_exits_with_one_clear_line(nats_url, tmp_path, spec, reason):
    async with Env(nats_url, tmp_path) as env:
        s = ev.FunctionSpec(name="broken", memory_bytes=1, **({"code": env.code} | spec))
        await env.kv.put(subjects.token("broken"), encode(s))
        proc = await env.launch("b1", "broken", ready=False)
        assert await asyncio.wait_for(proc.wait(), 60) != 0
        out = (await proc.stdout.read()).decode().splitlines()  # never READY: one FAILED line for the agent
        assert len(out) == 1 and out[0].startswith("FAILED ") and reason in out[0], out
        errors = [json.loads(line) for line in proc.log_path.read_text().splitlines() if '"level": "error"' in line]
        assert len(errors) == 1, errors
        assert errors[0]["function"] == "broken" and reason in errors[0]["error"] and "'broken'" in errors[0]["error"]


def sample(name, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_node_agent_exports_its_instances_function_metrics(nats_url, tmp_path, monkeypatch):
    monkeypatch.setenv("DILU_CODE_CACHE", str(tmp_path / "cache"))
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="agentfn", entry="app:Upper", slo_ms=1000.0)
        agent = NodeAgent(node="n1", gpus=0, nats=nats_url)
        shutdown = asyncio.Event()
        task = asyncio.create_task(serve(agent, nats_url, shutdown=shutdown, install_signals=False))
        try:
            deadline = time.monotonic() + 30
            while not agent.ready():
                assert time.monotonic() < deadline, "agent not ready"
                await asyncio.sleep(0.05)
            malformed = "dilu_malformed_messages_total"
            bad0 = sample(malformed, service="node_agent", subject=FUNCTION_STATS_SUBJECTS)
            ok0 = sample("dilu_function_requests_total", function="agentfn", status="ok")
            # another node's report is not this agent's; junk and nonsense are rejected and counted
            await env.nc.publish(subjects.function_stats("agentfn", "x"), encode(ev.FunctionStats(
                function="agentfn", instance_id="x", node="n2", ok=100)))
            await env.nc.publish(subjects.function_stats("agentfn", "x"), b"{not json")
            await env.nc.publish(subjects.function_stats("agentfn", "x"), encode(ev.FunctionStats(
                function="agentfn", instance_id="x", node="n1", ok=1, latency_ms=[-5.0])))

            kv = await env.js.key_value(subjects.PLACEMENT_BUCKET)
            await kv.put("a1", encode(ev.Placement(instance_id="a1", function="agentfn", node="n1", gpu=0,
                                                   request_quota=0.5, limit_quota=1.0, width=1.0, memory_bytes=1,
                                                   batch_size=2)))
            client = InvokeClient(env.nc, env.js)
            await client.start()
            results = await asyncio.gather(*(client.invoke("agentfn", b"x", request_id=f"a{i}", scheduled_ns=time.time_ns(),
                                                           timeout_s=60) for i in range(4)))
            assert [r.status for r in results] == ["ok"] * 4, [r.error for r in results]
            await client.close()
            deadline = time.monotonic() + 15
            while sample("dilu_function_requests_total", function="agentfn", status="ok") - ok0 < 4:
                assert time.monotonic() < deadline, "the agent never exported the instance's counts"
                await asyncio.sleep(0.05)
            assert sample("dilu_function_requests_total", function="agentfn", status="ok") - ok0 == 4
            assert sample("dilu_function_latency_seconds_count", function="agentfn") >= 4
            assert sample("dilu_function_cold_starts_total", function="agentfn") >= 1  # sent before the launch
            assert sample(malformed, service="node_agent", subject=FUNCTION_STATS_SUBJECTS) - bad0 == 2
        finally:
            shutdown.set()
            await asyncio.wait_for(task, 40)
