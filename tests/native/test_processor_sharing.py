"""The emulated GPU shares its SMs as MPS does (DESIGN.md section 7): while the widths of the
processes running kernels sum to W > 1, each progresses W times slower; widths that fit run side
by side at full speed.

Two processes, each paced to its own width (so never throttled), launch 1 ms kernels back to back
for 1.5 s on one GPU. A process's progress rate is the solo work it completed per ns over their
common run, read from the device's own timeline.
"""
from __future__ import annotations

import pytest

from native_helpers import finish, launch_env, spawn
from dilu.interceptor import timeline

pytestmark = pytest.mark.native

SEC = 1_000_000_000
KERNEL_NS = 1_000_000  # k_1000


@pytest.mark.parametrize("wa,wb", [(0.7, 0.4), (0.6, 0.6), (1.0, 1.0), (0.5, 0.5), (0.3, 0.6)])
def test_each_busy_process_progresses_w_times_slower(agent, gpu, wa, wb):
    """Widths 0.7 + 0.4 each progress at 1 / 1.1 of solo speed (a device where they took turns
    gave about 0.5), 0.6 + 0.6 at 1 / 1.2, 1 + 1 at 1 / 2, and widths that fit at 1; -0.15 / +0.04."""
    procs = []
    for w in (wa, wb):
        cb = agent.block(request_quota=w, width=w)
        procs.append(spawn(launch_env(cb.path, gpu, width=w, request_quota=w), "-k", "k_1000", "-t", "1.5"))
    outs = [finish(p) for p in procs]
    recs = timeline.read_array(gpu)
    spans = [timeline.span(recs, o["pid"]) for o in outs]
    t0 = max(s[0] for s in spans) + SEC // 10  # both running, queues full
    t1 = min(s[1] for s in spans) - SEC // 10
    assert t1 - t0 > SEC // 2, spans
    expected = 1.0 / max(1.0, wa + wb)
    rates = [timeline.kernels_completed(recs, o["pid"], t0, t1) * KERNEL_NS / (t1 - t0) for o in outs]
    # Host lateness only ever lowers a rate: paced to its width, a process is at most a burst
    # (2 ms) ahead, so a launching thread descheduled longer leaves its queue empty, and a device
    # worker that wakes late starts its next kernel late (0.93 seen for 0.3 + 0.6 and 0.89 for
    # 0.5 + 0.5 in full suite runs on a 2-core host). Hence more room below than above; the
    # device this guards against (turn-taking once widths sum above 1) gave 0.5 for 0.7 + 0.4
    # and 0.6 + 0.6, below 0.76 and 0.68.
    assert all(expected - 0.15 <= r <= expected + 0.04 for r in rates), (rates, expected)
