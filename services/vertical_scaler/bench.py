"""``dilu bench vertical``: reaction time of the vertical scaler, stretch published -> grant received.

Runs a real embedded ``nats-server``, the :class:`VerticalScaler` service (same code as
``python -m dilu.services.vertical_scaler``) and a synthetic node publisher on one GPU with three
instances: a latency-sensitive one (mostly idle, so it drops back to its request between
stretches), a training one and a best-effort one (both saturating). Every ``--interval-ms`` the
publisher sends a KernelCycleStretch of the latency-sensitive instance stamped with
``detected_ns``; the reaction time is the wall-clock time from that stamp until the TokenGrant
raising that instance (``cause_ns`` = the stamp) arrives back at the publisher. Telemetry flows
every ``--telemetry-ms`` meanwhile, echoing the grants in effect, as a node agent does.

Writes ``{"reaction_ms_p50", "reaction_ms_p99", "reaction_ms_max", "reaction_ms_mean",
"samples", "missed", "goal_ms_p99", "goal_met", "setup"}`` (HDR histogram, µs resolution).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import click
import uvloop
from hdrh.histogram import HdrHistogram

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import GpuTelemetry, InstanceTelemetry, KernelCycleStretch, TokenGrant
from dilu.services.common import logging as dlog
from dilu.loadgen.bench import OWN_SERVER, given_nats, nats_default_shown, one_line_nats_errors, reachable_or_exit
from dilu.services.common.bus import settle
from dilu.services.common.cliopts import nats_options, writable_output
from dilu.services.common.interrupt import SignalExit
from dilu.services.common.natsconn import NatsOptions, connect
from dilu.services.common.natsserver import EmbeddedNats
from dilu.services.common.runner import serve

from .policy import VerticalConfig
from .service import VerticalScaler

NODE, GPU = "bench-node", 0
GOAL_MS_P99 = 10.0
READY_TIMEOUT_S = 15.0  # the scaler's connection and subscriptions, on a loopback server
INSTANCES = {  # id -> (priority, request, limit)
    "ls": ("latency-sensitive", 0.3, 0.7),
    "tr": ("training", 0.3, 0.6),
    "be": ("best-effort", 0.2, 0.5),
}


class SyntheticNode:
    """Publishes telemetry and stretch events for one GPU; applies and times the grants."""

    def __init__(self, nc, telemetry_ms: float) -> None:
        self.nc, self.telemetry_s = nc, telemetry_ms / 1000.0
        self.quota = {i: req for i, (_, req, _) in INSTANCES.items()}
        self.pending: dict[int, int] = {}  # cause_ns -> 0 until answered
        self.hist = HdrHistogram(1, 60_000_000, 3)  # µs
        self.samples: list[float] = []
        self.granted = 0

    async def on_grant(self, msg) -> None:
        now = time.time_ns()
        g = decode(msg.data, TokenGrant)
        self.granted += 1
        raised = g.quota > self.quota.get(g.instance_id, 0.0)
        self.quota[g.instance_id] = g.quota
        if g.instance_id == "ls" and raised and g.cause_ns in self.pending:
            del self.pending[g.cause_ns]
            us = max(1, (now - g.cause_ns) // 1000)
            self.hist.record_value(us)
            self.samples.append(us / 1000.0)

    def telemetry(self) -> GpuTelemetry:
        rows = []
        for iid, (prio, req, lim) in INSTANCES.items():
            q = self.quota[iid]
            used = 0.05 if iid == "ls" else q  # ls idle between bursts; the others saturate
            rows.append(InstanceTelemetry(instance_id=iid, function=f"fn-{iid}", priority=prio, quota=q,
                                          request_quota=req, limit_quota=lim, width=lim, sm_time_share=used,
                                          busy_share=used / lim, wait_us=0 if iid == "ls" else 2000))
        return GpuTelemetry(node=NODE, gpu=GPU, window_ms=self.telemetry_s * 1000.0, instances=rows)

    async def telemetry_loop(self) -> None:
        subject = subjects.telemetry_gpu(NODE, GPU)
        while True:
            await self.nc.publish(subject, encode(self.telemetry()))
            await asyncio.sleep(self.telemetry_s)

    async def first_grant(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.granted and time.monotonic() < deadline:
            await asyncio.sleep(self.telemetry_s)
        if not self.granted:
            raise TimeoutError(f"no grant from the vertical scaler within {timeout_s} s")

    async def released(self, timeout_s: float) -> None:
        """Wait until the latency-sensitive instance is back at its request quota."""
        deadline = time.monotonic() + timeout_s
        while self.quota["ls"] > INSTANCES["ls"][1] + 1e-6 and time.monotonic() < deadline:
            await asyncio.sleep(self.telemetry_s / 2)

    async def stretch(self) -> None:
        detected = time.time_ns()
        self.pending[detected] = 0
        await self.nc.publish(subjects.kernel_cycle_stretch(NODE, GPU), encode(KernelCycleStretch(
            node=NODE, gpu=GPU, instance_id="ls", function="fn-ls", span_us=30_000, baseline_us=10_000,
            ratio=3.0, detected_ns=detected, ts_ns=detected)))


async def _stop_service(service: asyncio.Task, shutdown: asyncio.Event) -> None:
    """Ask the service under test to stop (it drains its NATS connection) and wait for it."""
    shutdown.set()
    await service


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it has ended."""
    task.cancel()
    await asyncio.wait({task})


async def run_bench(events: int, interval_ms: float, telemetry_ms: float,
                    nats_url: NatsOptions | str | None = None) -> dict:
    """Run the measurement (against ``nats_url``: a URL list or full :class:`NatsOptions` with
    credentials and TLS; or an embedded server) and return the figures. Raises RuntimeError when
    the scaler is not ready within READY_TIMEOUT_S, TimeoutError when no grant comes."""
    async with contextlib.AsyncExitStack() as stack:
        # Undone in reverse, each even if one before it fails, and on cancellation (Ctrl-C,
        # SIGTERM: SignalExit.cancelling): the telemetry task before the connection it publishes
        # on, the service, then the server (and its store).
        server = None if nats_url else EmbeddedNats().start()
        if server:
            stack.callback(server.stop)
        url = nats_url or server.url
        shutdown = asyncio.Event()
        hold = max(1.0, min(interval_ms / 3.0, 500.0))  # the boost must lapse between two stretches
        # Release at once between stretches so every stretch finds the instance back at its request.
        scaler = VerticalScaler(NODE, VerticalConfig(pressure_hold_ms=hold, release_per_s=1000.0))
        service = asyncio.create_task(serve(scaler, url, shutdown=shutdown, install_signals=False))
        stack.push_async_callback(_stop_service, service, shutdown)
        ready_by = time.monotonic() + READY_TIMEOUT_S
        while not scaler.ready():
            if service.done():
                service.result()
            if time.monotonic() > ready_by:
                raise RuntimeError(f"the vertical scaler did not get ready on NATS at {NatsOptions.of(url).url} "
                                   f"within {READY_TIMEOUT_S:g} s (is a NATS server listening there, and does "
                                   f"it accept these credentials and TLS settings?)")
            await asyncio.sleep(0.01)
        nc = await connect(url, name="dilu-bench-vertical")
        stack.push_async_callback(nc.close)
        node = SyntheticNode(nc, telemetry_ms)
        await nc.subscribe(subjects.grant_issued(NODE, GPU), cb=node.on_grant)
        await settle(nc)
        tel = asyncio.create_task(node.telemetry_loop())
        stack.push_async_callback(_cancelled, tel)  # left running, it fails on the closed connection
        await node.first_grant(timeout_s=10.0)  # the scaler has learnt the GPU
        for _ in range(events):
            await node.released(timeout_s=2.0)  # time only real raises: ls back at its request
            await node.stretch()
            await asyncio.sleep(interval_ms / 1000.0)
        await asyncio.sleep(0.2)
    h = node.hist
    n = len(node.samples)
    return {
        "reaction_ms_p50": h.get_value_at_percentile(50) / 1000.0 if n else None,
        "reaction_ms_p99": h.get_value_at_percentile(99) / 1000.0 if n else None,
        "reaction_ms_max": h.get_max_value() / 1000.0 if n else None,
        "reaction_ms_mean": h.get_mean_value() / 1000.0 if n else None,
        "samples": n,
        "missed": len(node.pending),
        "goal_ms_p99": GOAL_MS_P99,
        "goal_met": bool(n) and not node.pending and h.get_value_at_percentile(99) / 1000.0 <= GOAL_MS_P99,
        "setup": {"events": events, "interval_ms": interval_ms, "telemetry_ms": telemetry_ms,
                  "pressure_hold_ms": hold, "transport": "nats-server (loopback)",
                  "measured": "KernelCycleStretch.detected_ns -> TokenGrant received by the node publisher"},
    }


@nats_default_shown(OWN_SERVER)
@click.command("vertical")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=writable_output,
              help="write the figures here")
@click.option("--events", type=click.IntRange(10, 100_000), default=300, show_default=True,
              help="stretch events timed, a count (the run lasts at least events x --interval-ms)")
@click.option("--interval-ms", type=click.FloatRange(5, 10_000), default=30.0, show_default=True,
              help="time between two stretch events, in ms")
@click.option("--telemetry-ms", type=click.FloatRange(1, 10_000), default=10.0, show_default=True,
              help="period of the synthetic node's GPU telemetry, in ms")
@nats_options
def bench_vertical(json_path, events, interval_ms, telemetry_ms, nats):
    """Vertical scaler reaction time: stretch event published -> TokenGrant received (goal p99 <= 10 ms).
    Without --nats-url it starts its own nats-server. Ctrl-C or SIGTERM stops it (and its own
    nats-server) with exit status 130 (143)."""
    with SignalExit() as stop:
        dlog.configure("bench-vertical", "warning")
        nats_url = given_nats(nats)
        reachable_or_exit(nats_url)  # the service under test would wait for an unreachable server forever
        try:
            with one_line_nats_errors(nats_url):
                result = uvloop.run(stop.cancelling(run_bench(events, interval_ms, telemetry_ms, nats_url)))
        except (RuntimeError, TimeoutError) as exc:  # not ready in time, no grant: one line, no traceback
            raise click.ClickException(str(exc)) from None
        text = json.dumps(result, indent=2)
        if json_path:
            json_path.write_text(text + "\n")
        click.echo(text)
