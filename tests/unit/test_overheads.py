"""The simulator's overheads (loadgen/sim/overheads.py) and how dilu calibrate measures them from a
live run's logs (loadgen/sim/calibrate.py, loadgen/requestlog.py)."""
from __future__ import annotations

import calendar
import json
from pathlib import Path

import pytest

from dilu.loadgen import requestlog
from dilu.loadgen.generator import Record, RunResult, Timings
from dilu.loadgen.report import FunctionMeta, RunFacts, RunInfo, build_report
from dilu.loadgen.sim import calibrate as cal
from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads, OverheadsError, Sampler, quantiles
from dilu.services.common import models


def flat(v: float) -> tuple[float, ...]:
    return (v,) * QUANTILE_POINTS


def test_quantiles_are_the_percentiles_with_negatives_as_zero():
    q = quantiles([-5.0, *range(1, 101)])  # 101 values: -5 (as 0), 1, ..., 100
    assert len(q) == QUANTILE_POINTS and q[0] == 0.0 and q[1] == 1.0 and q[50] == 50.0 and q[100] == 100.0
    with pytest.raises(OverheadsError, match="no batch overhead measured"):
        quantiles([], "batch")


@pytest.mark.parametrize("table, error", [
    ((1.0,) * 10, "must hold 101 quantiles"),
    ((2.0, *(1.0,) * 100), "not non-decreasing"),
    ((-1.0, *(1.0,) * 100), "negative, non-finite or above 600,000 ms"),
    ((float("nan"),) * 101, "negative, non-finite or above 600,000 ms"),
    ((1e12,) * 101, "transport_ms holds a value that is negative, non-finite or above 600,000 ms"),
])
def test_a_malformed_table_is_refused(table, error):
    with pytest.raises(OverheadsError, match=error):
        Overheads(table, flat(1.0))
    for name in ("batch_ms", "pickup_ms", "dispatch_ms"):  # every table, by its name
        with pytest.raises(OverheadsError, match=name):
            Overheads(**{"transport_ms": flat(1.0), "batch_ms": flat(1.0), name: table})


def test_a_deploy_table_that_falls_is_refused():
    assert Overheads(flat(1.0), flat(1.0), process_start_initial_ms=(2000.0, 2000.0, 2100.0))
    with pytest.raises(OverheadsError, match="process_start_initial_ms is not non-decreasing"):
        Overheads(flat(1.0), flat(1.0), process_start_initial_ms=(2100.0, 2000.0))


@pytest.mark.parametrize("starts", [(400.0, -1.0), (float("nan"),), (4e9,)])
def test_a_process_start_table_out_of_range_is_refused(starts):
    with pytest.raises(OverheadsError, match="process_start_by_starting_ms must hold values in"):
        Overheads(flat(1.0), flat(1.0), process_start_by_starting_ms=starts)


def test_a_file_round_trips_and_a_bad_one_is_one_error_naming_it(tmp_path: Path):
    ov = Overheads.from_samples([1.0, 2.0, 3.0], [0.5, 4.0], 401.04, {"runs": ["a"]})
    path = tmp_path / "ov.json"
    path.write_bytes(ov.to_json())
    back = Overheads.read(path)
    assert back == ov and back.process_start_ms == 401.0 and back.transport_ms[50] == 2.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"transport_ms": [1, 2], "batch_ms": list(flat(1.0))}))
    with pytest.raises(OverheadsError, match=r"bad.json: not an overheads file \(transport_ms must hold 101"):
        Overheads.read(bad)
    with pytest.raises(OverheadsError, match="missing.json"):
        Overheads.read(tmp_path / "missing.json")


def test_the_sampler_draws_within_the_table_and_repeats_per_seed():
    table = quantiles(list(range(0, 1001)))  # uniform on 0..1000
    a, b = Sampler(table, "s-1"), Sampler(table, "s-1")
    draws = [a() for _ in range(20_000)]
    assert draws == [b() for _ in range(20_000)]
    assert draws != [Sampler(table, "s-2")() for _ in range(20_000)]
    assert 0 <= min(draws) and max(draws) <= 1000
    assert 480 < sum(draws) / len(draws) < 520  # the table's mean, 500
    assert all(Sampler(flat(3.0), 1)() == 3.0 for _ in range(10))


# ---------------------------------------------------------------- the live run's logs


def line(fn: str, inst: str, sched: int, enq: int, start: int, replied: int, done: int, batch: int,
         status: str = "ok") -> requestlog.RequestLine:
    ms = 1_000_000
    return requestlog.RequestLine(id=f"{inst}-{sched}", function=fn, status=status, scheduled_ns=sched * ms,
                                  sent_ns=sched * ms, done_ns=done * ms, instance=inst, enqueued_ns=enq * ms,
                                  started_ns=start * ms, replied_ns=replied * ms, batch=batch)


def test_transport_is_the_way_in_plus_the_way_back_of_answered_requests():
    lines = [line("f", "f-1", 0, 2, 10, 40, 43, 1), line("f", "f-1", 0, 1, 10, 40, 41, 1, status="timeout"),
             requestlog.RequestLine(id="x", function="f", status="ok", scheduled_ns=0, sent_ns=0, done_ns=5)]
    assert cal.transport_ms(lines) == [5.0]  # 2 in + 3 back; the timeout and the untimed one are left out


def test_a_batch_is_served_from_its_start_to_its_first_reply():
    lines = [line("f", "f-1", 0, 1, 10, 42, 45, 2), line("f", "f-1", 1, 2, 10, 40, 44, 2),  # one batch of 2
             line("f", "f-2", 0, 1, 10, 30, 31, 1), line("g", "g-1", 0, 1, 5, 25, 26, 1)]
    assert cal.live_services(lines) == {("f", 2): [30.0], ("f", 1): [20.0], ("g", 1): [20.0]}


def test_the_batch_overhead_is_live_less_simulated_quantile_by_quantile():
    live = {("f", 1): [s + 3.0 for s in range(100)], ("few", 1): [100.0] * 5, ("f", 2): [9.0] * 30}
    sim = {("f", 1): [s / 10 for s in range(1000)], ("few", 1): [1.0] * 50, ("f", 2): [10.0] * 40}
    got = cal.batch_overheads_ms(live, sim, min_batches=20)
    assert len(got) == 130  # one per live batch of the two kept; "few" has 5 live batches
    assert got[:100] == pytest.approx([3.0] * 100, abs=0.6)  # the same spread, 3 ms later
    assert got[100:] == pytest.approx([-1.0] * 30)  # faster than simulated: counted as 0 in the table
    assert Overheads.from_samples([1.0], got).batch_ms[0] == 0.0


def _ready(instance: str, cold_ms: float, ready_s: float) -> str:
    """A node agent's 'instance ready' line, ready ``ready_s`` s after 12:00:00 UTC."""
    ts = f"2026-01-01T12:00:{ready_s:09.6f}Z"
    return json.dumps({"event": "instance ready", "instance": instance, "cold_start_ms": cold_ms, "timestamp": ts})


def test_process_starts_count_the_launches_after_the_initial_ones_and_those_starting_beside_them(tmp_path: Path):
    log = tmp_path / "node_agent.log"
    cold = models.cold_start_ms("bert_base")
    lines = [_ready("a-0000000001", cold + 900, 10.0), _ready("b-0000000002", cold + 800, 10.5),  # the initial ones
             # a-3 launched at 20 s, alone; a-4 launched at 30 s, d-5 0.1 s later, while a-4 was starting
             _ready("a-0000000003", cold + 400, 20.0 + (cold + 400) / 1000),
             _ready("a-0000000004", cold + 1000, 30.0 + (cold + 1000) / 1000),
             _ready("b-0000000005", cold + 1200, 30.1 + (cold + 1200) / 1000)]
    log.write_text("not json\n" + "\n".join(lines) + "\n")
    got = cal.process_starts_ms(log, {"a": "bert_base", "b": "bert_base"})
    assert [k for k, _ in got.later] == [0, 0, 1]  # a-4 found none starting, b-5 found a-4
    assert [ms for _, ms in got.later] == pytest.approx([400.0, 1000.0, 1200.0], abs=0.01)
    # each function's first instance, in launch order: a-1 launched first, b-2 600 ms later
    assert [k for k, _ in got.initial] == [0, 1]
    assert [ms for _, ms in got.initial] == pytest.approx([900.0, 600.0 + 800.0], abs=0.01)
    log.write_text(json.dumps({"event": "instance ready", "instance": "a-1", "cold_start_ms": 1.0}) + "\n")
    with pytest.raises(ValueError, match="node_agent.log:1: not an 'instance ready' line .* field `timestamp`"):
        cal.process_starts_ms(log, {"a": "bert_base"})


def test_the_deploys_launches_are_up_by_launch_order_the_median_of_the_runs():
    initial = [(0, 2000.0), (1, 2100.0), (2, 2500.0),  # one run's three launches
               (0, 1800.0), (1, 2300.0), (2, 2200.0), (3, 2600.0),  # another's four
               (0, 2100.0), (1, 2000.0)]
    # medians 2000, 2100, 2350, 2600; a later launch is never up sooner than one before it
    assert cal.initial_by_order(initial) == pytest.approx([2000.0, 2100.0, 2350.0, 2600.0])
    assert cal.initial_by_order([(0, 900.0), (1, 800.0)]) == pytest.approx([900.0, 900.0])
    assert cal.initial_by_order([]) == []


@pytest.mark.parametrize("starts, table", [
    ([(0, 100.0)] * 12 + [(1, 200.0)] * 12 + [(2, 300.0)] * 12 + [(3, 400.0)] * 3, [100.0, 200.0, 300.0]),
    ([(0, 100.0)] * 12 + [(1, 200.0)] * 5 + [(2, 300.0)] * 12, [100.0, 300.0]),  # k=1 too few: pooled with 2
    ([(0, 100.0)] * 12 + [(1, 200.0)] * 12 + [(2, 300.0)] * 5 + [(3, 400.0)] * 4, [100.0, 200.0]),
    ([(0, 100.0)] * 12 + [(2, 300.0)] * 4, [100.0]),  # k=2 too few for an entry: pooled into k=0's
    ([(0, 100.0)] * 5, []),  # too few launches for any entry
])
def test_process_starts_by_those_starting_pool_what_is_too_few(starts, table):
    assert cal.starts_by_starting(starts, min_starts=10) == pytest.approx(table)


def test_the_request_log_holds_unix_times_and_names_a_bad_line(tmp_path: Path):
    rec = Record(id="r1", function="f", scheduled_ns=1_000, sent_ns=1_500, done_ns=9_000, status="ok",
                 timings=Timings(instance="f-1", enqueued_ns=10_002_000, started_ns=10_003_000,
                                 replied_ns=10_008_000, batch=3))
    lost = Record(id="r2", function="f", scheduled_ns=2_000, sent_ns=2_000, done_ns=30_000, status="timeout")
    result = RunResult(records=[rec, lost], wall_s=1.0, started_unix_ns=10_000_000, late_sends=0,
                       late_threshold_ms=10.0, max_late_ms=0.0)
    path = tmp_path / requestlog.FILENAME
    requestlog.write(path, result)
    a, b = requestlog.read(path)
    assert (a.scheduled_ns, a.sent_ns, a.done_ns) == (10_001_000, 10_001_500, 10_009_000)
    assert (a.instance, a.enqueued_ns, a.started_ns, a.replied_ns, a.batch) == ("f-1", 10_002_000, 10_003_000, 10_008_000, 3)
    assert b.status == "timeout" and b.instance == "" and b.batch == 0
    with path.open("a") as fh:
        fh.write('{"id": 3}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:3: not a request log line"):
        requestlog.read(path)


def test_a_request_log_whose_times_go_backwards_or_negative_is_refused(tmp_path: Path):
    path = tmp_path / requestlog.FILENAME
    good = dict(id="r", function="f", status="ok", scheduled_ns=10, sent_ns=9, done_ns=50, instance="f-1",
                enqueued_ns=8, started_ns=20, replied_ns=40, batch=1)  # sent and stored before scheduled: allowed
    path.write_text(json.dumps(good) + "\n")
    assert requestlog.read(path)[0].replied_ns == 40
    for bad, words in ((dict(good, started_ns=45), "times out of order"), (dict(good, done_ns=30), "times out of order"),
                       (dict(good, batch=-3), "not a request log line")):
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=rf"requests.jsonl:2: {words}"):
            requestlog.read(path)


ONE = [Record(id="r", function="f", scheduled_ns=1, sent_ns=1, done_ns=9, status="ok")]  # _log_dir's request


def _log_dir(d: Path, report: object = None, requests: str | None = None, node_log: str | None = None) -> Path:
    d.mkdir()
    if report is None:  # a live run's report as dilu demo writes it, of one function
        run = RunInfo(wall_s=10.0, policy="dilu", trace="t", functions=1, duration_s=10.0, speedup=10.0, seed=1, gpus=4)
        report = build_report(ONE, {"f": FunctionMeta(model="bert_base", slo_ms=80.0)}, RunFacts(), run).to_dict()
    (d / requestlog.REPORT_FILENAME).write_text(json.dumps(report))
    (d / requestlog.FILENAME).write_text(requests if requests is not None else json.dumps(
        dict(id="r", function="f", status="ok", scheduled_ns=1, sent_ns=1, done_ns=9)) + "\n")
    (d / cal.NODE_AGENT_LOG).write_text(node_log if node_log is not None else
                                        _ready("f-0000000001", 900.0, 10.0) + "\n")
    return d


@pytest.mark.parametrize("kw, words", [
    (dict(report=[]), "report.json: not a Dilu report"),
    (dict(report={"functions": [], "run": {"policy": "dilu"}}), "report.json: not a Dilu report"),
    (dict(requests=""), "requests.jsonl: holds no request"),
    (dict(node_log="starting\n"), "node_agent.log: no instance became ready in it"),
    (dict(node_log="{not json\n"), "node_agent.log:1: not a JSON log line"),
    (dict(node_log='{"event": "instance ready", "instance": "f-1", "cold_start_ms": "x", "timestamp": "2026-01-01T12:00:00Z"}\n'),
     r"node_agent.log:1: not an 'instance ready' line of the node agent: Expected `float`"),
    (dict(node_log='{"event": "instance ready", "instance": 42, "cold_start_ms": 1.0, "timestamp": "2026-01-01T12:00:00Z"}\n'),
     r"node_agent.log:1: not an 'instance ready' line .* `\$.instance`"),
    (dict(node_log='{"event": "instance ready", "instance": "f-1", "cold_start_ms": -60.0, "timestamp": "2026-01-01T12:00:00Z"}\n'),
     r"node_agent.log:1: .*Expected `float` >= 0"),
    (dict(node_log='{"event": "instance ready", "instance": "f-1", "cold_start_ms": 1.0, "timestamp": "noon"}\n'),
     r"node_agent.log:1: .*datetime"),
    (dict(node_log='{"event": "instance ready", "instance": "f-1", "cold_start_ms": NaN, "timestamp": "2026-01-01T12:00:00Z"}\n'),
     "node_agent.log:1: not a JSON log line"),
])
def test_calibrate_names_the_file_it_cannot_use(tmp_path: Path, kw, words):
    with pytest.raises(ValueError, match=words):
        cal.calibrate([_log_dir(tmp_path / "run", **kw)])


def test_calibrate_says_what_a_folder_without_a_report_is_not(tmp_path: Path):
    with pytest.raises(ValueError, match=rf"{tmp_path} holds no report.json: not the log directory of a run"):
        cal.calibrate([tmp_path])  # was "not a Dilu report ([Errno 2] No such file or directory: ...)"


def test_calibrate_names_a_log_that_is_not_text(tmp_path: Path):
    run = _log_dir(tmp_path / "run")
    (run / cal.NODE_AGENT_LOG).write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match=r"node_agent.log: not text \(not UTF-8\)"):
        cal.calibrate([run])


def test_logs_moved_off_their_checkout_calibrate_against_the_bundled_sample(tmp_path: Path):
    """A report records the trace directory's absolute path; the bundled sample's, from a checkout
    that is gone, is this checkout's copy (the run is simulated: too short to calibrate, it says
    so, where a missing trace directory would have stopped it first)."""
    from dilu.loadgen.trace import default_trace_dir

    gone = f"/nonexistent/checkout/{default_trace_dir().name}"
    run = RunInfo(wall_s=10.0, policy="dilu", trace=gone, functions=1, duration_s=10.0, speedup=10.0, seed=1, gpus=4,
                  start_minute=480)
    rep = build_report(ONE, {"f": FunctionMeta(model="bert_base", slo_ms=80.0)}, RunFacts(), run).to_dict()
    with pytest.raises(OverheadsError, match="no function served 20 batches"):
        cal.calibrate([_log_dir(tmp_path / "run", report=rep)])
    rep["run"]["trace"] = "/nonexistent/other-trace"
    with pytest.raises(ValueError, match="trace directory not found"):
        cal.calibrate([_log_dir(tmp_path / "other", report=rep)])


def test_calibrate_given_the_log_dir_names_its_policies_directories(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    _log_dir(tmp_path / "logs" / "dilu")
    with pytest.raises(ValueError, match=r"logs holds one log directory per policy: name them \(.*logs/dilu\)"):
        cal.calibrate([tmp_path / "logs"])


def test_calibrate_refuses_a_directory_given_twice(tmp_path: Path):
    d = _log_dir(tmp_path / "run")
    with pytest.raises(ValueError, match="given twice"):
        cal.calibrate([d, tmp_path / "." / "run"])


def test_calibrate_refuses_a_copy_of_a_run_given_beside_it(tmp_path: Path):
    """The same requests under another path would count twice; another run (its own request
    ids and times) is another sample."""
    import shutil

    two = [dict(id=f"r{i}", function="f", status="ok", scheduled_ns=i, sent_ns=i, done_ns=9) for i in (1, 2)]
    report = {**json.loads((_log_dir(tmp_path / "proto").joinpath("report.json")).read_text())}
    report["totals"]["offered"] = 2
    d = _log_dir(tmp_path / "run", report=report, requests="".join(json.dumps(r) + "\n" for r in two))
    shutil.copytree(d, tmp_path / "copy")
    with pytest.raises(ValueError, match=r"copy holds requests of .*run \(the same run\)"):
        cal.read_runs([d, tmp_path / "copy"])
    # reordered, its first request's id edited: still the same run's requests
    edited = [dict(two[1]), dict(two[0], id="x0")]
    (tmp_path / "copy" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edited))
    with pytest.raises(ValueError, match=r"copy holds requests of .*run \(the same run\)"):
        cal.read_runs([d, tmp_path / "copy"])
    (tmp_path / "copy" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [two[0], two[0]]))
    with pytest.raises(ValueError, match=r"copy/requests.jsonl holds a request twice"):
        cal.read_runs([tmp_path / "copy"])
    other = _log_dir(tmp_path / "other", report=report, requests="".join(
        json.dumps(dict(r, id="s" + r["id"])) + "\n" for r in two))
    assert len(cal.read_runs([d, other])) == 2


def test_the_process_start_can_come_from_other_runs_of_the_node(tmp_path: Path, monkeypatch):
    """``--starts-from``: one run's way in and back and its own deploy with the process start of
    other runs of the node; the run's own later launches are not counted then, theirs are (its own
    log still gives its parks and deploy: a malformed one stops it)."""
    cold = models.cold_start_ms("bert_base")
    request = dict(id="r", function="f", status="ok", instance="f-0000000001", batch=1, scheduled_ns=1_000_000,
                   sent_ns=1_000_000, enqueued_ns=3_000_000, started_ns=4_000_000, replied_ns=6_000_000,
                   done_ns=10_000_000)
    run = _log_dir(tmp_path / "run", requests=json.dumps(request) + "\n",
                   node_log=_ready("f-0000000001", cold + 5000, 10.0) + "\n")
    other = _log_dir(tmp_path / "other", node_log="\n".join([
        _ready("f-0000000001", cold + 900, 10.0), _ready("f-0000000002", cold + 250, 20.0 + (cold + 250) / 1000)]))
    monkeypatch.setattr(cal, "simulated_services", lambda *a, **kw: {})  # no batch to set against the model
    monkeypatch.setattr(cal, "batch_overheads_ms", lambda *a, **kw: [2.0])
    ov = cal.calibrate([run], starts_from=[other])
    assert ov.transport_ms[50] == pytest.approx(6.0)  # the run's own: 2 ms in, 4 ms back
    assert ov.process_start_ms == pytest.approx(250.0)  # the other run's launch after its initial one
    assert ov.process_start_initial_ms == pytest.approx((5000.0,))  # the run's own deploy, not the other's 0.9 s
    assert ov.source["process_starts_from"] == [str(other)]
    assert cal.calibrate([run]).process_start_initial_ms == pytest.approx((5000.0,))
    (run / cal.NODE_AGENT_LOG).write_text("{not json\n")
    with pytest.raises(ValueError, match="run/node_agent.log:1: not a JSON log line"):
        cal.calibrate([run])  # its own launches, unreadable
    with pytest.raises(ValueError, match="run/node_agent.log:1: not a JSON log line"):
        cal.calibrate([run], starts_from=[other])  # its own parks, unreadable
    with pytest.raises(cal.StartsFromError, match="given twice"):  # said of --starts-from, not LOG_DIRS
        cal.calibrate([run], starts_from=[other, tmp_path / "." / "other"])
    (other / cal.NODE_AGENT_LOG).unlink()
    with pytest.raises(cal.StartsFromError, match=r"cannot read .*other/node_agent.log: No such file"):
        cal.calibrate([run], starts_from=[other])  # unreadable too: said of --starts-from


def test_a_pickup_is_counted_where_the_next_batch_was_waiting():
    """From a batch's last reply to the next batch's start on one instance, when a request of the
    next batch was stored before that reply; a batch that came to an idle instance is no pickup."""
    def line(i, started, replied, enqueued, instance="f-1"):
        return requestlog.RequestLine(id=str(i), function="f", status="ok", scheduled_ns=enqueued, sent_ns=enqueued,
                                      done_ns=replied + 1, instance=instance, enqueued_ns=enqueued,
                                      started_ns=started, replied_ns=replied, batch=1)
    ms = 1_000_000
    lines = [line(1, 10 * ms, 20 * ms, 9 * ms), line(2, 10 * ms, 21 * ms, 9 * ms),  # one batch of two
             line(3, 23 * ms, 30 * ms, 15 * ms),  # waiting since 15 ms: picked up 2 ms after the last reply
             line(4, 50 * ms, 60 * ms, 45 * ms),  # came after 30 ms, to an idle instance: no pickup
             line(5, 61 * ms, 70 * ms, 55 * ms, instance="f-2")]  # another instance's first batch
    assert cal.pickups_ms(lines) == pytest.approx([2.0])
    ov = Overheads.from_samples([1.0], [1.0], pickup_ms=[2.0])
    assert ov.pickup_ms == flat(2.0) and Overheads.from_samples([1.0], [1.0]).pickup_ms == ()


def test_a_dispatch_is_counted_where_the_batch_came_to_an_idle_instance_not_parked():
    """From a batch's first stored request to its start on one instance, when that request was
    stored after the batch before had its last reply; where the instance was parked in between,
    the wait was its resume (modelled apart), no dispatch."""
    def line(i, started, replied, enqueued, instance="f-1"):
        return requestlog.RequestLine(id=str(i), function="f", status="ok", scheduled_ns=enqueued, sent_ns=enqueued,
                                      done_ns=replied + 1, instance=instance, enqueued_ns=enqueued,
                                      started_ns=started, replied_ns=replied, batch=1)
    ms = 1_000_000
    lines = [line(1, 10 * ms, 20 * ms, 9 * ms),
             line(2, 23 * ms, 30 * ms, 15 * ms),  # waiting since 15 ms: a pickup, no dispatch
             line(3, 51 * ms, 60 * ms, 50 * ms),  # stored at 50 ms on an idle instance: 1 ms dispatch
             line(4, 130 * ms, 140 * ms, 100 * ms),  # idle, but parked at 80 ms: a resume, no dispatch
             line(5, 203 * ms, 210 * ms, 200 * ms, instance="f-2"),  # another instance's first batch
             line(6, 302 * ms, 310 * ms, 300 * ms, instance="f-2")]  # its next, idle: 2 ms (f-1's park is f-1's)
    assert cal.dispatches_ms(lines, {"f-1": [80 * ms]}) == pytest.approx([1.0, 2.0])
    assert cal.dispatches_ms(lines, {}) == pytest.approx([1.0, 30.0, 2.0])
    ov = Overheads.from_samples([1.0], [1.0], dispatch_ms=[2.0])
    assert ov.dispatch_ms == flat(2.0) and Overheads.from_samples([1.0], [1.0]).dispatch_ms == ()


def test_parks_are_read_from_the_node_agents_log_and_a_bad_line_is_named(tmp_path: Path):
    log = tmp_path / "node_agent.log"
    parked = [json.dumps({"event": "instance parked", "instance": "f-1", "timestamp": f"2026-01-01T12:00:0{s}Z"})
              for s in (5, 1)]
    log.write_text("\n".join([_ready("f-1", 900.0, 0.5), *parked]) + "\n")
    base = 1767268800 * 10**9  # 2026-01-01T12:00:00Z
    assert cal.parked_ns(log) == {"f-1": [base + 1 * 10**9, base + 5 * 10**9]}
    log.write_text(json.dumps({"event": "instance parked", "instance": "f-1"}) + "\n")
    with pytest.raises(ValueError, match="node_agent.log:1: not an 'instance parked' line .* `timestamp`"):
        cal.parked_ns(log)


@pytest.mark.parametrize("change, words", [
    (dict(requests="\n".join([json.dumps(dict(id=f"r{i}", function="f", status="ok", scheduled_ns=1, sent_ns=1,
                                                done_ns=9)) for i in range(2)]) + "\n"),
     "holds 2 requests where its report offered 1: not that run's whole request log"),
    (dict(requests=json.dumps(dict(id="r", function="g", status="ok", scheduled_ns=1, sent_ns=1, done_ns=9)) + "\n"),
     "holds requests of g, which its report does not replay"),
])
def test_calibrate_refuses_a_request_log_that_is_not_its_reports_runs(tmp_path: Path, change, words):
    with pytest.raises(ValueError, match=words):
        cal.calibrate([_log_dir(tmp_path / "run", **change)])


def test_calibrate_refuses_a_simulated_runs_report(tmp_path: Path):
    run = RunInfo(wall_s=10.0, policy="dilu", trace="t", functions=1, duration_s=10.0, speedup=10.0, seed=1, gpus=4,
                  simulated=True)
    rep = build_report(ONE, {"f": FunctionMeta(model="bert_base", slo_ms=80.0)}, RunFacts(), run).to_dict()
    with pytest.raises(ValueError, match="a simulated run's report: calibrate from live runs"):
        cal.calibrate([_log_dir(tmp_path / "run", report=rep)])


def test_an_interrupted_calibration_says_so_and_exits_with_the_signals_status(tmp_path: Path, monkeypatch):
    """Ctrl-C during dilu calibrate (its simulations take seconds on many runs): the one line every
    long command prints, and 130, as crosscheck and sim end."""
    from click.testing import CliRunner

    from dilu.cli.main import main

    def stopped(*_a, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cal, "calibrate", stopped)
    r = CliRunner().invoke(main, ["calibrate", str(_log_dir(tmp_path / "run"))])
    assert r.exit_code == 130 and r.output.strip() == "interrupted", r.output


def _logged(event: str, at_s: float, **fields) -> str:
    """A service's JSON log line of ``event`` at ``at_s`` s after 12:00:00 UTC."""
    stamp = f"2026-01-01T12:{int(at_s // 60):02d}:{at_s % 60:09.6f}Z"
    return json.dumps({"event": event, "level": "info", "timestamp": stamp, **fields})


def test_the_horizontal_tick_is_timed_by_its_decisions_and_a_wake_off_the_tick_is_left_out(tmp_path: Path):
    """The live tick sleeps its 500 ms and then works, so it runs 501.6 ms apart on the emulated
    node: decisions a whole number of ticks apart give the period; a resume decided when a
    request came (off the tick) and gaps over TICK_GAPS_MAX ticks are left out."""
    from dilu.services.horizontal_scaler.service import WAKE_REASON

    period, t0 = 0.5016, 10.0
    lines = [_logged("scale decided", t0 + 0.003 + 0.002 * i, reason="initial scale 1", count=1) for i in range(3)]
    lines += [_logged("scale decided", t0 + k * period + 0.003, reason="stable: window 1.0 in flight", count=1)
              for k in (5, 40, 41, 100, 180)]  # gaps of 5, 35, 1, 59 (too long) and 80 ticks (too long)
    lines.append(_logged("scale decided", t0 + 17.3, reason=WAKE_REASON, count=1))
    (tmp_path / cal.HORIZONTAL_LOG).write_text("starting\n" + "\n".join(lines) + "\n")
    total, ticks = cal.tick_gaps(tmp_path, 500.0)
    assert ticks == 41 and total / ticks == pytest.approx(period * 1000.0, abs=0.01)
    assert cal.tick_gaps(tmp_path / "missing", 500.0) == (0.0, 0)


def test_a_runs_loop_timing_is_read_from_its_deploys_tick(tmp_path: Path):
    """The first request and the defragmentation round nearest to it, ms after the tick that
    decided the deploy's initial scale; the deploy's launches are that tick's counts (a later
    initial scale, another tick, is not the deploy's)."""
    lines = [_logged("scale decided", 10.0 + 0.001 * i, reason="initial scale 1", count=1 + (i == 0)) for i in range(3)]
    lines.append(_logged("scale decided", 14.0, reason="initial scale 1", count=1))
    (tmp_path / cal.HORIZONTAL_LOG).write_text("\n".join(lines) + "\n")
    (tmp_path / cal.SCHEDULER_LOG).write_text("\n".join(
        [_logged("defragmentation planned", 11.2 + 3 * k) for k in range(10)] + [_logged("service started", 15.0)]) + "\n")
    epoch_ms = calendar.timegm((2026, 1, 1, 0, 0, 0)) * 1000
    start_ms = (12 * 3600 + 15) * 1000  # the first request at 12:00:15 UTC, 5 s after the deploy's tick
    reqs = [line("f", "f-1", epoch_ms + start_ms + 40, 0, 0, 0, 0, 1), line("f", "f-1", epoch_ms + start_ms, 0, 0, 0, 0, 1)]
    # (the request log's times are Unix ns; line() takes ms)
    timing = cal.loop_timing(tmp_path, reqs, 500.0)
    assert timing.launches == 4 and timing.first_request_ms == pytest.approx(5000.0)
    assert timing.defrag_ms == pytest.approx(4200.0)  # 11.2 + 3 x 1 s: 0.8 s before the first request
    # at info level a round is logged only when it moves something: whole intervals from the start
    (tmp_path / cal.SCHEDULER_LOG).write_text(_logged("placement policy", 11.2, defrag_interval_s=3.0) + "\n")
    assert cal.loop_timing(tmp_path, reqs, 500.0).defrag_ms == pytest.approx(4200.0)
    (tmp_path / cal.SCHEDULER_LOG).write_text(_logged("placement policy", 11.2, defrag_interval_s="off") + "\n")
    assert cal.loop_timing(tmp_path, reqs, 500.0).defrag_ms is None  # a policy that does not defragment
    (tmp_path / cal.SCHEDULER_LOG).unlink()
    assert cal.loop_timing(tmp_path, reqs, 500.0).defrag_ms is None  # no round logged: drawn
    assert cal.loop_timing(tmp_path, [], 500.0) is None
    (tmp_path / cal.HORIZONTAL_LOG).write_text(_logged("scale decided", 10.0, reason="stable", count=1) + "\n")
    assert cal.loop_timing(tmp_path, reqs, 500.0) is None  # no initial scale: no deploy to time from


@pytest.mark.parametrize("kw, words", [
    (dict(horizontal_tick_ms=0.0), "horizontal_tick_ms must be in"),
    (dict(horizontal_tick_ms=float("inf")), "horizontal_tick_ms must be in"),
])
def test_a_tick_out_of_range_is_refused(kw, words):
    with pytest.raises(OverheadsError, match=words):
        Overheads(flat(1.0), flat(1.0), **kw)


@pytest.mark.parametrize("kw, words", [
    (dict(launches=0, first_request_ms=1.0), "launches >= 1"),
    (dict(launches=1, first_request_ms=-1.0), "first_request_ms must be in"),
    (dict(launches=1, first_request_ms=1.0, defrag_ms=float("nan")), "defrag_ms must be within"),
])
def test_a_loop_timing_out_of_range_is_refused(kw, words):
    from dilu.loadgen.sim.overheads import LoopTiming

    with pytest.raises(OverheadsError, match=words):
        LoopTiming(**kw)


def test_a_last_log_line_cut_short_by_a_kill_is_left_out_and_one_in_the_middle_is_not(tmp_path: Path):
    log = tmp_path / cal.NODE_AGENT_LOG
    whole = _ready("a-0000000001", models.cold_start_ms("bert_base") + 900, 10.0)
    log.write_text(whole + "\n" + whole[:40])  # killed while writing its last line
    assert [n for n, _ in cal._log_events(log, ("instance ready",))] == [1]
    log.write_text(whole[:40] + "\n" + whole + "\n")
    with pytest.raises(ValueError, match="node_agent.log:1: not a JSON log line"):
        list(cal._log_events(log, ("instance ready",)))
    log.write_text(whole + "\n" + whole[:40] + "\n")  # ended by a newline: written whole, yet not JSON
    with pytest.raises(ValueError, match="node_agent.log:2: not a JSON log line"):
        list(cal._log_events(log, ("instance ready",)))
