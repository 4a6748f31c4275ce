"""The pure side of ``dilu chaos``: fault schedule, request tally, recovery time, soak slopes."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilu.loadgen import chaos
from dilu.loadgen.generator import Record

S = 1_000_000_000  # ns per s


def rec(i, status="ok", sent_s=0.0, done_s=0.1, fn="f"):
    return Record(id=f"r{i}", function=fn, scheduled_ns=int(sent_s * S), sent_ns=int(sent_s * S),
                  done_ns=int(done_s * S), status=status)


def test_schedule_spreads_faults_in_order_between_lead_and_tail():
    faults = chaos.schedule(["kill-scheduler", "restart-nats", "kill-instance"], 100, lead_s=10, tail_s=30)
    assert [f.kind for f in faults] == ["kill-scheduler", "restart-nats", "kill-instance"]
    assert [f.at_s for f in faults] == pytest.approx([10, 30, 50])


def test_schedule_refuses_crowded_faults_and_names_the_duration_that_fits():
    with pytest.raises(ValueError, match="at least 104 s"):
        chaos.schedule(list(chaos.KINDS), 60, lead_s=20, tail_s=20)


def test_schedule_refuses_unknown_kinds():
    with pytest.raises(ValueError, match="unknown fault kinds"):
        chaos.schedule(["kill-everything"], 600, lead_s=0, tail_s=0)


def test_tally_places_every_request_and_counts_results_given_twice():
    records = [rec(0), rec(1, "error"), rec(2, "timeout"), rec(3, "dropped"), rec(4), rec(4)]
    t = chaos.tally(records, offered=7, duplicate_replies=3)
    assert (t.completed, t.failed, t.timed_out, t.dropped) == (3, 1, 1, 1)
    assert t.lost == 1  # 7 offered, 6 results of which one is a second result for r4
    assert t.duplicates == 3 and t.duplicates_to_caller == 1


@given(st.lists(st.sampled_from(["ok", "error", "timeout", "dropped"]), max_size=50))
def test_tally_adds_up_when_each_request_ends_once(statuses):
    t = chaos.tally([rec(i, s) for i, s in enumerate(statuses)], offered=len(statuses), duplicate_replies=0)
    assert t.lost == 0 and t.completed + t.failed + t.timed_out + t.dropped == t.offered


def test_recovery_waits_for_the_cluster_and_for_an_answer_sent_after_the_fault():
    start = 1_000 * S
    fault = chaos.Fault(kind="kill-node-agent", at_s=10, started_ns=start + 10 * S, whole_ns=start + 12 * S)
    # answered after the fault but sent before it: not evidence of recovery
    records = [rec(0, sent_s=9.9, done_s=10.5), rec(1, "error", sent_s=10.5, done_s=11), rec(2, sent_s=11, done_s=14)]
    assert chaos.recovery_s(fault, records, start) == pytest.approx(4.0)
    # the cluster whole later than the first answer: that is the recovery
    fault.whole_ns = start + 20 * S
    assert chaos.recovery_s(fault, records, start) == pytest.approx(10.0)


def test_each_timeout_goes_to_the_latest_fault_injected_before_it_was_sent():
    start = 500 * S
    a = chaos.Fault(kind="kill-scheduler", at_s=10, started_ns=start + 10 * S)
    skipped = chaos.Fault(kind="restart-nats", at_s=20)  # never injected (the run was stopped)
    b = chaos.Fault(kind="kill-instance", at_s=30, started_ns=start + 31 * S)
    records = [rec(0, "timeout", sent_s=5), rec(1, "timeout", sent_s=10), rec(2, "timeout", sent_s=25),
               rec(3, "timeout", sent_s=30.5), rec(4, "timeout", sent_s=31), rec(5, sent_s=40), rec(6, "error", sent_s=50)]
    assert chaos.timeouts_by_fault([a, skipped, b], records, start) == 1  # r0, before any fault
    assert (a.timed_out, skipped.timed_out, b.timed_out) == (3, 0, 1)
    assert chaos.timeouts_by_fault([a, skipped, b], [], start) == 0 and a.timed_out == 0  # counts are reset


def test_no_recovery_without_an_answer_or_a_whole_cluster():
    start = 0
    fault = chaos.Fault(kind="kill-instance", at_s=1, started_ns=1 * S, whole_ns=2 * S, function="g")
    assert chaos.recovery_s(fault, [rec(0, sent_s=1.5, done_s=1.6, fn="f")], start) is None  # only f answered
    assert chaos.recovery_s(fault, [rec(0, sent_s=1.5, done_s=1.6, fn="g")], start) == pytest.approx(1.0)
    fault.whole_ns = 0
    assert chaos.recovery_s(fault, [rec(0, sent_s=1.5, done_s=1.6, fn="g")], start) is None


def test_slopes_per_minute_and_flat_series():
    samples = [chaos.Sample(process="agent", t_s=60.0 * m, private_bytes=100 + 7 * m, fds=20, threads=5 + m)
               for m in range(5)]
    s = chaos.slopes(samples + [chaos.Sample(process="short", t_s=0.0), chaos.Sample(process="short", t_s=9.0)])
    assert set(s) == {"agent"}  # two readings tell no slope
    assert s["agent"].private_bytes_per_min == pytest.approx(7.0)
    assert s["agent"].fds_per_min == 0.0 and s["agent"].threads_per_min == pytest.approx(1.0)
    assert s["agent"].minutes == pytest.approx(4.0) and s["agent"].samples == 5
    assert s["agent"].private_bytes_per_min_settled == pytest.approx(7.0)  # a steady leak stays one


def test_a_heap_that_fills_then_holds_is_no_slope_after_its_warm_up():
    """Growth in the first quarter of the span, then a sawtooth around a level (a Go heap)."""
    level = [0, 6, 12, 18, 20, 22, 18, 22, 18, 22, 18, 22, 18, 22, 18, 22, 20]  # MiB, one a minute
    samples = [chaos.Sample(process="nats-server", t_s=60.0 * m, private_bytes=v * 2**20) for m, v in enumerate(level)]
    s = chaos.slopes(samples)["nats-server"]
    assert s.private_bytes_per_min > 0.3 * 2**20  # across the warm-up it looks like a leak
    assert abs(s.private_bytes_per_min_settled) < 0.05 * 2**20


def test_own_bytes_leave_out_shared_memory_segments_and_clean_file_pages():
    from types import SimpleNamespace as M

    maps = [M(path="[heap]", private_dirty=4096, private_clean=0, swap=8192),
            M(path="[anon]", private_dirty=1000, private_clean=0, swap=0),
            M(path="/usr/lib/libfoo.so", private_dirty=200, private_clean=50_000, swap=0),  # clean: left out
            M(path="/dev/shm/dilu-gpu-dilu-1-n-r-g0", private_dirty=30_000_000, private_clean=0, swap=0),
            M(path="/dev/shmx/other", private_dirty=7, private_clean=0, swap=0)]  # not under /dev/shm/
    assert chaos.own_bytes(maps) == 4096 + 8192 + 1000 + 200 + 7
    assert chaos.own_bytes(maps, shm_dir="/dev/shm/") == 4096 + 8192 + 1000 + 200 + 7
    assert chaos.own_bytes([]) == 0


@pytest.mark.parametrize("count", range(len(chaos.KINDS) + 1))
def test_the_shortest_run_for_n_faults_schedules_them_and_a_shorter_one_does_not(count):
    kinds = list(chaos.KINDS[:count])
    shortest = chaos.min_duration_s(count)
    lead, tail = chaos.margins_s(shortest)
    assert len(chaos.schedule(kinds, shortest, lead_s=lead, tail_s=tail)) == count
    if count:
        lead, tail = chaos.margins_s(shortest - 0.01)
        with pytest.raises(ValueError, match="need a run of at least"):
            chaos.schedule(kinds, shortest - 0.01, lead_s=lead, tail_s=tail)


def test_the_margins_are_fixed_or_a_share_of_a_short_run():
    assert chaos.margins_s(600) == (chaos.LEAD_S, chaos.TAIL_S)
    assert chaos.margins_s(60) == pytest.approx((10, 12))
    assert chaos.min_duration_s(len(chaos.KINDS)) == pytest.approx(98.75)  # 15 + 8 x 8 + 98.75 / 5
