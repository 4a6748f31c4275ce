"""One function instance: a process the node agent launches (``python -m dilu.services.node_agent.instance``).

Life: connect to NATS, read the function's spec from KV ``dilu-functions`` (absent: the command
line's model and handler, as older callers expect), load what the spec says to run
(:mod:`.runtime`: the emulated handler, the user's class from its code bundle, or a handler
module; this is the cold start), print ``READY`` (or ``READY parkable``) on stdout (the node agent
waits for that line), then by the function's kind:

- ``inference``: pull batches from the function's JetStream work queue, run ``predict`` in a
  worker thread, reply to each caller's inbox and ack;
- ``llm``: the same queue, but ``generate`` runs step by step and each step's chunks go to their
  callers as they are produced (``Dilu-Status: chunk``), then each request's final reply;
- ``training``: no requests; ``train_step`` runs in a loop, iterations are counted.

Parking (``inference`` and ``llm``; a training instance logs the signal and ignores it): an idle
instance gives its GPU back but keeps its process, so coming back is a weight copy, not a cold
start. SIGUSR1 parks: nothing more is fetched, the batch in hand is answered, the runtime moves
the weights to host memory (:meth:`.runtime.FunctionRuntime.park`), the control block's ready
flag goes off, and the process prints ``PARKED``; a function that cannot park (its code has no
``park``/``resume``, or ``park`` raises) prints ``PARK-FAILED <reason>`` and serves on. SIGUSR2
resumes: the weights are copied back and ``READY`` is printed again, then pulling resumes; a
resume that raises is ``FAILED <reason>`` and exit 1 (the weights are not back). Signals may
repeat and come in any order: the last one wins, and one that asks for the state the instance is
in prints that state's line again. One that comes while loading is applied once ``READY`` is out.
A parked process waits on the next signal, polling nothing (its stats tick aside). The first word of ``READY`` is what
counts; ``READY parkable`` says the function can park.

SIGTERM drains: the batch (or training step) in hand finishes and is answered, nothing more is
fetched, the process exits 0; one still loading exits without serving; one parked exits at once
(nothing in hand); one parking or resuming finishes that step first. A drain never takes more
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
from dilu.services.common.cliopts import log_level_option, nats_options
from dilu.services.common.lifetime import ORPHANED_EXIT, signal_on_parent_death
from dilu.services.common.digits import as_count
from dilu.services.common.functions import recent_latency
from dilu.services.common.jsresources import ride_out
from dilu.services.common.natsconn import NatsOptions, connect
from dilu.services.common.workqueue import BatchPuller, Request, ensure_consumer, ensure_stream

from . import runtime

AGENT_PID_ENV = "DILU_AGENT_PID"  # the node agent's pid, set in each instance's environment
DRAIN_TIMEOUT_S = 25.0  # a drain (SIGTERM to exit) takes at most this (s); the agent kills after it too
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
            self.latency_us_ewma = recent_latency(self.latency_us_ewma, lat, self.requests)
            self.requests += 1
        self.flush()

    def flush(self) -> None:
        if self.cb is not None:
            self.cb.set_runtime(self.ready, self.requests, int(self.latency_us_ewma), self.queue_depth)


def die_with_parent() -> None:
    """Ask Linux for SIGTERM when the node agent dies, so no instance outlives its agent; then,
    if the agent named in ``DILU_AGENT_PID`` is already not the parent (it died before the
    request was made: no signal will come), exit at once with ``ORPHANED_EXIT``."""
    signal_on_parent_death(signal.SIGTERM)  # not Linux: the agent's stop() still retires instances
    if orphaned(os.environ.get(AGENT_PID_ENV, ""), os.getppid()):
        print(f"instance: node agent {os.environ[AGENT_PID_ENV]} is gone (parent is {os.getppid()}); exiting",
              file=sys.stderr, flush=True)
        os._exit(ORPHANED_EXIT)


def orphaned(agent_pid: str, parent_pid: int) -> bool:
    """Whether the agent whose pid is ``agent_pid`` (as the environment carries it; empty: not
    launched by an agent) is no longer this process's parent ``parent_pid``."""
    agent = as_count(agent_pid)
    return agent is not None and agent != parent_pid


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


READY_LINE = "READY"  # serving; "READY parkable" when its code can park
PARKABLE_WORD = "parkable"
PARKED_LINE = "PARKED"
PARK_FAILED_PREFIX = "PARK-FAILED "  # the park was refused or raised: the instance keeps serving
PARK_SIGNAL, RESUME_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
PARKABLE_KINDS = ("inference", "llm")  # a training job is never idle: nothing to park


class Control:
    """What the node agent's signals ask for, and where the instance stands, so the serving loop
    can reconcile the two: signals come in any order, repeat, and may come while the function
    loads or while a park or resume runs, so only the last wish counts.

    ``stop``: SIGTERM/SIGINT (for good). ``wanted``: parked wanted (SIGUSR1 true, SIGUSR2 false).
    ``state``: loading | serving | moving (a park or resume under way) | parked. ``changed`` is
    set on every signal (it wakes a parked instance: no polling); the event from :meth:`pause`
    is set once the puller must stop fetching (stop, or a park wanted)."""

    def __init__(self, out, log) -> None:
        self.out, self.log = out, log
        self.stop = asyncio.Event()
        self.changed = asyncio.Event()
        self.wanted = False
        self.state = "loading"
        self.kind = ""  # the function's, once known (training ignores park and resume)
        self.parkable = False  # as its READY line says
        self._pause: asyncio.Event | None = None

    def on_stop(self) -> None:
        """SIGTERM/SIGINT: drain, bounded by ``DRAIN_TIMEOUT_S``."""
        if not self.stop.is_set():
            self.stop.set()
            bound_drain()
        self._wake()

    def on_park(self, parked: bool) -> None:
        """SIGUSR1 (``parked`` true) or SIGUSR2. A wish the instance already meets changes
        nothing but says its state line again, so the agent always gets an answer."""
        if self.kind == "training":
            self.log.warning("park and resume are for inference and llm functions; signal ignored",
                             parked=parked)
            return
        self.wanted = parked
        if self.state == ("parked" if parked else "serving"):
            self.say_state()
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        if self._pause is not None and (self.stop.is_set() or self.wanted):
            self._pause.set()

    def pause(self) -> asyncio.Event:
        """A new event for one serving period, set (now or at the next signal) once stop or a
        park is wanted: the puller then finishes its batch and fetches no more."""
        self._pause = asyncio.Event()
        self._wake()
        return self._pause

    def ready_line(self) -> str:
        return f"{READY_LINE} {PARKABLE_WORD}" if self.parkable else READY_LINE

    def say_state(self) -> None:
        self.say(PARKED_LINE if self.state == "parked" else self.ready_line())

    def say(self, line: str) -> None:
        """Write one line on the channel the node agent reads (flushed); an agent gone already
        (broken pipe) is ignored: its SIGTERM comes with its death."""
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (OSError, ValueError):
            pass


class Instance:
    """The serving half of an instance process, once its function is loaded."""

    def __init__(self, nc, js, rt: runtime.FunctionRuntime, *, instance_id: str, function: str, node: str,
                 batch_size: int, cb_path: str | None, log, ready_out=None, control: Control | None = None) -> None:
        self.nc, self.js, self.rt = nc, js, rt
        self.ready_out = ready_out or sys.stdout
        self.control = control or Control(self.ready_out, log)
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
        request into the stats period. Generation stops once every caller of the batch has
        withdrawn its request (``BatchPuller.withdrawn``)."""
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

        outputs = await runtime.run_generate(self.rt, [r.payload for r in batch], on_chunk,
                                             stop=lambda: all(self.puller.withdrawn(r) for r in batch))
        for i, (req, out) in enumerate(zip(batch, outputs)):
            if isinstance(out, runtime.Withdrawn):  # nobody to tell
                continue
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

    async def serve(self, kind: str) -> None:
        """Serve until ``control.stop`` (then drain), parking and resuming as the signals ask.
        Raises what a training step or a resume raises."""
        ctl = self.control
        if kind != "training":  # the queue must exist before READY: requests may wait in it
            await ride_out(lambda: ensure_stream(self.js))  # a nats-server restarting meanwhile is waited for
            await ride_out(lambda: ensure_consumer(self.js, self.function))
        ready_ns = time.time_ns()
        ctl.kind = kind
        ctl.parkable = kind in PARKABLE_KINDS and self.rt.parkable
        if kind not in PARKABLE_KINDS and ctl.wanted:  # asked while loading
            self.log.warning("park and resume are for inference and llm functions; signal ignored")
            ctl.wanted = False
        self._now_serving()
        self.serving = True
        self.log.info("instance ready", kind=kind, parkable=ctl.parkable)
        stats = asyncio.create_task(self.stats_loop())
        try:
            if kind == "training":
                done = await runtime.train_loop(self.rt, ctl.stop, self.window.iteration)
                self.log.info("training stopped", iterations=done)
            else:
                self.puller = BatchPuller(self.nc, self.js, self.function, instance_id=self.instance_id,
                                          max_batch=self.batch_size, ready_ns=ready_ns, on_done=self.on_done,
                                          stream=kind == "llm")
                await self.serve_requests(self.generate if kind == "llm" else self.predict)
                self.log.info("instance drained", requests=self.cb.requests)
        finally:
            stats.cancel()
            await self.publish_stats()  # the last, partial period
            self.cb.ready = False
            self.cb.flush()

    async def serve_requests(self, process) -> None:
        """Pull and answer batches until ``control.stop``; between serving periods, park and
        resume as ``control.wanted`` says. Parked, it waits on the next signal (no polling).
        Raises what a resume raises (the process then fails: its weights are not back)."""
        ctl = self.control
        while not ctl.stop.is_set():
            if ctl.state == "serving" and ctl.wanted:
                await self.park()
            elif ctl.state == "parked" and not ctl.wanted:
                await self.resume()
            elif ctl.state == "parked":
                ctl.changed.clear()
                await ctl.changed.wait()
            else:
                pause = ctl.pause()
                await self.puller.run(process, pause)
                if not pause.is_set():  # the puller gave up (connection closed): done, as a drain
                    return

    def _now_serving(self) -> None:
        """Ready (first time or resumed): the block's ready flag on, the READY line out."""
        self.cb.ready = True
        self.cb.flush()
        self.control.state = "serving"
        self.control.say_state()

    async def park(self) -> None:
        """Move the weights off the device (the batch in hand is answered already), then the
        block's ready flag off and ``PARKED``; a park refused or raising is one ``PARK-FAILED``
        line, and the instance serves on (the wish is dropped: a repeat signal tries again)."""
        ctl = self.control
        ctl.state = "moving"
        t0 = time.perf_counter()
        try:
            if not ctl.parkable:
                raise runtime.NotParkable(f"{self.rt.description} cannot park: it has no park and resume")
            await asyncio.to_thread(self.rt.park)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            self.log.warning("park failed; serving on", error=reason)
            ctl.state, ctl.wanted = "serving", False
            ctl.say(f"{PARK_FAILED_PREFIX}{reason}"[:MAX_FAILED_CHARS])
            return
        self.cb.ready = False
        self.cb.flush()
        ctl.state = "parked"
        ctl.say_state()
        self.log.info("instance parked", park_ms=round((time.perf_counter() - t0) * 1000.0, 1))

    async def resume(self) -> None:
        """Copy the weights back, then ``READY`` again (pulling resumes). Raises what the
        runtime's resume raises."""
        self.control.state = "moving"
        t0 = time.perf_counter()
        await asyncio.to_thread(self.rt.resume)
        self._now_serving()
        self.log.info("instance resumed", resume_ms=round((time.perf_counter() - t0) * 1000.0, 1))


async def serve_instance(
    *, instance_id: str, function: str, model: str, handler: str, batch_size: int, width: float,
    device: str, nats: NatsOptions | str, cb_path: str | None, node: str = "", ready_out=None,
) -> int:
    """Run the instance until SIGTERM/SIGINT, parking on SIGUSR1 and resuming on SIGUSR2;
    returns the exit code: 0 after a drain, 1 when the function cannot load or fails (a resume
    included; one log line says why). ``ready_out``: where ``READY``, ``PARKED`` and the
    ``FAILED`` lines are written (default stdout)."""
    log = dlog.get("instance", instance=instance_id, function=function)
    out = ready_out or sys.stdout
    ctl = Control(out, log)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctl.on_stop)
    # from now a park or resume is remembered, even while loading (applied once READY)
    loop.add_signal_handler(PARK_SIGNAL, ctl.on_park, True)
    loop.add_signal_handler(RESUME_SIGNAL, ctl.on_park, False)

    # NATS first: reading the spec (and the code bundle) is part of the cold start
    try:
        nc = await connect(nats, name=f"dilu-instance-{instance_id}", max_reconnect_attempts=-1)
    except Exception as exc:
        log.error("instance failed to connect to NATS", url=str(nats), error=f"{type(exc).__name__}: {exc}")
        return 1
    js = nc.jetstream()
    rt = inst = None
    try:
        spec = await ride_out(lambda: read_spec(js, function))
        plan = runtime.choose(spec, function=function, device=device, model=model, handler=handler)
        ctx = runtime.context_for(plan, instance_id=instance_id, batch_size=batch_size, width=width, device=device)
        rt = await runtime.open_runtime(js, plan, ctx)
        log.info("function loaded", source=plan.source, target=plan.target, kind=plan.kind, model=plan.model)
        if ctl.stop.is_set():  # stopped while loading (its agent may be gone): serve nothing
            log.info("instance stopped before serving")
            return 0
        inst = Instance(nc, js, rt, instance_id=instance_id, function=function, node=node,
                        batch_size=batch_size, cb_path=cb_path, log=log, ready_out=out, control=ctl)
        await inst.serve(plan.kind)
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
@log_level_option
def main(log_level: str, **kwargs) -> None:
    """Run one function instance until SIGTERM (then drain and exit)."""
    die_with_parent()
    ready_out = ready_channel()
    dlog.configure("instance", log_level)
    sys.exit(uvloop.run(serve_instance(ready_out=ready_out, **kwargs)))


if __name__ == "__main__":
    main()
