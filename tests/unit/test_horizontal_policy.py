"""Horizontal scaling policy: windows, lazy scale-out, keep-alive, pre-warm, zero; fake clock (s)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu.services.horizontal_scaler.policy import (
    FunctionParams,
    HorizontalConfig,
    HorizontalPolicy,
    IdleTimeHistogram,
    IdleWindows,
    InstanceShare,
    burst_reach,
    horizontal_policy,
    vertical_headroom,
)

FN = "f"


def policy(**kw) -> HorizontalPolicy:
    params = kw.pop("params", FunctionParams(target=1.0, max_instances=20))
    p = HorizontalPolicy(HorizontalConfig(**{"stable_window_s": 6.0, "panic_window_s": 1.0, **kw}))
    p.add_function(FN, params)
    return p


def feed(p, t0, t1, backlog, tick=0.5, headroom=0.0, reach=None):
    """Record ``backlog`` every tick in (t0, t1] and decide; returns the decisions."""
    out, t = [], t0
    while t < t1 - 1e-9:
        t = round(t + tick, 6)
        b = backlog(t) if callable(backlog) else backlog
        p.record(FN, t, b, 1 if b > 0 else 0)  # a request arrives each tick while there is load
        out.append(p.decide(FN, t, headroom, reach=reach))
    return out


def ready(p, n, t=0.0):
    for k in range(n):
        p.instance_ready(FN, f"w{k}", t)


# ---------------------------------------------------------------------- from zero, unknown backlog


def test_backlog_with_no_instance_scales_from_zero_within_one_tick():
    p = policy()
    feed(p, 0.0, 5.0, 0)
    p.record(FN, 5.5, 1)  # one request left unacknowledged by an instance that died
    d = p.decide(FN, 5.5)
    assert d.current == 0 and d.place >= 1 and d.direction == "out"


def test_unknown_backlog_holds_the_current_count():
    p = policy(mode="eager")
    ready(p, 3)
    for t in (0.5, 1.0, 1.5, 2.0):
        p.record(FN, t, None)  # consumer missing or misnamed
        d = p.decide(FN, t)
        assert (d.desired, d.place, d.retire) == (3, 0, [])
        assert "unknown" in d.reason
    assert p.instances(FN) == {"w0": "ready", "w1": "ready", "w2": "ready"}


def test_unknown_backlog_with_stored_requests_and_no_instance_starts_exactly_one():
    p = policy(mode="eager")
    for t in (0.5, 1.0, 1.5):
        p.record(FN, t, None, stored=40)
        d = p.decide(FN, t)
        if t == 0.5:
            assert (d.desired, d.place) == (1, 1)
            p.instance_starting(FN, "only", t)
        else:
            assert (d.desired, d.place, d.retire) == (1, 0, [])  # held at one, never the maximum


def test_unknown_backlog_still_honours_min_instances():
    p = policy(mode="eager", params=FunctionParams(target=1.0, min_instances=2, max_instances=8))
    p.record(FN, 0.5, None)
    d = p.decide(FN, 0.5)
    assert (d.desired, d.place) == (2, 2)


def test_bad_observations_are_clear_errors():
    p = policy()
    with pytest.raises(ValueError, match="backlog"):
        p.record(FN, 1.0, -1)
    with pytest.raises(KeyError, match="nope"):
        p.record("nope", 1.0, 1)
    with pytest.raises(ValueError, match="mode"):
        HorizontalConfig(mode="sometimes")
    with pytest.raises(ValueError, match="panic window"):
        HorizontalConfig(stable_window_s=5.0, panic_window_s=10.0)
    with pytest.raises(ValueError, match="target"):
        FunctionParams(target=0.0)


# ---------------------------------------------------------------------- lazy versus eager


def test_lazy_waits_for_vertical_headroom_eager_does_not():
    for mode, headroom, expect_place in (("lazy", 0.4, False), ("lazy", 0.0, True), ("eager", 0.4, True)):
        p = policy(mode=mode, panic_window_s=3.0)
        ready(p, 2)
        ds = feed(p, 0.0, 2.0, 8, headroom=headroom)
        assert any(d.place for d in ds) == expect_place, (mode, headroom)
        if not expect_place:
            assert "lazy" in ds[-1].reason


def test_lazy_gives_up_on_headroom_that_is_never_used():
    p = policy(mode="lazy", panic_window_s=2.0)
    ready(p, 2)
    ds = feed(p, 0.0, 5.0, 8, headroom=0.4)
    first = next(d for d in ds if d.place)
    assert 2.0 <= first.now_s <= 3.0  # after one panic window of holding
    assert "unused" in first.reason


def test_lazy_sizes_instances_by_their_burst_capacity_eager_by_the_request():
    sized = FunctionParams(target=4.0, burst_target=12.0, instance_rps=30.0, burst_rps=90.0, max_instances=20)
    out = {}
    for mode in ("lazy", "eager"):
        p = policy(mode=mode, params=sized, panic_window_s=1.0)
        ready(p, 1)
        ds = feed(p, 0.0, 8.0, 10)  # 10 in flight: over 4 (request), under 12 (burst)
        out[mode] = ds[-1].desired
        breaches = [d.breach for d in ds if d.breach]
        assert bool(breaches) == (mode == "eager")
        if breaches:
            assert breaches[0].capacity_rps == 30.0
    assert out == {"lazy": 1, "eager": 4}  # eager: 10 / (4 x the 70 % target utilisation), rounded up
    p = policy(mode="lazy", params=sized, panic_window_s=1.0)
    ready(p, 1)
    assert feed(p, 0.0, 8.0, 30)[-1].desired == 3  # past the burst capacity it scales out
    assert FunctionParams(target=4.0).sizing("lazy") == (4.0, 0.0)  # no burst measurement: the request
    with pytest.raises(ValueError, match="burst_target"):
        FunctionParams(burst_target=-1.0)


def test_a_function_without_vertical_headroom_scales_at_the_target_utilisation_an_elastic_one_at_its_burst():
    """Lazy scaling leans on vertical headroom: a rigid function (no more capacity at its limit
    than at its request, as BERT-base) has none, so it keeps Knative's 30 % in-flight buffer; an
    elastic one's buffer is its headroom to the limit."""
    rigid = FunctionParams(target=4.0, burst_target=4.0, max_instances=20)
    elastic = FunctionParams(target=4.0, burst_target=12.0, max_instances=20)
    out = {}
    for name, params in (("rigid", rigid), ("elastic", elastic)):
        for u in (0.7, 1.0):
            p = policy(mode="lazy", params=params, target_utilization=u)
            ready(p, 1)
            out[name, u] = feed(p, 0.0, 8.0, 4)[-1].desired  # 4 in flight: one rigid instance's whole target
    assert out == {("rigid", 0.7): 2, ("rigid", 1.0): 1, ("elastic", 0.7): 1, ("elastic", 1.0): 1}
    assert rigid.scaling_target("lazy", 1.0, 0.7) == pytest.approx(2.8)
    assert elastic.scaling_target("lazy", 0.5, 0.7) == pytest.approx(8.0)  # halfway to its burst, whole
    assert elastic.scaling_target("kpa", 1.0, 0.7) == pytest.approx(2.8)  # the baselines have no headroom
    for bad in (0.0, -0.5, 1.01, float("nan")):
        with pytest.raises(ValueError, match="target_utilization"):
            HorizontalConfig(target_utilization=bad)


# ---------------------------------------------------------------------- scale in and victims


def test_scale_in_only_after_the_stable_window_stays_low_and_picks_idle_newest_first():
    p = policy(mode="eager", stable_window_s=6.0, panic_window_s=1.0, keep_alive_s=1000.0, target_utilization=1.0)
    ready(p, 2)
    p.instance_ready(FN, "busy", 0.0)
    p.instance_ready(FN, "new", 1.0)
    p.instance_starting(FN, "cold", 2.0)
    ds = feed(p, 0.0, 3.0, 5)
    assert not any(d.retire for d in ds)
    p.set_busy(FN, "busy", 0.9)
    p.set_busy(FN, "w0", 0.2)
    p.set_busy(FN, "w1", 0.1)
    ds = feed(p, 3.0, 20.0, 1)
    retired = [(d.now_s, i) for d in ds for i in d.retire]
    assert retired and retired[0][0] > 3.0 + 0.5  # not on the first low sample
    live_at = {d.now_s: d.current - len(d.retire) for d in ds}
    assert live_at[4.0] >= 4 and live_at[5.0] >= 3  # down gradually, as the stable window empties
    assert live_at[20.0] == 1
    order = [i for _, i in retired]
    assert order[0] == "cold"  # starting first
    assert order.index("new") < order.index("w1") < order.index("w0")  # idle newest first
    assert "busy" not in order  # the busy one keeps serving (target 1 in flight: 1 instance left)
    assert p.instances(FN)["busy"] == "ready"


def test_failed_retirement_is_counted_back():
    p = policy(mode="eager", keep_alive_s=0.5)
    ready(p, 2)
    feed(p, 0.0, 1.0, 1)
    ds = feed(p, 1.0, 10.0, 0)
    victims = [i for d in ds for i in d.retire]
    assert victims
    p.retire_failed(FN, victims[0])
    assert p.instances(FN)[victims[0]] == "ready"


# ---------------------------------------------------------------------- keep-alive, pre-warm, zero


def test_idle_function_keeps_one_instance_for_the_keep_alive_then_scales_to_zero():
    p = policy(mode="eager", keep_alive_s=10.0)
    ds = feed(p, 0.0, 3.0, 2)  # activity: scales out from zero
    assert sum(d.place for d in ds) >= 2
    for d in ds:
        for _ in range(d.place):
            p.instance_ready(FN, f"n{d.now_s}-{_}", d.now_s)
    ds = feed(p, 3.0, 20.0, 0)
    alive = [(d.now_s, d.desired) for d in ds]
    assert all(n >= 1 for t, n in alive if t < 3.0 + 10.0)
    zero = [d for d in ds if d.direction == "zero"]
    assert len(zero) == 1 and 13.0 <= zero[0].now_s <= 13.5
    assert all(n == 0 for t, n in alive if t > 13.5)
    assert not any(d.breach for d in ds)  # idle: the old load in the windows is no burst
    assert all(s == "draining" for s in p.instances(FN).values())


def test_a_long_request_keeps_its_instance_past_the_keep_alive():
    p = policy(mode="eager", keep_alive_s=10.0)
    ready(p, 1)
    ds = feed(p, 0.0, 60.0, 1)  # one request in flight for 60 s: backlog 1 throughout
    assert not any(d.retire for d in ds)


def test_histogram_windows_follow_the_head_and_tail_percentiles():
    h = IdleTimeHistogram(bin_s=1.0, range_s=120.0, min_samples=10)
    for k in range(40):
        h.add(30.0 + (k % 3) * 0.4)  # idle times 30.0 .. 30.8 s
    w = h.windows(fallback_keep_alive_s=600.0)
    assert w.representative
    assert w.prewarm_s == pytest.approx(30.0 * 0.9)
    assert w.keep_alive_s == pytest.approx(31.0 * 1.1 - 27.0)


def test_histogram_falls_back_to_the_fixed_keep_alive_when_not_representative():
    few = IdleTimeHistogram(bin_s=1.0, range_s=120.0, min_samples=10)
    for _ in range(5):
        few.add(30.0)
    flat = IdleTimeHistogram(bin_s=1.0, range_s=120.0, min_samples=10)
    for k in range(240):
        flat.add(k % 120 + 0.5)  # uniform over the range: CV 0
    far = IdleTimeHistogram(bin_s=1.0, range_s=120.0, min_samples=10)
    for _ in range(20):
        far.add(1000.0)
    for h in (few, flat, far):
        assert h.windows(77.0) == IdleWindows(0.0, 77.0, False)
    with pytest.raises(ValueError):
        few.add(-1.0)


def test_prewarm_unloads_after_use_and_loads_again_before_the_expected_arrival():
    p = policy(mode="eager", idle_bin_s=1.0, idle_range_s=120.0, histogram_min_samples=5, keep_alive_s=600.0,
               idle_grace_s=1.0)
    ready(p, 1)
    t = 0.0
    for _ in range(8):  # a function invoked every ~20 s: busy 1 s, idle 20 s
        feed(p, t, t + 1.0, 1)
        feed(p, t + 1.0, t + 21.0, 0)
        t += 21.0
        for iid, state in p.instances(FN).items():
            if state == "draining":
                p.instance_retired(FN, iid)
        if not p.instances(FN):
            p.instance_ready(FN, f"r{t}", t)
    w = p.idle_windows(FN)
    assert w.representative and w.prewarm_s == pytest.approx(18.0)
    feed(p, t, t + 1.0, 1)
    ds = feed(p, t + 1.0, t + 21.0, 0)
    zero = next(d for d in ds if d.direction == "zero")
    assert zero.now_s - (t + 1.0) <= 1.5  # unloaded right after use (after the grace)
    p.instance_retired(FN, zero.retire[0])
    warm = next(d for d in ds if d.direction == "prewarm")
    assert warm.place == 1 and 18.0 <= warm.now_s - (t + 1.0) <= 19.0  # back before the ~20 s arrival


def test_never_invoked_function_is_not_prewarmed():
    p = policy(mode="eager", keep_alive_s=5.0)
    ds = feed(p, 0.0, 30.0, 0)
    assert not any(d.place for d in ds)


def test_deployed_function_gets_its_initial_scale_then_keep_alive_applies():
    p = policy(mode="eager", initial_scale=2, keep_alive_s=10.0)
    p.deployed(FN, 0.0)
    d = feed(p, 0.0, 0.5, 0)[0]
    assert (d.desired, d.place, d.direction) == (2, 2, "prewarm") and "initial scale" in d.reason
    p.instance_ready(FN, "w0", 0.5)
    p.instance_ready(FN, "w1", 0.5)
    held = feed(p, 0.5, 10.0, 0)
    assert all(x.desired == 2 and not x.retire for x in held)  # never invoked: kept for the keep-alive
    gone = feed(p, 10.0, 11.0, 0)
    zero = next(x for x in gone if x.direction == "zero")  # 10 s after the first was ready
    assert zero.now_s == 10.5 and len(zero.retire) == 2 and "keep-alive" in zero.reason


def test_wait_for_the_first_request_is_not_an_idle_time():
    p = policy(mode="eager", keep_alive_s=100.0)
    p.deployed(FN, 0.0)
    ready(p, 1)
    feed(p, 0.0, 5.0, 0)
    feed(p, 5.0, 6.0, 3)  # first requests: the function is in use, no longer fresh
    assert p._fn(FN).histogram.samples == 0
    p.deployed(FN, 6.0)  # a later ProfileReady (redeploy) does not make it fresh again
    feed(p, 6.0, 8.0, 0)
    feed(p, 8.0, 9.0, 2)
    assert p._fn(FN).histogram.samples == 1  # the real idle gap (about 2 s) is recorded


def test_initial_scale_zero_leaves_a_new_function_at_zero():
    p = policy(mode="eager", initial_scale=0)
    p.deployed(FN, 0.0)
    assert all(d.desired == 0 and not d.place for d in feed(p, 0.0, 3.0, 0))
    with pytest.raises(ValueError, match="initial_scale"):
        HorizontalConfig(initial_scale=-1)
    with pytest.raises(KeyError, match="nope"):
        p.deployed("nope", 0.0)


# ---------------------------------------------------------------------- burst-window breach


def test_breach_when_load_exceeds_capacity_at_most_once_per_interval():
    p = policy(mode="lazy", params=FunctionParams(target=2.0, max_instances=20, instance_rps=4.0))
    ready(p, 2)
    quiet = feed(p, 0.0, 3.0, 3, headroom=0.5)  # 3 in flight < 2 x 2: no breach
    assert not any(d.breach for d in quiet)
    hot = feed(p, 3.0, 6.0, 12, headroom=0.5)
    breaches = [d.breach for d in hot if d.breach]
    assert 2 <= len(breaches) <= 4  # one per panic window (1 s) over 3 s
    b = next(b for b in breaches if b.panic)
    assert b.window_s == 1.0 and b.capacity_rps == 8.0 and b.queue_depth == 12
    assert b.rate_rps == pytest.approx(2.0)  # 1 arrival per 0.5 s tick


def test_lazy_sizes_by_the_share_the_gpus_can_give():
    """On a GPU whose requests are full (reach 0) an instance never rises above its request: it
    is sized there, and the burst that its limit could absorb elsewhere scales out."""
    sized = FunctionParams(target=4.0, burst_target=12.0, instance_rps=30.0, burst_rps=90.0, max_instances=20)
    assert sized.sizing("lazy", 0.0) == (4.0, 30.0)
    assert sized.sizing("lazy", 0.5) == (8.0, 60.0)
    assert sized.sizing("lazy", 2.0) == sized.sizing("lazy") == (12.0, 90.0)  # clamped to 0..1
    assert sized.sizing("eager", 0.5) == (4.0, 30.0)
    desired = {}
    for reach in (1.0, 0.5, 0.0):
        p = policy(mode="lazy", params=sized, panic_window_s=1.0)
        ready(p, 1)
        ds = feed(p, 0.0, 8.0, 10, reach={"w0": reach})  # 10 in flight
        desired[reach] = ds[-1].desired
        assert any(d.breach for d in ds) == (reach < 1.0)
        # the decision says what it was sized by (the scaler's debug tick line logs both)
        assert ds[0].reach == reach and ds[0].target == sized.sizing("lazy", reach)[0]
    assert desired == {1.0: 1, 0.5: 2, 0.0: 3}


def test_lazy_sizes_by_the_least_reach_and_retires_the_instance_that_cannot_rise():
    """Two instances, one on a full GPU (reach 0): 6 in flight are more than it serves at its
    request, so two are kept while it stays; when load falls, it is the one retired."""
    sized = FunctionParams(target=4.0, burst_target=12.0, instance_rps=30.0, burst_rps=90.0, max_instances=20)
    reach = {"w0": 1.0, "w1": 0.0}
    p = policy(mode="lazy", params=sized, panic_window_s=1.0)
    ready(p, 2)
    assert all(d.desired == 2 and not d.retire for d in feed(p, 0.0, 12.0, 6, reach=reach))
    ds = feed(p, 12.0, 30.0, 2, reach=reach)  # 2 in flight: one instance at its request serves it
    assert [d.retire for d in ds if d.retire] == [["w1"]]
    p = policy(mode="eager", params=sized, panic_window_s=1.0)  # no burst sizing: reach is ignored
    ready(p, 2)
    ds = feed(p, 0.0, 30.0, 2, reach=reach)
    assert [d.retire for d in ds if d.retire] == [["w0"]]  # the newest of equally idle ones


def test_burst_reach_is_the_part_of_the_limit_the_gpus_can_grant():
    gpus = {
        0: [InstanceShare("a", "f", "latency-sensitive", 0.5, 0.5, 0.9),  # requests fill the GPU
            InstanceShare("b", "g", "latency-sensitive", 0.5, 0.5, 0.5)],
        1: [InstanceShare("c", "f", "latency-sensitive", 0.3, 0.3, 0.7),  # 0.2 free of its 0.4
            InstanceShare("d", "h", "latency-sensitive", 0.5, 0.3, 0.7)],  # 0.2 up, 0.2 free
        2: [InstanceShare("e", "k", "latency-sensitive", 0.2, 0.2, 0.6),
            InstanceShare("t", "train", "training", 0.8, 0.2, 0.8)],  # gives back all above 0.2
        3: [InstanceShare("m", "u", "latency-sensitive", 0.5, 0.3, 0.7),  # 0.2 up, nothing free
            InstanceShare("n", "v", "latency-sensitive", 0.5, 0.5, 0.5)],
    }
    r = burst_reach(gpus)
    assert r["a"] == 0.0  # its GPU's requests sum to 1
    assert r["c"] == pytest.approx(0.5)  # 0.2 free of its 0.4
    assert r["b"] == 1.0  # no limit above its request: sized as before
    assert r["d"] == pytest.approx(1.0)  # 0.2 up, and the 0.2 free
    assert r["m"] == pytest.approx(0.5)
    assert r["e"] == 1.0  # training yields the whole span
    assert burst_reach({0: gpus[0], 1: [InstanceShare("a", "f", "latency-sensitive", 0.5, 0.5, 0.9)]})["a"] == 0.0


# ---------------------------------------------------------------------- vertical headroom


def test_vertical_headroom_counts_only_what_the_gpu_can_give():
    gpus = {
        0: [InstanceShare("a", "f", "latency-sensitive", 0.3, 0.3, 0.6),
            InstanceShare("b", "g", "best-effort", 0.2, 0.2, 0.4),
            InstanceShare("c", "h", "training", 0.5, 0.3, 0.6)],
        1: [InstanceShare("d", "f", "latency-sensitive", 0.6, 0.3, 0.6)],
    }
    h = vertical_headroom(gpus)
    assert h["f"] == pytest.approx(0.3)  # a: up to its limit, from be (0.2) + training above request (0.2)
    assert h["h"] == pytest.approx(0.1)  # training: GPU full, up to its limit from best-effort
    assert h["g"] == pytest.approx(0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.booleans()), min_size=1, max_size=60),
       st.integers(1, 10))
def test_desired_stays_within_bounds_and_unknown_never_scales(samples, max_n):
    p = policy(mode="eager", params=FunctionParams(target=1.0, max_instances=max_n))
    t = 0.0
    for backlog, known in samples:
        t += 0.5
        before = sum(1 for s in p.instances(FN).values() if s != "draining")
        p.record(FN, t, backlog if known else None)
        d = p.decide(FN, t)
        assert 0 <= d.desired <= max_n
        if not known:
            assert d.desired == before and not d.place and not d.retire
        if known and backlog >= 1:
            assert d.desired >= 1
        for k in range(d.place):
            p.instance_starting(FN, f"i{t}-{k}", t)


def test_surplus_donor_is_the_function_with_most_ready_instances():
    from dilu.services.horizontal_scaler.policy import HorizontalPolicy

    pol = HorizontalPolicy()
    for name in ("a", "b", "starved"):
        pol.add_function(name)
    pol.instance_starting("a", "a1", 0.0)
    pol.instance_ready("a", "a1", 1.0)
    assert pol.surplus_donor("starved") is None  # a single instance is never a surplus
    for i in range(2, 4):
        pol.instance_starting("b", f"b{i}", 0.0)
        pol.instance_ready("b", f"b{i}", 1.0)
    pol.instance_starting("a", "a2", 2.0)  # starting instances do not count: they serve nothing yet
    assert pol.surplus_donor("starved") == "b"


def test_concurrency_target_is_what_one_instance_serves_within_the_slo():
    from dilu.services.horizontal_scaler.policy import concurrency_target

    assert concurrency_target(1, 16.0, 81.0) == 5.0   # five batches of one back to back
    assert concurrency_target(8, 2200.0, 4900.0) == 16.0
    assert concurrency_target(4, 90.0, 80.0) == 4.0   # never below one batch
    assert concurrency_target(4, 0.0, 80.0) == 4.0    # unknown latency: the batch


def test_scale_down_delay_holds_a_fresh_scale_out():
    from dilu.services.horizontal_scaler.policy import FunctionParams, HorizontalConfig, HorizontalPolicy

    def run(delay):
        pol = HorizontalPolicy(HorizontalConfig(stable_window_s=6, keep_alive_s=600, scale_down_delay_s=delay))
        pol.add_function("f", FunctionParams(target=1))
        pol.instance_starting("f", "i0", 0.0)
        pol.instance_ready("f", "i0", 0.0)
        counts = []
        for t in range(0, 30):
            backlog = 4 if t < 3 else 1  # a short burst, then one instance's worth
            pol.record("f", float(t), backlog)
            d = pol.decide("f", float(t))
            for k in range(d.place):
                pol.instance_starting("f", f"i{t}-{k}", float(t))
                pol.instance_ready("f", f"i{t}-{k}", float(t))
            for iid in d.retire:
                pol.instance_retired("f", iid)
            counts.append(d.desired)
        return counts

    eager_in, delayed = run(0.0), run(20.0)
    first_out = next(t for t, c in enumerate(delayed) if c > 1)
    # with the delay nothing is retired within 20 s of the scale-out; without it, it is
    assert min(delayed[first_out:first_out + 19]) == max(delayed[first_out:first_out + 19])
    assert min(eager_in[first_out:first_out + 19]) < max(eager_in[first_out:first_out + 19])


def test_window_mean_is_the_mean_of_the_samples_inside_it():
    """The running sum gives what a pass over the samples gives, as samples come and go
    (integers stay exact; an empty window resets the sum)."""
    import random

    from dilu.services.horizontal_scaler.policy import _Window

    rng = random.Random(7)
    w, kept, t = _Window(), [], 0.0
    for _ in range(2000):
        t += rng.choice([0.5, 1.0, 3.0, 90.0])
        v = float(rng.randint(0, 40))
        w.add(t, v)
        kept.append((t, v))
        since = t - rng.choice([6.0, 60.0])
        inside = [x for s, x in kept if s > since]
        assert w.mean_since(since) == (sum(inside) / len(inside) if inside else 0.0)
        kept = [(s, x) for s, x in kept if s > since]
    assert w.mean_since(t) == 0.0 and w._sum == 0.0


def test_a_new_function_keeps_its_initial_instances_for_the_policys_first_keep_alive():
    """first_keep_alive_s is what decide() does with a function deployed and never invoked: its
    initial instance stays that long after it is ready, and goes at the first tick after (dilu's
    fallback keep-alive; Knative's stable window plus scale-to-zero grace)."""
    for mode, expected in (("lazy", 20.0), ("kpa", 6.0 + 3.0)):
        p = horizontal_policy(HorizontalConfig(mode=mode, keep_alive_s=20.0, stable_window_s=6.0,
                                               scale_to_zero_grace_s=3.0, panic_window_s=1.0))
        assert p.first_keep_alive_s() == pytest.approx(expected)
        p.add_function("f", FunctionParams(instance_rps=10.0))
        p.deployed("f", 0.0)
        p.instance_starting("f", "i1", 0.0)
        # a slow cold start: the keep-alive runs from the instance's readiness, not the deploy
        for t, alive in ((0.5, 1), (expected + 1.0, 1)):
            p.record("f", t, 0.0, 0)
            assert p.decide("f", t).desired == alive, (mode, t)
        p.instance_ready("f", "i1", expected + 2.0)
        p.instance_starting("f", "i2", expected + 2.0)
        p.instance_ready("f", "i2", expected + 3.0)  # a second one does not restart the clock
        for t, alive in ((expected + 2.5, 1), (2 * expected + 1.5, 1), (2 * expected + 2.0, 0)):
            p.record("f", t, 0.0, 0)
            assert p.decide("f", t).desired == alive, (mode, t)
