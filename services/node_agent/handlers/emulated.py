"""The emulated-model handler: replays a model's kernel sequence on the (fake or real) driver.

Timing comes only from the measured A100 surfaces (DESIGN.md section 7): a batch of size b at SM
width w lasts L(b, w), interpolated by :func:`dilu.services.common.models.latency_ms`. The batch is
replayed as ``kernels_per_step`` kernels per step (one step for encoders and CNNs; 32 decode steps
for LLaMA2, whose surface gives the latency of one generated token), launched through the CUDA
driver API under the interceptor, so token pacing and contention act on them as on a real model.
A launch's grid grows with the work it does (:func:`grid_blocks`), as a real kernel's does: the
interceptor keys its cost estimate on the kernel *and* its geometry, so a batch of 4 is metered
as a batch of 4, not as the batch of 1 that last taught the key its cost.

By the function's kind:

- ``inference`` (:func:`predict`): one batch replay; the output is each payload's length, ASCII.
- ``llm`` (:func:`generate`): each payload is JSON ``{"prompt_tokens": P, "max_new_tokens": N}``
  (:func:`parse_llm_payload`); one prefill step, then one decode step per generated token until
  every request of the batch has its N tokens. A decode step of the requests still generating
  (b of them) lasts ``models.step_latency_ms(model, b, width)`` (the measured per-token surface).
  The prefill step has no measured surface: it lasts :func:`prefill_ms`, a compute-bound model
  documented there. Each decode step yields one chunk ``b"tok<i> "`` per request still generating
  (i from 0), ``None`` for requests already done.
- ``training`` (:func:`train_step`): one iteration = the forward and backward pass of a batch of
  ``ctx.batch_size`` (the spec's ``max_batch``), lasting ``TRAIN_PASSES x L(b, w)``. Under the
  interceptor the launches are paced by the instance's token grant, so iterations/s follows the
  grant: a training job soaks idle share and yields when inference is pressed.

Parking (:func:`park`, :func:`resume`): the weights' device memory is freed and allocated again,
so the interceptor, NVML and the fake driver all see a parked instance hold only its CUDA context
(which the fake driver charges on the emulated node: ``models.CONTEXT_BYTES``); a resume lasts the
weight copy from pinned host memory, :func:`dilu.services.common.models.resume_ms`.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from dilu.interceptor.cuda import Driver
from dilu.services.common import models
from dilu.services.common.functions import LLM_REFERENCE_TOKENS

from . import FunctionContext

# llm payload defaults and bounds (tokens). The default reply length is the one the LLaMA2 surface
# and every llm profile are sized for (LLM_REFERENCE_TOKENS); 128 prompt tokens is the default
# prompt of the emulation. The caps bound one request's device time (32k tokens: LLaMA2's longest
# context variants; 1024 new tokens: a long chat reply).
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_NEW_TOKENS = LLM_REFERENCE_TOKENS
MAX_PROMPT_TOKENS = 32768
MAX_NEW_TOKENS = 1024

# Prefill compute model. A prefill is compute-bound: a forward pass costs about 2 FLOPs per
# parameter per token (Kaplan et al., "Scaling Laws for Neural Language Models", 2020, section
# 2.1: C_forward ~ 2N per token). The emulated GPU is an A100, whose dense fp16/bf16 tensor-core
# peak is 312 TFLOPS (NVIDIA A100 Tensor Core GPU datasheet, 2020/2021, "Peak FP16 Tensor Core
# 312 TF"; 624 TF only with structured sparsity). Transformer prefills reach about half of that
# peak (model FLOPs utilisation 0.5, the order PaLM reports for large dense models: Chowdhery et
# al., "PaLM", 2022, section 4.1, 46.2 % MFU). At width w the instance has a fraction w of the SMs.
A100_FP16_DENSE_FLOPS = 312e12
PREFILL_MFU = 0.5
FLOPS_PER_PARAM_TOKEN = 2.0

# A training iteration = forward + backward. The backward pass computes gradients with respect to
# both activations and weights, about twice the forward's FLOPs (Kaplan et al. 2020, section 2.1:
# C ~ 6N per token for training = 2N forward + 4N backward), so an iteration lasts 3 x the
# forward latency L(b, w) of the measured surface.
TRAIN_PASSES = 3

# A prefill's grid counts tiles of this many prompt tokens: the M dimension of its GEMMs, tiled as
# 128-row blocks (CUTLASS's default threadblock tile for fp16 tensor-core GEMMs is 128 x 128).
# Tiles, not tokens, so a model has a bounded number of launch geometries.
PREFILL_TILE_TOKENS = 128


@dataclass
class EmulatedModel:
    """A model ready to replay: the driver session, the catalogue entry, the instance's SM width
    (0..1), its kernels (one handle per kernel of a step) and ``batch_size`` (training batch).

    ``weights``: the device pointer of the weights (None: not loaded, or parked);
    ``weight_bytes``: their size (bytes); ``load_ms``: the load time the cold start took (ms),
    from which a resume's copy time follows."""

    driver: Driver
    spec: models.ModelSpec
    width: float
    kernels: list
    batch_size: int = 1
    weights: int | None = None
    weight_bytes: int = 0
    load_ms: float = 0.0


def load_kernels(ctx: FunctionContext, variant: str = "") -> EmulatedModel:
    """Open the driver and look up the model's kernels (no weight-load delay), named
    ``{model}{variant}_k{i}``. The interceptor keeps a cost estimate per kernel (the least of its
    last 8 timings), so a process that runs the model at several widths (the profiler's trial
    worker) gives each width its ``variant``: kernels shared across widths would be charged a
    wider trial's shorter cost, and a narrower trial paced after it would run faster than an
    instance deployed at that width. Raises KeyError for a model not in the catalogue,
    OSError/CudaError when no driver opens."""
    spec = models.spec(ctx.model)
    driver = Driver.load()
    kernels = [driver.function(f"{ctx.model}{variant}_k{i}") for i in range(spec.kernels_per_step)]
    return EmulatedModel(driver=driver, spec=spec, width=ctx.width, kernels=kernels,
                         batch_size=max(1, ctx.batch_size))


def load(ctx: FunctionContext, cold_start_ms: float | None = None) -> EmulatedModel:
    """Open the driver and 'load the weights': allocates their device memory (fp16, through
    cuMemAlloc, so the interceptor counts it against the instance's reservation and NVML sees it)
    and sleeps the load time: ``cold_start_ms`` when given and > 0 (the spec's), else the model's
    documented one (:func:`models.cold_start_ms`). Raises CudaError (CUDA_ERROR_OUT_OF_MEMORY)
    when the weights do not fit the reservation, KeyError for an unknown model."""
    model = load_kernels(ctx)
    model.weight_bytes = models.weight_bytes(ctx.model)
    model.weights = model.driver.mem_alloc(model.weight_bytes)
    model.load_ms = cold_start_ms if cold_start_ms and cold_start_ms > 0 else models.cold_start_ms(ctx.model)
    time.sleep(model.load_ms / 1000.0)
    return model


def park(model: EmulatedModel) -> None:
    """Park: free the weights' device memory (cuMemFree). The emulation holds no bytes to copy
    out, and no request waits for a park, so it takes no emulated time. A model already parked
    is left as it is. Raises CudaError."""
    if model.weights is None:
        return
    model.driver.mem_free(model.weights)
    model.weights = None


def resume(model: EmulatedModel) -> None:
    """Resume: allocate the weights' ``weight_bytes`` again, then sleep the copy from pinned host
    memory, ``models.resume_ms(load_ms)`` ms. A model not parked is left as it is. Raises
    CudaError (CUDA_ERROR_OUT_OF_MEMORY when the weights no longer fit the reservation or the
    device)."""
    if model.weights is not None:
        return
    model.weights = model.driver.mem_alloc(model.weight_bytes)  # first: a refusal costs no wait
    time.sleep(models.resume_ms(model.load_ms) / 1000.0)


def grid_blocks(rows: int) -> int:
    """The grid (gridDimX, >= 1) of a launch over ``rows`` independent rows of work: the batch of
    an encoder, CNN or training step, the requests of a decode step, the prompt tiles of a prefill.
    One block per row: the geometry, hence the interceptor's cost key, changes with the work."""
    return max(1, int(rows))


def _replay(m: EmulatedModel, total_ms: float, passes: int = 1, rows: int = 1) -> None:
    """Launch ``passes`` x the model's kernels over ``rows`` rows of work (:func:`grid_blocks`),
    each pass lasting ``total_ms / passes`` (at the instance's width, on the fake driver), then
    wait for them."""
    per_kernel_us = total_ms * 1000.0 / passes / len(m.kernels)
    grid = grid_blocks(rows)
    for _ in range(passes):
        for k in m.kernels:
            m.driver.launch(k, per_kernel_us, grid=grid)
    m.driver.synchronize()


def run_batch(m: EmulatedModel, batch: int, width: float | None = None, max_steps: int | None = None) -> float:
    """Replay one batch; returns its wall latency in ms (launch of the first kernel to sync).

    ``max_steps`` replays only that many decode steps and scales the measured time to the whole
    request (profiling trials of generative models: per-step latency is what varies).
    """
    w = m.width if width is None else width
    step_ms = models.step_latency_ms(m.spec.name, batch, w)
    per_kernel_us = step_ms * 1000.0 / len(m.kernels)
    steps = m.spec.steps_per_request if max_steps is None else max(1, min(max_steps, m.spec.steps_per_request))
    grid = grid_blocks(batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        for k in m.kernels:
            m.driver.launch(k, per_kernel_us, grid=grid)
    m.driver.synchronize()
    return (time.perf_counter() - t0) * 1000.0 * m.spec.steps_per_request / steps


def predict(model: EmulatedModel, batch: list[bytes]) -> list[bytes]:
    """One batch replay; each output is its payload's length in bytes, ASCII."""
    run_batch(model, len(batch))
    return [b"%d" % len(item) for item in batch]


# ------------------------------------------------------------------------------------------ llm


def _tokens(obj: dict, key: str, default: int, high: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return min(max(value, 1), high)


def parse_llm_payload(payload: bytes) -> tuple[int, int]:
    """``(prompt_tokens, max_new_tokens)`` of an llm request.

    The payload is JSON ``{"prompt_tokens": P, "max_new_tokens": N}``; a field that is absent or
    not an integer (and any payload that is not a JSON object) takes its default (P = 128,
    N = ``LLM_REFERENCE_TOKENS``); P is clamped to 1..32768 and N to 1..1024. Never raises.
    """
    try:
        obj = json.loads(payload)
    except (ValueError, TypeError):  # not JSON (or not UTF-8): the defaults
        obj = None
    if not isinstance(obj, dict):
        return DEFAULT_PROMPT_TOKENS, DEFAULT_NEW_TOKENS
    return (_tokens(obj, "prompt_tokens", DEFAULT_PROMPT_TOKENS, MAX_PROMPT_TOKENS),
            _tokens(obj, "max_new_tokens", DEFAULT_NEW_TOKENS, MAX_NEW_TOKENS))


def prefill_ms(model: str, prompt_tokens: int, width: float) -> float:
    """Prefill latency (ms) of ``prompt_tokens`` tokens (summed over a batch) at SM width
    ``width`` (0..1): ``2 x params x tokens`` FLOPs at the A100's dense fp16 peak times the
    prefill MFU, divided by the width (see the constants' sources above). KeyError for an
    unknown model."""
    flops = FLOPS_PER_PARAM_TOKEN * models.spec(model).params * prompt_tokens
    return flops / (A100_FP16_DENSE_FLOPS * PREFILL_MFU) / width * 1000.0


def token_chunk(i: int) -> bytes:
    """The text of generated token ``i`` (from 0)."""
    return b"tok%d " % i


def generate(model: EmulatedModel, batch: list[bytes]) -> Iterator[list[bytes | None]]:
    """Stream a batch of llm requests: yields once after the prefill (all ``None``: no token yet),
    then once per decode step, one chunk per request (``None`` once a request has its N tokens),
    until every request is done: ``1 + max(N)`` steps in all."""
    parsed = [parse_llm_payload(p) for p in batch]
    prompt = sum(p for p, _ in parsed)
    _replay(model, prefill_ms(model.spec.name, prompt, model.width), rows=-(-prompt // PREFILL_TILE_TOKENS))
    yield [None] * len(batch)
    wanted = [n for _, n in parsed]
    for i in range(max(wanted)):
        active = sum(1 for n in wanted if n > i)
        _replay(model, models.step_latency_ms(model.spec.name, active, model.width), rows=active)
        yield [token_chunk(i) if n > i else None for n in wanted]


# ------------------------------------------------------------------------------------- training


def iteration_ms(model: str, batch: int, width: float) -> float:
    """Unpaced duration (ms) of one training iteration: ``TRAIN_PASSES x L(batch, width)``."""
    return TRAIN_PASSES * models.latency_ms(model, batch, width)


def train_step(model: EmulatedModel) -> None:
    """One training iteration of a batch of ``model.batch_size`` at the instance's width: the
    forward pass then the backward pass (twice the forward), replayed as kernels."""
    _replay(model, iteration_ms(model.spec.name, model.batch_size, model.width), passes=TRAIN_PASSES,
            rows=model.batch_size)
