"""The seeded rule that gives each replayed trace function a deep-learning model.

Trace functions carry counts, not models, so each selected function is given one of
:data:`MODELS`. The rule, per function (its name and seed decide, nothing else):

1. Draw a model with a seeded weighted choice (:data:`DEFAULT_WEIGHTS`: the light vision and
   language models are common, the 7B LLM, which needs most of a GPU's memory, is rare). The
   draw uses ``random.Random(f"{seed}/{name}")``, so a function keeps its model whichever other
   functions are replayed.
2. Keep the draw only if one GPU can carry the function's peak rate: ``peak_rps <=
   max_utilisation * capacity_rps(model)``, where ``peak_rps = peak_minute_count * speedup / 60``
   is the busiest trace minute's mean wall-clock rate and ``capacity_rps(model)`` the requests/s of
   one whole GPU at the model's best SLO-meeting batch.
3. Otherwise fall back to a lighter model: among the models that can carry it, the one with the
   least capacity (the closest to the draw); if no model can, the one with the most capacity.

``capacity_rps`` is passed in so the platform's model catalogue plugs in; :func:`surface_capacity`
derives it from the measured A100 surfaces (``batch,sm_percent,latency_s,throughput_rps``).
"""
from __future__ import annotations

import csv
import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from dilu.services.common import files

MODELS: tuple[str, ...] = ("bert_base", "gpt2_large", "llama2", "resnet152")
DEFAULT_WEIGHTS: Mapping[str, float] = {"bert_base": 0.35, "resnet152": 0.35, "gpt2_large": 0.2, "llama2": 0.1}
# The LLaMA2 surface times one decode step; a request generates this many tokens (data README).
LLAMA2_TOKENS = 32
# Default SLO of a model: this many times its batch-1 latency on a whole GPU (issue 2, item 4).
SLO_FACTOR = 5.0


class HasPeak(Protocol):
    """What the rule reads of a function (e.g. :class:`dilu.loadgen.arrivals.FunctionLoad`)."""

    name: str
    peak_minute_count: int


def assign_models(
    functions: Iterable[HasPeak],
    seed: int,
    speedup: float,
    capacity_rps: Callable[[str], float],
    *,
    weights: Mapping[str, float] = DEFAULT_WEIGHTS,
    max_utilisation: float = 1.0,
) -> dict[str, str]:
    """Model per function name, by the rule in the module docstring.

    ``speedup`` is the replay's trace-time compression; ``capacity_rps(model)`` requests/s of one
    whole GPU for the model (> 0); ``weights`` relative draw weights per model (those with weight 0
    are drawn never but still serve as fallbacks); ``max_utilisation`` (0..1] the share of that
    capacity a function's peak may use. Raises ValueError on an empty or negative weight set or a
    non-positive capacity.
    """
    models = sorted(weights)
    if not models or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {dict(weights)}")
    capacity = {m: float(capacity_rps(m)) for m in models}
    bad = {m: c for m, c in capacity.items() if not c > 0}
    if bad:
        raise ValueError(f"capacity_rps must be positive, got {bad}")
    by_capacity = sorted(models, key=lambda m: (capacity[m], m))
    out: dict[str, str] = {}
    for f in functions:
        need = f.peak_minute_count * speedup / 60.0
        drawn = random.Random(f"{seed}/{f.name}").choices(models, weights=[weights[m] for m in models])[0]
        fits = [m for m in by_capacity if need <= max_utilisation * capacity[m]]
        out[f.name] = drawn if drawn in fits else (fits[0] if fits else by_capacity[-1])
    return out


def read_surface(path: str | Path) -> list[tuple[int, float, float, float]]:
    """Rows ``(batch, sm_percent, latency_s, throughput_rps)`` of one A100 surface CSV.
    Raises ValueError naming the file and line on a malformed row."""
    path = Path(path)
    rows = []
    with files.open_regular(path, newline="") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            try:
                rows.append((int(float(row["batch"])), float(row["sm_percent"]), float(row["latency_s"]),
                             float(row["throughput_rps"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path} line {reader.line_num}: bad surface row ({exc})") from exc
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def request_latency_s(model: str, latency_s: float) -> float:
    """Latency of one request batch from a surface's ``latency_s`` (LLaMA2: 32 decode steps)."""
    return latency_s * LLAMA2_TOKENS if model == "llama2" else latency_s


def surface_capacity(perf_dir: str | Path, *, queueing_factor: float = 2.0) -> Callable[[str], float]:
    """``capacity_rps(model)`` from the A100 surfaces in ``perf_dir`` (``<model>.csv``).

    Capacity is the throughput at 100 % SMs of the best batch whose request latency is at most
    ``SLO / queueing_factor``, where SLO = 5 x the batch-1 request latency on the whole GPU.
    The factor 2 leaves room for a request that arrives while the previous batch runs and so
    waits up to one batch time before its own batch starts. Raises ValueError for an unknown
    model (no CSV) when called.
    """
    perf_dir = Path(perf_dir)
    cache: dict[str, float] = {}

    def capacity_rps(model: str) -> float:
        if model not in cache:
            path = perf_dir / f"{model}.csv"
            if not path.is_file():
                raise ValueError(f"no performance surface for model {model!r} at {path}")
            full = [r for r in read_surface(path) if r[1] == 100.0]
            b1 = [r for r in full if r[0] == 1]
            if not b1:
                raise ValueError(f"{path}: no batch-1 row at 100 % SMs")
            budget = SLO_FACTOR * request_latency_s(model, b1[0][2]) / queueing_factor
            cache[model] = max(r[3] for r in full if request_latency_s(model, r[2]) <= budget)
        return cache[model]

    return capacity_rps


def catalogue_capacity(
    latency_ms: Callable[[str, int, float], float],
    default_slo_ms: Callable[[str], float],
    *,
    batches: Iterable[int] = (1, 2, 4, 8, 16, 32),
    queueing_factor: float = 2.0,
) -> Callable[[str], float]:
    """``capacity_rps(model)`` from a model catalogue such as ``dilu.services.common.models``:
    ``latency_ms(model, batch, sm_fraction)`` (request latency in ms of a batch alone on a GPU at
    SM share ``sm_fraction`` 0..1) and ``default_slo_ms(model)``.

    Same rule as :func:`surface_capacity`: the best ``batch / latency`` on the whole GPU over
    ``batches`` whose latency is at most ``SLO / queueing_factor``; batch 1 always counts, so a
    model whose batch-1 latency alone misses that budget still gets its batch-1 throughput.
    """
    sizes = sorted(set(batches) | {1})

    def capacity_rps(model: str) -> float:
        budget = default_slo_ms(model) / queueing_factor
        rates = [1000.0 * b / latency_ms(model, b, 1.0) for b in sizes
                 if b == 1 or latency_ms(model, b, 1.0) <= budget]
        return max(rates)

    return capacity_rps
