"""A function restored from stored state (a restart of the platform) keeps the instances it had
for its keep-alive, from the restart on; one restored with none stays at zero; no initial scale."""
from __future__ import annotations

from dilu.services.horizontal_scaler.policy import FunctionParams, HorizontalConfig, HorizontalPolicy

CFG = HorizontalConfig(stable_window_s=6.0, keep_alive_s=30.0, initial_scale=2)


def restored(instances: int, t0: float = 100.0) -> HorizontalPolicy:
    pol = HorizontalPolicy(CFG)
    pol.add_function("f", FunctionParams(target=1.0))
    for i in range(instances):
        pol.instance_ready("f", f"i{i}", t0)
    pol.restored("f", t0)
    return pol


def step(pol: HorizontalPolicy, t: float, backlog: int = 0):
    pol.record("f", t, backlog)
    return pol.decide("f", t)


def test_restored_instances_stay_for_the_keep_alive_then_go():
    pol = restored(1)
    for t in (100.5, 101.0, 110.0, 129.0):
        d = step(pol, t)
        assert d.retire == [] and d.place == 0, (t, d.reason)
    d = step(pol, 130.5)
    assert d.direction == "zero" and d.retire == ["i0"]


def test_a_function_restored_without_instances_stays_at_zero_until_requests_come():
    pol = restored(0)
    assert step(pol, 101.0).place == 0  # no initial scale, no keep-alive instance
    d = step(pol, 102.0, backlog=3)
    assert d.place >= 1 and d.direction == "out"
    assert pol._fns["f"].histogram.samples == 0  # the wait since the restart is no idle time


def test_restored_does_not_undo_a_live_deploy():
    pol = HorizontalPolicy(CFG)
    pol.add_function("f", FunctionParams(target=1.0))
    pol.deployed("f", 100.0)
    pol.restored("f", 100.0)
    assert step(pol, 100.5).place == 2  # the initial scale still applies


def test_a_restarted_scaler_does_not_halve_a_busy_function_before_a_full_window():
    """14 instances restored under a steady load of 7 in flight: a restarted scaler with no history
    once went 14 -> 7 -> 3 within a second; now it holds 14 for a stable window, then follows
    the load (KPA halving at most per decision)."""
    pol = restored(14)
    counts = []
    t = 100.0
    while t < 100.0 + CFG.stable_window_s - 0.5:
        t = round(t + 0.5, 3)
        d = step(pol, t, backlog=7)
        assert d.retire == [], (t, d.reason)
        counts.append(d.desired)
    assert set(counts) == {14}
    later = [step(pol, round(t + k * 0.5, 3), backlog=7) for k in range(1, 4)]
    assert any(d.retire for d in later), "after a full window the count follows the load"


def test_a_function_deployed_before_its_consumer_exists_gets_its_initial_scale_at_once():
    """Its backlog is unknown (no consumer yet: the first instance creates it); waiting for the
    consumer once left it without an instance for 40 s."""
    pol = HorizontalPolicy(CFG)
    pol.add_function("f", FunctionParams(target=1.0))
    pol.deployed("f", 100.0)
    pol.record("f", 100.5, None)
    d = pol.decide("f", 100.5)
    assert d.place == CFG.initial_scale and "initial scale" in d.reason
