"""The node agent's profiling trial (TrialWorker: the worker process under the interceptor on the
fake driver) runs an instance as deployed when asked: width = its limit paced by tokens to its
grant. Read on the emulated GPU's device timeline, not from sleeps."""
from __future__ import annotations

import asyncio

import pytest

from dilu.contracts import events as ev
from dilu.interceptor import native, timeline
from dilu.services.common import models
from dilu.services.node_agent.trial import CALIBRATION_BATCHES, TrialWorker

pytestmark = pytest.mark.native

REPEATS = 3


def _span_ms(gpu: str, since: int) -> float:
    """Device-timeline span (ms) of the kernels recorded after the first ``since``."""
    recs = timeline.read_array(gpu)[since:]
    assert len(recs) > 0
    return (int(recs["end_ns"].max()) - int(recs["start_ns"].min())) / 1e6


async def _trials(gpu: str) -> dict[str, tuple[ev.TrialReply, float]]:
    worker = TrialWorker("trialtest", lambda env: native.emulated_gpu_env(env, gpu_name=gpu))
    await worker.start()
    try:
        out = {}
        # the first trial of a model also calibrates the interceptor on its kernels: not timed
        first = await worker.run(ev.TrialRequest(model="resnet152", batch=1, quota=0.3, repeats=1))
        assert first.ok, first.error
        for name, req in (
            ("unpaced", ev.TrialRequest(model="resnet152", batch=1, quota=0.3, repeats=REPEATS)),
            ("paced", ev.TrialRequest(model="resnet152", batch=1, quota=0.6, grant=0.3, repeats=REPEATS)),
            ("bad", ev.TrialRequest(model="resnet152", batch=1, quota=0.6, grant=1.5)),
        ):
            before = len(timeline.read_array(gpu))
            reply = await worker.run(req)
            out[name] = (reply, _span_ms(gpu, before) if reply.ok else 0.0)
        return out
    finally:
        await worker.close()


def test_trial_at_width_06_paced_to_03_takes_longer_than_at_03(gpu):
    out = asyncio.run(_trials(gpu))
    (unpaced, t_unpaced), (paced, t_paced), (bad, _) = out["unpaced"], out["paced"], out["bad"]
    assert unpaced.ok and paced.ok, (unpaced.error, paced.error)
    batches = REPEATS + 1  # a warm-up batch before the timed ones
    first_at_width = batches + CALIBRATION_BATCHES - 1  # the first trial at a width also calibrates its kernels
    per_unpaced, per_paced = t_unpaced / batches, t_paced / first_at_width
    # ResNet152 batch 1 barely speeds up with SMs: 0.3 of the GPU all the time beats 0.6 half the time
    assert per_paced > 1.6 * per_unpaced
    assert per_unpaced == pytest.approx(models.latency_ms("resnet152", 1, 0.3), rel=0.25)
    assert per_paced == pytest.approx(models.paced_latency_ms("resnet152", 1, 0.6, 0.3), rel=0.25)
    assert bad.ok is False and "grant" in bad.error


async def _narrow_after_wide(gpu: str) -> tuple[ev.TrialReply, float]:
    worker = TrialWorker("trialtest", lambda env: native.emulated_gpu_env(env, gpu_name=gpu))
    await worker.start()
    try:
        wide = await worker.run(ev.TrialRequest(model="gpt2_large", batch=8, quota=1.0, repeats=REPEATS))
        assert wide.ok, wide.error
        before = len(timeline.read_array(gpu))
        narrow = await worker.run(ev.TrialRequest(model="gpt2_large", batch=8, quota=0.5, grant=0.25, repeats=REPEATS))
        return narrow, _span_ms(gpu, before)
    finally:
        await worker.close()


def test_a_paced_trial_after_a_wider_one_of_the_same_model_is_charged_its_own_kernels_cost(gpu):
    """The interceptor charges a launch the least of its kernel's last timings: a trial at width
    0.5 run on the kernels a width-1 trial calibrated would be charged the shorter width-1 cost
    and paced about a quarter too fast (GPT-2 large batch 8: 49.5 ms at width 1, 65.5 at 0.5).
    Each width has kernels of its own, so the narrow trial runs as an instance deployed there."""
    narrow, span = asyncio.run(_narrow_after_wide(gpu))
    assert narrow.ok, narrow.error
    want = models.paced_latency_ms("gpt2_large", 8, 0.5, 0.25)  # 131 ms; the bucket's burst saves ~4
    assert span / (CALIBRATION_BATCHES + REPEATS) == pytest.approx(want, rel=0.06)  # calibration, warm-up, repeats
    assert narrow.latency_ms_mean == pytest.approx(want, rel=0.06)
