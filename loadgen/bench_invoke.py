"""``dilu bench invoke``: the overhead of Dilu's data plane, caller -> work queue -> instance -> caller.

Runs (unless ``--nats-url`` is given) an embedded ``nats-server``, a no-op function instance in
this process (the real :class:`~dilu.services.common.workqueue.BatchPuller`, its own NATS
connection, a handler returning the payload) and an open-loop caller (the real
:class:`~dilu.loadgen.generator.OpenLoopGenerator` through the real
:class:`~dilu.services.common.invoke.InvokeClient`). The function does nothing, so a request's
overhead is its reply time minus its *scheduled* send time.

Three parts, in one run:

1. Overhead at ``--rate`` for ``--seconds``: ``overhead_ms_p50`` / ``overhead_ms_p99``.
2. Baseline at the same rate and length: a bare JetStream work-queue round trip (a work-queue
   stream with the same storage, ``js.publish``, a pull consumer that replies then acks, no Dilu
   code): ``baseline_ms_p50`` / ``baseline_ms_p99``.
3. The highest rate held (p99 < ``HELD_P99_MS`` with every request answered ok): from ``--rate``
   double until a step fails, then bisect, each step ``STEP_S`` seconds, no new step once
   ``--search-s`` seconds have passed: ``max_rate_rps`` (0 when no step held),
   ``max_rate_failed_rps`` (the lowest rate that failed, None if none did) and ``steps``.

Percentiles from an HDR histogram (µs resolution). Goals (informational): <= 1 ms p50 and <= 3 ms
p99 at 1,000 req/s.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import click
import uvloop
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from dilu.services.common import logging as dlog
from dilu.services.common.bus import settle
from dilu.services.common.cliopts import Finite, nats_options, writable_output
from dilu.services.common.interrupt import SignalExit
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsconn import NatsOptions, connect
from dilu.services.common.natsserver import EmbeddedNats
from dilu.services.common.workqueue import BatchPuller, backlog, consumer_name, ensure_consumer, ensure_stream
from dilu.contracts import subjects as subj

from .arrivals import Invocation
from .bench import (CONNECT_TIMEOUT_S, OWN_SERVER, given_nats, ms_histogram, nats_default_shown,
                    one_line_nats_errors, reachable_or_exit, steady_plan)
from .generator import OpenLoopGenerator, Outcome

HELD_P99_MS = 10.0
STEP_S = 3.0
REQUEST_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 5.0
MAX_BATCH = 64
MAX_ACK_PENDING = 10_000
PAYLOAD = b"x" * 64
GOAL_MS_P50, GOAL_MS_P99, GOAL_RATE_RPS = 1.0, 3.0, 1000.0
BASE_REPLY_HEADER = "Bench-Reply-To"

Invoke = Callable[[Invocation], Awaitable[Outcome]]


async def _phase(make_invoke: Callable[[OpenLoopGenerator, str], Invoke], rate_rps: float, seconds: float,
                 tag: str) -> dict:
    """One open-loop run at ``rate_rps`` for ``seconds``; latency = answer - scheduled send."""
    async def invoke(inv: Invocation) -> Outcome:
        return await call(inv)

    gen = OpenLoopGenerator(invoke, drain_timeout_s=DRAIN_TIMEOUT_S)
    call = make_invoke(gen, tag)  # the call needs gen.started_unix_ns
    result = await gen.run(steady_plan(rate_rps, seconds))
    hist = ms_histogram()
    ok = 0
    for r in result.records:
        hist.record_value(max(1, r.latency_ns // 1000))
        ok += r.status == "ok"
    sent = len(result.records)
    p50 = hist.get_value_at_percentile(50) / 1000.0 if sent else None
    p99 = hist.get_value_at_percentile(99) / 1000.0 if sent else None
    return {"rate_rps": rate_rps, "seconds": seconds, "sent": sent, "completed": ok, "errors": sent - ok,
            "p50_ms": p50, "p99_ms": p99, "max_ms": hist.get_max_value() / 1000.0 if sent else None,
            "late_sends": result.late_sends,
            "held": bool(sent) and ok == sent and p99 is not None and p99 < HELD_P99_MS}


async def _connect(url: NatsOptions | str, name: str):
    """One connection of the bench: one attempt, no reconnect (a refusal or a lost server fails the run)."""
    return await connect(url, name=name, connect_timeout=CONNECT_TIMEOUT_S, allow_reconnect=False)


class DiluPath:
    """A no-op function instance (BatchPuller) and an InvokeClient caller on one NATS server."""

    def __init__(self, url: NatsOptions | str) -> None:
        self.url = url
        self.function = f"bench-noop-{uuid.uuid4().hex[:8]}"
        self.nc_caller = self.nc_fn = self.js = self.serving = self.client = None  # set by start()

    async def start(self) -> None:
        self.nc_caller = await _connect(self.url, "dilu-bench-caller")
        self.nc_fn = await _connect(self.url, "dilu-bench-function")
        self.js = self.nc_caller.jetstream()
        await ensure_stream(self.js, replicas=NatsOptions.of(self.url).replicas)
        await ensure_consumer(self.js, self.function, max_ack_pending=MAX_ACK_PENDING)
        self.puller = BatchPuller(self.nc_fn, self.nc_fn.jetstream(), self.function, instance_id=f"{self.function}-0",
                                  max_batch=MAX_BATCH, ready_ns=0)
        self.stop_fn = asyncio.Event()

        async def noop(requests):
            return [r.payload for r in requests]

        self.serving = asyncio.create_task(self.puller.run(noop, self.stop_fn))
        self.client = InvokeClient(self.nc_caller, self.js)
        await self.client.start(ensure=False)

    def make_invoke(self, gen: OpenLoopGenerator, tag: str) -> Invoke:
        async def invoke(inv: Invocation) -> Outcome:
            res = await self.client.invoke(self.function, PAYLOAD, request_id=f"{tag}-{inv.id}",
                                           scheduled_ns=gen.started_unix_ns + inv.scheduled_ns,
                                           timeout_s=REQUEST_TIMEOUT_S)
            return Outcome(status=res.status, detail=res.error)
        return invoke

    async def settle(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait (at most ``timeout_s``) until the instance has taken every queued request."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and await backlog(self.js, self.function) > 0:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop the instance, remove its consumer, close the connections. Does only what is left
        to do: safe twice, and on a path whose start() was cut short (a failure, Ctrl-C)."""
        if self.serving is not None:
            self.stop_fn.set()
            await _stopped(self.serving, timeout_s=5)
            self.serving = None
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.js is not None:
            try:
                await self.js.delete_consumer(subj.INVOKE_STREAM, consumer_name(self.function))
            except Exception:  # noqa: BLE001 - best effort on a shared server
                pass
            self.js = None
        await _close(self.nc_fn, self.nc_caller)
        self.nc_fn = self.nc_caller = None


class BarePath:
    """The baseline: a work-queue stream, ``js.publish``, a pull consumer replying, no Dilu code."""

    def __init__(self, url: NatsOptions | str) -> None:
        self.url = url
        tag = uuid.uuid4().hex[:8]
        self.stream, self.subject = f"DILU_BENCH_BASE_{tag}", f"dilu.bench.base.{tag}"
        self.nc_caller = self.nc_fn = self.js = self.serving = None  # set by start()

    async def start(self) -> None:
        self.nc_caller = await _connect(self.url, "dilu-bench-caller")
        self.nc_fn = await _connect(self.url, "dilu-bench-function")
        self.js = self.nc_caller.jetstream()
        await self.js.add_stream(StreamConfig(name=self.stream, subjects=[self.subject],
                                              retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        await self.js.add_consumer(self.stream, ConsumerConfig(durable_name="base", ack_policy=AckPolicy.EXPLICIT,
                                                               max_ack_pending=MAX_ACK_PENDING))
        self.psub = await self.nc_fn.jetstream().pull_subscribe_bind(durable="base", stream=self.stream)
        self.inbox = self.nc_caller.new_inbox()
        self.waiting: dict[str, asyncio.Future] = {}

        async def on_reply(msg) -> None:
            fut = self.waiting.pop(msg.subject.rsplit(".", 1)[1], None)
            if fut is not None and not fut.done():
                fut.set_result(None)

        await self.nc_caller.subscribe(f"{self.inbox}.*", cb=on_reply)
        await settle(self.nc_caller)
        self.stop_serving = asyncio.Event()
        self.serving = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        # Stops on the event, not on cancel() alone: a cancellation that lands as fetch's timeout
        # fires comes out as a TimeoutError (Python 3.11's wait_for), and this loop would go on.
        while not self.stop_serving.is_set():
            try:
                msgs = await self.psub.fetch(MAX_BATCH, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            for msg in msgs:
                await self.nc_fn.publish(msg.headers[BASE_REPLY_HEADER], msg.data)
                await msg.ack()

    def make_invoke(self, gen: OpenLoopGenerator, tag: str) -> Invoke:
        async def invoke(inv: Invocation) -> Outcome:
            key = f"{tag}-{inv.id}"
            fut = asyncio.get_running_loop().create_future()
            self.waiting[key] = fut
            try:
                await self.js.publish(self.subject, PAYLOAD, headers={BASE_REPLY_HEADER: f"{self.inbox}.{key}"},
                                      timeout=REQUEST_TIMEOUT_S)
                await asyncio.wait_for(fut, REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                return Outcome(status="timeout")
            except Exception as exc:  # noqa: BLE001 - a failed publish is a dropped request
                return Outcome(status="dropped", detail=repr(exc))
            finally:
                self.waiting.pop(key, None)
            return Outcome()
        return invoke

    async def close(self) -> None:
        """Stop the consumer, remove the stream, close the connections; like DiluPath.close,
        safe twice and after a start() cut short."""
        if self.serving is not None:
            self.stop_serving.set()
            await _stopped(self.serving, timeout_s=0)
            self.serving = None
        if self.js is not None:
            try:
                await self.js.delete_stream(self.stream)
            except Exception:  # noqa: BLE001 - best effort on a shared server
                pass
            self.js = None
        await _close(self.nc_fn, self.nc_caller)
        self.nc_fn = self.nc_caller = None


async def _stopped(task: asyncio.Task, timeout_s: float) -> None:
    """Give ``task`` ``timeout_s`` seconds to end by itself, then cancel it and wait: a task left
    running would fail on the closed connection, and asyncio would print its traceback."""
    await asyncio.wait({task}, timeout=timeout_s)
    if not task.done():
        task.cancel()
        await asyncio.wait({task})


async def _close(*conns) -> None:
    """Close the NATS connections opened (None: never opened)."""
    for nc in conns:
        if nc is not None:
            await nc.close()


async def _search(dilu: DiluPath, first: dict, search_s: float) -> tuple[float, float | None, list[dict]]:
    """Highest rate held: double from ``first``'s rate until a step fails, then bisect to 10 %."""
    held = first["rate_rps"] if first["held"] else None
    failed = None if first["held"] else first["rate_rps"]
    steps: list[dict] = []
    deadline = time.monotonic() + search_s
    while time.monotonic() + STEP_S < deadline:
        if failed is None:
            rate = held * 2
        elif held is None:
            rate = failed / 2
            if rate < 1:
                break
        elif failed / held <= 1.1:
            break
        else:
            rate = (held + failed) / 2
        step = await _phase(dilu.make_invoke, rate, STEP_S, f"s{len(steps)}")
        await dilu.settle()
        steps.append({k: step[k] for k in ("rate_rps", "sent", "completed", "p50_ms", "p99_ms", "held")})
        if step["held"]:
            held = rate
        else:
            failed = rate
    return held or 0.0, failed, steps


async def run_bench(rate_rps: float, seconds: float, search_s: float,
                    nats_url: NatsOptions | str | None = None) -> dict:
    """Run the three parts (module docstring) against ``nats_url`` (a URL list or full
    :class:`NatsOptions`: credentials, TLS) or an embedded server. Raises what
    :func:`natsconn.connect` raises when that server refuses us."""
    async with contextlib.AsyncExitStack() as stack:
        # Undone in reverse, each even if one before it fails, and on cancellation (Ctrl-C,
        # SIGTERM: SignalExit.cancelling): connections first, the server (and its store) last.
        server = None if nats_url else EmbeddedNats().start()
        if server:
            stack.callback(server.stop)
        url = nats_url or server.url
        dilu, bare = DiluPath(url), BarePath(url)
        stack.push_async_callback(dilu.close)
        stack.push_async_callback(bare.close)
        await bare.start()
        await _phase(bare.make_invoke, rate_rps, min(seconds, 0.5), "warm")
        base = await _phase(bare.make_invoke, rate_rps, seconds, "base")
        await bare.close()
        await dilu.start()
        await _phase(dilu.make_invoke, rate_rps, min(seconds, 0.5), "warm")
        await dilu.settle()
        main = await _phase(dilu.make_invoke, rate_rps, seconds, "main")
        await dilu.settle()
        max_rate, failed, steps = await _search(dilu, main, search_s)
        await dilu.close()
    return {
        "rate_rps": rate_rps,
        "seconds": seconds,
        "sent": main["sent"],
        "completed": main["completed"],
        "errors": main["errors"],
        "overhead_ms_p50": main["p50_ms"],
        "overhead_ms_p99": main["p99_ms"],
        "overhead_ms_max": main["max_ms"],
        "late_sends": main["late_sends"],
        "baseline_ms_p50": base["p50_ms"],
        "baseline_ms_p99": base["p99_ms"],
        "baseline_ms_max": base["max_ms"],
        "baseline_completed": base["completed"],
        "baseline_errors": base["errors"],
        "max_rate_rps": max_rate,
        "max_rate_failed_rps": failed,
        "held_p99_ms": HELD_P99_MS,
        "steps": steps,
        "goal": {"rate_rps": GOAL_RATE_RPS, "overhead_ms_p50": GOAL_MS_P50, "overhead_ms_p99": GOAL_MS_P99,
                 "met": (rate_rps >= GOAL_RATE_RPS and main["errors"] == 0 and main["p50_ms"] is not None
                         and main["p50_ms"] <= GOAL_MS_P50 and main["p99_ms"] <= GOAL_MS_P99)},
        "setup": {"transport": "nats-server (loopback)" if server else NatsOptions.of(url).url, "storage": "file",
                  "function": "no-op BatchPuller in the caller's process, own NATS connection",
                  "max_batch": MAX_BATCH, "step_s": STEP_S, "search_s": search_s,
                  "measured": "answer received - scheduled send (open loop)"},
    }


@nats_default_shown(OWN_SERVER)
@click.command("invoke")
@nats_options
@click.option("--rate", type=Finite(1, 1_000_000), default=1000.0, show_default=True,
              help="requests per second of the overhead and baseline runs")
@click.option("--seconds", type=Finite(0.1, 3600), default=10.0, show_default=True,
              help="length of the overhead run and of the baseline run, in s each (after a warm-up of up to 0.5 s)")
@click.option("--search-s", type=Finite(0, 3600), default=60.0, show_default=True,
              help="time for the highest-rate search, in s (no new step after it; 0: no search)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=writable_output, help="write the figures here")
def bench_invoke(nats, rate, seconds, search_s, json_path):
    """Data-plane overhead of a no-op function vs a bare JetStream round trip, and the highest rate held.
    Without --nats-url it starts its own nats-server; with it, that server (JetStream on).
    Ctrl-C or SIGTERM stops it (and its own nats-server) with exit status 130 (143)."""
    with SignalExit() as stop:
        nats_url = given_nats(nats)
        reachable_or_exit(nats_url)
        dlog.configure("bench-invoke", "error")
        with one_line_nats_errors(nats_url):
            result = uvloop.run(stop.cancelling(run_bench(rate, seconds, search_s, nats_url)))
        text = json.dumps(result, indent=2)
        if json_path:
            json_path.write_text(text + "\n")
        click.echo(text)
