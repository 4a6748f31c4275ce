"""Kernel-launch cycle telemetry: count, last span and baseline span, and their stretch when
another process contends for the device (the signal the node agent turns into
KernelCycleStretch)."""
from __future__ import annotations

import statistics
import time

import pytest

from native_helpers import finish, launch_env, spawn

pytestmark = pytest.mark.native


def test_cycles_are_counted_and_stretch_under_contention(agent, gpu):
    cb = agent.block(request_quota=1.0)
    # batches of 10 x 200 µs kernels, a synchronisation, then 3 ms of host think time
    proc = spawn(launch_env(cb.path, gpu), "-k", "k_200", "-s", "10", "-p", "3000", "-t", "2.4")
    time.sleep(0.6)
    # a loaded host can stall the launcher within one cycle: judge the typical one of 8 read 50 ms apart
    reads = []
    for _ in range(8):
        time.sleep(0.05)
        reads.append(cb.snapshot())
    alone = reads[-1]
    assert alone.cycles >= 20
    assert alone.baseline_cycle_us == pytest.approx(2000, rel=0.15)
    assert statistics.median(r.last_cycle_us for r in reads) <= 1.4 * alone.baseline_cycle_us
    # a saturating width-1 neighbour: our kernels now share the SMs with its kernels
    rival = agent.block(request_quota=1.0)
    other = spawn(launch_env(rival.path, gpu), "-k", "k_200", "-t", "1.2")
    # One cycle is one sample, and on a loaded host the rival can be off the CPU for a cycle:
    # read a cycle every 50 ms through the rival's run and keep the most stretched.
    samples = []
    for _ in range(16):
        time.sleep(0.05)
        samples.append(cb.snapshot())
    finish(other)
    finish(proc)
    contended = max(samples, key=lambda s: s.last_cycle_us / s.baseline_cycle_us)
    assert contended.cycles > alone.cycles
    assert contended.last_cycle_us >= 1.5 * contended.baseline_cycle_us
    assert contended.baseline_cycle_us == pytest.approx(alone.baseline_cycle_us, rel=0.15)


def test_a_cycle_cut_short_by_a_stalled_launcher_keeps_the_baseline(agent, gpu):
    """A launcher preempted mid-cycle (``-S``: 20 ms after the first launch of its 21st cycle) ends
    that cycle after one 200 µs kernel; that fragment is no baseline, or every later cycle would
    read as a tenfold stretch. The baseline stays near the 2 ms of a whole cycle."""
    cb = agent.block(request_quota=1.0)
    finish(spawn(launch_env(cb.path, gpu), "-k", "k_200", "-s", "10", "-p", "3000", "-S", "20000", "-t", "0.6"))
    snap = cb.snapshot()
    assert snap.cycles > 40
    assert snap.baseline_cycle_us == pytest.approx(2000, rel=0.15)
