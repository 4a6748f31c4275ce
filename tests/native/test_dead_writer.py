"""A writer killed mid-write (its seqlock sequence left odd) blocks and spins no one.

"Killed mid-write" is simulated by leaving a sequence odd through the block's raw memory. Every
call runs under a generous timeout that only stops a hang from hanging the suite (no speed claim).
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import REGISTRY

from dilu.interceptor import timeline
from dilu.interceptor.control_block import ControlBlock
from dilu.services.node_agent import accounting
from native_helpers import finish, launch_env, spawn

pytestmark = pytest.mark.native

HANG = 20  # s: a call that has not returned by then is taken for hung


def bounded(fn, *args):
    """fn(*args), failing the test when it has not returned within HANG s (a spinning reader; a
    daemon thread, so a reader that never returns cannot hold the test run at exit either)."""
    done, box = threading.Event(), {}

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the test
            box["error"] = exc
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(HANG), f"{fn.__qualname__} did not return within {HANG} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def torn_count(group: str) -> float:
    return REGISTRY.get_sample_value("dilu_cb_torn_reads_total", {"group": group}) or 0.0


def test_snapshot_gives_up_on_a_dead_telemetry_writer(agent):
    cb = agent.block(request_quota=0.5)
    raw = cb._cb
    raw.t_launches, raw.t_busy_us = 5, 700  # a writer's last complete write (t_seq even)
    good = cb.snapshot()
    assert not good.torn and good.launches == 5
    before = torn_count("telemetry")
    raw.t_seq += 1  # the writer starts its next write ...
    raw.t_launches, raw.t_busy_us = 99, 1  # ... gets half-way and is killed
    snap = bounded(cb.snapshot)
    assert snap.torn and (snap.launches, snap.busy_us) == (5, 700)  # the last good values
    assert cb.torn_reads == 1 and torn_count("telemetry") == before + 1
    again = bounded(cb.snapshot)  # the same dead writer: gives up at once, counted again
    assert again.torn and again.launches == 5 and cb.torn_reads == 2
    fresh = ControlBlock.open(cb.path)  # a reader with no good reading yet gets the fields as they are
    try:
        first = bounded(fresh.snapshot)
        assert first.torn and first.launches == 99 and fresh.torn_reads == 1
    finally:
        fresh.close()


def test_a_new_interceptor_repairs_the_dead_writers_sequence(agent, gpu):
    cb = agent.block(request_quota=1.0)
    cb._cb.t_seq = 7  # the previous instance process died inside its telemetry write
    assert bounded(cb.snapshot).torn
    out = finish(spawn(launch_env(cb.path, gpu), "-k", "k_50", "-n", "20"), timeout=HANG)
    assert out["launches"] == 20
    assert cb._cb.t_seq % 2 == 0 and cb._cb.t_seq > 7
    snap = cb.snapshot()
    assert not snap.torn and snap.launches == 20 and snap.pid == out["pid"]


def test_grant_writer_repairs_its_own_dead_write():
    path = f"/dev/shm/dilu-cb-test-grant-{time.monotonic_ns()}"
    cb = ControlBlock.create(path, "g", request_quota=0.2, width=1.0)
    try:
        cb.write_grant(0.4)
        assert not cb.snapshot().torn
        before = torn_count("grant")
        cb._cb.grant_seq += 1  # the agent died inside write_grant
        cb._cb.quota_ppm = 123
        snap = bounded(cb.snapshot)
        assert snap.torn and snap.quota == 0.4 and torn_count("grant") == before + 1
        assert cb.write_grant(0.6) == 2  # the restarted agent's next grant repairs the sequence
        assert cb._cb.grant_seq % 2 == 0
        snap = cb.snapshot()
        assert not snap.torn and snap.quota == 0.6
    finally:
        cb.close()
        cb.unlink()


def test_launching_process_never_blocks_on_a_dead_grant_writer(agent, gpu):
    """The agent was killed inside write_grant: the interceptor runs at the request quota."""
    cb = agent.block(request_quota=0.3)
    cb.write_grant(0.9)
    cb._cb.grant_seq += 1  # killed mid-write of the next grant
    cb._cb.quota_ppm = 1_000_000  # half-written: must not be used
    out = finish(spawn(launch_env(cb.path, gpu, request_quota=0.3), "-k", "k_100", "-t", "1.2"),
                 timeout=HANG)
    recs = timeline.read_array(gpu)
    t0, t1 = timeline.span(recs, out["pid"])
    share = timeline.busy_share(recs, out["pid"], t0 + 300_000_000, t1)
    assert abs(share - 0.3) <= 0.05, share  # the fail-safe rate, not the torn 1.0 nor the old 0.9
    reader = ControlBlock.open(cb.path)
    try:
        snap = bounded(reader.snapshot)  # torn grant group, telemetry as written
        assert snap.torn and snap.grant_torn and snap.torn_grant_reads >= 1
        assert snap.applied_quota == pytest.approx(0.3) and snap.launches == out["launches"]
    finally:
        reader.close()


def test_stuck_sample_loop_turns_the_agent_not_ready(monkeypatch):
    """The agent's sample loop stops completing rounds (a read that never returns): /readyz says
    503 once the bound has passed, and 200 again when rounds resume."""
    from dilu.services.node_agent.service import NodeAgent

    monkeypatch.setattr(accounting, "SAMPLE_STALL_MIN_S", 1.0)
    node = NodeAgent(node="stuck", gpus=0, sample_ms=10.0, telemetry_ms=1000.0)
    node._started = True
    release = threading.Event()

    class Inst:
        class placement:
            instance_id = "i-1"

    async def stuck_sample(inst, now):
        while not release.is_set():  # stands in for a snapshot spinning on a dead writer
            await asyncio.sleep(0.01)

    monkeypatch.setattr(node, "_sample", stuck_sample)
    node.instances["i-1"] = Inst()
    seen = {}

    async def run():
        loop_task = asyncio.create_task(node._sample_loop())
        await asyncio.sleep(0.1)
        seen["early"] = node.ready()
        await asyncio.sleep(1.5)
        seen["stuck"] = node.ready()
        release.set()
        node.instances.clear()
        await asyncio.sleep(0.2)
        seen["resumed"] = node.ready()
        loop_task.cancel()

    asyncio.run(asyncio.wait_for(run(), HANG))
    assert seen == {"early": True, "stuck": False, "resumed": True}


def test_sample_loop_stall_bound():
    stalled = accounting.sample_loop_stalled
    assert not stalled(100.0, 100.0 + accounting.SAMPLE_STALL_MIN_S - 0.01, 0.01)
    assert stalled(100.0, 100.0 + accounting.SAMPLE_STALL_MIN_S + 0.01, 0.01)
    assert not stalled(100.0, 100.0 + 9.9, 1.0) and stalled(100.0, 100.0 + 10.1, 1.0)
