"""One function instance: a process the node agent launches (``python -m dilu.services.node_agent.instance``).

Life: connect to NATS, read the function's spec from KV ``dilu-functions`` (absent: the command
line's model and handler, as older callers expect), load what the spec says to run
(:mod:`.runtime`: the emulated handler, the user's class from its code bundle, or a handler
module; this is the cold start), print ``READY`` on stdout (the node agent waits for that line),
then by the function's kind:

- ``inference``: pull batches from the function's JetStream work queue, run ``predict`` in a
  worker thread, reply to each caller's inbox and ack;
- ``llm``: the same queue, but ``generate`` runs step by step and each step's chunks go to their
  callers as they are produced (``Dilu-Status: chunk``), then each request's final reply;
- ``training``: no requests; ``train_step`` runs in a loop, iterations are counted.

SIGTERM drains: the batch (or training step) in hand finishes and is answered, nothing more is
fetched, the process exits 0; one still loading exits without serving. A drain never takes more
than ``DRAIN_TIMEOUT_S``: past it the process ends itself (exit 1), even with no agent left to
kill it. No instance outlives its node agent: the process asks Linux for SIGTERM when its parent
dies, and exits at once when its parent is already not the agent that launched it (its pid is in
``DILU_AGENT_PID``: the agent died while the instance was starting). A function that cannot load makes the process exit 1 after one
log line naming the function and the reason and one line ``FAILED <reason>`` on stdout (the node
agent does not launch it again); a function that fails once serving (e.g. a training step
raising) prints the same line and exits 1 (the agent relaunches it, a few times).

About once a second, when it did anything, the instance publishes :class:`FunctionStats` on
``dilu.v1.telemetry.function.<fn>.<instance>`` (the node agent exports them as per-function
Prometheus metrics). On an emulated or real GPU the process runs under the interceptor
(LD_PRELOAD), which meters its kernel launches against the tokens in its control block; this
runtime also writes request-level counters into that block (ready, requests, latency EWMA,
queue depth).
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import threading
import time

import click
import msgspec
import uvloop
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError

from dilu.contracts import cloudevents, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import logging as dlog
from dilu.services.common.cliopts import nats_options
from dilu.services.common.natsconn import NatsOptions, connect
from dilu.services.common.workqueue import BatchPuller, Request, ensure_consumer, ensure_stream

from . import runtime

PR_SET_PDEATHSIG = 1
AGENT_PID_ENV = "DILU_AGENT_PID"  # the node agent's pid, set in each instance's environment
DRAIN_TIMEOUT_S = 25.0  # a drain (SIGTERM to exit) takes at most this (s); the agent kills after it too
ORPHANED_EXIT = 3  # exit code of an instance that found its agent gone before it started
LATENCY_EWMA_ALPHA = 0.2  # weight of the newest batch in the latency EWMA written to the block
STATS_PERIOD_S = 1.0  # FunctionStats period: per-function metrics a second behind at most


class RuntimeStats:
    """Request-level counters mirrored into the control block (when there is one)."""

    def __init__(self, cb_path: str | None) -> None:
        self.cb = None
        if cb_path:
            from dilu.interceptor.control_block import ControlBlock

            self.cb = ControlBlock.open(cb_path)
        self.requests = 0
        self.latency_us_ewma = 0.0
        self.queue_depth = 0
        self.ready = False

    def record(self, latencies_us: list[float]) -> None:
        for lat in latencies_us:
            alpha = LATENCY_EWMA_ALPHA if self.requests else 1.0
            self.latency_us_ewma += alpha * (lat - self.latency_us_ewma)
            self.requests += 1
        self.flush()

    def flush(self) -> None:
        if self.cb is not None:
            self.cb.set_runtime(self.ready, self.requests, int(self.latency_us_ewma), self.queue_depth)


def die_with_parent() -> None:
    """Ask Linux for SIGTERM when the node agent dies, so no instance outlives its agent; then,
    if the agent named in ``DILU_AGENT_PID`` is already not the parent (it died before the
    request was made: no signal will come), exit at once with ``ORPHANED_EXIT``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the agent's stop() still retires instances
        pass
    if orphaned(os.environ.get(AGENT_PID_ENV, ""), os.getppid()):
        print(f"instance: node agent {os.environ[AGENT_PID_ENV]} is gone (parent is {os.getppid()}); exiting",
              file=sys.stderr, flush=True)
        os._exit(ORPHANED_EXIT)


def orphaned(agent_pid: str, parent_pid: int) -> bool:
    """Whether the agent whose pid is ``agent_pid`` (as the environment carries it; empty: not
    launched by an agent) is no longer this process's parent ``parent_pid``."""
    return agent_pid.strip().isdigit() and int(agent_pid) != parent_pid


def bound_drain(timeout_s: float = DRAIN_TIMEOUT_S) -> threading.Timer:
    """From now, end the process (exit 1) if it is still alive after ``timeout_s`` seconds: a
    drain whose batch, close or NATS drain hangs must not keep it alive once its agent is gone.
    A daemon thread, so it fires even while the event loop is blocked; returns it started."""
    def hard_exit() -> None:
        print(f"instance: drain took more than {timeout_s:g} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(timeout_s, hard_exit)
    timer.daemon = True
    timer.start()
    return timer


def ready_channel():
    """The stdout the node agent reads ``READY`` from, kept for this runtime alone: fd 1 then
    points at stderr, so whatever the function's code prints cannot fake or delay that line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


async def read_spec(js, function: str) -> ev.FunctionSpec | None:
    """The function's spec from KV ``dilu-functions`` (FunctionSpec JSON, or FunctionDeployed as
    the scheduler also accepts); None when the bucket or the key is absent. Raises
    runtime.LoadError for a value that decodes as neither."""
    try:
        kv = await js.key_value(subjects.FUNCTIONS_BUCKET)
        raw = (await kv.get(subjects.token(function))).value or b""
    except (BucketNotFoundError, KeyNotFoundError, KeyDeletedError):
        return None
    try:
        return msgspec.json.decode(raw, type=ev.FunctionSpec)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            return msgspec.json.decode(raw, type=ev.FunctionDeployed).spec
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise runtime.LoadError(function, f"its spec in {subjects.FUNCTIONS_BUCKET!r} is malformed: {exc}") from None


FAILED_PREFIX = "FAILED "  # the line the node agent reads an instance's own error from
MAX_FAILED_CHARS = 500


def report_failure(out, reason: str) -> None:
    """Write ``FAILED <reason>`` (one line, at most ``MAX_FAILED_CHARS``) on ``out``, the
    channel the node agent reads; an agent gone already (broken pipe) is ignored."""
    line = " ".join(str(reason).split())[:MAX_FAILED_CHARS]
    try:
        out.write(f"{FAILED_PREFIX}{line}\n")
        out.flush()
    except (OSError, ValueError):
        pass


def checked_outputs(outputs: list, batch: list[Request]) -> list[bytes | Exception]:
    """``predict``'s outputs with each one that is not bytes (bytearray, memoryview) replaced
    by a TypeError for its request alone (a str must not fail the batch or the instance)."""
    return [
        bytes(out) if isinstance(out, (bytes, bytearray, memoryview)) else TypeError(
            f"predict returned {type(out).__name__} for request {req.request_id}; expected bytes")
        for out, req in zip(outputs, batch)
    ]


class Instance:
    """The serving half of an instance process, once its function is loaded."""

    def __init__(self, nc, js, rt: runtime.FunctionRuntime, *, instance_id: str, function: str, node: str,
                 batch_size: int, cb_path: str | None, log, ready_out=None) -> None:
        self.nc, self.js, self.rt = nc, js, rt
        self.ready_out = ready_out or sys.stdout
        self.instance_id, self.function, self.batch_size = instance_id, function, batch_size
        self.log = log
        self.cb = RuntimeStats(cb_path)
        self.window = runtime.StatsWindow(function, instance_id, node, start_ns=time.time_ns())
        self.puller: BatchPuller | None = None
        self.serving = False  # READY written
        self.stats_subject = subjects.function_stats(function, instance_id)
        self.ce_source = cloudevents.source("instance", node)

    # ---------------------------------------------------------------- stats

    def on_done(self, req: Request, done_ns: int) -> None:
        """BatchPuller hook: one answered request into the stats period."""
        cold = self.puller is not None and req.enqueued_ns < self.puller.ready_ns
        self.window.request(ok=req.status == "ok", latency_ms=(done_ns - req.scheduled_ns) / 1e6, cold_start=cold)

    async def publish_stats(self) -> None:
        stats = self.window.take(time.time_ns())
        if stats is None:
            return
        try:
            data = encode(stats)  # stamps ts_ns, which ce-time is made from
            await self.nc.publish(self.stats_subject, data, headers=cloudevents.headers(stats, self.ce_source))
        except Exception as exc:  # reconnecting: this period's counts are lost, serving goes on
            self.log.warning("function stats not published", error=repr(exc))

    async def stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            await self.publish_stats()

    # ---------------------------------------------------------------- kinds

    async def predict(self, batch: list[Request]) -> list[bytes | Exception]:
        self.cb.queue_depth = len(batch)
        self.cb.flush()
        try:
            outputs = await asyncio.to_thread(self.rt.predict, [r.payload for r in batch])
            if len(outputs) != len(batch):
                raise ValueError(f"predict returned {len(outputs)} outputs for {len(batch)} inputs")
            outputs = checked_outputs(outputs, batch)
        except Exception as exc:  # the whole batch is answered with the error, none is lost
            self.log.warning("batch failed", error=repr(exc))
            outputs = [exc] * len(batch)
        self._batch_done(batch)
        return outputs

    async def generate(self, batch: list[Request]) -> list[bytes | Exception]:
        """One llm batch: chunks to their callers as ``generate`` yields them; ttft (from the
        scheduled send time to the first chunk sent) and tpot (mean gap between chunks) per
        request into the stats period."""
        self.cb.queue_depth = len(batch)
        self.cb.flush()
        first_ns = [0] * len(batch)
        last_ns = [0] * len(batch)
        count = [0] * len(batch)

        async def on_chunk(i: int, chunk: bytes) -> None:
            await self.puller.send_chunk(batch[i], chunk)
            now = time.time_ns()
            first_ns[i] = first_ns[i] or now
            last_ns[i] = now
            count[i] += 1

        outputs = await runtime.run_generate(self.rt, [r.payload for r in batch], on_chunk)
        for i, (req, out) in enumerate(zip(batch, outputs)):
            if isinstance(out, Exception):
                self.log.warning("request failed", request_id=req.request_id, error=repr(out))
            elif count[i]:
                tpot = (last_ns[i] - first_ns[i]) / 1e6 / (count[i] - 1) if count[i] > 1 else None
                self.window.stream(ttft_ms=(first_ns[i] - req.scheduled_ns) / 1e6, tpot_ms=tpot)
        self._batch_done(batch)
        return outputs

    def _batch_done(self, batch: list[Request]) -> None:
        now = time.time_ns()
        self.cb.queue_depth = 0
        self.cb.record([(now - r.scheduled_ns) / 1000.0 for r in batch])

    # ---------------------------------------------------------------- serve

    async def serve(self, kind: str, stop: asyncio.Event) -> None:
        """Serve until ``stop`` (then drain). Raises what a training step raises."""
        if kind != "training":  # the queue must exist before READY: requests may wait in it
            await ensure_stream(self.js)
            await ensure_consumer(self.js, self.function)
        ready_ns = time.time_ns()
        self.cb.ready = True
        self.cb.flush()
        self.ready_out.write("READY\n")
        self.ready_out.flush()
        self.serving = True
        self.log.info("instance ready", kind=kind)
        stats = asyncio.create_task(self.stats_loop())
        try:
            if kind == "training":
                done = await runtime.train_loop(self.rt, stop, self.window.iteration)
                self.log.info("training stopped", iterations=done)
            else:
                self.puller = BatchPuller(self.nc, self.js, self.function, instance_id=self.instance_id,
                                          max_batch=self.batch_size, ready_ns=ready_ns, on_done=self.on_done,
                                          stream=kind == "llm")
                await self.puller.run(self.generate if kind == "llm" else self.predict, stop)
                self.log.info("instance drained", requests=self.cb.requests)
        finally:
            stats.cancel()
            await self.publish_stats()  # the last, partial period
            self.cb.ready = False
            self.cb.flush()


async def serve_instance(
    *, instance_id: str, function: str, model: str, handler: str, batch_size: int, width: float,
    device: str, nats: NatsOptions | str, cb_path: str | None, node: str = "", ready_out=None,
) -> int:
    """Run the instance until ``stop`` (SIGTERM/SIGINT); returns the exit code: 0 after a drain,
    1 when the function cannot load or fails (one log line says why). ``ready_out``: where
    ``READY`` is written (default stdout)."""
    log = dlog.get("instance").bind(instance=instance_id, function=function)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        if not stop.is_set():
            stop.set()
            bound_drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)

    # NATS first: reading the spec (and the code bundle) is part of the cold start
    try:
        nc = await connect(nats, name=f"dilu-instance-{instance_id}", max_reconnect_attempts=-1)
    except Exception as exc:
        log.error("instance failed to connect to NATS", url=str(nats), error=f"{type(exc).__name__}: {exc}")
        return 1
    js = nc.jetstream()
    rt = inst = None
    out = ready_out or sys.stdout
    try:
        spec = await read_spec(js, function)
        plan = runtime.choose(spec, function=function, device=device, model=model, handler=handler)
        ctx = runtime.context_for(plan, instance_id=instance_id, batch_size=batch_size, width=width, device=device)
        rt = await runtime.open_runtime(js, plan, ctx)
        log.info("function loaded", source=plan.source, target=plan.target, kind=plan.kind, model=plan.model)
        if stop.is_set():  # stopped while loading (its agent may be gone): serve nothing
            log.info("instance stopped before serving")
            return 0
        inst = Instance(nc, js, rt, instance_id=instance_id, function=function, node=node,
                        batch_size=batch_size, cb_path=cb_path, log=log, ready_out=ready_out)
        await inst.serve(plan.kind, stop)
        return 0
    except runtime.LoadError as exc:
        log.error("instance failed to load", reason=exc.reason, error=str(exc))
        report_failure(out, exc.reason)
        return 1
    except Exception as exc:  # e.g. a training step raising: one line, and the agent sees the crash
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        log.error("instance failed", error=error)
        if inst is not None and inst.serving:  # before READY it may be the platform's (NATS) fault
            report_failure(out, error)
        return 1
    finally:
        if rt is not None:
            try:
                await asyncio.to_thread(rt.close)
            except Exception as exc:
                log.warning("close failed", error=repr(exc))
        try:
            await asyncio.wait_for(nc.drain(), 5)
        except Exception:
            pass


@click.command()
@click.option("--instance-id", required=True)
@click.option("--function", required=True)
@click.option("--model", required=True, help="emulation model when the function has no spec in KV ('none': empty)")
@click.option("--handler", default=runtime.EMULATED_HANDLER, show_default=True,
              help="handler module when the function has no spec in KV")
@click.option("--batch-size", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--width", type=click.FloatRange(0.01, 1.0), default=1.0, show_default=True)
@click.option("--device", type=click.Choice(["emulated", "cpu", "cuda"]), default="emulated", show_default=True)
@nats_options
@click.option("--cb", "cb_path", default=None, help="control block path (the node agent creates it)")
@click.option("--node", default="", help="the node agent's node name, carried in FunctionStats")
@click.option("--log-level", default="info", show_default=True)
def main(log_level: str, **kwargs) -> None:
    """Run one function instance until SIGTERM (then drain and exit)."""
    die_with_parent()
    ready_out = ready_channel()
    dlog.configure("instance", log_level)
    sys.exit(uvloop.run(serve_instance(ready_out=ready_out, **kwargs)))


if __name__ == "__main__":
    main()
