"""The composed profile search (ProfileSearch): one procedure for the service, `dilu profile` and the
simulator; the training search's true minimum and its refusal of a profile without throughput."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu.contracts.events import FunctionSpec, ProfileRequest
from dilu.services.common import models
from dilu.services.profiler import service as service_mod
from dilu.services.profiler.cli import profile_surface
from dilu.services.profiler.policy import (
    BATCH_GRID,
    QUOTA_GRID,
    Measurement,
    NoThroughput,
    ProfileSearch,
    SearchProtocolError,
    TrainingSearch,
    Trial,
    search_for,
)
from dilu.services.profiler.service import ProfilerService
from dilu.services.profiler.surface import SURFACES_DIR

QUOTAS = [round(0.1 * i, 1) for i in range(1, 11)]


def fake(t: Trial) -> Measurement:
    """A power-law GPU: latency grows with batch, falls with quota."""
    lat = 10 * t.batch ** 0.7 / t.quota ** 0.8
    return Measurement(latency_ms=lat, throughput_rps=t.batch / lat * 1000)


def drive(search, answer):
    asked = []
    while (t := search.next_trial()) is not None:
        assert t not in asked, "a measured trial was asked again"
        asked.append(t)
        search.record(t, answer(t))
    return search.result(), asked


def test_profile_search_composes_search_knee_and_the_trial_at_the_limit():
    res, asked = drive(ProfileSearch("inference", BATCH_GRID, QUOTA_GRID, slo_ms=200), fake)
    assert res.trials == len(asked)
    assert fake(Trial(res.request_setting, res.batch_size)).latency_ms <= 100  # half the SLO
    assert res.limit_quota >= res.request_quota and res.burst_batch >= res.batch_size
    at_limit = Trial(res.limit_setting, res.burst_batch)
    assert at_limit in asked, "the burst batch was measured at the limit"
    assert (res.limit_latency_ms, res.limit_throughput_rps) == (fake(at_limit).latency_ms,
                                                                 fake(at_limit).throughput_rps)
    # the knee: the smallest quota at which the burst batch gets 0.8 x its full-GPU throughput
    full = fake(Trial((1.0,), res.burst_batch)).throughput_rps
    knee = min(q for q in QUOTAS if fake(Trial((q,), res.burst_batch)).throughput_rps >= 0.8 * full)
    assert res.limit_quota == max(knee, res.request_quota)
    p = res.to_profile("f", "fake")
    assert p.limit_latency_ms == res.limit_latency_ms and p.trials == res.trials


def test_profile_search_protocol_and_arguments():
    s = ProfileSearch("inference", [1, 2], [0.5, 1.0], slo_ms=100)
    s.next_trial()
    with pytest.raises(SearchProtocolError):
        s.record(Trial((0.7,), 1), Measurement(1, 1))
    with pytest.raises(RuntimeError):
        s.result()
    for kwargs in ({"kind": "batch"}, {"grid_batches": []}, {"grid_quotas": []}, {"queueing_budget": 0}):
        args = {"kind": "inference", "grid_batches": [1], "grid_quotas": [1.0], "slo_ms": 10, **kwargs}
        with pytest.raises(ValueError):
            ProfileSearch(**args)


@pytest.mark.parametrize(("model", "factor"), [("resnet152", 3), ("bert_base", 5), ("gpt2_large", 2), ("llama2", 5)])
def test_service_and_cli_produce_the_same_profile_for_the_same_surface(model, factor):
    """`dilu profile --surface` and the profiler service (surface backend) run one procedure."""
    slo = factor * models.latency_ms(model, 1, 1.0)
    spec = FunctionSpec(name="f", model=model, slo_ms=slo, max_batch=max(BATCH_GRID))
    live = asyncio.run(ProfilerService(backend="surface")._search(spec))
    offline = profile_surface(SURFACES_DIR / models.spec(model).surface, slo)
    for field in ("request_quota", "limit_quota", "batch_size", "burst_batch", "trials", "latency_ms",
                  "throughput_rps", "limit_latency_ms", "limit_throughput_rps"):
        assert getattr(live, field) == pytest.approx(offline[field]), field


# ----------------------------------------------------------------------------- training


def test_training_finds_the_true_minimum_past_a_dip():
    """Throughput meets the target at 0.4, dips at 0.5 and 0.6: the answer is 0.4 (a binary search said 0.7)."""
    thr = dict(zip(QUOTAS, [10, 40, 80, 99, 60, 70, 99, 99.5, 100, 100]))
    res, asked = drive(TrainingSearch(QUOTAS), lambda t: Measurement(1.0, thr[t.quota]))
    assert res.request_quota == 0.4
    assert res.limit_quota == 0.9
    assert len(asked) == 10  # the full GPU, then 0.1 .. 0.9


@given(curve=st.lists(st.floats(0.0, 1000.0), min_size=10, max_size=10), threshold=st.floats(0.5, 1.0),
       extra=st.floats(0.0, 0.5))
@settings(max_examples=200, deadline=None)
def test_training_returns_the_smallest_quota_meeting_the_target_on_any_curve(curve, threshold, extra):
    """Guarantee: request = min{q : thr(q) ≥ threshold·thr(full)}, every smaller quota measured and
    missing it; limit = min{q ≥ request : thr(q) ≥ limit_threshold·thr(full)}; ≤ len(grid) trials;
    no throughput on the full GPU -> NoThroughput."""
    thr = dict(zip(QUOTAS, curve))
    limit_threshold = min(1.0, threshold + extra)
    search = TrainingSearch(QUOTAS, threshold=threshold, limit_threshold=limit_threshold)
    if thr[1.0] == 0:
        with pytest.raises(NoThroughput, match="no throughput"):
            drive(search, lambda t: Measurement(1.0, thr[t.quota]))
        return
    res, asked = drive(search, lambda t: Measurement(1.0, thr[t.quota]))
    measured = {t.quota for t in asked}
    target = threshold * thr[1.0]
    assert thr[res.request_quota] >= target
    assert all(q in measured and thr[q] < target for q in QUOTAS if q < res.request_quota)
    assert res.request_quota == min(q for q in QUOTAS if thr[q] >= target)
    assert res.limit_quota == min(q for q in QUOTAS if q >= res.request_quota and thr[q] >= limit_threshold * thr[1.0])
    assert len(asked) <= len(QUOTAS)


def test_training_profile_without_throughput_is_an_error_reply(monkeypatch):
    """All-zero throughput: ValueError with a one-line message; the service answers an error reply."""
    search = ProfileSearch("training", [8], QUOTAS)
    with pytest.raises(NoThroughput) as err:
        drive(search, lambda t: Measurement(1.0, 0.0))
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)

    async def zero(self, trial):
        return Measurement(1.0, 0.0)

    monkeypatch.setattr(service_mod._SurfaceAsync, "run", zero)
    spec = FunctionSpec(name="t", model="resnet152", kind="training", max_batch=8)
    assert search_for(spec).kind == "training"
    reply = asyncio.run(ProfilerService(backend="surface")._on_request(ProfileRequest(spec=spec), None))
    assert not reply.ok and reply.error.startswith("NoThroughput") and "no throughput" in reply.error
