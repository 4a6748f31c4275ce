"""The simulator's timing of a paced batch (models.bucket_paced_ms, models.bucket_charged) read
against the interceptor on the emulated device's timeline: a batch after an idle gap, and one
whose grant is raised while it runs."""
from __future__ import annotations

import json
import subprocess

import pytest

from native_helpers import PYTHON, launch_env
from dilu.interceptor import timeline
from dilu.services.common import models

pytestmark = pytest.mark.native

KERNELS, KERNEL_US, WIDTH, GRANT = 12, 2500.0, 0.2, 0.1  # GPT-2 large's batch of 1 at width 0.2: 30 ms
RAISED_AFTER = 4  # the grant is raised to the width once this launch has returned

# The instance's side: three batches to calibrate the interceptor's cost estimates, an idle gap
# that fills the bucket, a batch as it comes, another gap, and a batch whose grant is raised
# (written into its own control block, as the node agent would) after launch RAISED_AFTER.
CHILD = f"""
import json, sys, time
from dilu.interceptor.control_block import ControlBlock
from dilu.interceptor.cuda import Driver
d = Driver.load()
ks = [d.function(f"m_k{{i}}") for i in range({KERNELS})]
def batch(cb=None):
    written = None
    for i, k in enumerate(ks):
        d.launch(k, {KERNEL_US})
        if cb is not None and i == {RAISED_AFTER}:
            written = time.monotonic_ns()
            cb.write_grant({WIDTH})
    d.synchronize()
    return written
for _ in range(3):
    batch()
time.sleep(0.05)
batch()
time.sleep(0.05)
print(json.dumps({{"written_ns": batch(ControlBlock.open(sys.argv[1]))}}))
"""


def _batches(gpu: str) -> list[tuple[int, int]]:
    """(first kernel's start, last kernel's end), ns, of each batch of KERNELS on the timeline."""
    recs = timeline.read_array(gpu)
    starts, ends = [int(t) for t in recs["start_ns"]], [int(t) for t in recs["end_ns"]]
    assert len(starts) == 5 * KERNELS
    return [(min(starts[i:i + KERNELS]), max(ends[i:i + KERNELS])) for i in range(0, len(starts), KERNELS)]


def test_a_paced_batch_and_one_whose_grant_is_raised_midway_take_the_time_the_model_says(agent, gpu):
    cb = agent.block(request_quota=GRANT, width=WIDTH)
    cb.write_grant(GRANT)
    env = launch_env(cb.path, gpu, width=WIDTH, request_quota=GRANT)
    out = subprocess.run([PYTHON, "-c", CHILD, cb.path], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    written = json.loads(out.stdout)["written_ns"]
    (_, _), _, _, (s0, e0), (s1, e1) = _batches(gpu)
    busy, rate = KERNELS * KERNEL_US / 1000.0, GRANT / WIDTH
    plain, _ = models.bucket_paced_ms(busy, KERNELS, rate, models.BURST_MS)  # a full bucket after the gap
    assert (e0 - s0) / 1e6 == pytest.approx(plain, rel=0.04)
    at = (written - s1) / 1e6
    charged, balance, free = models.bucket_charged(busy, KERNELS, rate, models.BURST_MS, at)
    assert charged == RAISED_AFTER + 1
    rest, _ = models.bucket_paced_ms(busy * (KERNELS - charged) / KERNELS, KERNELS - charged, 1.0, balance,
                                     free_ms=max(0.0, free - at))
    assert (e1 - s1) / 1e6 == pytest.approx(at + rest, rel=0.04)
    assert at + rest < 0.8 * plain  # the raise mattered
