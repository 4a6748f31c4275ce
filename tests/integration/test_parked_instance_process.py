"""Parking an instance process live, driven as the node agent drives it: launched with the agent's
arguments against a real nats-server, SIGUSR1 to park, SIGUSR2 to resume, SIGTERM to stop, its
stdout lines read (READY [parkable], PARKED, PARK-FAILED, FAILED). Users' classes run on device
cpu; the emulated model runs on the fake driver, where parking must give its weights' memory back
and keep its context's."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import nats
import pytest
from nats.js.api import KeyValueConfig

from dilu.contracts import encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import bundle, models
from dilu.services.common.bus import settle
from dilu.services.common.workqueue import consumer_name, ensure_consumer, ensure_stream
from dilu.services.node_agent.runtime import EMULATED_HANDLER

pytestmark = pytest.mark.nats

APP = '''
import os
import time


class Parkable:
    """Answers "<payload> parks=<n>"; predict while parked raises. With config "gate": the load
    writes "<gate>.loading" then waits until the file "<gate>" exists (a load the test holds)."""

    def __init__(self, ctx):
        gate = ctx.config.get("gate", "")
        if gate:
            open(gate + ".loading", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.01)
        self.parked, self.parks = False, 0

    def predict(self, batch):
        if self.parked:
            raise RuntimeError("predict while parked")
        return [b"%s parks=%d" % (b, self.parks) for b in batch]

    def park(self):
        self.parked, self.parks = True, self.parks + 1

    def resume(self):
        self.parked = False


class Plain:
    def __init__(self, ctx):
        pass

    def predict(self, batch):
        return list(batch)


class ParkRaises(Parkable):
    def park(self):
        raise RuntimeError("no host memory")


class ResumeRaises(Parkable):
    def resume(self):
        raise RuntimeError("no room on the GPU")


class Trainer:
    def __init__(self, ctx):
        pass

    def train_step(self):
        time.sleep(0.005)
'''

LINE_S = 60.0  # longest wait for one stdout line (a load included)


class Env:
    """A NATS connection, APP's bundle in dilu-code, specs in dilu-functions, instance processes."""

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
        self.procs: list[asyncio.subprocess.Process] = []
        return self

    async def deploy(self, **kw) -> ev.FunctionSpec:
        spec = ev.FunctionSpec(**({"code": self.code, "memory_bytes": 1} | kw))
        await self.kv.put(subjects.token(spec.name), encode(spec))
        await ensure_consumer(self.js, spec.name)
        return spec

    async def launch(self, iid: str, fn: str, *, device: str = "cpu", env: dict | None = None):
        """Start an instance as the node agent does (same arguments; stderr to a log file)."""
        env = dict(env or os.environ, DILU_CODE_CACHE=str(self.tmp / "cache"))
        log = open(self.tmp / f"{iid}.log", "wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dilu.services.node_agent.instance", "--instance-id", iid, "--function", fn,
            "--model", "none", "--handler", EMULATED_HANDLER, "--batch-size", "4", "--width", "1.0000",
            "--device", device, "--nats-url", self.url, "--node", "n1",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=log)
        proc.log_path = self.tmp / f"{iid}.log"
        self.procs.append(proc)
        return proc

    async def __aexit__(self, *exc):
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await self.nc.drain()


async def line(proc) -> str:
    """The instance's next stdout line ("" once it closed)."""
    got = await asyncio.wait_for(proc.stdout.readline(), LINE_S)
    return got.decode().rstrip("\n")


async def signalled(proc, sig) -> str:
    """Send ``sig``; the line it answers with."""
    proc.send_signal(sig)
    return await line(proc)


async def exit_code(proc, sig=signal.SIGTERM, timeout_s: float = 30.0) -> int:
    proc.send_signal(sig)
    return await asyncio.wait_for(proc.wait(), timeout_s)


class Call:
    """One request published on the function's queue; ``reply`` is set when it is answered."""

    def __init__(self, env: Env, fn: str, payload: bytes):
        self.env, self.fn, self.payload = env, fn, payload
        self.answered = asyncio.Event()
        self.reply = None

    async def send(self) -> "Call":
        async def on_reply(msg):
            self.reply = msg
            self.answered.set()

        inbox = self.env.nc.new_inbox()
        await self.env.nc.subscribe(inbox, cb=on_reply)
        await settle(self.env.nc)
        await self.env.js.publish(subjects.invoke(self.fn), self.payload, headers={
            subjects.H_REQUEST_ID: uuid.uuid4().hex, subjects.H_SCHEDULED_NS: str(time.time_ns()),
            subjects.H_REPLY_TO: inbox})
        return self

    async def result(self, timeout_s: float = 30.0) -> bytes:
        await asyncio.wait_for(self.answered.wait(), timeout_s)
        assert self.reply.headers[subjects.H_STATUS] == "ok", self.reply.headers
        return self.reply.data


async def call(env: Env, fn: str, payload: bytes) -> bytes:
    return await (await Call(env, fn, payload).send()).result()


async def test_a_parked_instance_answers_nothing_until_it_resumes(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="parky", entry="app:Parkable", slo_ms=1000.0)
        proc = await env.launch("p1", "parky")
        assert await line(proc) == "READY parkable", proc.log_path.read_text()
        assert await call(env, "parky", b"a") == b"a parks=0"

        assert await signalled(proc, signal.SIGUSR1) == "PARKED"
        assert await signalled(proc, signal.SIGUSR1) == "PARKED"  # parked already: said again

        waiting = await Call(env, "parky", b"b").send()
        with pytest.raises(asyncio.TimeoutError):  # parked: nobody pulls it
            await asyncio.wait_for(asyncio.shield(waiting.answered.wait()), 2.0)
        info = await env.js.consumer_info(subjects.INVOKE_STREAM, consumer_name("parky"))
        assert (info.num_pending, info.num_ack_pending) == (1, 0)  # in the queue, held by no one

        assert await signalled(proc, signal.SIGUSR2) == "READY parkable"
        assert await waiting.result() == b"b parks=1"  # after the weights came back
        assert await signalled(proc, signal.SIGUSR2) == "READY parkable"  # serving already: said again
        assert await call(env, "parky", b"c") == b"c parks=1"
        assert await exit_code(proc) == 0
        assert await line(proc) == ""


async def test_sigterm_while_parked_exits_at_once(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="parky", entry="app:Parkable", slo_ms=1000.0)
        proc = await env.launch("p1", "parky")
        assert await line(proc) == "READY parkable"
        assert await signalled(proc, signal.SIGUSR1) == "PARKED"
        assert await exit_code(proc, timeout_s=10.0) == 0  # far below the 25 s drain bound
        assert await line(proc) == ""
        logged = proc.log_path.read_text()
        assert "instance drained" in logged and "drain took more than" not in logged


async def test_a_park_asked_while_loading_is_applied_once_ready(nats_url, tmp_path):
    gate = tmp_path / "gate"
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="slow", entry="app:Parkable", slo_ms=1000.0, config={"gate": str(gate)})
        proc = await env.launch("s1", "slow")
        deadline = time.monotonic() + LINE_S
        while not (tmp_path / "gate.loading").exists():  # its class is loading: signals are handled
            assert proc.returncode is None and time.monotonic() < deadline, proc.log_path.read_text()
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
        gate.touch()
        assert await line(proc) == "READY parkable"  # the agent's launch completes first
        assert await line(proc) == "PARKED"
        assert await signalled(proc, signal.SIGUSR2) == "READY parkable"
        assert await call(env, "slow", b"x") == b"x parks=1"
        assert await exit_code(proc) == 0


@pytest.mark.parametrize("entry,ready,failed", [
    ("app:Plain", "READY", "PARK-FAILED NotParkable: class app:Plain cannot park: it has no park and resume"),
    ("app:ParkRaises", "READY parkable", "PARK-FAILED RuntimeError: no host memory"),
])
async def test_a_function_that_cannot_park_says_so_and_serves_on(nats_url, tmp_path, entry, ready, failed):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="stay", entry=entry, slo_ms=1000.0)
        proc = await env.launch("s1", "stay")
        assert await line(proc) == ready
        assert await signalled(proc, signal.SIGUSR1) == failed
        assert (await call(env, "stay", b"still here")).startswith(b"still here")
        assert await signalled(proc, signal.SIGUSR2) == ready  # it never left
        assert await exit_code(proc) == 0


async def test_a_resume_that_raises_fails_the_instance(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="stuck", entry="app:ResumeRaises", slo_ms=1000.0)
        proc = await env.launch("r1", "stuck")
        assert await line(proc) == "READY parkable"
        assert await signalled(proc, signal.SIGUSR1) == "PARKED"
        assert await signalled(proc, signal.SIGUSR2) == "FAILED RuntimeError: no room on the GPU"
        assert await asyncio.wait_for(proc.wait(), 30) == 1


async def test_a_training_instance_ignores_park_and_resume(nats_url, tmp_path):
    async with Env(nats_url, tmp_path) as env:
        await env.deploy(name="trainer", entry="app:Trainer", kind="training", priority="training")
        proc = await env.launch("t1", "trainer")
        assert await line(proc) == "READY"
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGUSR2)
        assert await exit_code(proc) == 0  # the signals did not end it
        assert await line(proc) == ""  # and said nothing
        warned = [json.loads(x) for x in proc.log_path.read_text().splitlines() if "signal ignored" in x]
        assert len(warned) == 2 and all(w["level"] == "warning" for w in warned)


MEM_INFO = "from dilu.interceptor.cuda import Driver; import json; print(json.dumps(Driver.load().mem_get_info()))"


@pytest.mark.native
async def test_a_parked_emulated_instance_keeps_only_its_context_on_the_gpu(nats_url, tmp_path):
    """What the scheduler counts for a parked instance (``models.PARKED_BYTES``) is what its
    process holds on the emulated GPU: its CUDA context, the weights gone until it resumes."""
    from dilu.interceptor import native, timeline

    native.build()
    gpu, total = f"test-park-{uuid.uuid4().hex[:8]}", 8 << 30
    gpu_env = native.emulated_gpu_env(dict(os.environ), gpu_name=gpu, memory_bytes=total,
                                      context_bytes=models.CONTEXT_BYTES)  # as the node agent's; no interceptor
    reader_env = native.emulated_gpu_env(dict(os.environ), gpu_name=gpu, memory_bytes=total)  # its context: 0

    def free_bytes() -> int:  # as another process on the same emulated GPU reads it
        out = subprocess.run([sys.executable, "-c", MEM_INFO], env=reader_env, capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout)[0]

    weights = models.weight_bytes("bert_base")
    try:
        async with Env(nats_url, tmp_path) as env:
            await env.deploy(name="emu", model="bert_base", slo_ms=1000.0, cold_start_ms=300.0, code="", memory_bytes=0)
            proc = await env.launch("e1", "emu", device="emulated", env=gpu_env)
            assert await line(proc) == "READY parkable", proc.log_path.read_text()
            assert free_bytes() == total - models.CONTEXT_BYTES - weights
            assert await signalled(proc, signal.SIGUSR1) == "PARKED"
            assert free_bytes() == total - models.PARKED_BYTES
            assert await signalled(proc, signal.SIGUSR2) == "READY parkable"
            assert free_bytes() == total - models.CONTEXT_BYTES - weights
            assert await call(env, "emu", b"four") == b"4"
            resumed = [json.loads(x) for x in proc.log_path.read_text().splitlines() if "instance resumed" in x]
            assert len(resumed) == 1 and resumed[0]["resume_ms"] >= 0.95 * models.resume_ms(300.0)
            assert await exit_code(proc) == 0
            assert free_bytes() == total  # its context ended with its process
    finally:
        timeline.unlink_gpu(gpu)
