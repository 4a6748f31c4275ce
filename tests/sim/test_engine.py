"""The simulator's event loop and its shortcuts: order by time then by scheduling order; skipping
the ticks of idle functions changes nothing in the report."""
from __future__ import annotations

import signal

import pytest

from dilu.loadgen.sim.engine import POLL_EVERY, EventLoop
from dilu.services.common.interrupt import SignalExit, raise_if_stopped
from dilu.loadgen.sim.run import SimConfig, Simulation, prepare


def test_events_run_by_time_then_scheduling_order():
    loop = EventLoop()
    seen = []
    for t, tag in [(5.0, "c"), (1.0, "a"), (5.0, "d"), (3.0, "b")]:
        loop.at(t, seen.append, tag)
    loop.at(2.0, lambda _: loop.at(2.0, seen.append, "a2"))  # scheduled at the same instant, runs after
    loop.run(4.0)
    assert seen == ["a", "a2", "b"] and loop.now == 4.0
    loop.run()
    assert seen == ["a", "a2", "b", "c", "d"] and loop.processed == 6


def test_a_stop_whose_keyboardinterrupt_was_lost_still_ends_a_long_run():
    """A signal handled where its exception is swallowed (C code that clears errors, a finaliser;
    emulated here by catching it at once) must not let a simulation run on for minutes: the
    loop's poll raises it again, and the block exits as the signal says."""
    loop = EventLoop()
    ran = []

    def step(k):
        ran.append(k)
        loop.at(k + 1.0, step, k + 1)  # endless: only a stop ends it

    loop.at(0.0, step, 0)
    with pytest.raises(SystemExit) as out:
        with SignalExit():
            try:
                signal.raise_signal(signal.SIGTERM)
            except KeyboardInterrupt:
                pass  # lost
            loop.run(poll=raise_if_stopped)
    assert out.value.code == 128 + signal.SIGTERM and len(ran) == POLL_EVERY == loop.processed
    raise_if_stopped()  # the block has ended: nothing is pending any more


def test_event_time_must_be_finite():
    with pytest.raises(ValueError, match="finite"):
        EventLoop().at(float("nan"), print)


def test_sleeping_idle_functions_changes_nothing():
    cfg = SimConfig(functions=12, hours=0.3, nodes=2, seed=2, training_jobs=0.25)
    work = prepare(cfg)
    fast, _ = Simulation(cfg, "dilu", work).run()
    slow_sim = Simulation(cfg, "dilu", work)
    slow_sim.sleep_idle = False
    slow, _ = slow_sim.run()
    assert fast.mechanism.scale_to_zero > 0  # functions did go idle, so sleeping was exercised
    assert fast.to_dict() == slow.to_dict()
