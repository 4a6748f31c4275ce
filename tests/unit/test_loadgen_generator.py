"""Open-loop generator in virtual time: latency from the scheduled send, late sends, accounting.

Every test runs on :class:`VirtualTimeEventLoop`, so the asserted times are computed, never
measured against a wall clock.
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from dilu.loadgen.arrivals import Invocation, plan_replay
from dilu.loadgen.clock import LoopClock, VirtualTimeEventLoop
from dilu.loadgen.generator import OpenLoopGenerator, Outcome
from dilu.loadgen.report import FunctionMeta, RunFacts, RunInfo, build_report, run_info
from dilu.loadgen.trace import read_trace, write_trace

MS = 1_000_000
S = 1_000_000_000


def run_virtual(coro_factory):
    loop = VirtualTimeEventLoop()
    try:
        return loop.run_until_complete(coro_factory(loop))
    finally:
        loop.close()


def steady(rate_per_s: float, seconds: float, function: str = "f") -> list[Invocation]:
    n = round(rate_per_s * seconds)
    gap = round(S / rate_per_s)
    return [Invocation(id=f"r{i}", function=function, scheduled_ns=i * gap, trace_minute=0) for i in range(n)]


def single_server(service_s: float):
    """A fake instance with concurrency 1 and a fixed service time; FIFO (asyncio.Lock is fair)."""
    lock = asyncio.Lock()

    async def invoke(inv: Invocation) -> Outcome:
        async with lock:
            await asyncio.sleep(service_s)
        return Outcome(status="ok")

    return invoke


# ------------------------------------------------------------------------ issue 6, case 9


def test_case9_latency_counts_from_the_scheduled_send():
    invs = steady(20, 10)  # 200 requests, one every 50 ms

    async def main(loop):
        return await OpenLoopGenerator(single_server(0.1), clock=LoopClock()).run(invs)

    result = run_virtual(main)
    lat = [r.latency_ns / S for r in result.records]
    assert len(lat) == 200
    # request i waits for the i requests before it: done at 0.1 (i + 1), scheduled at 0.05 i
    assert sum(lat) / len(lat) == pytest.approx(5.075, abs=1e-3)
    assert max(lat) == pytest.approx(10.05, abs=1e-3)
    assert result.late_sends == 0
    assert max(r.late_ns for r in result.records) < 1000  # open loop: no send waited (ns float rounding only)
    # and the report says so, from the HDR histogram
    plan_meta = {"f": FunctionMeta(model="bert_base", slo_ms=500)}
    report = build_report(result.records, plan_meta, RunFacts(), RunInfo(wall_s=result.wall_s))
    assert 5.0e3 <= report.totals.latency_ms.p50 <= 5.1e3
    assert report.totals.latency_ms.p999 == pytest.approx(10.05e3, rel=1e-3)


def test_case9_a_stalled_generator_sends_late_but_latency_still_counts_from_schedule():
    invs = steady(20, 10)
    stalled = []

    async def stall(inv: Invocation) -> None:
        # a 2 s stall of the generator's own loop, right when request 100 (t = 5 s) is due
        if inv.id == "r100":
            stalled.append(inv.id)
            await asyncio.sleep(2.0)

    async def main(loop):
        return await OpenLoopGenerator(single_server(0.1), clock=LoopClock(), before_send=stall).run(invs)

    result = run_virtual(main)
    assert stalled == ["r100"]
    # requests scheduled in [5.00, 6.95] s all go out at 7.00 s
    assert result.late_sends == 40
    assert result.max_late_ms == pytest.approx(2000, abs=1)
    late = [r for r in result.records if r.late_ns > 10 * MS]
    assert {r.id for r in late} == {f"r{i}" for i in range(100, 140)}
    assert all(r.sent_ns == pytest.approx(7 * S, abs=1000) for r in late)
    # the server stayed busy through the stall (backlog), so the schedule-based latencies are
    # exactly those of the unstalled run; a latency taken from the actual send would be lower
    lat = [r.latency_ns / S for r in result.records]
    assert sum(lat) / len(lat) == pytest.approx(5.075, abs=1e-3)
    assert max(lat) == pytest.approx(10.05, abs=1e-3)
    since_send = [(r.done_ns - r.sent_ns) / S for r in result.records]
    assert sum(since_send) / len(since_send) < 5.075 - 0.2


def test_a_stall_that_blocks_the_whole_process_shifts_every_later_answer():
    invs = steady(20, 10)

    async def main(loop):
        async def freeze(inv):
            if inv.id == "r100":
                loop.advance(2.0)  # like a blocking call: nothing runs for 2 s, timers fall due

        return await OpenLoopGenerator(single_server(0.1), clock=LoopClock(), before_send=freeze).run(invs)

    result = run_virtual(main)
    assert result.late_sends == 40
    # the server froze too, so the last answer comes 2 s later: 12.05 s after its schedule
    assert max(r.latency_ns for r in result.records) / S == pytest.approx(12.05, abs=2e-3)


# ------------------------------------------------------------------------ issue 6, case 10


def test_case10_every_invocation_offered_once_and_accounted(tmp_path):
    counts = {f"steady{i:03d}": [1] * 10 for i in range(100)}
    counts["F"] = [5, 0, 0, 5, 0, 0, 0, 0, 0, 0]
    plan = plan_replay(read_trace(write_trace(tmp_path, counts, first_minute=0)), seed=9, duration_s=600,
                       speedup=1, functions="all")
    rng = random.Random(4)
    fates = {inv.id: rng.choice(["ok"] * 7 + ["dropped", "error", "timeout", "raise", "hang"]) for inv in plan.invocations}

    async def invoke(inv: Invocation) -> Outcome:
        await asyncio.sleep(0.05)
        fate = fates[inv.id]
        if fate == "raise":
            raise RuntimeError("instance crashed")
        if fate == "hang":
            await asyncio.sleep(3600)
        return Outcome(status=fate, cold_start=inv.trace_minute == 0)

    async def main(loop):
        gen = OpenLoopGenerator(invoke, clock=LoopClock(), request_timeout_s=5.0)
        return await gen.run(plan.invocations, duration_s=plan.duration_s)

    result = run_virtual(main)
    ids = Counter(r.id for r in result.records)
    assert set(ids) == {i.id for i in plan.invocations} and set(ids.values()) == {1}
    status = Counter(r.status for r in result.records)
    want = Counter(fates.values())
    assert status["ok"] == want["ok"] and status["dropped"] == want["dropped"]
    assert status["error"] == want["error"] + want["raise"]
    assert status["timeout"] == want["timeout"] + want["hang"]

    meta = {f.name: FunctionMeta(model="resnet152", slo_ms=100) for f in plan.functions}
    report = build_report(result.records, meta, RunFacts(), run_info(plan, result))
    t = report.totals
    assert t.offered == len(plan.invocations) == 1010
    assert t.offered == t.completed + t.dropped + t.failed + t.timed_out
    for f in report.functions:
        assert f.offered == f.completed + f.dropped + f.failed + f.timed_out
    assert next(f for f in report.functions if f.name == "fn-f").offered == 10


# --------------------------------------------------------------------------- stop and drain


def test_stop_ends_sending_and_drains_what_is_in_flight():
    invs = steady(10, 100)  # 1000 planned over 100 s

    async def main(loop):
        gen = OpenLoopGenerator(single_server(0.05), clock=LoopClock(), drain_timeout_s=30)
        loop.call_later(10.02, gen.stop)
        return await gen.run(invs)

    result = run_virtual(main)
    assert result.stopped
    assert len(result.records) == 101 and result.not_sent == 899  # sent at 0.0 .. 10.0 s
    assert all(r.status == "ok" for r in result.records)
    assert result.wall_s == pytest.approx(10.05, abs=1e-3)


def test_requests_unanswered_at_drain_timeout_count_as_timed_out():
    invs = steady(1, 3)

    async def never(inv):
        await asyncio.sleep(3600)
        return Outcome()

    async def main(loop):
        return await OpenLoopGenerator(never, clock=LoopClock(), drain_timeout_s=4).run(invs)

    result = run_virtual(main)
    assert [r.status for r in result.records] == ["timeout"] * 3
    assert result.wall_s == pytest.approx(2 + 4, abs=1e-3)  # last send at 2 s, then 4 s of drain
    assert all("before the run ended" in r.detail for r in result.records)


def test_outcome_done_time_is_used_when_given():
    invs = steady(1, 2)

    async def stamped(inv):
        loop = asyncio.get_running_loop()
        return Outcome(done_ns=round(loop.time() * 1e9) + 250 * MS)  # e.g. a reply timestamp

    async def main(loop):
        return await OpenLoopGenerator(stamped, clock=LoopClock()).run(invs)

    result = run_virtual(main)
    assert [r.latency_ns for r in result.records] == [250 * MS, 250 * MS]


def test_an_idle_tail_is_waited_out_and_an_empty_replay_still_lasts():
    async def main(loop):
        gen = OpenLoopGenerator(single_server(0.1), clock=LoopClock())
        return await gen.run(steady(1, 3), duration_s=60)  # sends at 0, 1, 2 s; then idle

    result = run_virtual(main)
    assert len(result.records) == 3 and result.wall_s == pytest.approx(60, abs=1e-6)

    async def empty(loop):
        gen = OpenLoopGenerator(single_server(0.1), clock=LoopClock())
        loop.call_later(5, gen.stop)  # stop interrupts the idle wait
        return await gen.run([], duration_s=60)

    result = run_virtual(empty)
    assert result.records == [] and result.stopped and result.wall_s == pytest.approx(5, abs=1e-6)


def test_progress_bar_reports_sent_and_answered():
    from rich.console import Console

    console = Console(record=True, width=120, force_terminal=False)

    async def main(loop):
        return await OpenLoopGenerator(single_server(0.01), clock=LoopClock(), progress=True, console=console).run(steady(10, 2))

    result = run_virtual(main)
    text = console.export_text()
    assert len(result.records) == 20
    assert "replay: sent" in text and "20/20" in text and "late 0" in text


def test_a_misbehaving_invoke_is_a_counted_failure_never_a_lost_request():
    async def sloppy(inv):
        if inv.id == "r0":
            return None  # not an Outcome
        if inv.id == "r1":
            return Outcome(status="weird")  # not a known status
        raise ValueError("bad payload")

    async def main(loop):
        return await OpenLoopGenerator(sloppy, clock=LoopClock()).run(steady(1, 3))

    result = run_virtual(main)
    assert [(r.id, r.status) for r in result.records] == [("r0", "error"), ("r1", "error"), ("r2", "error")]
    assert "NoneType" in result.records[0].detail and "bad payload" in result.records[2].detail


async def test_the_real_clock_never_returns_before_the_deadline_when_a_sleep_ends_early(monkeypatch):
    """uvloop's timers run on a cached ms clock, so a sleep can end up to ~1 ms early on
    ``time.monotonic_ns``: the clock sleeps the rest instead of letting a send leave early.
    The monotonic clock is faked too, so the early wake is exact however loaded the host is."""
    from dilu.loadgen import clock as clock_mod

    now, asked = [1_000_000_000], []

    async def early_sleep(delay_s):  # wakes up to 1 ms early, as a cached loop clock can (time still moves on)
        asked.append(delay_s)
        ns = round(delay_s * 1e9)
        now[0] += max(ns - 1_000_000, ns // 2 + 1)

    monkeypatch.setattr(clock_mod.time, "monotonic_ns", lambda: now[0])
    monkeypatch.setattr(clock_mod.asyncio, "sleep", early_sleep)
    c = clock_mod.MonotonicClock()
    deadline = c.now_ns() + 3_000_000
    await c.sleep_until(deadline)
    assert c.now_ns() >= deadline and len(asked) >= 2
