"""The vertical scaler service against a real nats-server: telemetry and stretch in, grants out."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import GpuTelemetry, InstanceRetired, InstanceTelemetry, KernelCycleStretch, TokenGrant
from dilu.services.common.runner import serve
from dilu.services.vertical_scaler.bench import run_bench
from dilu.services.vertical_scaler.policy import VerticalConfig
from dilu.services.vertical_scaler.service import VerticalScaler
from dilu.services.common.bus import settle

pytestmark = pytest.mark.nats
NODE = "node0"


def telemetry(quota: dict[str, float]) -> GpuTelemetry:
    specs = {"ls": ("latency-sensitive", 0.3, 0.7, 0.05, 0), "be": ("best-effort", 0.2, 0.6, None, 3000)}
    rows = []
    for iid, (prio, req, lim, used, wait) in specs.items():
        q = quota[iid]
        rows.append(InstanceTelemetry(instance_id=iid, function=f"fn-{iid}", priority=prio, quota=q, request_quota=req,
                                      limit_quota=lim, width=lim, sm_time_share=q if used is None else used,
                                      busy_share=0.5, wait_us=wait))
    return GpuTelemetry(node=NODE, gpu=1, window_ms=100.0, instances=rows)


async def start(url: str, config: VerticalConfig | None = None):
    scaler = VerticalScaler(NODE, config)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(scaler, url, shutdown=shutdown, install_signals=False))
    for _ in range(500):
        if scaler.ready():
            break
        assert not task.done(), task
        await asyncio.sleep(0.01)
    return scaler, shutdown, task


async def next_grants(queue: asyncio.Queue, n: int = 1, timeout: float = 5.0) -> list[TokenGrant]:
    return [await asyncio.wait_for(queue.get(), timeout) for _ in range(n)]


async def test_telemetry_and_stretch_produce_grants_with_cause_and_increasing_epochs(nats_url):
    scaler, shutdown, task = await start(nats_url, VerticalConfig(park_idle=False))  # one grant at a time
    nc = await nats.connect(nats_url)
    grants: asyncio.Queue = asyncio.Queue()

    async def on_grant(msg):
        assert msg.subject == subjects.grant_issued(NODE, 1)
        await grants.put(decode(msg.data, TokenGrant))

    await nc.subscribe(f"{subjects.PREFIX}.grant.issued.{NODE}.*", cb=on_grant)
    quota = {"ls": 0.3, "be": 0.2}
    tel = telemetry(quota)
    tel.ts_ns = time.time_ns()
    await nc.publish(subjects.telemetry_gpu(NODE, 1), encode(tel))
    (g,) = await next_grants(grants)  # best-effort is hungry and the GPU has room: up to its limit
    assert (g.instance_id, g.quota, g.cause_ns) == ("be", pytest.approx(0.6), tel.ts_ns)
    quota["be"] = g.quota

    # malformed input is rejected and counted; the service carries on
    await nc.publish(subjects.kernel_cycle_stretch(NODE, 1), b'{"node": 7}')
    detected = time.time_ns()
    await nc.publish(subjects.kernel_cycle_stretch(NODE, 1), encode(KernelCycleStretch(
        node=NODE, gpu=1, instance_id="ls", ratio=2.5, detected_ns=detected)))
    down, up = await next_grants(grants, 2)
    assert (down.instance_id, up.instance_id) == ("be", "ls")  # the decrease goes out first
    assert up.quota == pytest.approx(0.7) and up.cause_ns == detected == down.cause_ns
    assert down.quota + up.quota <= 1.0 + 1e-9
    assert g.epoch < down.epoch < up.epoch
    assert "stretch" in up.reason
    assert scaler.bus.malformed == 1 and scaler.grants_sent == 3
    await nc.close()
    shutdown.set()
    await task


async def test_a_retired_instance_s_share_goes_to_its_neighbour_on_the_event(nats_url):
    """InstanceRetired from the node agent frees the instance's grant at once: the hungry
    neighbour gets its limit then, not after forget_after_ms of absent telemetry."""
    scaler, shutdown, task = await start(nats_url, VerticalConfig(park_idle=False, forget_after_ms=600_000))
    nc = await nats.connect(nats_url)
    grants: asyncio.Queue = asyncio.Queue()

    async def on_grant(msg):
        await grants.put(decode(msg.data, TokenGrant))

    await nc.subscribe(f"{subjects.PREFIX}.grant.issued.{NODE}.*", cb=on_grant)
    await settle(nc)
    rows = [InstanceTelemetry(instance_id="ls", function="fn-ls", priority="latency-sensitive", quota=0.3,
                              request_quota=0.3, limit_quota=0.9, width=0.9, sm_time_share=0.3, busy_share=1.0,
                              wait_us=3000),
            InstanceTelemetry(instance_id="tr", function="fn-tr", priority="training", quota=0.6, request_quota=0.6,
                              limit_quota=0.7, width=0.7, sm_time_share=0.6, busy_share=1.0, wait_us=3000)]
    await nc.publish(subjects.telemetry_gpu(NODE, 1), encode(GpuTelemetry(node=NODE, gpu=1, window_ms=100.0,
                                                                          instances=rows)))
    await asyncio.sleep(0.3)
    while not grants.empty():
        grants.get_nowait()
    assert scaler.policy.quotas(1)["ls"] <= 0.4 + 1e-9  # training keeps its request: no room to grow
    await nc.publish(subjects.instance_state("retired", NODE), encode(InstanceRetired(
        instance_id="tr", function="fn-tr", node=NODE, gpu=1, ts_ns=time.time_ns())))
    (g,) = await next_grants(grants)
    assert (g.instance_id, g.quota) == ("ls", pytest.approx(0.9))
    assert "tr" not in scaler.policy.quotas(1)
    await nc.close()
    shutdown.set()
    await task


async def test_off_mode_sends_nothing(nats_url):
    scaler, shutdown, task = await start(nats_url, VerticalConfig(mode="off"))
    nc = await nats.connect(nats_url)
    got = []
    async def on_grant(msg):
        got.append(msg)

    await nc.subscribe(f"{subjects.PREFIX}.grant.issued.>", cb=on_grant)
    await nc.publish(subjects.telemetry_gpu(NODE, 1), encode(telemetry({"ls": 0.3, "be": 0.2})))
    await nc.publish(subjects.kernel_cycle_stretch(NODE, 1), encode(KernelCycleStretch(
        node=NODE, gpu=1, instance_id="ls", ratio=2.5)))
    await settle(nc)
    await asyncio.sleep(0.3)
    assert got == [] and scaler.bus.handler_errors == 0
    await nc.close()
    shutdown.set()
    await task


async def test_bench_measures_every_reaction(nats_url):
    result = await run_bench(events=20, interval_ms=20.0, telemetry_ms=5.0, nats_url=nats_url)
    # every stretch is answered by a raise, or counted missed; in one run of the whole suite on a
    # busy 2-core host one of 20 found no raise (not reproduced in 20 runs alone, 8 of them with
    # the cores busy), so one miss is tolerated and two are a fault
    assert result["missed"] <= 1 and result["samples"] >= 19, result
    assert 0 < result["reaction_ms_p50"] <= result["reaction_ms_p99"] <= result["reaction_ms_max"]


async def test_at_debug_level_each_window_and_stretch_logs_its_inputs_and_grants(nats_url):
    """DILU_LOG_LEVEL=debug (docs/operations.md, Logs): each telemetry window logs every row's
    quota, busy share, token wait, batch in hand and recent latency with the grants answered
    (reasons included), each stretch its ratio and grants."""
    from structlog.testing import capture_logs

    from dilu.services.common import logging as dlog

    scaler, shutdown, task = await start(nats_url, VerticalConfig(park_idle=False))
    nc = await nats.connect(nats_url)
    dlog.configure("vertical_scaler", "debug")
    try:
        with capture_logs() as logs:
            await nc.publish(subjects.telemetry_gpu(NODE, 1), encode(telemetry({"ls": 0.3, "be": 0.2})))
            await nc.publish(subjects.kernel_cycle_stretch(NODE, 1), encode(KernelCycleStretch(
                node=NODE, gpu=1, instance_id="ls", ratio=2.5, detected_ns=time.time_ns())))
            for _ in range(500):
                if any(e["event"] == "stretch" for e in logs):
                    break
                await asyncio.sleep(0.01)
        (window,) = [e for e in logs if e["event"] == "window"]
        assert window["gpu"] == 1
        assert window["rows"] == [("ls", 0.3, 0.5, 0, 0, 0.0), ("be", 0.2, 0.5, 3000, 0, 0.0)]
        assert [g[:2] for g in window["grants"]] == [("be", 0.6)] and window["grants"][0][2]
        (stretch,) = [e for e in logs if e["event"] == "stretch"]
        assert stretch["instance"] == "ls" and stretch["ratio"] == 2.5
        assert {g[0] for g in stretch["grants"]} == {"be", "ls"} and any("stretch" in g[2] for g in stretch["grants"])
    finally:
        dlog.configure("vertical_scaler", "info")
        await nc.close()
        shutdown.set()
        await task
