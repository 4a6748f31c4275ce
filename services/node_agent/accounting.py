"""Pure bookkeeping of the node agent: telemetry from control-block deltas, kernel-cycle stretch,
and the GPU-cost integrals of DESIGN.md section 8. No I/O and no clock reads: times are arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dilu.services.common.functions import STRETCH_RATIO  # the stretch that is contention (one truth)
SAMPLE_STALL_PERIODS = 10  # the sample loop is stuck after this many sample periods without a round
SAMPLE_STALL_MIN_S = 3.0  # ... and never sooner than this (s): a busy host delays a round a little


def sample_loop_stalled(last_round_s: float, now_s: float, sample_s: float) -> bool:
    """True when the sample loop last completed a round (or started) at ``last_round_s`` and, at
    ``now_s``, more than max(SAMPLE_STALL_PERIODS x ``sample_s``, SAMPLE_STALL_MIN_S) has passed:
    its telemetry, stretch detection and relaunch checks have stopped (the agent is not ready).
    All times in seconds on one monotonic clock."""
    return now_s - last_round_s > max(SAMPLE_STALL_PERIODS * sample_s, SAMPLE_STALL_MIN_S)


@dataclass(frozen=True)
class Counters:
    """The cumulative control-block counters the agent samples (µs; ``at_ns`` is the sample time)."""

    at_ns: int
    busy_us: int = 0
    wait_us: int = 0
    launches: int = 0
    cycles: int = 0
    last_cycle_us: int = 0
    baseline_cycle_us: int = 0


@dataclass(frozen=True)
class WindowUse:
    """Use over one window: ``busy_share`` 0..1 of wall time, ``wait_us`` waited for tokens."""

    busy_share: float
    wait_us: int
    launches: int


def window_use(prev: Counters, cur: Counters) -> WindowUse:
    """Use between two samples; a window of zero length reads as no use."""
    span_us = (cur.at_ns - prev.at_ns) / 1000.0
    if span_us <= 0:
        return WindowUse(0.0, 0, 0)
    busy = max(0, cur.busy_us - prev.busy_us)
    return WindowUse(
        busy_share=min(1.0, busy / span_us),
        wait_us=max(0, cur.wait_us - prev.wait_us),
        launches=max(0, cur.launches - prev.launches),
    )


def stretch(prev: Counters, cur: Counters, ratio: float = STRETCH_RATIO) -> float | None:
    """The stretch ratio of a cycle that completed since ``prev`` when it is at least ``ratio`` x
    the baseline cycle, else None (no new cycle, no baseline yet, or no contention).

    Time the instance's own launches waited for tokens since ``prev`` is taken out of the span:
    a cycle slowed by its own quota is throttling, not contention from a neighbour.
    """
    if cur.cycles <= prev.cycles or cur.baseline_cycle_us <= 0:
        return None
    own_wait_us = max(0, cur.wait_us - prev.wait_us)
    r = max(0, cur.last_cycle_us - own_wait_us) / cur.baseline_cycle_us
    return r if r >= ratio else None


@dataclass(frozen=True)
class Slot:
    """One instance's part of a GPU during a window: quotas are fractions 0..1 of the GPU."""

    function: str
    request_quota: float
    quota: float
    sm_time_share: float


@dataclass
class GpuCost:
    """Time integrals over the run (seconds), DESIGN.md section 8.

    A GPU is active while it holds at least one instance. Allocation fragmentation integrates
    (1 - sum of request quotas), idle fragmentation (1 - sum of measured SM-time shares), both
    over active GPUs only; divide by ``active_gpu_seconds`` for the time-weighted means.
    """

    active_gpu_seconds: float = 0.0
    allocation_frag_seconds: float = 0.0
    idle_frag_seconds: float = 0.0
    quota_seconds: dict[str, float] = field(default_factory=dict)

    def advance(self, dt_s: float, gpus: list[list[Slot]]) -> None:
        """Account ``dt_s`` seconds during which each GPU held the given slots."""
        if dt_s <= 0:
            return
        for slots in gpus:
            if not slots:
                continue
            self.active_gpu_seconds += dt_s
            self.allocation_frag_seconds += max(0.0, 1.0 - sum(s.request_quota for s in slots)) * dt_s
            self.idle_frag_seconds += max(0.0, 1.0 - sum(s.sm_time_share for s in slots)) * dt_s
            for s in slots:
                self.quota_seconds[s.function] = self.quota_seconds.get(s.function, 0.0) + s.quota * dt_s

    @property
    def allocation_fragmentation(self) -> float:
        return self.allocation_frag_seconds / self.active_gpu_seconds if self.active_gpu_seconds else 0.0

    @property
    def idle_fragmentation(self) -> float:
        return self.idle_frag_seconds / self.active_gpu_seconds if self.active_gpu_seconds else 0.0
