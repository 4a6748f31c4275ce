"""The model catalogue every part of the product uses, with timing read from measured surfaces.

Each model has a measured A100 MPS surface (``surfaces/a100-mps/``, see ``surfaces/ATTRIBUTION.md``):
:func:`latency_ms` interpolates it (this is what the emulated GPU runs at), :func:`default_slo_ms`
derives an SLO from it, :func:`memory_bytes` and :func:`cold_start_ms` derive an instance's
memory need and model load time from the parameter count.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from .surface import SURFACES_DIR, Surface, load_surface

BYTES_PER_PARAM = 2  # fp16 weights
GIB = 1 << 30
# Memory allowance beyond the weights: CUDA context + allocator pools (~1.5 GiB, what a PyTorch
# process holds on an A100 before loading anything) plus activations and workspace, taken as 20 %
# of the weights (KV cache for LLaMA2 at batch 32 × 32 tokens is well under that).
CONTEXT_BYTES = int(1.5 * GIB)
ACTIVATION_FRACTION = 0.20
# Host -> GPU model load bandwidth including deserialisation: 4 GB/s (PCIe 4 x16 peaks at ~25 GB/s,
# but reading a checkpoint and building tensors typically lands at 2-6 GB/s).
LOAD_BANDWIDTH_BYTES_PER_S = 4e9
SLO_FACTOR = 5.0  # default SLO = 5 × latency of batch 1 on the full GPU


@dataclass(frozen=True)
class ModelInfo:
    """A model: parameter count, the A100 surface its timing comes from, tokens per request
    (a generative model's request generates that many tokens; 1 for the others)."""

    name: str
    params: int
    surface: str  # path relative to surfaces/
    tokens_per_request: int = 1


MODELS: dict[str, ModelInfo] = {
    "bert_base": ModelInfo("bert_base", 110_000_000, "a100-mps/bert_base.csv"),
    "gpt2_large": ModelInfo("gpt2_large", 774_000_000, "a100-mps/gpt2_large.csv"),
    "llama2": ModelInfo("llama2", 6_740_000_000, "a100-mps/llama2.csv", tokens_per_request=32),
    "resnet152": ModelInfo("resnet152", 60_200_000, "a100-mps/resnet152.csv"),
}


def model(name: str) -> ModelInfo:
    """The catalogue entry; raises KeyError naming the known models."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None


@functools.cache
def surface(name: str) -> Surface:
    """The model's A100 surface (request latency in ms: per-token latency × tokens per request)."""
    info = model(name)
    return load_surface(SURFACES_DIR / info.surface, tokens_per_request=info.tokens_per_request)


def _bracket(values: tuple, x: float) -> tuple[int, int, float]:
    """Indices (i, j) around ``x`` in sorted ``values`` and the weight of j; clamps at the ends."""
    if x <= values[0]:
        return 0, 0, 0.0
    if x >= values[-1]:
        return len(values) - 1, len(values) - 1, 0.0
    j = bisect.bisect_left(values, x)
    i = j - 1
    return i, j, (x - values[i]) / (values[j] - values[i])


def latency_ms(name: str, batch: float, sm_fraction: float) -> float:
    """Latency (ms) of one batch of ``batch`` requests alone on an A100 at SM share ``sm_fraction``.

    Bilinear interpolation of the measured surface over (batch, SM share). Outside the grid:
    a batch above the largest measured one scales linearly from it (the GPU is saturated there);
    an SM share below the smallest (10 %) scales as 1/share from it. For llama2 it is the time to
    generate the request's 32 tokens. Raises KeyError for an unknown model, ValueError for
    batch < 1 or sm_fraction outside (0, 1].
    """
    if batch < 1 or not 0 < sm_fraction <= 1:
        raise ValueError(f"need batch ≥ 1 and 0 < sm_fraction ≤ 1, got {batch}, {sm_fraction}")
    s = surface(name)
    sms = s.quota_axes[0]
    scale = 1.0
    if batch > s.batches[-1]:
        scale *= batch / s.batches[-1]
        batch = s.batches[-1]
    if sm_fraction < sms[0]:
        scale *= sms[0] / sm_fraction
        sm_fraction = sms[0]
    bi, bj, wb = _bracket(s.batches, batch)
    si, sj, ws = _bracket(sms, sm_fraction)

    def at(b: int, i: int) -> float:
        return s.measure((sms[i],), s.batches[b]).latency_ms

    low = at(bi, si) * (1 - ws) + at(bi, sj) * ws
    high = at(bj, si) * (1 - ws) + at(bj, sj) * ws
    return scale * (low * (1 - wb) + high * wb)


def default_slo_ms(name: str) -> float:
    """SLO_FACTOR (5) × the latency of batch 1 on the full GPU (a common serving target)."""
    return SLO_FACTOR * latency_ms(name, 1, 1.0)


def weights_bytes(name: str) -> int:
    return model(name).params * BYTES_PER_PARAM


def memory_bytes(name: str) -> int:
    """GPU memory of one instance: fp16 weights + CONTEXT_BYTES + ACTIVATION_FRACTION × weights."""
    w = weights_bytes(name)
    return int(w + CONTEXT_BYTES + ACTIVATION_FRACTION * w)


def cold_start_ms(name: str) -> float:
    """Model load time (ms) of a fresh instance: weights / LOAD_BANDWIDTH_BYTES_PER_S (process start excluded)."""
    return weights_bytes(name) / LOAD_BANDWIDTH_BYTES_PER_S * 1000
