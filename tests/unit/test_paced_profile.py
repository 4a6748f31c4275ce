"""Profile what is deployed: an instance runs at SM width = its limit, paced by tokens to its
request, so the profile's request quota is searched in that configuration (issue 12, item 3)."""
from __future__ import annotations

import json

import msgspec
import pytest
from click.testing import CliRunner

from dilu.contracts.events import TrialRequest
from dilu.services.common import models
from dilu.services.node_agent.trial import busy_fraction
from dilu.services.profiler.cli import profile, profile_surface
from dilu.services.profiler.policy import (
    QUEUEING_BUDGET,
    QUOTA_GRID,
    Measurement,
    ProfileSearch,
    Trial,
)
from dilu.services.profiler.surface import SURFACES_DIR, SurfaceBackend, load_surface


def flat_gpu(t: Trial) -> Measurement:
    """A model whose latency does not improve with SMs (10 ms per batch item at any width) but
    whose throughput knee is at 0.6 (throughput stops growing there), paced by the shared rule."""
    width = t.quota
    lat = 10.0 * t.batch / min(1.0, 0.4 + width) * models.pacing_stretch(width, t.rate)
    return Measurement(latency_ms=lat, throughput_rps=t.batch / lat * 1000)


def drive(search, answer):
    asked = []
    while (t := search.next_trial()) is not None:
        asked.append(t)
        search.record(t, answer(t))
    return search.result(), asked


def test_search_raises_the_request_when_the_paced_trial_misses():
    old, _ = drive(ProfileSearch("inference", [1], QUOTA_GRID, slo_ms=40, deployed=False), flat_gpu)
    new, asked = drive(ProfileSearch("inference", [1], QUOTA_GRID, slo_ms=40), flat_gpu)
    bound = 40 * QUEUEING_BUDGET
    assert old.limit_quota > old.request_quota  # the case: a limit wider than the request
    # as deployed, the old request misses the bound: it was measured at width = grant
    paced_old = flat_gpu(Trial(old.limit_setting, old.batch_size, old.request_quota))
    assert paced_old.latency_ms > bound
    # the search tried the deployed configuration and went up the grid until it fit
    paced = [t for t in asked if t.grant is not None]
    assert paced and paced[0] == Trial(new.limit_setting, new.batch_size, old.request_quota)
    assert [t.grant for t in paced] == sorted(t.grant for t in paced)
    assert old.request_quota < new.request_quota <= new.limit_quota == old.limit_quota
    as_deployed = flat_gpu(Trial(new.limit_setting, new.batch_size,
                                 None if new.request_quota == new.limit_quota else new.request_quota))
    assert as_deployed.latency_ms <= bound
    assert new.latency_ms == as_deployed.latency_ms and new.te == pytest.approx(as_deployed.throughput_rps
                                                                              / new.request_quota)
    # the grant just below the chosen one missed: the request is the smallest that fits
    below = [t for t in paced if t.rate < new.request_quota]
    assert all(flat_gpu(t).latency_ms > bound for t in below)


def test_request_kept_when_the_paced_trial_fits():
    def sm_bound(t: Trial) -> Measurement:  # latency ∝ 1 / width: pacing to the request costs nothing extra
        lat = 2.0 * t.batch / t.rate
        return Measurement(latency_ms=lat, throughput_rps=t.batch / lat * 1000)

    old, _ = drive(ProfileSearch("inference", [1, 2], QUOTA_GRID, slo_ms=40, deployed=False), sm_bound)
    new, _ = drive(ProfileSearch("inference", [1, 2], QUOTA_GRID, slo_ms=40), sm_bound)
    assert (new.request_quota, new.batch_size, new.limit_quota) == (old.request_quota, old.batch_size,
                                                                   old.limit_quota)


def test_old_format_trial_request_still_decodes_unpaced():
    old = b'{"ts_ns": 0, "model": "resnet152", "batch": 4, "quota": 0.5, "repeats": 3, "gpu": -1}'
    req = msgspec.json.decode(old, type=TrialRequest)
    assert req.grant == 0.0 and req.quota == 0.5
    assert busy_fraction(req) == 1.0  # no pacing: grant = width = quota
    assert busy_fraction(TrialRequest(model="m", batch=1, quota=0.6, grant=0.3)) == pytest.approx(0.5)
    assert busy_fraction(TrialRequest(model="m", batch=1, quota=0.3, grant=0.6)) == 1.0


def test_paced_latency_model():
    base = models.latency_ms("resnet152", 1, 0.6)
    assert models.paced_latency_ms("resnet152", 1, 0.6, 0.3) == pytest.approx(2 * base)
    assert models.paced_latency_ms("resnet152", 1, 0.6, 0.6) == base
    assert models.paced_latency_ms("resnet152", 1, 0.6, 0.9) == base  # a grant above the width buys nothing
    for width, grant in ((0.0, 0.5), (0.5, 0.0), (1.2, 0.5), (0.5, -1)):
        with pytest.raises(ValueError):
            models.pacing_stretch(width, grant)
    # the surface backend answers a paced trial with the same rule
    surf = load_surface(SURFACES_DIR / models.spec("resnet152").surface)
    m = SurfaceBackend(surf).run(Trial((0.6,), 1, 0.3))
    assert m.latency_ms == pytest.approx(surf.measure((0.6,), 1).latency_ms * 2)


def test_dilu_profile_resnet152_request_meets_the_bound_as_deployed(tmp_path):
    path = SURFACES_DIR / models.spec("resnet152").surface
    slo = models.default_slo_ms("resnet152")
    out = tmp_path / "p.json"
    res = CliRunner().invoke(profile, ["--surface", str(path), "--slo-ms", str(slo), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "TE: throughput efficacy" in res.output  # the legend defines every column
    r = json.loads(out.read_text())
    paced = models.paced_latency_ms("resnet152", r["batch_size"], r["limit_quota"], r["request_quota"])
    assert paced <= r["batch_latency_bound_ms"] + 1e-9
    assert r["latency_ms"] == pytest.approx(paced)
    # the request as measured at width = grant (before) misses as deployed
    old = profile_surface(path, slo, deployed=False)
    assert old["request_quota"] < r["request_quota"]
    assert models.paced_latency_ms("resnet152", old["batch_size"], old["limit_quota"],
                                   old["request_quota"]) > r["batch_latency_bound_ms"]


def test_the_table_names_every_surface_whole_within_100_columns():
    from dilu.services.profiler.surface import surface_files

    res = CliRunner().invoke(profile, [])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 100
    rows = [line.split() for line in lines]
    for path in surface_files():
        assert any(row and row[0] == path.stem for row in rows), path.stem  # not cut to "mobilenet_v…"


def test_a_batch_under_the_token_bucket_tends_to_the_first_order_model_when_long():
    """Long batches (many bursts' worth) take busy / rate; short ones after an idle gap ride the
    burst and finish sooner, never sooner than their busy time; an unpaced one takes its busy time
    times the stretch."""
    long_ms, _ = models.bucket_paced_ms(400.0, 100, 0.5, models.BURST_MS)
    assert long_ms == pytest.approx(400.0 / 0.5, rel=0.02)
    short_ms, left = models.bucket_paced_ms(21.25, 10, 0.5, models.BURST_MS)
    assert 21.25 < short_ms < 21.25 / 0.5 - 4.0  # the burst and the last kernel's run are saved
    want = min(2.125, models.BURST_MS / 2)  # a throttled launch waits for its cost, at most half the burst
    assert short_ms == pytest.approx((21.25 - 2.125 - models.BURST_MS + want) / 0.5 + 2.125)
    assert left < 0  # the bucket ends in debt: the next batch right after waits for it
    empty_ms, _ = models.bucket_paced_ms(21.25, 10, 0.5, left)
    assert empty_ms > short_ms
    assert models.bucket_paced_ms(10.0, 5, 1.0, 0.0, stretch=1.5)[0] == pytest.approx(15.0)
    with pytest.raises(ValueError):
        models.bucket_paced_ms(10.0, 0, 0.5, 0.0)
    with pytest.raises(ValueError):
        models.bucket_paced_ms(10.0, 5, 1.5, 0.0)
    for bad in ({"busy_ms": -1.0}, {"busy_ms": float("nan")}, {"balance_ms": float("nan")},
                {"balance_ms": float("inf")}, {"stretch": 0.5}, {"free_ms": -1.0}):
        with pytest.raises(ValueError):
            models.bucket_paced_ms(**{"busy_ms": 10.0, "kernels": 5, "rate": 0.5, "balance_ms": 0.0, **bad})
    for at in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            models.bucket_charged(10.0, 5, 0.5, 0.0, at)
    for kernels in (0, 2.5, True, models.MAX_KERNELS + 1):
        with pytest.raises(ValueError):
            models.bucket_paced_ms(10.0, kernels, 0.5, 0.0)
    for rate, cost in ((0.0, 1.0), (-1.0, 1.0), (1.5, 1.0), (float("nan"), 1.0), (0.5, -5.0), (0.5, float("nan"))):
        with pytest.raises(ValueError):
            models.launch_threshold_ms(cost, rate)
    # a bucket holds at most its depth: a larger balance is a full bucket, not a longer burst
    assert models.bucket_paced_ms(10.0, 10, 0.5, 1e9) == models.bucket_paced_ms(10.0, 10, 0.5, models.BURST_MS)
    assert models.bucket_charged(10.0, 10, 0.5, 1e9, 0.0) == models.bucket_charged(10.0, 10, 0.5, models.BURST_MS, 0.0)



@pytest.mark.parametrize("at_ms", [0.0, 1.0, 2.25, 5.0, 17.3, 36.25, 50.0])
@pytest.mark.parametrize("rate,balance,stretch", [(0.5, models.BURST_MS, 1.0), (0.3, -1.0, 1.4), (1.0, models.BURST_MS, 1.6)])
def test_a_batch_split_where_it_stands_ends_as_the_whole_when_the_rate_holds(at_ms, rate, balance, stretch):
    """Where a batch stands at any instant (kernels charged, balance, device free) and the rest
    timed from there at the same rate end it when timing it whole does: the state a grant
    written mid-batch starts from is the bucket's own."""
    whole, left = models.bucket_paced_ms(21.25, 10, rate, balance, stretch)
    charged, bal, free = models.bucket_charged(21.25, 10, rate, balance, at_ms, stretch)
    assert 0 <= charged <= 10 and free <= whole + 1e-9
    if charged < 10:
        rest, left_rest = models.bucket_paced_ms(21.25 * (10 - charged) / 10, 10 - charged, rate, bal, stretch,
                                                  free_ms=max(0.0, free - at_ms))
        assert at_ms + rest == pytest.approx(whole) and left_rest == pytest.approx(left)
    else:
        assert free == pytest.approx(whole)


def test_a_launch_past_the_floor_waits_for_its_cost_or_the_least_refill():
    """Paced, a launch finding the bucket in debt waits until it holds the kernel's cost, at most
    half the burst and at least ``MIN_WAIT_MS`` x rate of refill; unpaced, launches run a burst
    ahead (interceptor.c, admit)."""
    assert models.launch_threshold_ms(2.5, 0.5) == (0.0, models.BURST_MS / 2)
    assert models.launch_threshold_ms(0.3, 0.5) == (0.0, 0.3)
    assert models.launch_threshold_ms(0.01, 0.5) == (0.0, pytest.approx(models.MIN_WAIT_MS * 0.5))
    floor, want = models.launch_threshold_ms(2.5, 1.0)
    assert floor == -models.BURST_MS and want == pytest.approx(-models.BURST_MS + models.MIN_WAIT_MS)
