"""What a live node adds to a request beyond the GPU time the simulator models, as quantile tables
measured by ``dilu calibrate`` (:mod:`.calibrate`) and replayed by ``dilu sim --overheads``.

Four tables, split by the serving instance's own times in its reply (``Dilu-Started-Ns``,
``Dilu-Replied-Ns``; :class:`dilu.loadgen.generator.Timings`):

- ``transport_ms``: the way in (scheduled send -> stored by JetStream) plus the way back (reply
  published -> answer received) of a request: the load generator, NATS and the caller's event
  loop. It adds to the request's latency and holds no instance.
- ``batch_ms``: how much longer a batch's service (handler called -> reply published) takes live
  than the simulator's model of it (the surface at the instance's width, paced and stretched):
  the instance's Python, the launch path through the interceptor and the fake driver, and the
  wait for a CPU on a busy node. The instance is busy for it, so it also lengthens the queue.
- ``pickup_ms``: from a batch's last reply to the next batch's start on the same instance while
  requests were waiting (the puller acks, fetches what is queued and decodes it): the instance
  takes no request meanwhile, so on a busy function it costs capacity (a median of 1.1 ms on the
  emulated node, 6 % of a BERT-base batch of 19 ms). Empty in a file of an older build: no pickup.
- ``dispatch_ms``: from a request's storage to its batch's start when it came to an idle instance
  (waiting in its fetch; not parked): JetStream's delivery to the pending fetch and the decode.
  The instance takes no other request meanwhile, and the request waits that much longer: on a
  busy function it adds to the backlog the horizontal scaler sizes by (a median of 0.7 ms on the
  emulated node, 80 rps x 0.7 ms = 0.06 requests in flight, near a KPA target such as 2.8 per
  instance). Empty in a file of an older build: no dispatch.

Beside them, the node's process start (before the weights load), as a median and by how many
other instances were starting on the node at the launch: on a 2-core node the starting
processes share the CPU, so a burst of launches starts several times slower than one launch.
The deploy's initial launches (every function's first instance, all at once) are measured apart,
by launch order: they start beside all the others, longer than any launch of the replay, and a
later one is up later (on the emulated node the first 2.0 s after the deploy, the sixteenth 2.5 s,
against 0.3-0.8 s for a launch of the replay).

And when the replay met the live control loops, which tick on their own clocks: the horizontal
scaler's measured tick period (``horizontal_tick_ms``: it sleeps its 500 ms and then works, so
on the emulated node a tick is 501.6 ms, and over a 60 s replay 500 ms ticks drift two fifths of
a tick away), and each run's :class:`LoopTiming` (its first request and a defragmentation round
after the deploy's tick). A decision on a threshold (a keep-alive running out one tick before a
request, a stable window a hair under its target) turns on these phases: replayed at the phases
its run met, a simulation takes the decisions on the ticks that run took them, where drawn
phases put them on other ticks.

On a real GPU node the tables are small against the GPU's time; on the emulated node of a
2-core machine they are not (README, At cluster scale: the cross-check). ``dilu sim`` without
``--overheads`` models none of them.
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from dilu.services.common import files, models

QUANTILE_POINTS = 101  # each table: the 0th, 1st, ..., 100th percentile
# the largest overhead a table may hold (ms): ten minutes, far past any request's timeout (max(30 s,
# 10 x SLO)); a larger value is a hand-edited or corrupt file, not a node's
OVERHEAD_MAX_MS = 600_000.0
OVERHEADS_MAX_BYTES = 16 * files.MiB  # a few tables of QUANTILE_POINTS numbers: tens of KB


class OverheadsError(ValueError):
    """An overheads file that cannot be used (one line: the file and what is wrong)."""


class LoopTiming(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When one live run met its control loops, ms after the horizontal scaler's tick that
    decided the deploy's initial scale (the simulator's time 0, where its ticks start):
    ``launches``, how many instances that deploy launched (a simulation replays this timing only
    if its deploy launches as many: another plan meets its loops otherwise); ``first_request_ms``,
    the first request's scheduled send; ``defrag_ms``, a defragmentation round of the scheduler
    near it (None: none logged, e.g. a policy that does not defragment). Raises
    :class:`OverheadsError` for a value out of range."""

    launches: int
    first_request_ms: float
    defrag_ms: float | None = None

    def __post_init__(self) -> None:
        if self.launches < 1:
            raise OverheadsError(f"a loop timing needs launches >= 1, got {self.launches}")
        if not (math.isfinite(self.first_request_ms) and 0 <= self.first_request_ms <= OVERHEAD_MAX_MS):
            raise OverheadsError(f"first_request_ms must be in [0, {OVERHEAD_MAX_MS:,.0f}] ms, got {self.first_request_ms}")
        d = self.defrag_ms
        if d is not None and not (math.isfinite(d) and abs(d) <= OVERHEAD_MAX_MS):
            raise OverheadsError(f"defrag_ms must be within ±{OVERHEAD_MAX_MS:,.0f} ms, got {d}")


class Overheads(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Measured overheads (ms) as quantile tables of :data:`QUANTILE_POINTS` non-decreasing,
    finite, non-negative values (``transport_ms``, ``batch_ms``), the node's median process start
    (``process_start_ms``, ms; None: not measured), the median process start by the number of
    other instances already starting on the node (``process_start_by_starting_ms``: entry k for
    k of them, the last entry also for more; empty: not measured; on a 2-core node the starting
    processes share the CPU), when the deploy's launches are up by launch order
    (``process_start_initial_ms``: entry k, ms from the first launch, for the k-th, the last
    entry also for more; empty: not measured), the pickup between batches while
    requests wait (``pickup_ms``, ms, a table as the two first; empty: not measured), the
    dispatch of a request to an idle instance (``dispatch_ms``, likewise), the horizontal
    scaler's tick period (``horizontal_tick_ms``, ms; None: not measured, the nominal one), each
    run's :class:`LoopTiming` (``loop_timings``; empty: not measured) and where they come
    from (``source``:
    free JSON, e.g. the runs measured and how many samples); the JSON of ``dilu calibrate
    --json`` is this struct's. Raises :class:`OverheadsError` when a table is malformed."""

    transport_ms: tuple[float, ...]
    batch_ms: tuple[float, ...]
    process_start_ms: float | None = None
    process_start_by_starting_ms: tuple[float, ...] = ()
    source: dict = {}
    pickup_ms: tuple[float, ...] = ()
    dispatch_ms: tuple[float, ...] = ()
    process_start_initial_ms: tuple[float, ...] = ()
    horizontal_tick_ms: float | None = None
    loop_timings: tuple[LoopTiming, ...] = ()

    def __post_init__(self) -> None:
        for name in ("transport_ms", "batch_ms", "pickup_ms", "dispatch_ms"):
            q = getattr(self, name)
            if name in ("pickup_ms", "dispatch_ms") and not q:
                continue
            if len(q) != QUANTILE_POINTS:
                raise OverheadsError(f"{name} must hold {QUANTILE_POINTS} quantiles, got {len(q)}")
            if any(not (math.isfinite(v) and 0 <= v <= OVERHEAD_MAX_MS) for v in q):
                raise OverheadsError(f"{name} holds a value that is negative, non-finite or above "
                                     f"{OVERHEAD_MAX_MS:,.0f} ms")
            if any(b < a for a, b in zip(q, q[1:])):
                raise OverheadsError(f"{name} is not non-decreasing (quantiles)")
        ps = self.process_start_ms
        if ps is not None and not (math.isfinite(ps) and 0 <= ps <= models.PROCESS_START_MAX_MS):
            raise OverheadsError(f"process_start_ms must be in [0, {models.PROCESS_START_MAX_MS:g}] ms, got {ps}")
        for name in ("process_start_by_starting_ms", "process_start_initial_ms"):
            if any(not (math.isfinite(v) and 0 <= v <= models.PROCESS_START_MAX_MS) for v in getattr(self, name)):
                raise OverheadsError(f"{name} must hold values in [0, {models.PROCESS_START_MAX_MS:g}] ms")
        ups = self.process_start_initial_ms
        if any(b < a for a, b in zip(ups, ups[1:])):  # a later launch of the deploy is up no sooner
            raise OverheadsError("process_start_initial_ms is not non-decreasing (by launch order)")
        tick = self.horizontal_tick_ms
        if tick is not None and not (math.isfinite(tick) and 0 < tick <= OVERHEAD_MAX_MS):
            raise OverheadsError(f"horizontal_tick_ms must be in (0, {OVERHEAD_MAX_MS:,.0f}] ms, got {tick}")

    @classmethod
    def from_samples(cls, transport_ms: Sequence[float], batch_ms: Sequence[float],
                     process_start_ms: float | None = None, source: dict | None = None,
                     process_start_by_starting_ms: Sequence[float] = (),
                     pickup_ms: Sequence[float] = (), dispatch_ms: Sequence[float] = (),
                     process_start_initial_ms: Sequence[float] = (), horizontal_tick_ms: float | None = None,
                     loop_timings: Sequence[LoopTiming] = ()) -> Overheads:
        """The tables of the samples (ms; negative values count as 0: a batch served faster than
        modelled adds nothing; no pickup or dispatch sample: no such table). Raises
        :class:`OverheadsError` when the transport or batch sample is empty."""
        return cls(quantiles(transport_ms, "transport"), quantiles(batch_ms, "batch"),
                   None if process_start_ms is None else round(process_start_ms, 1),
                   tuple(round(v, 1) for v in process_start_by_starting_ms), dict(source or {}),
                   quantiles(pickup_ms, "pickup") if len(pickup_ms) else (),
                   quantiles(dispatch_ms, "dispatch") if len(dispatch_ms) else (),
                   tuple(round(v, 1) for v in process_start_initial_ms),
                   None if horizontal_tick_ms is None else round(horizontal_tick_ms, 3), tuple(loop_timings))

    @property
    def start_ms(self) -> float:
        """The process start a simulation takes from this file: the measured median, else the
        model's (:data:`models.PROCESS_START_MS`)."""
        return models.PROCESS_START_MS if self.process_start_ms is None else self.process_start_ms

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"

    @classmethod
    def read(cls, path: str | Path) -> Overheads:
        """Load a file written by ``dilu calibrate --json``; raises :class:`OverheadsError` naming the
        file when it is unreadable or malformed."""
        try:
            data = files.read_bounded(path, OVERHEADS_MAX_BYTES)
        except OSError as exc:
            raise OverheadsError(f"{path}: cannot read: {exc.strerror or exc}") from None
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.DecodeError as exc:  # a table's own error arrives as a ValidationError
            raise OverheadsError(f"{path}: not an overheads file ({exc})") from None


def quantiles(sample: Sequence[float], what: str = "sample") -> tuple[float, ...]:
    """The :data:`QUANTILE_POINTS` percentiles 0..100 of ``sample`` (ms, values clamped at 0;
    numpy's linear interpolation between order statistics), rounded to µs. Raises
    :class:`OverheadsError` when the sample is empty."""
    if not len(sample):
        raise OverheadsError(f"no {what} overhead measured: the runs hold no answered request with its timings")
    q = np.percentile(np.maximum(np.asarray(sample, dtype=float), 0.0), np.linspace(0.0, 100.0, QUANTILE_POINTS))
    return tuple(round(float(v), 3) for v in q)


class Sampler:
    """Draws from a quantile table by inverse transform: u uniform on [0, 1), read between the two
    neighbouring quantiles. Deterministic per ``seed`` (its own :class:`random.Random`, so the
    draws do not move any other seeded stream)."""

    __slots__ = ("table", "rng", "span")

    def __init__(self, table: Sequence[float], seed: int | str) -> None:
        self.table = tuple(table)
        self.span = len(self.table) - 1
        self.rng = random.Random(seed)

    def __call__(self) -> float:
        pos = self.rng.random() * self.span
        i = int(pos)
        lo, hi = self.table[i], self.table[i + 1]
        return lo + (hi - lo) * (pos - i)
