"""One function instance: a process the node agent launches (``python -m dilu.services.node_agent.instance``).

Life: load the handler's model (the cold start), print ``READY`` on stdout (the node agent waits
for that line), then pull batches from the function's JetStream work queue, run them through the
handler in a worker thread, reply to each caller's inbox and ack. SIGTERM drains: the batch in
hand finishes and is answered, nothing more is fetched, the process exits 0.

On an emulated or real GPU the process runs under the interceptor (LD_PRELOAD), which meters its
kernel launches against the tokens in its control block; this runtime only adds request-level
counters to that block (ready, requests, latency EWMA, queue depth).
"""
from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
import time

import click
import nats
import uvloop

from dilu.services.common import logging as dlog
from dilu.services.common.workqueue import BatchPuller, Request, ensure_consumer, ensure_stream

from .handlers import HandlerContext, load_module

PR_SET_PDEATHSIG = 1
LATENCY_EWMA_ALPHA = 0.2  # weight of the newest batch in the latency EWMA written to the block


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
    """Ask Linux for SIGTERM when the node agent dies, so no instance outlives its agent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the agent's stop() still retires instances
        pass


async def serve_instance(
    *, instance_id: str, function: str, model: str, handler: str, batch_size: int, width: float,
    device: str, nats_url: str, cb_path: str | None,
) -> int:
    log = dlog.get("instance").bind(instance=instance_id, function=function)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    module = load_module(handler)
    ctx = HandlerContext(instance_id=instance_id, function=function, model=model,
                         batch_size=batch_size, width=width, device=device)
    stats = RuntimeStats(cb_path)
    state = await asyncio.to_thread(module.load, ctx)  # the cold start: weights onto the device

    nc = await nats.connect(nats_url, name=f"dilu-instance-{instance_id}", max_reconnect_attempts=-1)
    js = nc.jetstream()
    await ensure_stream(js)
    await ensure_consumer(js, function)
    ready_ns = time.time_ns()
    stats.ready = True
    stats.flush()
    print("READY", flush=True)
    log.info("instance ready")

    async def process(batch: list[Request]) -> list[bytes | Exception]:
        stats.queue_depth = len(batch)
        stats.flush()
        try:
            outputs = await asyncio.to_thread(module.predict, state, [r.payload for r in batch])
            if len(outputs) != len(batch):
                raise ValueError(f"handler returned {len(outputs)} outputs for {len(batch)} inputs")
        except Exception as exc:  # the whole batch is answered with the error, none is lost
            log.warning("batch failed", error=repr(exc))
            outputs = [exc] * len(batch)
        now = time.time_ns()
        stats.queue_depth = 0
        stats.record([(now - r.scheduled_ns) / 1000.0 for r in batch])
        return outputs

    puller = BatchPuller(nc, js, function, instance_id=instance_id, max_batch=batch_size, ready_ns=ready_ns)
    await puller.run(process, stop)
    log.info("instance drained", requests=stats.requests)
    stats.ready = False
    stats.flush()
    await nc.drain()
    return 0


@click.command()
@click.option("--instance-id", required=True)
@click.option("--function", required=True)
@click.option("--model", required=True)
@click.option("--handler", default="dilu.services.node_agent.handlers.emulated", show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--width", type=click.FloatRange(0.01, 1.0), default=1.0, show_default=True)
@click.option("--device", type=click.Choice(["emulated", "cpu", "cuda"]), default="emulated", show_default=True)
@click.option("--nats-url", required=True)
@click.option("--cb", "cb_path", default=None, help="control block path (the node agent creates it)")
@click.option("--log-level", default="info", show_default=True)
def main(log_level: str, **kwargs) -> None:
    """Run one function instance until SIGTERM (then drain and exit)."""
    die_with_parent()
    dlog.configure("instance", log_level)
    sys.exit(uvloop.run(serve_instance(**kwargs)))


if __name__ == "__main__":
    main()
