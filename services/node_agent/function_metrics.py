"""Per-function Prometheus metrics of a node, from its instances' FunctionStats reports.

Each instance publishes :class:`~dilu.contracts.events.FunctionStats` about once a second
(:mod:`.instance`); the node agent keeps those of its own node (``stats.node``) and feeds them
to :class:`FunctionMetrics`, which exports:

- ``dilu_function_requests_total{function,status}``: requests answered, status ``ok``/``error``;
- ``dilu_function_latency_seconds{function}``: request latency from the scheduled send time;
- ``dilu_function_cold_starts_total{function}``: requests that waited for an instance launch;
- ``dilu_function_ttft_seconds{function}`` / ``dilu_function_tpot_seconds{function}``: time to
  first token and mean time per output token of streamed (``llm``) requests;
- ``dilu_training_iterations_total{function}``: training steps done.

Label values are bounded: the first :data:`MAX_FUNCTION_LABELS` function names seen get their own
series, later ones share ``other`` (a node must not grow time series without bound). A report
that decodes but makes no sense (negative or non-finite durations, no function name) is
rejected by :func:`problem` and counted by the caller as malformed.
"""
from __future__ import annotations

import math

from prometheus_client import Counter, Histogram

from dilu.contracts import events as ev

MAX_FUNCTION_LABELS = 1000
OTHER = "other"

# Request latency buckets (s), one set for every function: 5 ms (a small encoder's batch on a
# whole A100, e.g. bert_base at batch 1 takes 16 ms) up to 60 s (an llm reply of hundreds of
# tokens, or a request that waited for a cold start of a multi-GB model), roughly x2-x2.5 apart so
# an SLO of 0.1..10 s falls near a bucket bound. Used for latency and ttft.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Per-token buckets (s): a decode step is 10-100 ms on an A100 (LLaMA2-7B surface: 31 ms at
# batch 1), so 1 ms .. 2.5 s covers fast small models to heavily contended big ones.
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter("dilu_function_requests", "Requests answered by the node's instances", ["function", "status"])
LATENCY = Histogram("dilu_function_latency_seconds", "Request latency from its scheduled send time (s)",
                    ["function"], buckets=LATENCY_BUCKETS_S)
COLD_STARTS = Counter("dilu_function_cold_starts", "Requests that waited for an instance launch", ["function"])
TTFT = Histogram("dilu_function_ttft_seconds", "Time to first token of streamed requests (s)",
                 ["function"], buckets=LATENCY_BUCKETS_S)
TPOT = Histogram("dilu_function_tpot_seconds", "Mean time per output token of streamed requests (s)",
                 ["function"], buckets=TOKEN_BUCKETS_S)
TRAINING_ITERATIONS = Counter("dilu_training_iterations", "Training iterations done", ["function"])


def problem(stats: ev.FunctionStats) -> str | None:
    """Why a decoded report cannot be used (one line), or None when it can."""
    if not stats.function or not stats.instance_id:
        return "function and instance_id must not be empty"
    for name in ("latency_ms", "ttft_ms", "tpot_ms"):
        values = getattr(stats, name)
        if any(not math.isfinite(v) or v < 0 for v in values):
            return f"{name} holds a negative or non-finite duration"
    if not math.isfinite(stats.period_ms) or stats.period_ms < 0:
        return "period_ms is negative or not finite"
    return None


class FunctionMetrics:
    """Turns FunctionStats reports into the module's Prometheus metrics, with at most
    ``max_functions`` function label values (then ``other``)."""

    def __init__(self, max_functions: int = MAX_FUNCTION_LABELS) -> None:
        self.max_functions = max_functions
        self._labels: set[str] = set()
        self.reports = 0

    def label(self, function: str) -> str:
        """The label value of ``function``: itself while fewer than ``max_functions`` names are
        in use (or it already is one), else ``other``."""
        if function in self._labels:
            return function
        if len(self._labels) < self.max_functions:
            self._labels.add(function)
            return function
        return OTHER

    def observe(self, stats: ev.FunctionStats) -> None:
        """Add one report (already checked with :func:`problem`)."""
        fn = self.label(stats.function)
        self.reports += 1
        if stats.ok:
            REQUESTS.labels(fn, "ok").inc(stats.ok)
        if stats.errors:
            REQUESTS.labels(fn, "error").inc(stats.errors)
        if stats.cold_starts:
            COLD_STARTS.labels(fn).inc(stats.cold_starts)
        if stats.iterations:
            TRAINING_ITERATIONS.labels(fn).inc(stats.iterations)
        for hist, values in ((LATENCY, stats.latency_ms), (TTFT, stats.ttft_ms), (TPOT, stats.tpot_ms)):
            if values:
                child = hist.labels(fn)
                for v in values:
                    child.observe(v / 1000.0)
