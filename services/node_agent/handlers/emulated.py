"""The emulated-model handler: replays a model's kernel sequence on the (fake or real) driver.

Timing comes only from the measured A100 surfaces (DESIGN.md section 7): a batch of size b at SM
width w lasts L(b, w), interpolated by :func:`dilu.services.common.models.latency_ms`. The batch is
replayed as ``kernels_per_step`` kernels per step (one step for encoders and CNNs; 32 decode steps
for LLaMA2, whose surface gives the latency of one generated token), launched through the CUDA
driver API under the interceptor, so token pacing and contention act on them as on a real model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from dilu.interceptor.cuda import Driver
from dilu.services.common import models

from . import HandlerContext


@dataclass
class EmulatedModel:
    driver: Driver
    spec: models.ModelSpec
    width: float
    kernels: list


def load_kernels(ctx: HandlerContext) -> EmulatedModel:
    """Open the driver and look up the model's kernels (no weight-load delay)."""
    spec = models.spec(ctx.model)
    driver = Driver.load()
    kernels = [driver.function(f"{ctx.model}_k{i}") for i in range(spec.kernels_per_step)]
    return EmulatedModel(driver=driver, spec=spec, width=ctx.width, kernels=kernels)


def load(ctx: HandlerContext) -> EmulatedModel:
    """Open the driver and 'load the weights': allocates their device memory (fp16, through
    cuMemAlloc, so the interceptor counts it against the instance's reservation and NVML sees it)
    and sleeps the model's documented load time. Raises CudaError (CUDA_ERROR_OUT_OF_MEMORY) when
    the weights do not fit the reservation."""
    model = load_kernels(ctx)
    model.driver.mem_alloc(models.weight_bytes(ctx.model))
    time.sleep(models.cold_start_ms(ctx.model) / 1000.0)
    return model


def run_batch(m: EmulatedModel, batch: int, width: float | None = None, max_steps: int | None = None) -> float:
    """Replay one batch; returns its wall latency in ms (launch of the first kernel to sync).

    ``max_steps`` replays only that many decode steps and scales the measured time to the whole
    request (profiling trials of generative models: per-step latency is what varies).
    """
    w = m.width if width is None else width
    step_ms = models.step_latency_ms(m.spec.name, batch, w)
    per_kernel_us = step_ms * 1000.0 / len(m.kernels)
    steps = m.spec.steps_per_request if max_steps is None else max(1, min(max_steps, m.spec.steps_per_request))
    t0 = time.perf_counter()
    for _ in range(steps):
        for k in m.kernels:
            m.driver.launch(k, per_kernel_us)
    m.driver.synchronize()
    return (time.perf_counter() - t0) * 1000.0 * m.spec.steps_per_request / steps


def predict(model: EmulatedModel, batch: list[bytes]) -> list[bytes]:
    run_batch(model, len(batch))
    return [b"%d" % len(item) for item in batch]
