"""A defragmenting migration as the horizontal policy sees it (instance_migrating): the
replacement and the instance it replaces count as one until the replacement is ready, then the
old one counts as draining; fake clock (s)."""
from __future__ import annotations

from dilu.services.horizontal_scaler.policy import FunctionParams, HorizontalConfig, HorizontalPolicy

FN = "f"


def policy(**params) -> HorizontalPolicy:
    # one request in flight, one instance of target 1 used whole: the count holds, so a pair shows
    p = HorizontalPolicy(HorizontalConfig(stable_window_s=6.0, panic_window_s=1.0, keep_alive_s=60.0,
                                          target_utilization=1.0))
    p.add_function(FN, FunctionParams(**{"target": 1.0, "max_instances": 4, **params}))
    return p


def busy(p, t, backlog=1):
    p.record(FN, t, backlog, backlog)
    return p.decide(FN, t)


def test_a_replacement_is_not_counted_nor_retired_while_it_starts():
    p = policy()
    p.instance_ready(FN, "old", 0.0)
    busy(p, 0.5)
    p.instance_migrating(FN, "new", "old", 1.0)
    assert p.instances(FN) == {"old": "ready", "new": "moving"}
    for t in (1.5, 2.0, 2.5, 3.0):
        d = busy(p, t)
        assert d.current == 1 and not d.retire and not d.place, d  # the pair is one instance


def test_the_old_instance_counts_as_draining_once_its_replacement_is_ready():
    p = policy()
    p.instance_ready(FN, "old", 0.0)
    p.instance_migrating(FN, "new", "old", 1.0)
    p.instance_ready(FN, "new", 2.0)
    assert p.instances(FN) == {"old": "draining", "new": "ready"}
    d = busy(p, 2.5)
    assert d.current == 1 and not d.retire and not d.place
    p.instance_retired(FN, "old")  # the scheduler drained it
    assert p.instances(FN) == {"new": "ready"}


def test_launched_first_then_told_it_migrates():
    """InstanceLaunched may reach the scaler before the PlacementDecided that says it migrates."""
    p = policy()
    p.instance_ready(FN, "old", 0.0)
    p.instance_starting(FN, "new", 1.0)
    p.instance_migrating(FN, "new", "old", 1.1)
    assert p.instances(FN) == {"old": "ready", "new": "moving"}


def test_a_replacement_of_an_instance_that_is_gone_is_an_ordinary_one():
    p = policy()
    p.instance_ready(FN, "old", 0.0)
    p.instance_migrating(FN, "new", "old", 1.0)
    p.instance_retired(FN, "old")  # crashed before the replacement was ready
    assert p.instances(FN) == {"new": "starting"}
    p.instance_migrating(FN, "late", "gone", 2.0)  # replaces nothing known: starting, counted
    assert p.instances(FN)["late"] == "starting"


def test_retiring_the_old_instance_cancels_its_replacement():
    p = policy()
    for i in ("a", "b"):
        p.instance_ready(FN, i, 0.0)
    p.set_busy(FN, "a", 0.0)
    p.set_busy(FN, "b", 0.9)
    p.instance_migrating(FN, "a2", "a", 1.0)
    d = None
    for t in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0):  # load for one instance
        d = busy(p, t, backlog=1)
        if d.retire:
            break
    assert d is not None and sorted(d.retire) == ["a", "a2"], d  # the idle one, and its replacement
    assert p.instances(FN) == {"a": "draining", "a2": "draining", "b": "ready"}


def test_scale_to_zero_retires_a_replacement_too():
    p = policy()
    p.instance_ready(FN, "old", 0.0)
    busy(p, 0.5)
    p.instance_migrating(FN, "new", "old", 1.0)
    d = None
    t = 0.5
    while t < 80.0:
        t += 0.5
        p.record(FN, t, 0, 0)
        d = p.decide(FN, t)
        if d.retire:
            break
    assert d is not None and d.direction == "zero" and sorted(d.retire) == ["new", "old"]
