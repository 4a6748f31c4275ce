"""The profiler service against a real nats-server, with a tiny fake trial responder standing in
for the node agent (it answers from the model's interpolated A100 surface)."""
from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    FunctionDeployed,
    FunctionSpec,
    Profile,
    ProfileReady,
    ProfileReply,
    ProfileRequest,
    TrialReply,
    TrialRequest,
)
from dilu.services.common.runner import running
from dilu.services.common import models
from dilu.services.profiler.service import ProfilerService
from dilu.services.common.bus import settle

pytestmark = pytest.mark.nats


@contextlib.asynccontextmanager
async def fake_node(nc, node="node0", fail=False):
    """Answers TrialRequests: latency from the surface at width ``quota`` paced to ``grant`` (ms),
    throughput = batch / latency."""
    seen: list[TrialRequest] = []

    async def cb(msg):
        req = decode(msg.data, TrialRequest)
        seen.append(req)
        if fail:
            reply = TrialReply(ok=False, error="emulated GPU busy")
        else:
            lat = models.paced_latency_ms(req.model, req.batch, req.quota, req.grant or req.quota)
            reply = TrialReply(ok=True, latency_ms_mean=lat, latency_ms_p99=lat, throughput_rps=req.batch / lat * 1000)
        await nc.publish(msg.reply, encode(reply))

    sub = await nc.subscribe(subjects.node_trial(node), cb=cb)
    try:
        yield seen
    finally:
        await sub.unsubscribe()


async def ask(nc, spec: FunctionSpec) -> ProfileReply:
    msg = await nc.request(subjects.PROFILER_PROFILE, encode(ProfileRequest(spec=spec)), timeout=20)
    return decode(msg.data, ProfileReply)


async def test_profiles_through_node_stores_kv_and_caches(nats_url):
    nc = await nats.connect(nats_url)
    ready: list[ProfileReady] = []

    async def on_ready(msg):
        ready.append(decode(msg.data, ProfileReady))

    await nc.subscribe(f"{subjects.PREFIX}.profile.ready.*", cb=on_ready)
    async with fake_node(nc) as seen, running(ProfilerService(node="node0"), nats_url) as svc:
        spec = FunctionSpec(name="bert.a", model="bert_base", slo_ms=models.default_slo_ms("bert_base"))
        reply = await ask(nc, spec)
        assert reply.ok, reply.error
        p = reply.profile
        assert p.function == "bert.a" and p.backend == "emulated"
        assert p.trials == len(seen) > 0
        assert 0 < p.request_quota <= p.limit_quota <= 1 and p.batch_size >= 1
        assert models.latency_ms("bert_base", p.batch_size, p.request_quota) <= spec.slo_ms
        # stored in KV (key sanitised), with history
        kv = await nc.jetstream().key_value(subjects.PROFILES_BUCKET)
        stored = msgspec.json.decode((await kv.get("bert_a")).value, type=Profile)
        assert stored == p
        assert (await kv.status()).history >= 5
        # a second deploy of the same model and SLO costs no trials
        n = len(seen)
        again = FunctionSpec(name="bert-b", model="bert_base", slo_ms=spec.slo_ms)
        await nc.publish(subjects.function_deployed("bert-b"), encode(FunctionDeployed(spec=again)))
        for _ in range(1500):  # up to 30 s on a loaded host
            if any(r.profile.function == "bert-b" for r in ready):
                break
            await asyncio.sleep(0.02)
        b = next(r.profile for r in ready if r.profile.function == "bert-b")
        assert len(seen) == n and b.trials == 0
        assert (b.request_quota, b.batch_size) == (p.request_quota, p.batch_size)
        assert svc.trials == n
    await nc.close()


async def test_bad_requests_get_clear_errors_and_service_survives(nats_url):
    nc = await nats.connect(nats_url)
    async with fake_node(nc, fail=True), running(ProfilerService(node="node0"), nats_url) as svc:
        r = await ask(nc, FunctionSpec(name="x", model="no-such-model"))
        assert not r.ok and "unknown model" in r.error
        r = await ask(nc, FunctionSpec(name="y", model="resnet152"))
        assert not r.ok and "emulated GPU busy" in r.error
        msg = await nc.request(subjects.PROFILER_PROFILE, b'{"spec": 3}', timeout=5)
        assert b'"ok":false' in msg.data.replace(b" ", b"")
        await nc.publish(subjects.function_deployed("z"), b"not json")
        await settle(nc)
        for _ in range(750):  # up to 15 s on a loaded host
            if svc.bus.malformed >= 2:
                break
            await asyncio.sleep(0.02)
        assert svc.bus.malformed == 2
        r = await ask(nc, FunctionSpec(name="w", model="llama2", slo_ms=0.5))
        assert not r.ok  # still answering
    await nc.close()


async def test_no_node_agent_is_a_clear_error(nats_url):
    nc = await nats.connect(nats_url)
    async with running(ProfilerService(node="nowhere", trial_timeout_s=1, no_responder_wait_s=1), nats_url):
        r = await ask(nc, FunctionSpec(name="x", model="bert_base"))
        assert not r.ok and "no answer" in r.error
    await nc.close()


async def test_surface_backend_and_training(nats_url):
    nc = await nats.connect(nats_url)
    async with running(ProfilerService(backend="surface"), nats_url):
        r = await ask(nc, FunctionSpec(name="llm", model="llama2"))
        assert r.ok and r.profile.backend == "surface" and 0 < r.profile.trials <= 20
        t = await ask(nc, FunctionSpec(name="train", model="resnet152", kind="training", priority="training"))
        assert t.ok, t.error
        assert 0 < t.profile.request_quota <= t.profile.limit_quota <= 1
        assert t.profile.batch_size == 32
    await nc.close()
