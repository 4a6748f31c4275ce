"""Replay plan: exact minute counts, idle gaps, selection, partial minutes, determinism."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu.loadgen.arrivals import plan_replay
from dilu.loadgen.trace import read_trace, write_trace

NS = 1_000_000_000


def _trace_seconds(plan, inv) -> float:
    """An invocation's instant in trace seconds from the start of the span."""
    return inv.scheduled_ns * plan.speedup / NS


def _per_minute(plan) -> Counter:
    return Counter((inv.function, inv.trace_minute) for inv in plan.invocations)


@pytest.fixture
def case10_trace(tmp_path):
    """Issue 6 case 10: 100 functions at 1/min for 10 minutes, plus F with [5, 0, 0, 5]."""
    counts = {f"steady{i:03d}": [1] * 10 for i in range(100)}
    counts["F"] = [5, 0, 0, 5, 0, 0, 0, 0, 0, 0]
    return read_trace(write_trace(tmp_path, counts, first_minute=0))


def test_case10_trace_replay_fidelity(case10_trace):
    plan = plan_replay(case10_trace, seed=7, duration_s=600, speedup=1, functions="all")
    t = np.array([_trace_seconds(plan, inv) for inv in plan.invocations])
    assert len(t) == 1010 == plan.span_invocations == plan.selected_invocations
    # arrivals are spread within each minute, not bunched at its start
    first_second = np.count_nonzero(t % 60 < 1.0)
    assert first_second <= 0.05 * len(t)
    f_times = [_trace_seconds(plan, i) for i in plan.invocations if i.function == "fn-f"]
    assert len(f_times) == 10
    assert not [x for x in f_times if 60 <= x < 180]  # idle minutes stay idle
    assert sum(x < 60 for x in f_times) == 5 and sum(180 <= x < 240 for x in f_times) == 5
    # each (function, minute) count kept exactly; every id exactly once
    want = Counter({(f.name, m): c for f in case10_trace.functions for m, c in zip(case10_trace.minutes, f.counts) if c})
    assert _per_minute(plan) == want
    ids = [inv.id for inv in plan.invocations]
    assert len(set(ids)) == len(ids)
    assert plan.share == 1.0


def test_speedup_compresses_only_arrival_times(case10_trace):
    slow = plan_replay(case10_trace, seed=3, duration_s=600, speedup=1, functions="all")
    fast = plan_replay(case10_trace, seed=3, duration_s=60, speedup=10, functions="all")
    assert [(i.function, i.trace_minute) for i in slow.invocations] == [(i.function, i.trace_minute) for i in fast.invocations]
    for a, b in zip(slow.invocations, fast.invocations):
        assert abs(a.scheduled_ns - 10 * b.scheduled_ns) <= 10  # ns rounding only
    assert max(i.scheduled_ns for i in fast.invocations) < 60 * NS


def test_same_seed_same_plan_other_seed_other_times(case10_trace):
    a = plan_replay(case10_trace, seed=11, duration_s=120, speedup=5)
    b = plan_replay(case10_trace, seed=11, duration_s=120, speedup=5)
    c = plan_replay(case10_trace, seed=12, duration_s=120, speedup=5)
    assert a == b
    assert [i.scheduled_ns for i in a.invocations] != [i.scheduled_ns for i in c.invocations]


def test_partial_last_minute_is_a_prefix_of_the_longer_replay(case10_trace):
    full = plan_replay(case10_trace, seed=5, duration_s=600, speedup=1, functions="all")
    part = plan_replay(case10_trace, seed=5, duration_s=150, speedup=1, functions="all")  # 2.5 minutes
    cut = [(i.function, i.scheduled_ns) for i in full.invocations if i.scheduled_ns < 150 * NS]
    assert [(i.function, i.scheduled_ns) for i in part.invocations] == cut
    # roughly half of the third minute's 100 steady invocations are kept (binomial thinning)
    third = sum(1 for i in part.invocations if i.trace_minute == 2)
    assert 25 <= third <= 75
    assert part.duration_s == 150 and not part.clipped


def test_selection_takes_the_busiest_of_the_span_and_reports_their_share(tmp_path):
    trace = read_trace(write_trace(tmp_path, {
        "early": [50, 0, 0, 0], "late": [0, 0, 0, 90], "mid": [0, 20, 20, 0], "tiny": [1, 1, 1, 1], "idle": [0, 0, 0, 0],
    }))
    plan = plan_replay(trace, seed=1, duration_s=180, speedup=1, functions=2)  # minutes 1..3
    assert [f.name for f in plan.functions] == ["fn-early", "fn-mid"]
    assert plan.span_invocations == 50 + 40 + 3
    assert plan.share == pytest.approx(90 / 93)
    assert {i.function for i in plan.invocations} == {"fn-early", "fn-mid"}
    mid = plan.functions[1]
    assert (mid.invocations, mid.peak_minute_count, mid.peak_rps) == (40, 20, pytest.approx(20 / 60))
    every = plan_replay(trace, seed=1, duration_s=180, speedup=1, functions="all")
    assert {f.name for f in every.functions} == {"fn-early", "fn-mid", "fn-tiny"}  # idle in the span: not deployed


def test_start_minute_and_clipping(tmp_path):
    trace = read_trace(write_trace(tmp_path, {"a": [1, 2, 3, 4]}, first_minute=100))
    plan = plan_replay(trace, seed=0, duration_s=600, speedup=1, start_minute=102)
    assert plan.clipped and plan.duration_s == 120 and plan.requested_duration_s == 600
    assert Counter(i.trace_minute for i in plan.invocations) == {102: 3, 103: 4}
    with pytest.raises(ValueError, match="start minute 99 is outside the trace"):
        plan_replay(trace, seed=0, start_minute=99)


@pytest.mark.parametrize(
    "kwargs", [dict(seed=-1), dict(seed=1, duration_s=0), dict(seed=1, speedup=-2), dict(seed=1, functions=0),
               dict(seed=1, functions="some"), dict(seed=1, duration_s=float("nan"))],
)
def test_bad_arguments_are_rejected(case10_trace, kwargs):
    with pytest.raises(ValueError):
        plan_replay(case10_trace, **kwargs)


def test_bundled_trace_default_replay():
    plan = plan_replay(read_trace(), seed=42)
    assert plan.duration_s == 120 and plan.speedup == 10 and len(plan.functions) == 16
    # about 100 requests per second over 20 trace minutes (issue 2)
    assert 80 <= plan.selected_invocations / plan.duration_s <= 130
    assert 0.9 < plan.share <= 1.0
    assert all(0 <= i.scheduled_ns < 120 * NS for i in plan.invocations)
    assert [i.scheduled_ns for i in plan.invocations] == sorted(i.scheduled_ns for i in plan.invocations)


counts_matrix = st.integers(1, 5).flatmap(
    lambda m: st.lists(st.lists(st.integers(0, 30), min_size=m, max_size=m), min_size=1, max_size=6)
)


@settings(max_examples=40, deadline=None)
@given(counts=counts_matrix, seed=st.integers(0, 2**32), speedup=st.sampled_from([1, 2.5, 10, 60]))
def test_every_minute_count_is_exact_and_idle_minutes_stay_idle(tmp_path_factory, counts, seed, speedup):
    trace = read_trace(write_trace(tmp_path_factory.mktemp("t"), {f"h{i}": row for i, row in enumerate(counts)}))
    n = len(counts[0])
    plan = plan_replay(trace, seed=seed, duration_s=n * 60 / speedup, speedup=speedup, functions="all")
    want = Counter({(f.name, m): c for f in trace.functions for m, c in zip(trace.minutes, f.counts) if c})
    assert _per_minute(plan) == want
    for inv in plan.invocations:
        minute_start = (inv.trace_minute - trace.first_minute) * 60
        assert minute_start <= _trace_seconds(plan, inv) <= minute_start + 60
    assert len({i.id for i in plan.invocations}) == len(plan.invocations)
