"""The node agent's pure bookkeeping: window use, stretch detection, GPU-cost integrals."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilu.services.node_agent.accounting import Counters, GpuCost, Slot, stretch, window_use


def test_window_use_is_busy_time_over_wall_time():
    a = Counters(at_ns=0, busy_us=1_000, wait_us=10, launches=5)
    b = Counters(at_ns=100_000_000, busy_us=31_000, wait_us=2_010, launches=25)  # 100 ms later
    use = window_use(a, b)
    assert use.busy_share == pytest.approx(0.30)
    assert use.wait_us == 2_000 and use.launches == 20


def test_window_use_of_empty_or_reset_window_reads_zero():
    a = Counters(at_ns=5, busy_us=100)
    assert window_use(a, a).busy_share == 0.0
    # counters that went backwards (a restarted instance) never read as negative use
    assert window_use(a, Counters(at_ns=1_000_005, busy_us=0)).busy_share == 0.0


def test_stretch_needs_a_new_cycle_a_baseline_and_the_ratio():
    prev = Counters(at_ns=0, cycles=3, last_cycle_us=1000, baseline_cycle_us=1000)
    same = Counters(at_ns=1, cycles=3, last_cycle_us=5000, baseline_cycle_us=1000)
    assert stretch(prev, same) is None  # no cycle completed
    mild = Counters(at_ns=1, cycles=4, last_cycle_us=1200, baseline_cycle_us=1000)
    assert stretch(prev, mild) is None
    hard = Counters(at_ns=1, cycles=4, last_cycle_us=2500, baseline_cycle_us=1000)
    assert stretch(prev, hard) == pytest.approx(2.5)
    no_base = Counters(at_ns=1, cycles=4, last_cycle_us=2500, baseline_cycle_us=0)
    assert stretch(prev, no_base) is None


def test_a_cycle_slowed_by_its_own_token_waits_is_not_contention():
    prev = Counters(at_ns=0, cycles=3, wait_us=0, baseline_cycle_us=1000)
    throttled = Counters(at_ns=1, cycles=4, wait_us=1800, last_cycle_us=2600, baseline_cycle_us=1000)
    assert stretch(prev, throttled) is None  # 2600 - 1800 = 800 us of own work
    contended = Counters(at_ns=1, cycles=4, wait_us=200, last_cycle_us=2600, baseline_cycle_us=1000)
    assert stretch(prev, contended) == pytest.approx(2.4)


def test_gpu_cost_counts_only_active_gpus():
    cost = GpuCost()
    gpus = [[Slot("a", 0.25, 0.5, 0.4), Slot("b", 0.25, 0.25, 0.1)], []]
    cost.advance(2.0, gpus)
    assert cost.active_gpu_seconds == pytest.approx(2.0)
    assert cost.allocation_fragmentation == pytest.approx(0.5)
    assert cost.idle_fragmentation == pytest.approx(0.5)
    assert cost.quota_seconds == pytest.approx({"a": 1.0, "b": 0.5})


@given(st.lists(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)), max_size=4), min_size=1, max_size=4),
       st.floats(0.001, 10))
def test_fragmentations_stay_in_unit_interval(gpus, dt):
    cost = GpuCost()
    cost.advance(dt, [[Slot("f", r, q, u) for r, q, u in g] for g in gpus])
    assert 0.0 <= cost.allocation_fragmentation <= 1.0
    assert 0.0 <= cost.idle_fragmentation <= 1.0
    assert cost.active_gpu_seconds == pytest.approx(dt * sum(1 for g in gpus if g))
