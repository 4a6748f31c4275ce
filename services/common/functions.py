"""Rules about deployed functions that several services and the client share (one truth each).

- :func:`request_slo_ms`: the request-level objective of a function (an ``llm`` reply's from
  its time-to-first-token and time-per-output-token objectives);
- :func:`default_priority`: the priority class a kind gets when the spec names none;
- :func:`runs_on`: whether a node of a device kind can run a function (and why not);
- :data:`LLM_REFERENCE_TOKENS`: the output length an ``llm`` function is sized for;
- :data:`STRETCH_RATIO`: the kernel-cycle stretch that is contention (the node agent detects it,
  the vertical scaler acts on it), tested every :data:`SAMPLE_MS`;
- :func:`recent_latency`: the recent-latency average an instance reports in its telemetry (its
  process keeps it, the simulator mirrors it);
- priority classes (:data:`LATENCY_SENSITIVE`, :data:`TRAINING`, :data:`BEST_EFFORT`, ranked by
  :data:`PRIORITY_RANK`) and who gives share back: :func:`yields_share`, :func:`reclaimable_share`;
- memory units: :data:`MIB`, :data:`GIB` (bytes).
"""
from __future__ import annotations

from typing import get_args

from dilu.contracts import events as ev

from . import models

# An llm function is profiled and scaled for replies of this many output tokens: the length the
# A100 LLaMA2 surface's throughput counts (32 generated tokens a request, shared/data/README.md).
LLM_REFERENCE_TOKENS = 32

DEVICE_KINDS = ("nvml", "emulated", "cpu")

# A kernel cycle this many times its baseline is contention (the Dilu paper's kernel-cycle stretch,
# DESIGN.md section 7): the node agent reports it, the vertical scaler raises the instance for it.
STRETCH_RATIO = 1.5
# The node agent samples every control block this often (ms): a stretch is tested once a sample,
# on a cycle that closed since the last, with the instance's own token wait since then taken out.
SAMPLE_MS = 10.0

# Weight of the newest request in an instance's recent-latency average (InstanceTelemetry's
# latency_ms_recent): the last ten or so requests dominate it.
LATENCY_EWMA_ALPHA = 0.2

# Memory is bytes; these are the units sizes are written in.
MIB = 2**20
GIB = 2**30

# Priority classes, strongest first: a class may take share from the classes ranked after it.
LATENCY_SENSITIVE, TRAINING, BEST_EFFORT = "latency-sensitive", "training", "best-effort"
PRIORITY_RANK = {LATENCY_SENSITIVE: 0, TRAINING: 1, BEST_EFFORT: 2}
if set(PRIORITY_RANK) != set(get_args(ev.PriorityClass)):  # one truth with the contracts' Literal
    raise ImportError(f"priority classes {sorted(PRIORITY_RANK)} differ from the contracts' PriorityClass")


def recent_latency(average: float, latency: float, count: int) -> float:
    """The recent-latency average after one more request of ``latency`` (ms or µs, as
    ``average``), ``count`` requests having been averaged before it (0: it sets the average):
    an exponentially weighted mean, weight :data:`LATENCY_EWMA_ALPHA`. It persists across
    telemetry windows; an idle window leaves it as it was."""
    return latency if count == 0 else average + LATENCY_EWMA_ALPHA * (latency - average)


def yields_share(priority: str) -> bool:
    """Whether an instance of ``priority`` gives share back under pressure (training and
    best-effort do; latency-sensitive never does)."""
    return priority != LATENCY_SENSITIVE


def reclaimable_share(priority: str, quota: float, request_quota: float) -> float:
    """The share (0..1 of a GPU) a higher class may take back from an instance holding ``quota``
    with guarantee ``request_quota``: best-effort all of it, training what it holds above its
    request, latency-sensitive nothing."""
    if not yields_share(priority):
        return 0.0
    return quota if priority == BEST_EFFORT else max(0.0, quota - request_quota)


def request_slo_ms(kind: str, *, slo_ms: float = 0.0, ttft_ms: float = 0.0, tpot_ms: float = 0.0) -> float:
    """The latency objective of one request, ms: ``slo_ms`` for inference; for ``llm``
    ``ttft_ms + (LLM_REFERENCE_TOKENS - 1) * tpot_ms`` (the first token, then the rest at the
    per-token objective) unless ``slo_ms`` is given; 0 for training (no requests)."""
    if kind == "training":
        return 0.0
    if kind == "llm" and not slo_ms:
        return ttft_ms + (LLM_REFERENCE_TOKENS - 1) * tpot_ms
    return slo_ms


def default_priority(kind: str) -> str:
    """``training`` for training jobs, ``latency-sensitive`` for everything that serves requests."""
    return TRAINING if kind == "training" else LATENCY_SENSITIVE


def runs_on(spec: ev.FunctionSpec, device: str) -> str | None:
    """None when a node whose agent runs ``device`` (``nvml``, ``emulated``, ``cpu``) can run
    ``spec``; otherwise the reason, one line.

    An emulated GPU cannot execute user code: it times the function by its performance surface
    (``spec.model``, a catalogue model). Real GPUs and CPU nodes execute the code (``entry`` or
    ``handler``); a function whose handler is the emulated one runs only on emulated GPUs.
    """
    emulated_handler = not spec.entry and spec.handler.endswith("handlers.emulated")
    if device == "emulated":
        if spec.model not in models.MODELS:
            known = ", ".join(sorted(models.MODELS))
            return (f"emulated GPUs time a function by its performance surface, and {spec.name!r} names "
                    f"{'none' if not spec.model else repr(spec.model)} (set [emulation] model to one of: {known})")
        return None
    if emulated_handler:
        return f"{spec.name!r} has no code to run (no entry): only emulated GPUs can run it"
    return None
