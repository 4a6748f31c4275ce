"""Emulated llm and training instances (the instance process as the node agent launches it, the
spec in KV, a real nats-server) on the fake driver, read on the emulated GPU's device timeline:
an llm request is a prefill then one kernel replay per token, streamed chunk by chunk; a training
job's iteration rate follows its token grant."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import nats
import pytest
from nats.js.api import KeyValueConfig

from native_helpers import launch_env
from dilu.contracts import encode, subjects
from dilu.contracts import events as ev
from dilu.interceptor import native, timeline
from dilu.services.common import models
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.node_agent.handlers import emulated
from dilu.services.common.bus import settle

pytestmark = [pytest.mark.native, pytest.mark.nats]

SEC = 1_000_000_000


async def put_spec(url: str, spec: ev.FunctionSpec):
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket=subjects.FUNCTIONS_BUCKET))
    await kv.put(subjects.token(spec.name), encode(spec))
    await ensure_stream(js)
    await ensure_consumer(js, spec.name)
    return nc, js


async def launch(url: str, iid: str, fn: str, env: dict, *, width: float = 1.0, cb: str | None = None):
    """Start an instance as the node agent does on an emulated GPU; returns it once READY."""
    args = [sys.executable, "-m", "dilu.services.node_agent.instance", "--instance-id", iid, "--function", fn,
            "--model", "none", "--batch-size", "4", "--width", f"{width:.4f}", "--device", "emulated",
            "--nats-url", url, "--node", "n1"]
    proc = await asyncio.create_subprocess_exec(*args, *(["--cb", cb] if cb else []), env=env,
                                                stdout=asyncio.subprocess.PIPE)
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.split()[:1] == [b"READY"], line  # the first word, as the agent reads it ("READY parkable")
    return proc


async def test_emulated_llm_streams_a_prefill_then_one_replay_per_token(nats_url, gpu):
    nc, js = await put_spec(nats_url, ev.FunctionSpec(name="chat", model="llama2", kind="llm", ttft_ms=500.0,
                                                      tpot_ms=100.0, max_batch=4, cold_start_ms=1.0))
    env = native.emulated_gpu_env(dict(os.environ), gpu_name=gpu)  # the fake driver alone: no pacing
    proc = await launch(nats_url, "c1", "chat", env)
    try:
        inbox, got, done = nc.new_inbox(), [], asyncio.Event()

        async def cb(msg):
            got.append((time.monotonic_ns(), msg))
            if msg.headers[subjects.H_STATUS] != subjects.STATUS_CHUNK:
                done.set()

        await nc.subscribe(inbox, cb=cb)
        await settle(nc)
        await js.publish(subjects.invoke("chat"), b'{"prompt_tokens": 64, "max_new_tokens": 6}', headers={
            subjects.H_REQUEST_ID: "q1", subjects.H_SCHEDULED_NS: str(time.time_ns()), subjects.H_REPLY_TO: inbox})
        await asyncio.wait_for(done.wait(), 30)
        msgs = [m for _, m in got]
        assert [m.headers[subjects.H_STATUS] for m in msgs] == ["chunk"] * 6 + ["ok"]
        assert [m.headers[subjects.H_CHUNK] for m in msgs] == [str(i) for i in range(7)]
        assert msgs[-1].data == b"".join(emulated.token_chunk(i) for i in range(6))

        recs = [r for r in timeline.read(gpu) if r.pid == proc.pid]
        k = models.spec("llama2").kernels_per_step
        assert len(recs) == 7 * k  # the prefill, then one replay per token
        steps = [recs[i:i + k] for i in range(0, len(recs), k)]
        device_ms = [sum(r.end_ns - r.start_ns for r in s) / 1e6 for s in steps]
        assert device_ms[0] == pytest.approx(emulated.prefill_ms("llama2", 64, 1.0), rel=0.05)
        assert device_ms[1:] == pytest.approx([models.step_latency_ms("llama2", 1, 1.0)] * 6, rel=0.05)
        # each chunk left after its step's kernels ended on the device (streamed, not at the end)
        chunk_at = [t for t, m in got[:6]]
        for t, step in zip(chunk_at, steps[1:]):
            assert t >= step[-1].end_ns
        assert chunk_at[0] < steps[-1][0].start_ns
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        await nc.drain()


async def test_an_llm_caller_that_gives_up_frees_the_gpu_at_its_next_step(nats_url, gpu):
    """A caller cancels a 1024-token generation after its first token: the instance stops at the
    next decode step, sends nothing more, and serves the next request."""
    nc, js = await put_spec(nats_url, ev.FunctionSpec(name="chat", model="llama2", kind="llm", ttft_ms=500.0,
                                                      tpot_ms=100.0, max_batch=4, cold_start_ms=1.0))
    env = native.emulated_gpu_env(dict(os.environ), gpu_name=gpu)
    proc = await launch(nats_url, "c1", "chat", env)
    client = InvokeClient(nc, js)
    await client.start()
    try:
        first = asyncio.Event()
        call = asyncio.create_task(client.invoke(
            "chat", b'{"prompt_tokens": 16, "max_new_tokens": 1024}', request_id="long", scheduled_ns=time.time_ns(),
            timeout_s=60, on_chunk=lambda _: first.set()))
        await asyncio.wait_for(first.wait(), 30)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        after = await client.invoke("chat", b'{"max_new_tokens": 2}', request_id="next",
                                    scheduled_ns=time.time_ns(), timeout_s=30)
        assert after.status == "ok" and after.chunks == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    await settle(nc)
    assert client.stats.withdrawn == 1 and client.stats.late_replies == 0 and client.stats.ignored_chunks == 0
    await client.close()
    await nc.drain()
    k = models.spec("llama2").kernels_per_step
    replays = timeline.kernels_completed(timeline.read_array(gpu), proc.pid, 0, 2**63 - 1) / k
    # the long one's prefill and a few decode steps (the withdrawal's way over the bus), then the
    # short one's 1 + 2: far from its 1 + 1024
    assert replays < 1 + 40 + 3, replays


async def test_emulated_training_iterations_follow_the_token_grant(nats_url, gpu, agent):
    batch = 8
    nc, _ = await put_spec(nats_url, ev.FunctionSpec(name="train", model="resnet152", kind="training",
                                                     priority="training", max_batch=batch, cold_start_ms=1.0))
    cb = agent.block(request_quota=0.8)
    proc = await launch(nats_url, "t1", "train", launch_env(cb.path, gpu, request_quota=0.8), cb=cb.path)
    per_iteration = emulated.TRAIN_PASSES * models.spec("resnet152").kernels_per_step
    phase_s, settle_s = 1.6, 0.3
    try:
        marks = []
        for quota in (0.8, 0.2):
            cb.write_grant(quota)
            marks.append((time.monotonic_ns(), quota))
            await asyncio.sleep(phase_s)
        end = time.monotonic_ns()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        await nc.drain()
    recs = timeline.read_array(gpu)
    rates = {}
    for (t0, quota), t1 in zip(marks, [m[0] for m in marks[1:]] + [end]):
        t0 += int(settle_s * SEC)  # the step in flight when the grant changed
        iterations = timeline.kernels_completed(recs, proc.pid, t0, t1) / per_iteration
        rates[quota] = iterations / ((t1 - t0) / SEC)
        # paced: an iteration of 3 x L(8, 1.0) of kernels may keep the device busy `quota` of the time
        expected = quota / (emulated.iteration_ms("resnet152", batch, 1.0) / 1000.0)
        assert rates[quota] == pytest.approx(expected, rel=0.25), (quota, rates)
        assert timeline.busy_share(recs, proc.pid, t0, t1) == pytest.approx(quota, abs=0.06)
    assert rates[0.8] / rates[0.2] == pytest.approx(4.0, rel=0.3)
