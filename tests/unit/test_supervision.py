"""The runner's systemd notify policy (services/common/runner.py): what is said to systemd when."""
from __future__ import annotations

from dilu.services.common.runner import (
    EXTEND_PERIODS,
    NO_WATCHDOG_PERIOD_S,
    Notifier,
    Supervision,
    supervise_step,
    watchdog_period_s,
)


def test_watchdog_period_is_half_of_watchdog_usec_for_this_process_only():
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000"}, pid=7) == 15.0
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7) is None
    for bad in ("", "0", "-5", "abc", "1.5"):
        assert watchdog_period_s({"WATCHDOG_USEC": bad}, pid=7) is None
    assert watchdog_period_s({}, pid=7) is None


def run_steps(s: Supervision, steps):
    said = []
    for now, ready, stopping in steps:
        s, out = supervise_step(s, ready=ready, stopping=stopping, now=now, waiting_for="NATS")
        said.append(out)
    return s, said


def test_ready_once_then_status_changes_and_stopping_once():
    s, said = run_steps(Supervision(), [(0, False, False), (0.1, True, False), (0.2, True, False),
                                        (1.0, False, False), (2.0, True, False), (3.0, True, True),
                                        (4.0, True, True)])
    assert said[0] == ["STATUS=not ready: NATS",
                       f"EXTEND_TIMEOUT_USEC={int(EXTEND_PERIODS * NO_WATCHDOG_PERIOD_S * 1e6)}"]
    assert said[1] == ["READY=1\nSTATUS=ready"]
    assert said[2] == []
    assert said[3] == ["STATUS=not ready: NATS"]
    assert said[4] == ["STATUS=ready"]
    assert said[5] == ["STOPPING=1\nSTATUS=stopping"]
    assert said[6] == []
    assert s.ready_sent and s.stopping_sent


def test_never_ready_means_no_ready_but_the_start_timeout_keeps_being_extended():
    s, said = run_steps(Supervision(), [(t, False, False) for t in (0, 1, 5, 6, 10)])
    flat = [m for out in said for m in out]
    assert not any("READY=1" in m for m in flat)
    extends = [m for m in flat if m.startswith("EXTEND_TIMEOUT_USEC=")]
    assert len(extends) == 3 and len(set(extends)) == 1  # at 0, 5 and 10 s


def test_watchdog_pings_every_period_whatever_the_readiness_and_also_while_stopping():
    steps = [(t / 10, t >= 20, t >= 60) for t in range(0, 80)]  # 8 s, ready at 2 s, stopping at 6 s
    s, said = run_steps(Supervision(watchdog_s=1.0), steps)
    pings = [steps[i][0] for i, out in enumerate(said) if "WATCHDOG=1" in out]
    assert pings == [0, 1, 2, 3, 4, 5, 6, 7]
    assert s.poll_s() <= 1.0


def test_no_notifier_without_notify_socket_and_children_do_not_inherit_it():
    assert Notifier.from_environ({"WATCHDOG_USEC": "1000000"}) is None
    env = {"NOTIFY_SOCKET": "/nonexistent/sock", "WATCHDOG_USEC": "4000000"}
    notifier = Notifier.from_environ(env)
    assert notifier is not None and notifier.watchdog_s == 2.0
    assert env == {}
    notifier.notify("READY=1")  # an unreachable socket is ignored, as sd_notify does
