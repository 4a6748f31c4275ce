"""An emulated model's metered busy time is its device time, whatever its batch sizes.

The interceptor charges a launch the cost learned for its kernel *and* launch geometry. The
emulated models launch over a grid that grows with the batch, as real kernels do, so a batch of 4
is charged as a batch of 4; with one geometry for every batch size, a batch of 4 was charged
about a batch of 1's time and the node agent's busy share read about 0.7 of the true one here.
Both sides are read after the run: the control block's busy µs and the emulated GPU's timeline.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from native_helpers import PYTHON, launch_env
from dilu.interceptor import timeline

pytestmark = pytest.mark.native

# Mixed batches of one instance, each followed by a host gap as between real batches.
REPLAY = """
import json, random, time
from dilu.interceptor.cuda import Driver
from dilu.services.common import models
from dilu.services.node_agent.handlers import emulated
spec = models.spec({model!r})
d = Driver.load()
ks = [d.function(f"{model}_k{{i}}") for i in range(spec.kernels_per_step)]
m = emulated.EmulatedModel(driver=d, spec=spec, width=1.0, kernels=ks)
rng = random.Random(7)
for _ in range(60):
    emulated.run_batch(m, rng.choice([1, 1, 2, 4]))
    time.sleep(0.002)
print(json.dumps({{"ok": True}}))
"""


@pytest.mark.parametrize("model", ["bert_base", "resnet152"])
def test_mixed_batches_are_metered_at_their_device_time(agent, gpu, model):
    cb = agent.block(request_quota=1.0)
    proc = subprocess.run([PYTHON, "-c", REPLAY.format(model=model)], env=launch_env(cb.path, gpu),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stderr[-2000:]
    recs = timeline.read_array(gpu)
    device_us = float((recs["end_ns"] - recs["start_ns"]).sum()) / 1e3
    metered_us = cb.snapshot().busy_us
    # one geometry for all batch sizes: 0.71 (bert_base), 0.94 (resnet152)
    assert metered_us == pytest.approx(device_us, rel=0.03)
