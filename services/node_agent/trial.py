"""Profiling trials on an emulated GPU, run by a long-lived worker process under the interceptor.

The node agent keeps one trial worker (``python -m dilu.services.node_agent.trial``) with its own
control block; each trial replays ``repeats`` batches of the model at the width under test
(``quota``: its kernels last as at that width, after one warm-up batch; each width has kernels of
its own, calibrated at its first trial, see ``emulated.load_kernels``) and answers mean and p99
(max of the repeats) batch latency. The trial is paced by tokens to its ``grant`` below its width
(an instance as deployed: width = its limit, paced to its request); grant 0 or ≥ the width means
no pacing, the setting the A100 MPS surfaces were measured at. The worker's block has width 1
(the interceptor refills grant / width busy-µs per wall µs), so pacing width w to grant g is
the block's grant g / w: the same busy fraction, on the emulated device timeline. A generative
model's request (32 decode steps) is timed over ``TRIAL_STEPS`` steps and scaled.
Requests and answers are JSON lines over the worker's stdin/stdout.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

from dilu.contracts import events as ev

from . import segments

TRIAL_TIMEOUT_S = 60.0
CALIBRATION_BATCHES = 3  # the interceptor calibrates a kernel's cost over its first 3 launches
TRIAL_STEPS = 4  # decode steps measured per generative request (scaled to the whole request)


class TrialWorker:
    """Owns the trial worker process and its control block (node-agent side)."""

    def __init__(self, node: str, gpu_env) -> None:
        """``gpu_env(env) -> env`` adds what runs a process on the trial's GPU (the node agent's
        Device.gpu_env for that GPU)."""
        self.gpu_env = gpu_env
        self.cb_path = segments.trial_block_path(node)
        self.cb = None
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        from dilu.interceptor import native
        from dilu.interceptor.control_block import ControlBlock

        self.cb = ControlBlock.create(self.cb_path, "trial", request_quota=1.0, width=1.0)
        self.cb.write_grant(1.0)
        env = native.interceptor_env(self.cb_path, width=1.0, request_quota=1.0)
        env = self.gpu_env(env)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dilu.services.node_agent.trial", env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def run(self, req: ev.TrialRequest) -> ev.TrialReply:
        """Run one trial (see the module doc). A failure is an ok=false reply with the reason,
        never an exception: a grant outside [0, 1], a worker gone, a timeout."""
        if self.proc is None or self.proc.returncode is not None:
            return ev.TrialReply(ok=False, error="trial worker is not running")
        if not 0.0 <= req.grant <= 1.0:
            return ev.TrialReply(ok=False, error=f"grant must be in [0, 1] (0: the quota), got {req.grant}")
        self.cb.write_grant(busy_fraction(req))
        self.cb.heartbeat()
        self.proc.stdin.write(msgspec.json.encode(req) + b"\n")
        await self.proc.stdin.drain()
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=TRIAL_TIMEOUT_S)
        except asyncio.TimeoutError:
            return ev.TrialReply(ok=False, error=f"trial took over {TRIAL_TIMEOUT_S} s")
        if not line:
            return ev.TrialReply(ok=False, error="trial worker exited")
        return msgspec.json.decode(line, type=ev.TrialReply)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=5)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self.cb is not None:
            self.cb.close()
            Path(self.cb_path).unlink(missing_ok=True)


def busy_fraction(req: ev.TrialRequest) -> float:
    """The grant (fraction 0..1) the width-1 trial block gets so that the trial runs as width
    ``req.quota`` paced to ``req.grant``: ``grant / quota``, capped at 1 (1: no pacing; grant 0
    means grant = quota)."""
    if req.grant <= 0 or req.quota <= 0 or req.grant >= req.quota:
        return 1.0
    return req.grant / req.quota


def _serve() -> None:
    """Worker side: JSON TrialRequest lines in, TrialReply lines out, until stdin closes."""
    import time

    from dilu.services.common import models

    from .handlers import HandlerContext
    from .handlers import emulated

    loaded: dict[tuple[str, float], emulated.EmulatedModel] = {}
    for line in sys.stdin:
        try:
            req = msgspec.json.decode(line, type=ev.TrialRequest)
            m = loaded.get((req.model, req.quota))
            if m is None:  # kernels of their own at each width: the interceptor's estimates are per kernel
                models.spec(req.model)
                m = loaded[req.model, req.quota] = emulated.load_kernels(
                    HandlerContext(instance_id="trial", function="trial", model=req.model, batch_size=req.batch),
                    variant=f"@{req.quota:g}")
                for _ in range(CALIBRATION_BATCHES - 1):  # the interceptor times each new kernel's first launches
                    emulated.run_batch(m, req.batch, req.quota, TRIAL_STEPS)
            emulated.run_batch(m, req.batch, req.quota, TRIAL_STEPS)  # warm-up
            lats = sorted(emulated.run_batch(m, req.batch, req.quota, TRIAL_STEPS) for _ in range(req.repeats))
            mean = sum(lats) / len(lats)
            reply = ev.TrialReply(ok=True, latency_ms_mean=mean, latency_ms_p99=lats[-1],
                                  throughput_rps=req.batch / mean * 1000.0, ts_ns=time.time_ns())
        except Exception as exc:  # answer every request, even a bad one
            reply = ev.TrialReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
