"""Time-weighted GPU accounting: active GPU-seconds, both fragmentations, quota-seconds."""
from __future__ import annotations

import pytest

from dilu.loadgen.accounting import GpuAccounting, InstanceSample
from dilu.loadgen.report import Mechanism


def inst(fn: str, req: float, quota: float, share: float) -> InstanceSample:
    return InstanceSample(function=fn, request_quota=req, quota=quota, sm_share=share)


def test_piecewise_constant_allocation_gives_exact_figures():
    acc = GpuAccounting()
    # gpu0: 10 s with a (0.5 req, grant 0.6, using 0.4), then 10 s with a and b (0.3 req, grant 0.3, using 0.3)
    acc.observe(0, "gpu0", [inst("a", 0.5, 0.6, 0.4)])
    acc.observe(10, "gpu0", [inst("a", 0.5, 0.6, 0.4), inst("b", 0.3, 0.3, 0.3)])
    # gpu1: idle 0..5 s, then 5 s with b alone at full request, then empty again
    acc.observe(0, "gpu1", [])
    acc.observe(5, "gpu1", [inst("b", 1.0, 1.0, 0.9)])
    acc.observe(10, "gpu1", [])
    acc.launched("a")
    acc.launched("b")
    acc.launched("b")
    acc.close(20)
    facts = acc.facts(Mechanism(grant_changes=4))
    assert facts.active_gpu_seconds == pytest.approx(25)  # gpu0 20 s + gpu1 5 s
    # allocation: gpu0 (0.5 x 10 + 0.2 x 10) + gpu1 (0 x 5) over 25 s
    assert facts.allocation_fragmentation == pytest.approx((5 + 2 + 0) / 25)
    # idle: gpu0 (0.6 x 10 + 0.3 x 10) + gpu1 (0.1 x 5) over 25 s
    assert facts.idle_fragmentation == pytest.approx((6 + 3 + 0.5) / 25)
    assert facts.functions["a"].quota_seconds == pytest.approx(0.6 * 20)
    assert facts.functions["b"].quota_seconds == pytest.approx(0.3 * 10 + 1.0 * 5)
    assert (facts.functions["a"].instance_launches, facts.functions["b"].instance_launches) == (1, 2)
    assert facts.mechanism.grant_changes == 4


def test_no_active_time_means_no_fragmentation_and_time_cannot_run_backwards():
    acc = GpuAccounting()
    acc.observe(0, "gpu0", [])
    acc.close(30)
    facts = acc.facts()
    assert (facts.active_gpu_seconds, facts.allocation_fragmentation, facts.idle_fragmentation) == (0, 0.0, 0.0)
    acc.observe(40, "gpu0", [inst("a", 0.5, 0.5, 0.5)])
    with pytest.raises(ValueError, match="before the previous one"):
        acc.observe(39, "gpu0", [])
