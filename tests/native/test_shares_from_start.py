"""Tenants' shares hold from the first second (issue 14): no tenant exceeds its quota in any 1 s
window of device time, counted from its very first kernel, whatever its kernels do.

Every share is read from the emulated GPU's own timeline. The tolerance is the burst
(DILU_BURST_US, 2 ms: run-ahead the bucket allows) plus one kernel (a launch admitted at the end
of a window runs into it) plus 1 % for the emulator's granularity.
"""
from __future__ import annotations

import numpy as np
import pytest

from native_helpers import finish, launch_env, spawn
from dilu.interceptor import timeline
from dilu.services.common import models

pytestmark = pytest.mark.native

SEC = 1_000_000_000
BURST_S = models.BURST_MS / 1000.0  # DILU_BURST_US's default, in s


def max_window_share(recs: np.ndarray, pid: int, *, step_ns: int = SEC // 50) -> float:
    """Largest busy share of ``pid`` over sliding 1 s windows starting at its first kernel, moved
    by step_ns, up to the last window that fits inside its run. Raises ValueError if it ran
    nothing or for less than 1 s."""
    t0, t1 = timeline.span(recs, pid)
    if t1 - t0 < SEC:
        raise ValueError(f"pid {pid} ran {(t1 - t0) / SEC:.2f} s, less than one window")
    mine = recs[recs["pid"] == pid]
    return max(timeline.busy_share(mine, pid, w, w + SEC) for w in range(t0, t1 - SEC + 1, step_ns))


def max_window_sm_share(recs: np.ndarray, pid: int, *, step_ns: int = SEC // 50) -> float:
    """Like max_window_share, but the SM-time share (timeline.sm_time_shares): while tenants'
    kernels overlap each holds only its part of the SMs, so a busy share would overcount."""
    t0, t1 = timeline.span(recs, pid)
    if t1 - t0 < SEC:
        raise ValueError(f"pid {pid} ran {(t1 - t0) / SEC:.2f} s, less than one window")
    return max(timeline.sm_time_share(recs, pid, w, w + SEC) for w in range(t0, t1 - SEC + 1, step_ns))


def limit(quota: float, kernel_us: float) -> float:
    return quota + BURST_S + kernel_us / 1e6 + 0.01


@pytest.mark.parametrize("quota,kernel_us,keys", [(0.2, 500, 1000), (0.3, 200, 300),
                                                    (0.1, 20000, 100)])
def test_many_distinct_kernels_are_charged_their_real_cost(agent, gpu, quota, kernel_us, keys):
    """A process cycling through hundreds of distinct kernels (more than there are timing slots)
    from its first launch, never synchronising: every 1 s window holds the quota."""
    cb = agent.block(request_quota=quota)
    out = finish(spawn(launch_env(cb.path, gpu, request_quota=quota), "-k", f"k_{kernel_us}",
                       "-D", str(keys), "-t", "1.6"))
    recs = timeline.read_array(gpu)
    got = max_window_share(recs, out["pid"])
    print(f"distinct keys={keys} k_{kernel_us} quota {quota}: largest 1 s share {got:.3f}")
    assert got <= limit(quota, kernel_us), (got, cb.snapshot().samples)


@pytest.mark.parametrize("quota,kernel_us", [(0.25, 5000), (0.1, 20000)])
def test_long_kernels_back_to_back_hold_the_first_second(agent, gpu, quota, kernel_us):
    """Long kernels launched back to back without synchronising from the start: the launches
    admitted at the default cost before the first timing returns must not push the first 1 s
    window past the quota."""
    cb = agent.block(request_quota=quota)
    out = finish(spawn(launch_env(cb.path, gpu, request_quota=quota), "-k", f"k_{kernel_us}",
                       "-t", "1.6"))
    recs = timeline.read_array(gpu)
    got = max_window_share(recs, out["pid"])
    print(f"long k_{kernel_us} quota {quota}: largest 1 s share {got:.3f}")
    assert got <= limit(quota, kernel_us), got


@pytest.mark.parametrize("n,kernel_us", [(2, 1000), (4, 500), (8, 200), (4, 20000)])
def test_tenants_starting_at_once_each_hold_their_quota(agent, gpu, n, kernel_us):
    """n tenants at quota 1/n (width 1) started at once, each with 50 distinct kernels: in
    every 1 s window from its first kernel none exceeds its quota, and together they never
    exceed the device."""
    q = 1.0 / n
    blocks = [agent.block(request_quota=q) for _ in range(n)]
    procs = [spawn(launch_env(cb.path, gpu, request_quota=q), "-k", f"k_{kernel_us}", "-D", "50",
                   "-t", "1.6") for cb in blocks]
    outs = [finish(p, timeout=120) for p in procs]
    recs = timeline.read_array(gpu)
    got = sorted(max_window_sm_share(recs, o["pid"]) for o in outs)
    print(f"{n} tenants k_{kernel_us} quota {q:.3f}: largest 1 s share {got[-1]:.3f}")
    assert got[-1] <= limit(q, kernel_us), got
    t0 = min(timeline.span(recs, o["pid"])[0] for o in outs)
    total = sum(timeline.sm_time_shares(recs, t0, t0 + SEC).values())
    assert total <= 1.0 + 1e-6, total
