"""Parking (HorizontalConfig.park_after_s): an idle function's instances give up their GPU while
its keep-alive holds them, come back before any new instance is placed, and go when the
keep-alive ends; fake clock (s)."""
from __future__ import annotations

import pytest

from dilu.cli.deploy import function_spec
from dilu.services.common import models
from dilu.services.horizontal_scaler.policy import (PARK_SLO_SHARE, FunctionParams, HorizontalConfig,
                                                    HorizontalPolicy, PlacementBackoff, function_params)

FN = "f"
PARKABLE = dict(target=1.0, max_instances=4, resume_ms=10.0, slo_ms=100.0)


def policy(params: FunctionParams | None = None, **kw) -> HorizontalPolicy:
    # target 1 used whole: one request in flight wants one instance, so a resume is the whole scale-out
    cfg = {"stable_window_s": 6.0, "panic_window_s": 1.0, "keep_alive_s": 60.0, "park_after_s": 10.0,
           "target_utilization": 1.0, **kw}
    p = HorizontalPolicy(HorizontalConfig(**cfg))
    p.add_function(FN, params or FunctionParams(**PARKABLE))
    return p


def idle_until(p, t0, t1, tick=0.5):
    """Record an idle function every tick in (t0, t1]; the decisions."""
    out, t = [], t0
    while t < t1 - 1e-9:
        t = round(t + tick, 6)
        p.record(FN, t, 0, 0)
        out.append(p.decide(FN, t))
    return out


def served_then_idle(p):
    """One instance serves a request at 0.5 s; then nothing comes."""
    p.instance_ready(FN, "w0", 0.0)
    p.record(FN, 0.5, 1, 1)
    p.decide(FN, 0.5)


def test_an_idle_function_is_parked_after_park_after_s_not_before():
    p = policy()
    served_then_idle(p)
    decisions = idle_until(p, 0.5, 12.0)
    parked = [d for d in decisions if d.park]
    assert len(parked) == 1 and parked[0].park == ["w0"] and parked[0].direction == "park"
    assert parked[0].now_s >= 1.0 + 10.0  # idle from the first empty tick (1.0 s), parked 10 s later
    assert all(not d.retire and not d.place for d in decisions)
    assert p.instances(FN) == {"w0": "parked"}


def test_a_new_function_is_parked_only_once_its_instance_has_been_ready_park_after_s():
    """A new function's idle clock starts at its deploy, before its instance's cold start ends;
    that instance serves on the GPU for ``park_after_s`` first: the first requests, expected
    soon after a deploy, find it on the GPU (a pre-warmed one parks at once: see below)."""
    p = policy()
    p.deployed(FN, 0.0)
    p.instance_starting(FN, "w0", 0.0)
    idle_until(p, 0.0, 8.0)
    p.instance_ready(FN, "w0", 8.0)  # an 8 s cold start; the function has been idle since 0 s
    decisions = idle_until(p, 8.0, 20.0)
    parked = [d for d in decisions if d.park]
    assert len(parked) == 1 and parked[0].park == ["w0"]
    assert parked[0].now_s == pytest.approx(18.0)  # 10 s after ready, not 10 s after deploy
    assert all(not d.retire and not d.place for d in decisions)


def test_a_request_resumes_the_parked_instance_before_placing_a_new_one():
    p = policy()
    served_then_idle(p)
    idle_until(p, 0.5, 12.0)
    assert p.on_arrival(FN, 12.2) == ["w0"]  # woken by the arrival, not by the next tick
    assert p.instances(FN) == {"w0": "starting"}
    assert p.on_arrival(FN, 12.3) == []  # already coming back
    p.record(FN, 12.5, 3, 3)
    d = p.decide(FN, 12.5)
    assert not d.resume and not d.park  # counted as starting: nothing more to do for one


def test_a_scale_out_takes_the_parked_instance_first():
    p = policy()
    for k in range(2):
        p.instance_ready(FN, f"w{k}", 0.0)
    p.record(FN, 0.5, 2, 2)
    p.decide(FN, 0.5)
    idle_until(p, 0.5, 20.0)
    # scaled in to the one the keep-alive holds (the other parked by the scale-in), then that one parked
    assert p.instances(FN) == {"w0": "parked", "w1": "parked"}
    p.record(FN, 20.5, 8, 8)  # a burst for several
    d = p.decide(FN, 20.5)
    assert sorted(d.resume) == ["w0", "w1"] and d.place == d.desired - 2 > 0 and d.direction == "out"


def busy_pair(p, backlog=2):
    """Two ready instances serving ``backlog`` in flight for 10 s (ticks of 0.5 s)."""
    for k in range(2):
        p.instance_ready(FN, f"w{k}", 0.0)
    t = 0.0
    while t < 10.0:
        t = round(t + 0.5, 6)
        p.record(FN, t, backlog, 1)
        p.decide(FN, t)
    return t


@pytest.mark.parametrize("park_after_s", [10.0, 0.0])
def test_a_scale_in_of_a_serving_function_parks_its_victim_and_the_next_scale_out_resumes_it(park_after_s):
    """A function that keeps serving scales in to one instance: a parking policy parks the
    other (resumed in a copy, on the GPU it left, by the next scale-out: no launch, no new GPU);
    one that does not park retires it."""
    p = policy(park_after_s=park_after_s)
    t = busy_pair(p)
    decisions = []
    while t < 30.0:  # one in flight: one instance, once the stable window says so
        t = round(t + 0.5, 6)
        p.record(FN, t, 1, 1)
        decisions.append(p.decide(FN, t))
    down = [d for d in decisions if d.park or d.retire]
    assert len(down) == 1 and down[0].desired == 1
    (victim,) = down[0].park or down[0].retire
    if not park_after_s:
        assert down[0].retire == [victim] and down[0].direction == "in"
        return
    assert down[0].park == [victim] and not down[0].retire and down[0].direction == "park"
    assert sorted(p.instances(FN).values()) == ["parked", "ready"]
    p.record(FN, t + 0.5, 2, 2)  # two in flight: two wanted again
    d = p.decide(FN, t + 0.5)
    assert d.resume == [victim] and d.place == 0 and d.direction == "resume"


def test_an_instance_parked_by_a_scale_in_goes_after_a_keep_alive_window_while_the_function_serves():
    p = policy(keep_alive_s=20.0)
    t = busy_pair(p)
    parked_at = None
    gone = []
    while t < 60.0:
        t = round(t + 0.5, 6)
        p.record(FN, t, 1, 1)
        d = p.decide(FN, t)
        parked_at = d.now_s if d.park else parked_at
        gone += [(d.now_s, i) for i in d.retire]
    assert parked_at is not None and len(gone) == 1
    assert gone[0][0] == pytest.approx(parked_at + 20.0)  # the keep-alive window after it was parked
    assert sorted(p.instances(FN).values()) == ["draining", "ready"]


def test_parked_instances_go_when_the_keep_alive_ends():
    p = policy()
    served_then_idle(p)
    decisions = idle_until(p, 0.5, 70.0)
    gone = [d for d in decisions if d.retire]
    assert gone and gone[0].retire == ["w0"] and gone[0].direction == "zero"
    assert gone[0].now_s >= 1.0 + 60.0
    p.instance_retired(FN, "w0")
    assert p.instances(FN) == {}


@pytest.mark.parametrize("params, kw", [
    (FunctionParams(**PARKABLE), {"park_after_s": 0.0}),  # the default: never
    (FunctionParams(**{**PARKABLE, "resume_ms": 60.0}), {}),  # a resume would take over half the SLO
    (FunctionParams(**{**PARKABLE, "resume_ms": 0.0}), {}),  # resume time unknown
    (FunctionParams(**{**PARKABLE, "min_instances": 1}), {}),  # its owner asked for a warm instance
])
def test_what_is_never_parked(params, kw):
    p = policy(params, **kw)
    served_then_idle(p)
    assert not any(d.park for d in idle_until(p, 0.5, 30.0))
    assert p.instances(FN) == {"w0": "ready"}


def test_a_park_the_shell_could_not_do_leaves_the_instance_ready():
    p = policy()
    served_then_idle(p)
    idle_until(p, 0.5, 12.0)
    p.park_failed(FN, "w0")
    assert p.instances(FN) == {"w0": "ready"}


def test_parkable_follows_the_catalogue_resume_times_against_the_slos():
    """A ResNet152 resume (its weights at 12 GB/s) fits half its SLO; GPT2-large's does not."""
    for model, ok in (("resnet152", True), ("bert_base", True), ("gpt2_large", False)):
        spec = function_spec("x", model)
        params = function_params(spec, None, None, slo_ms=spec.slo_ms)
        assert params.resume_ms == pytest.approx(models.resume_ms(models.cold_start_ms(model)))
        assert params.parkable is ok, (model, params.resume_ms, spec.slo_ms * PARK_SLO_SHARE)


def test_park_after_s_must_be_finite_and_not_negative():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="park_after_s"):
            HorizontalConfig(park_after_s=bad)


def drive(p, t0, t1, busy_at=(), tick=0.5):
    """A shell acting at once on every decision in (t0, t1]: a placed instance is ready within
    the tick, a retired one gone; ``busy_at``: tick times with one request. The decisions."""
    out, t, n = [], t0, len(p.instances(FN))
    while t < t1 - 1e-9:
        t = round(t + tick, 6)
        b = 1 if any(abs(t - x) < tick / 2 for x in busy_at) else 0
        if b:
            for iid in p.on_arrival(FN, t):
                p.instance_ready(FN, iid, t)
        p.record(FN, t, b, b)
        d = p.decide(FN, t)
        for iid in d.resume:
            p.instance_ready(FN, iid, t)
        for _ in range(d.place):
            n += 1
            p.instance_starting(FN, f"w{n}", t)
            p.instance_ready(FN, f"w{n}", t)
        for iid in d.retire:
            p.instance_retired(FN, iid)
        out.append(d)
    return out


def test_a_pre_warm_still_launches_the_instance_it_then_parks():
    """A function whose idle times are regular is unloaded after use and launched again at its
    pre-warm time; parking must not hold that launch back: it parks the instance once launched,
    and the next request resumes it instead of waiting for a launch."""
    p = policy(keep_alive_s=600.0, idle_bin_s=10.0, park_after_s=5.0)
    requests = [100.0 * k for k in range(1, 16)]
    decisions = drive(p, 0.0, 1500.0, busy_at=requests)
    w = p.idle_windows(FN)
    assert w.representative and w.prewarm_s > 5.0
    last = [d for d in decisions if d.now_s > 1000.0]
    prewarms = [d for d in last if d.direction == "prewarm"]
    parks = [d for d in last if d.park]
    assert len(prewarms) >= 3
    for pw in prewarms:  # each pre-warmed instance is parked as soon as it is there
        assert any(0 < d.now_s - pw.now_s <= 1.0 for d in parks), pw.now_s
    assert not [d for d in last if d.place and d.direction != "prewarm"]  # no request waited for a launch


def test_an_instance_whose_code_cannot_park_keeps_its_function_on_the_gpu():
    p = policy()
    p.instance_ready(FN, "w0", 0.0, parkable=False)  # InstanceReady said its code has no park/resume
    p.record(FN, 0.5, 1, 1)
    p.decide(FN, 0.5)
    decisions = idle_until(p, 0.5, 70.0)
    assert not any(d.park for d in decisions)
    gone = [d for d in decisions if d.retire]
    assert gone and gone[0].retire == ["w0"]  # the keep-alive still ends it


def test_a_refused_resume_leaves_the_instance_parked_for_the_next_scale_out():
    p = policy()
    served_then_idle(p)
    idle_until(p, 0.5, 12.0)
    p.record(FN, 12.5, 2, 2)
    d = p.decide(FN, 12.5)
    assert d.resume == ["w0"] and p.instances(FN) == {"w0": "starting"}
    p.resume_failed(FN, "w0")  # the scheduler found no room anywhere
    assert p.instances(FN) == {"w0": "parked"}
    p.record(FN, 13.0, 2, 0)
    assert p.decide(FN, 13.0).resume == ["w0"]  # tried again


def test_a_refused_resume_backs_off_as_a_refused_placement():
    """The caller counts a refused resume in its PlacementBackoff; while that blocks the function,
    neither a tick nor a request resumes the parked instance, and no new one is placed in its
    stead; once it is over, the next tick resumes it."""
    p, backoff = policy(), PlacementBackoff(0.5, 10.0)
    served_then_idle(p)
    idle_until(p, 0.5, 12.0)
    p.record(FN, 12.5, 2, 2)
    assert p.decide(FN, 12.5, backing_off=backoff.blocked(FN, 12.5)).resume == ["w0"]
    p.resume_failed(FN, "w0")
    assert backoff.failed(FN, 12.5) == 0.5
    now = 12.5
    for _ in range(3):  # each refusal doubles the delay
        held = now + backoff.delay(FN) - 0.25
        p.record(FN, held, 2, 1)
        assert backoff.blocked(FN, held)
        d = p.decide(FN, held, backing_off=True)
        assert d.resume == [] and d.place == 0 and p.instances(FN) == {"w0": "parked"}  # none in its stead
        assert p.on_arrival(FN, held, backing_off=True) == []
        now += backoff.delay(FN)
        p.record(FN, now, 2, 0)
        assert not backoff.blocked(FN, now)
        assert p.decide(FN, now, backing_off=False).resume == ["w0"]  # over: tried again
        p.resume_failed(FN, "w0")
        backoff.failed(FN, now)
    assert backoff.delay(FN) == 4.0


def test_a_function_backing_off_places_nothing_in_a_parked_instances_stead():
    p = policy()
    served_then_idle(p)
    idle_until(p, 0.5, 12.0)
    p.record(FN, 12.5, 1, 1)
    d = p.decide(FN, 12.5, backing_off=True)
    assert d.desired == 1 and d.resume == [] and d.place == 0 and d.direction == ""  # nothing to carry out
    p.record(FN, 13.0, 40, 40)  # wants more than the one parked instance
    d = p.decide(FN, 13.0, backing_off=True)
    assert d.desired > 1 and d.resume == [] and d.place == 0  # the policy places nothing while it backs off
    assert p.instances(FN) == {"w0": "parked"}


def test_a_parked_instance_restored_from_the_table_is_resumed_not_counted():
    p = policy()
    p.instance_parked(FN, "w0", 0.0)
    p.restored(FN, 0.0)
    assert p.instances(FN) == {"w0": "parked"}
    p.record(FN, 0.5, 1, 1)
    d = p.decide(FN, 0.5)
    assert d.current == 0 and d.resume == ["w0"] and d.place == 0 and d.direction == "resume"
    p.instance_ready(FN, "w0", 0.6)
    assert p.instances(FN) == {"w0": "ready"}


def test_a_function_without_a_declared_cold_start_is_parkable_by_its_memory():
    """A user's function (no [emulation], so no cold_start_ms): its resume is bounded by its memory
    reservation copied back at RESUME_BANDWIDTH_BYTES_PER_S."""
    from dilu.contracts.events import FunctionSpec

    small = FunctionSpec(name=FN, memory_bytes=500_000_000, slo_ms=100.0)  # 42 ms: within half the SLO
    big = FunctionSpec(name=FN, memory_bytes=2_000_000_000, slo_ms=100.0)  # 167 ms: not
    p_small = function_params(small, None, None, slo_ms=100.0)
    assert p_small.resume_ms == pytest.approx(500_000_000 / models.RESUME_BANDWIDTH_BYTES_PER_S * 1000.0)
    assert p_small.parkable and not function_params(big, None, None, slo_ms=100.0).parkable


def test_a_function_restored_all_parked_stays_parked_until_its_keep_alive_ends():
    """After a restart its idle clock starts anew: it is neither resumed without a request nor
    scaled to zero before its keep-alive ends."""
    p = policy()
    p.instance_parked(FN, "w0", 0.0)
    p.restored(FN, 0.0)
    decisions = idle_until(p, 0.0, 59.0)
    assert not any(d.resume or d.retire or d.place for d in decisions)
    assert p.instances(FN) == {"w0": "parked"}
    later = idle_until(p, 59.0, 62.0)
    assert any(d.retire == ["w0"] for d in later)  # then it goes, as a kept instance would
