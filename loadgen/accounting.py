"""Time-weighted GPU accounting for the report's GPU-side figures (DESIGN.md section 8).

Pure: the caller (the node agent, or the simulator) feeds samples with their own timestamps; no
clock is read here. Each GPU's state is held constant from one sample to its next (zero-order
hold), so a figure is exact for piecewise-constant allocations and converges as the sampling
period shrinks for measured shares.

- ``active_gpu_seconds``: seconds during which a GPU hosted at least one instance, summed over GPUs.
- ``allocation_fragmentation``: time-weighted mean over active GPU time of 1 - sum of request quotas.
- ``idle_fragmentation``: time-weighted mean over active GPU time of 1 - sum of measured SM-time shares.
- ``quota_seconds`` per function: sum over its instances of the quota in effect (the grant) x seconds.
"""
from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .report import FunctionFacts, Mechanism, RunFacts


class InstanceSample(msgspec.Struct, frozen=True, kw_only=True):
    """One instance on a GPU at a sample instant: its ``function``, ``request_quota`` (guaranteed
    share 0..1), ``quota`` (the grant in effect, 0..1) and measured ``sm_share`` (SM-time share
    0..1 over the last sampling period)."""

    function: str
    request_quota: float
    quota: float
    sm_share: float


class GpuAccounting:
    """Accumulates samples per GPU; :meth:`facts` turns them into :class:`RunFacts`.

    Call :meth:`observe` for a GPU whenever its state is sampled (an empty ``instances`` list
    means the GPU is idle from then on), :meth:`launched` for each instance launch, and
    :meth:`close` with the end time of the run before :meth:`facts`.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, Sequence[InstanceSample]]] = {}
        self._active_s = 0.0
        self._alloc_free_s = 0.0  # integral of (1 - sum request quotas) over active time
        self._idle_s = 0.0  # integral of (1 - sum SM shares) over active time
        self._quota_s: dict[str, float] = {}
        self._launches: dict[str, int] = {}

    def observe(self, t_s: float, gpu: str, instances: Sequence[InstanceSample]) -> None:
        """Record GPU ``gpu``'s instances at time ``t_s`` (seconds, any origin, non-decreasing
        per GPU). Raises ValueError if time runs backwards for that GPU."""
        self._hold_until(gpu, t_s)
        self._last[gpu] = (t_s, tuple(instances))

    def launched(self, function: str) -> None:
        """Count one instance launch for ``function``."""
        self._launches[function] = self._launches.get(function, 0) + 1

    def close(self, t_s: float) -> None:
        """End every GPU's last interval at ``t_s``."""
        for gpu in list(self._last):
            self._hold_until(gpu, t_s)
            self._last[gpu] = (t_s, self._last[gpu][1])

    def facts(self, mechanism: Mechanism | None = None) -> RunFacts:
        """The accumulated figures as :class:`RunFacts` (fragmentations 0 without active time)."""
        names = set(self._quota_s) | set(self._launches)
        active = self._active_s
        return RunFacts(
            functions={n: FunctionFacts(instance_launches=self._launches.get(n, 0), quota_seconds=self._quota_s.get(n, 0.0))
                       for n in sorted(names)},
            active_gpu_seconds=active,
            allocation_fragmentation=self._alloc_free_s / active if active else 0.0,
            idle_fragmentation=self._idle_s / active if active else 0.0,
            mechanism=mechanism or Mechanism(),
        )

    def _hold_until(self, gpu: str, t_s: float) -> None:
        if gpu not in self._last:
            return
        t0, instances = self._last[gpu]
        dt = t_s - t0
        if dt < 0:
            raise ValueError(f"GPU {gpu}: sample at {t_s} s is before the previous one at {t0} s")
        if not instances or dt == 0:
            return
        self._active_s += dt
        self._alloc_free_s += (1.0 - sum(i.request_quota for i in instances)) * dt
        self._idle_s += (1.0 - sum(i.sm_share for i in instances)) * dt
        for i in instances:
            self._quota_s[i.function] = self._quota_s.get(i.function, 0.0) + i.quota * dt
