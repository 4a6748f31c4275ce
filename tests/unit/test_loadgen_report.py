"""Report definitions (DESIGN.md section 8) on synthetic records with known answers."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from dilu.loadgen.generator import Record
from dilu.loadgen.report import (
    FunctionFacts, FunctionMeta, Mechanism, Report, RunFacts, RunInfo, build_report, read_report, render,
    render_compare, write_report,
)

MS = 1_000_000


def rec(i: int, fn: str, latency_ms: float, status: str = "ok", scheduled_ms: float = 0.0, cold: bool = False) -> Record:
    sched = round(scheduled_ms * MS)
    return Record(id=f"{fn}-{i}", function=fn, scheduled_ns=sched, sent_ns=sched, done_ns=sched + round(latency_ms * MS),
                  status=status, cold_start=cold)


META = {"a": FunctionMeta(model="bert_base", slo_ms=100), "b": FunctionMeta(model="llama2", slo_ms=1000),
        "c": FunctionMeta(model="resnet152", slo_ms=50)}
FACTS = RunFacts(
    functions={"a": FunctionFacts(instance_launches=3, quota_seconds=12.5), "b": FunctionFacts(instance_launches=1, quota_seconds=40.0)},
    active_gpu_seconds=80.0, allocation_fragmentation=0.25, idle_fragmentation=0.6,
    mechanism=Mechanism(profiler_trials=17, grant_changes=9, token_wait_ms=123.4, scale_outs=2, retirements=1, scale_to_zero=1,
                        parks=5, resumes=3),
)


def known_records() -> list[Record]:
    """a: latencies 1..1000 ms (SLO 100 ms: 100 good, 900 late), 10 dropped, 5 failed, 5 timed
    out, the first 7 cold; b: 10 answers at 5 s (SLO 1 s: all late); c: nothing."""
    out = [rec(i, "a", i + 1, scheduled_ms=i * 7, cold=i < 7) for i in range(1000)]
    out += [rec(1000 + i, "a", 0, status=s) for i, s in enumerate(["dropped"] * 10 + ["error"] * 5 + ["timeout"] * 5)]
    out += [rec(i, "b", 5000) for i in range(10)]
    return out


def report() -> Report:
    return build_report(known_records(), META, FACTS, RunInfo(wall_s=10.0, policy="dilu", functions=3))


def test_per_function_figures_follow_the_pinned_definitions():
    by = {f.name: f for f in report().functions}
    a, b, c = by["a"], by["b"], by["c"]
    assert (a.offered, a.completed, a.dropped, a.failed, a.timed_out) == (1020, 1000, 10, 5, 5)
    assert a.slo_violation_rate == pytest.approx((900 + 20) / 1020)
    assert a.goodput_rps == pytest.approx(100 / 10.0)  # within SLO, per wall second
    assert a.latency_ms.p50 == pytest.approx(500, rel=1e-3)
    assert a.latency_ms.p99 == pytest.approx(990, rel=1e-3)
    assert a.latency_ms.p999 == pytest.approx(999, rel=1e-3)
    assert (a.cold_start_requests, a.instance_launches, a.quota_seconds) == (7, 3, 12.5)
    assert (b.slo_violation_rate, b.goodput_rps, b.latency_ms.p50) == (1.0, 0.0, pytest.approx(5000, rel=1e-3))
    assert (c.offered, c.slo_violation_rate, c.latency_ms.p50, c.instance_launches) == (0, 0.0, None, 0)
    assert [f.name for f in report().functions] == ["a", "b", "c"]  # most offered first


def test_totals_come_from_all_requests_not_from_averaging_percentiles():
    t = report().totals
    assert t.offered == 1030 == t.completed + t.dropped + t.failed + t.timed_out
    # 1010 latencies: 1..1000 ms and ten of 5000 ms. Nearest rank: p99 -> the 1000th = 1000 ms,
    # p99.9 -> the 1009th = 5000 ms (the mean of the functions' p99s would say 2995 ms)
    assert t.latency_ms.p99 == pytest.approx(1000, rel=1e-3)
    assert t.latency_ms.p999 == pytest.approx(5000, rel=1e-3)
    assert t.slo_violation_rate == pytest.approx((900 + 20 + 10) / 1030)
    assert t.goodput_rps == pytest.approx(10.0)
    assert (t.instance_launches, t.quota_seconds, t.cold_start_requests) == (4, 52.5, 7)
    assert (t.active_gpu_seconds, t.allocation_fragmentation, t.idle_fragmentation) == (80.0, 0.25, 0.6)


def test_json_has_the_specified_shape_and_round_trips(tmp_path):
    r = report()
    d = r.to_dict()
    assert set(d) == {"totals", "functions", "mechanism", "run"}
    keys = {"offered", "completed", "dropped", "failed", "timed_out", "goodput_rps", "slo_violation_rate",
            "latency_ms", "cold_start_requests", "instance_launches", "quota_seconds"}
    assert set(d["totals"]) == keys | {"active_gpu_seconds", "allocation_fragmentation", "idle_fragmentation"}
    assert set(d["functions"][0]) == keys | {"name", "model", "slo_ms"}
    assert set(d["totals"]["latency_ms"]) == {"p50", "p99", "p999"}
    assert set(d["mechanism"]) == {"profiler_trials", "grant_changes", "token_wait_ms", "scale_outs", "retirements",
                                   "scale_to_zero", "parks", "resumes", "migrations", "vertical_reaction_ms_p50",
                                   "vertical_reaction_ms_p99"}
    assert (d["mechanism"]["parks"], d["mechanism"]["resumes"]) == (5, 3)
    path = tmp_path / "r.json"
    write_report(r, path)
    assert json.loads(path.read_text()) == d
    assert read_report(path) == r
    (tmp_path / "bad.json").write_text('{"totals": 3}')
    with pytest.raises(ValueError, match="bad.json: not a Dilu report"):
        read_report(tmp_path / "bad.json")


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="'zzz', which is not among the replayed functions"):
        build_report([rec(0, "zzz", 1)], META, FACTS, RunInfo(wall_s=1))
    with pytest.raises(ValueError, match="wall_s must be positive"):
        build_report([], META, FACTS, RunInfo(wall_s=0))


def test_render_shows_functions_totals_and_mechanism():
    console = Console(record=True, width=250)
    render(report(), console)
    text = console.export_text()
    for needle in ("a", "bert_base", "llama2", "total", "1,030", "90.2 %", "90.3 %", "17", "123.4", "25.0 %", "60.0 %"):
        assert needle in text
    lines = text.splitlines()
    assert any(line.startswith("│ parks ") and " 5 " in line for line in lines)
    assert any(line.startswith("│ resumes ") and " 3 " in line for line in lines)


def test_a_report_written_before_parking_was_counted_reads_as_none_parked():
    d = report().to_dict()
    old = {k: v for k, v in d["mechanism"].items() if k not in ("parks", "resumes")}
    r = Report.from_dict({**d, "mechanism": old})
    assert (r.mechanism.parks, r.mechanism.resumes) == (0, 0)


def test_render_compare_puts_policies_side_by_side():
    good = report()
    d = good.to_dict()
    worse = Report.from_dict({**d, "totals": {**d["totals"], "goodput_rps": 3.0},
                              "mechanism": {**d["mechanism"], "grant_changes": 0, "vertical_reaction_ms_p99": 0.0}})
    console = Console(record=True, width=200)
    render_compare({"dilu": good, "exclusive": worse}, console)
    text = console.export_text()
    assert "dilu" in text and "exclusive" in text
    row = next(line for line in text.splitlines() if "goodput/s" in line)
    assert "10.00" in row and "3.00" in row
    # no grant changed in the second run: no reaction was measured, so it is not shown as 0.0
    react = next(line for line in text.splitlines() if "vertical reaction" in line)
    assert react.rstrip(" │").endswith("–")
    with pytest.raises(ValueError):
        render_compare({}, console)


latency_lists = st.lists(st.integers(0, 10**11), min_size=1, max_size=300)  # ns, up to 100 s


@settings(max_examples=60, deadline=None)
@given(latencies=latency_lists, statuses=st.lists(st.sampled_from(["dropped", "error", "timeout"]), max_size=300))
def test_percentiles_within_hdr_precision_and_accounting_holds(latencies, statuses):
    records = [Record(id=str(i), function="a", scheduled_ns=0, sent_ns=0, done_ns=v, status="ok")
               for i, v in enumerate(latencies)]
    records += [Record(id=f"x{i}", function="a", scheduled_ns=0, sent_ns=0, done_ns=0, status=s)
                for i, s in enumerate(statuses)]
    r = build_report(records, {"a": FunctionMeta(model="m", slo_ms=500)}, RunFacts(), RunInfo(wall_s=2.0))
    t = r.totals
    assert t.offered == len(records) == t.completed + t.dropped + t.failed + t.timed_out
    good = sum(v <= 500 * MS for v in latencies)
    assert t.goodput_rps == pytest.approx(good / 2.0)
    assert t.slo_violation_rate == pytest.approx((len(records) - good) / len(records))
    exact_us = sorted(max(v // 1000, 1) for v in latencies)
    for key, p in (("p50", 50), ("p99", 99), ("p999", 99.9)):
        rank = max(int(p / 100 * len(exact_us) + 0.5), 1)  # HDR's nearest-rank rule
        want = exact_us[rank - 1]
        got_us = getattr(t.latency_ms, key) * 1000
        assert want <= got_us + 1e-6 and got_us <= want * 1.001 + 1  # 3 significant digits, 1 µs unit
