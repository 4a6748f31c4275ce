"""Token throttling read on the device's own timeline: share accuracy, grants changed at run
time, fail-safe without a usable block, fork, graph charging, not-ready answers."""
from __future__ import annotations

import subprocess
import time

import pytest

from native_helpers import PYTHON, finish, launch_env, spawn
from dilu.interceptor import timeline

pytestmark = pytest.mark.native

SEC = 1_000_000_000


def shares(gpu: str, pid: int, window_s: float, skip_s: float = 0.2) -> list[float]:
    """Busy shares of ``pid`` in windows of window_s, past the first skip_s (process start-up)."""
    recs = timeline.read_array(gpu)
    t0, t1 = timeline.span(recs, pid)
    return timeline.window_shares(recs, pid, t0 + int(skip_s * SEC), t1, int(window_s * SEC))


@pytest.mark.parametrize("quota,kernel", [(0.25, "k_200"), (0.6, "k_500"), (0.1, "k_2000")])
def test_busy_share_follows_quota(agent, gpu, quota, kernel):
    cb = agent.block(request_quota=quota)
    out = finish(spawn(launch_env(cb.path, gpu), "-k", kernel, "-t", "1.6"))
    got = shares(gpu, out["pid"], 0.5)
    assert len(got) >= 2
    assert all(abs(s - quota) <= 0.03 for s in got), got
    snap = cb.snapshot()
    assert snap.throttled > 0 and snap.wait_us > 0
    assert snap.samples > 0  # costs were calibrated with events


def test_grant_changed_at_run_time_reaches_the_enforcer(agent, gpu):
    """Issue 6 case 2, scaled 10 s -> 1.2 s per phase: 1.0, then 0.3, then 0.8."""
    cb = agent.block(request_quota=1.0)
    proc = spawn(launch_env(cb.path, gpu), "-k", "k_500", "-t", "3.6")
    phase = 1.2
    marks, busy = [], []
    start = time.monotonic()
    for quota in (1.0, 0.3, 0.8):
        if quota != 1.0:
            marks.append((time.monotonic_ns(), quota, cb.write_grant(quota)))
        end = start + phase * (len(marks) + 1)
        while time.monotonic() < end - 0.05:
            time.sleep(0.1)
            busy.append(cb.snapshot().busy_us)
    out = finish(proc)
    steps = [b - a for a, b in zip(busy, busy[1:])]
    assert all(s > 0 for s in steps), "telemetry read 0 while the process ran"
    recs = timeline.read_array(gpu)
    for i, (t_grant, quota, epoch) in enumerate(marks):
        t_next = marks[i + 1][0] if i + 1 < len(marks) else timeline.span(recs, out["pid"])[1]
        got = timeline.busy_share(recs, out["pid"], t_grant + SEC // 10, t_next)
        assert abs(got - quota) <= 0.05, (quota, got)
    snap = cb.snapshot()
    assert snap.applied_epoch == marks[-1][2]
    assert snap.applied_quota == pytest.approx(0.8)


def test_no_block_runs_at_request_quota(gpu):
    env = launch_env("/dev/shm/dilu-cb-does-not-exist", gpu, request_quota=0.3)
    out = finish(spawn(env, "-k", "k_100", "-t", "1.4"))
    got = shares(gpu, out["pid"], 0.5)
    assert got and all(abs(s - 0.3) <= 0.05 for s in got), got


def test_invalid_block_runs_at_request_quota_with_a_clear_error(gpu, tmp_path):
    bad = tmp_path / "cb"
    bad.write_bytes(b"not a control block" * 100)
    proc = spawn(launch_env(str(bad), gpu, request_quota=0.4), "-k", "k_100", "-t", "1.4")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "not a control block" in err
    import json
    got = shares(gpu, json.loads(out)["pid"], 0.5)
    assert got and all(abs(s - 0.4) <= 0.05 for s in got), got


def test_stale_block_keeps_the_last_grant(agent, gpu):
    cb = agent.block(request_quota=0.2, stale_after_ms=50, heartbeat=False)
    cb.write_grant(0.45)  # the agent's last word; it then goes silent
    out = finish(spawn(launch_env(cb.path, gpu, request_quota=0.2), "-k", "k_100", "-t", "1.4"))
    got = shares(gpu, out["pid"], 0.5)
    assert got and all(abs(s - 0.45) <= 0.05 for s in got), got
    assert cb.snapshot().stale


def test_block_created_after_start_is_picked_up(agent, gpu, tmp_path):
    path = f"/dev/shm/dilu-cb-late-{gpu}"
    # 500 µs kernels: at 0.7, 100 µs ones need 7,000 launches a second, which a loaded 2-core
    # host does not always issue (it read 0.65 once), so the host and not the tokens set the pace
    proc = spawn(launch_env(path, gpu, request_quota=0.2), "-k", "k_500", "-t", "1.6")
    time.sleep(0.5)
    from dilu.interceptor.control_block import ControlBlock
    cb = ControlBlock.create(path, "late", request_quota=0.2, width=1.0)
    cb.heartbeating = True
    agent.blocks.append(cb)
    t_grant = time.monotonic_ns()
    cb.write_grant(0.7)
    out = finish(proc)
    recs = timeline.read_array(gpu)
    # the block is looked for every 100 ms
    got = timeline.busy_share(recs, out["pid"], t_grant + 2 * SEC // 10, timeline.span(recs)[1])
    assert abs(got - 0.7) <= 0.05, got
    assert cb.snapshot().launches > 0


def test_zero_grant_never_blocks_forever(agent, gpu):
    cb = agent.block(request_quota=0.5)
    cb.write_grant(0.0)
    out = finish(spawn(launch_env(cb.path, gpu), "-k", "k_50", "-n", "8"), timeout=30)
    assert out["launches"] == 8  # floor of 1 % keeps it moving: 8 x 50 µs in about 40 ms


def test_fork_child_shares_the_instance_quota_and_telemetry(agent, gpu):
    # width 0.5: parent and child run side by side without taking turns
    cb = agent.block(request_quota=0.2, width=0.5)
    env = launch_env(cb.path, gpu, width=0.5, request_quota=0.2)
    out = finish(spawn(env, "-f", "-k", "k_100", "-n", "4000", "-s", "500"), timeout=60)
    recs = timeline.read_array(gpu)
    child = [p for p in timeline.pids(recs) if p != out["pid"]]
    assert len(child) == 1, "the forked child ran kernels"
    # while both run, parent + child together hold the instance's quota (one shared bucket)
    t0 = max(timeline.span(recs, p)[0] for p in (out["pid"], child[0]))
    t1 = min(timeline.span(recs, p)[1] for p in (out["pid"], child[0]))
    shares = timeline.sm_time_shares(recs, t0, t1)
    assert shares[out["pid"]] + shares[child[0]] == pytest.approx(0.2, abs=0.03)
    snap = cb.snapshot()
    assert snap.pid == out["pid"]  # one writer: the parent
    assert snap.launches == 2000 + 2 * 2000  # the child's launches are counted too


def test_graph_launch_is_charged_its_cost(agent, gpu):
    cb = agent.block(request_quota=0.4)
    out = finish(spawn(launch_env(cb.path, gpu), "-m", "graph", "-k", "k_100", "-g", "8",
                       "-t", "1.6"))
    got = shares(gpu, out["pid"], 0.5, skip_s=0.2)
    assert got and all(abs(s - 0.4) <= 0.05 for s in got), got
    snap = cb.snapshot()
    # each graph is about 800 µs of busy time
    assert snap.busy_us / snap.launches == pytest.approx(800, rel=0.1)


def test_not_ready_answers(gpu):
    code = (
        "from dilu.interceptor.cuda import Driver\n"
        "d = Driver.load(); f = d.function('long'); a = d.event(); b = d.event()\n"
        "d.record(a); d.launch(f, 30000.0); d.record(b)\n"
        "busy = (d.stream_ready(), d.event_ready(b))\n"
        "d.synchronize()\n"
        "print(busy, d.stream_ready(), d.event_ready(b), round(d.elapsed_ms(a, b), 3))\n"
    )
    env = launch_env("/dev/shm/dilu-cb-none", gpu)
    proc = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    busy, idle_stream, idle_event, ms = proc.stdout.split(")")[0] + ")", *proc.stdout.split(")")[1].split()
    assert busy == "(False, False)"  # CUDA_ERROR_NOT_READY while the 30 ms kernel runs
    assert (idle_stream, idle_event) == ("True", "True")
    # read on the device clock: the kernel's 30 ms plus the host's time between the two calls
    assert 30.0 <= float(ms) < 40.0


def test_a_process_killed_mid_run_does_not_stall_the_device(agent, gpu):
    import signal
    a = agent.block(request_quota=1.0)
    b = agent.block(request_quota=1.0)
    doomed = spawn(launch_env(a.path, gpu), "-k", "k_300", "-t", "5")
    survivor = spawn(launch_env(b.path, gpu), "-k", "k_300", "-t", "1.5")
    time.sleep(0.5)
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate()
    t_kill = time.monotonic_ns()
    out = finish(survivor, timeout=30)
    recs = timeline.read_array(gpu)
    # the survivor kept the device busy after the kill, with the width the dead one held freed
    assert timeline.busy_share(recs, out["pid"], t_kill + SEC // 10, timeline.span(recs, out["pid"])[1]) > 0.9
