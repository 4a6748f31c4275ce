"""Rules about deployed functions that several services and the client share (one truth each).

- :func:`request_slo_ms`: the request-level objective of a function (an ``llm`` reply's from
  its time-to-first-token and time-per-output-token objectives);
- :func:`default_priority`: the priority class a kind gets when the spec names none;
- :func:`runs_on`: whether a node of a device kind can run a function (and why not);
- :data:`LLM_REFERENCE_TOKENS`: the output length an ``llm`` function is sized for.
"""
from __future__ import annotations

from dilu.contracts import events as ev

from . import models

# An llm function is profiled and scaled for replies of this many output tokens: the length the
# A100 LLaMA2 surface's throughput counts (32 generated tokens a request, shared/data/README.md).
LLM_REFERENCE_TOKENS = 32

DEVICE_KINDS = ("nvml", "emulated", "cpu")


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
    return "training" if kind == "training" else "latency-sensitive"


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
