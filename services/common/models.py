"""The model catalogue and the emulated GPU's timing, read from measured surfaces only.

Latency L(b, w) of a batch of b requests at SM width w (fraction 0..1) is interpolated bilinearly
on the A100 MPS surfaces in ``surfaces/a100-mps/`` (Dilu authors' measurements; see
``surfaces/ATTRIBUTION.md``). Outside the measured widths (w < 0.1) latency scales as 1/w from the
narrowest measured width; batches above 32 scale linearly from batch 32.

Documented constants (the sources of the defaults):
- memory: parameters x 2 bytes (fp16 weights) + ``MEMORY_FIXED_BYTES`` (CUDA context, allocator
  pools, cuDNN/cuBLAS workspaces: about 1.5 GiB on an A100 under PyTorch) + ``MEMORY_ACTIVATION_FRACTION``
  of the weights for activations and the KV cache at the profiled batch;
- cold start: weights / ``LOAD_BANDWIDTH_BYTES_PER_S`` (4 GB/s: host page cache to device over
  PCIe 4.0 x16 including deserialisation, the middle of the 2-12 GB/s seen for torch.load + .cuda()),
  plus process start, which the instance pays for real;
- SLO: 5 x the request latency at batch 1 on a full GPU (the project's default).
"""
from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SURFACES = Path(__file__).parent / "surfaces"
MEMORY_FIXED_BYTES = int(1.5 * 2**30)
MEMORY_ACTIVATION_FRACTION = 0.2
LOAD_BANDWIDTH_BYTES_PER_S = 4e9
# Bringing a parked instance's weights back from pinned host memory: a plain copy, no
# deserialisation, at about half of PCIe 4.0 x16's 25 GB/s peak (an assumption until a node
# measures it; dilu sim's parking, horizontal_scaler.policy).
RESUME_BANDWIDTH_BYTES_PER_S = 12e9
# GPU memory a process's CUDA context takes, apart from its allocations (the kernels loaded into
# it, the runtime's state; part of MEMORY_FIXED_BYTES). Measured on an H200 under PyTorch
# (docs/measurements/h200-gpu-check.json, memory step): NVML showed 882 MiB for a process with
# 260 MiB allocated, 622 MiB besides its allocations; rounded up. The emulated node's fake driver
# charges it to each instance's process (DILU_FAKE_CONTEXT_BYTES, devices.Device.gpu_env).
CONTEXT_BYTES = 640 * 2**20
# GPU memory a parked instance's process keeps: its weights and allocator pools are freed, its
# CUDA context is not.
PARKED_BYTES = CONTEXT_BYTES
# An instance's process start and imports before it loads weights (Python on an A100 node); the
# emulated node pays it for real, so only the simulator uses this figure (dilu sim --process-start-ms).
PROCESS_START_MS = 1000.0
PROCESS_START_MAX_MS = 600_000.0  # the longest process start a simulation accepts: 10 minutes
DEFAULT_SLO_FACTOR = 5.0


@dataclass(frozen=True)
class ModelSpec:
    """One emulated model. ``steps_per_request``: decode steps per request (32 generated tokens
    for LLaMA2, whose surface latency is per token); ``kernels_per_step``: kernels replayed per step."""

    name: str
    params: int
    surface: str
    steps_per_request: int = 1
    kernels_per_step: int = 8


MODELS: dict[str, ModelSpec] = {
    "bert_base": ModelSpec("bert_base", 110_000_000, "a100-mps/bert_base.csv", kernels_per_step=12),
    "gpt2_large": ModelSpec("gpt2_large", 774_000_000, "a100-mps/gpt2_large.csv", kernels_per_step=12),
    "llama2": ModelSpec("llama2", 6_740_000_000, "a100-mps/llama2.csv", steps_per_request=32, kernels_per_step=4),
    "resnet152": ModelSpec("resnet152", 60_200_000, "a100-mps/resnet152.csv", kernels_per_step=10),
}


def spec(model: str) -> ModelSpec:
    """The catalogue entry; KeyError names the known models."""
    try:
        return MODELS[model]
    except KeyError:
        raise KeyError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}") from None


@lru_cache(maxsize=None)
def _grid(model: str) -> tuple[tuple[float, ...], tuple[float, ...], dict[tuple[float, float], float]]:
    """(batches, widths 0..1, {(batch, width): step latency ms}) from the model's surface CSV.

    Plain Python (no numpy): instances import this, and their start is part of every cold start.
    """
    path = SURFACES / spec(model).surface
    table: dict[tuple[float, float], float] = {}
    for r in csv.DictReader(path.open()):
        table[(float(r["batch"]), round(float(r["sm_percent"]) / 100.0, 6))] = float(r["latency_s"]) * 1000.0
    batches = tuple(sorted({b for b, _ in table}))
    widths = tuple(sorted({w for _, w in table}))
    if len(table) != len(batches) * len(widths):
        raise ValueError(f"{path}: surface has holes (every batch x sm_percent must be measured)")
    return batches, widths, table


def _bracket(axis: tuple[float, ...], x: float) -> tuple[float, float, float]:
    """Grid values (lo, hi) around ``x`` (clamped to the axis) and the weight of ``hi``."""
    x = min(max(x, axis[0]), axis[-1])
    j = min(bisect.bisect_left(axis, x), len(axis) - 1)
    if axis[j] == x or j == 0:
        return axis[j], axis[j], 0.0
    lo, hi = axis[j - 1], axis[j]
    return lo, hi, (x - lo) / (hi - lo)


def step_latency_ms(model: str, batch: int, width: float) -> float:
    """Latency (ms) of one step of a batch of ``batch`` at SM width ``width`` (0 < width <= 1):
    bilinear in (batch, width) on the measured grid, scaled outside it as the module doc says.
    Raises ValueError for batch < 1 or width outside (0, 1]; KeyError for an unknown model."""
    if batch < 1 or not 0 < width <= 1.0 + 1e-9:
        raise ValueError(f"batch must be >= 1 and width in (0, 1], got batch={batch} width={width}")
    batches, widths, table = _grid(model)
    b0, b1, wb = _bracket(batches, float(batch))
    s0, s1, ws = _bracket(widths, width)
    low = table[(b0, s0)] * (1 - ws) + table[(b0, s1)] * ws
    high = table[(b1, s0)] * (1 - ws) + table[(b1, s1)] * ws
    value = low * (1 - wb) + high * wb
    if batch > batches[-1]:
        value *= batch / batches[-1]
    if width < widths[0]:
        value *= widths[0] / width
    return value


def latency_ms(model: str, batch: int, width: float) -> float:
    """Latency (ms) of a whole batch of requests: steps x step latency."""
    return spec(model).steps_per_request * step_latency_ms(model, batch, width)


def pacing_stretch(width: float, grant: float) -> float:
    """How many times longer a batch takes at SM width ``width`` when paced by tokens to
    ``grant`` (both fractions of the GPU, 0 < grant, width <= 1): ``width / grant`` when
    ``grant < width``, else 1 (a grant at or above the width does not slow it).

    Source: the interceptor refills tokens (µs of busy time) at ``grant / width`` per µs of wall
    time (interceptor.c, set_rate), so the instance may keep its width's SMs busy only
    ``grant / width`` of the time, and a batch of busy time L(b, w) lasts L(b, w) · w / grant
    (DESIGN.md section 7, first-order timing model). The token bucket's burst (DILU_BURST_US,
    2 ms) is left out: a first-order model, exact for batches much longer than the burst and for
    batches back to back (the profiler's repeated trials); ``dilu sim`` times each batch with
    :func:`bucket_paced_ms` instead.
    Raises ValueError for a width or grant outside (0, 1]."""
    if not (0 < width <= 1.0 + 1e-9 and 0 < grant <= 1.0 + 1e-9):
        raise ValueError(f"width and grant must be in (0, 1], got width={width} grant={grant}")
    return max(1.0, width / grant)


BURST_MS = 2.0  # the interceptor's token bucket depth (DILU_BURST_US's default, 2000 µs)
MIN_WAIT_MS = 0.2  # the least refill a throttled launch waits for, x the rate (DILU_MIN_WAIT_US's default, 200 µs)
MAX_KERNELS = 1_000_000  # the most kernels one batch is timed over (a catalogue batch has at most 128)
# The interceptor's kernel-launch cycles (interceptor.c, note_cycle), mirrored by the simulator:
CYCLE_GAP_MS = 1.0  # an idle gap longer than this closes a cycle (DILU_CYCLE_GAP_US's default, 1000 µs)
WARM_CYCLES = 16  # the first cycles set the baseline to their shortest (its WARM_CYCLES)
BASELINE_DRIFT_MS = 60_000.0  # later a cycle moves the baseline towards it by (its span + the gap) / this (60e9 ns)


def kernels_per_batch(model: str) -> int:
    """Kernels the emulated runtime launches for one batch: kernels per step x steps."""
    s = spec(model)
    return s.kernels_per_step * s.steps_per_request


def launch_threshold_ms(kernel_ms: float, rate: float) -> tuple[float, float]:
    """The interceptor's throttle for a launch of a ``kernel_ms`` kernel at refill ``rate``:
    ``(floor, want)``, ms of tokens. A launch goes at once while the balance is >= ``floor``;
    below it, it waits until the balance is back to ``want``. Paced (rate < 1): floor 0, want the
    kernel's cost, at least ``MIN_WAIT_MS`` x rate of refill, at most half the burst; unpaced
    (rate 1): launches may run a burst ahead (floor -``BURST_MS``) and a throttled one waits for
    ``MIN_WAIT_MS`` x rate of it back. Source: interceptor.c, admit(). Raises ValueError for a
    rate outside (0, 1] or a negative or non-finite cost."""
    if not (0 < rate <= 1.0 + 1e-9 and kernel_ms >= 0 and math.isfinite(kernel_ms)):
        raise ValueError(f"need 0 < rate <= 1 and a finite kernel_ms >= 0, got rate={rate} kernel_ms={kernel_ms}")
    if rate >= 1.0:
        return -BURST_MS, -BURST_MS + min(MIN_WAIT_MS * rate, BURST_MS / 2)
    return 0.0, min(max(kernel_ms, MIN_WAIT_MS * rate), BURST_MS / 2)


def _bucket_launches(busy_ms: float, kernels: int, rate: float, balance_ms: float, stretch: float,
                     free_ms: float):
    """Yields, kernel by kernel, (when it is charged, the balance after its charge, when it leaves
    the device), ms from the start (:func:`bucket_paced_ms`)."""
    if isinstance(kernels, bool) or not isinstance(kernels, int) or not 1 <= kernels <= MAX_KERNELS:
        raise ValueError(f"kernels must be an integer in 1..{MAX_KERNELS:,}, got {kernels!r}")
    if not (busy_ms >= 0 and stretch >= 1 and free_ms >= 0
            and math.isfinite(busy_ms + stretch + free_ms + balance_ms)):
        raise ValueError(f"need finite busy_ms >= 0, stretch >= 1, free_ms >= 0 and a finite balance_ms, got "
                         f"{busy_ms}, {stretch}, {free_ms}, {balance_ms}")
    c = busy_ms / kernels
    run = c * stretch
    floor, want = launch_threshold_ms(c, rate)
    t, balance, end = 0.0, min(balance_ms, BURST_MS), free_ms  # the bucket holds at most the burst
    for _ in range(kernels):
        if balance < floor:
            t += (want - balance) / rate
            balance = want
        balance -= c
        end = max(t, end) + run
        yield t, balance, end


def bucket_paced_ms(busy_ms: float, kernels: int, rate: float, balance_ms: float,
                    stretch: float = 1.0, free_ms: float = 0.0) -> tuple[float, float]:
    """Wall time (ms) of one batch of ``busy_ms`` of busy time in ``kernels`` equal kernels under
    the interceptor's token bucket, and the bucket's balance (ms of tokens) when it ends.

    The bucket holds ``balance_ms`` (more counts as ``BURST_MS``, its depth) at the batch's start
    and refills at ``rate`` = grant / width (0 < rate <= 1) per ms; the kernels are launched one after another
    (a launch returns at once), each charged its busy time c = busy_ms / kernels as it goes; a
    launch that finds the balance below :func:`launch_threshold_ms`'s floor waits for its
    ``want``. Kernels run one after another on the device, free from ``free_ms`` (work launched
    before still running), each ``stretch`` times its busy time (SMs shared with neighbours; the
    charge meters busy time, not the stretch). Source: interceptor.c, admit(). For a batch much
    longer than the burst this tends to :func:`pacing_stretch`'s ``busy_ms / rate``; shorter
    ones, and an instance idle long enough to fill its bucket, finish sooner: the first kernels
    ride the burst and the last one's run is not waited for. Raises ValueError for a rate
    outside (0, 1], kernels not an integer in 1..``MAX_KERNELS``, a negative or non-finite busy
    time or start, a stretch below 1, a non-finite balance."""
    t, balance, end = 0.0, balance_ms, free_ms
    for t, balance, end in _bucket_launches(busy_ms, kernels, rate, balance_ms, stretch, free_ms):
        pass
    return end, min(BURST_MS, balance + rate * (end - t))


def bucket_charged(busy_ms: float, kernels: int, rate: float, balance_ms: float, at_ms: float,
                   stretch: float = 1.0, free_ms: float = 0.0) -> tuple[int, float, float]:
    """Where a batch timed as :func:`bucket_paced_ms` (same arguments) stands ``at_ms`` after its
    start: ``(kernels charged, the balance then (ms of tokens), when the device is free of the
    charged ones (ms from the start))``. A grant written then meets the kernels not yet charged:
    the interceptor reads it at each launch and wakes a launch waiting for tokens (interceptor.c,
    refresh_grant). Raises ValueError as :func:`bucket_paced_ms`, and for ``at_ms`` not a finite
    number >= 0."""
    if not (at_ms >= 0 and math.isfinite(at_ms)):
        raise ValueError(f"at_ms must be a finite number >= 0, got {at_ms}")
    charged, t, balance, end = 0, 0.0, min(balance_ms, BURST_MS), free_ms
    for when, after, leaves in _bucket_launches(busy_ms, kernels, rate, balance_ms, stretch, free_ms):
        if when > at_ms:
            break
        charged, t, balance, end = charged + 1, when, after, leaves
    return charged, min(BURST_MS, balance + rate * (at_ms - t)), end


def paced_latency_ms(model: str, batch: int, width: float, grant: float) -> float:
    """Latency (ms) of a whole batch of ``batch`` requests of ``model`` by an instance of SM
    width ``width`` (its limit quota) paced to token grant ``grant`` (e.g. its request quota):
    ``latency_ms(model, batch, width) × pacing_stretch(width, grant)`` (the emulated GPU's
    pacing under the interceptor; see :func:`pacing_stretch` for the source). The profiler's
    deployed-configuration trials and the simulator answer from this one function. Raises
    ValueError for batch < 1 or a width/grant outside (0, 1]; KeyError for an unknown model."""
    return latency_ms(model, batch, width) * pacing_stretch(width, grant)


def throughput_rps(model: str, batch: int, width: float) -> float:
    """Requests per second of back-to-back batches at ``width``."""
    return batch / latency_ms(model, batch, width) * 1000.0


def default_slo_ms(model: str) -> float:
    """5 x the request latency at batch 1 on a full GPU."""
    return DEFAULT_SLO_FACTOR * latency_ms(model, 1, 1.0)


def model(name: str) -> ModelSpec:
    """Alias of :func:`spec` (the profiler's name for it)."""
    return spec(name)


def weight_bytes(model: str) -> int:
    return spec(model).params * 2


def memory_bytes(model: str) -> int:
    """GPU memory one instance needs (bytes): fp16 weights + fixed + activation allowance."""
    w = weight_bytes(model)
    return int(w + MEMORY_FIXED_BYTES + MEMORY_ACTIVATION_FRACTION * w)


def cold_start_ms(model: str) -> float:
    """Weight-load time (ms) of a fresh instance at the documented load bandwidth."""
    return weight_bytes(model) / LOAD_BANDWIDTH_BYTES_PER_S * 1000.0


def resume_ms(cold_start_ms: float) -> float:
    """Time (ms) to bring a parked instance's weights back to its GPU from host memory: the weight
    load of its cold start (``cold_start_ms``, at ``LOAD_BANDWIDTH_BYTES_PER_S``; no process start,
    the process kept running) at ``RESUME_BANDWIDTH_BYTES_PER_S`` instead."""
    return max(0.0, cold_start_ms) * LOAD_BANDWIDTH_BYTES_PER_S / RESUME_BANDWIDTH_BYTES_PER_S
