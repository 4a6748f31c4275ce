"""dilu summarize: the mean and range of each figure over runs, each policy against the first by
the ratio of the means (points for rates) with its range run by run, read from the files dilu
compare, sim and demo write, refused in one line when a file is none of them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from dilu.loadgen.generator import Record
from dilu.loadgen.report import FunctionFacts, FunctionMeta, Mechanism, Report, RunFacts, RunInfo, build_report
from dilu.loadgen.summary import Spread, check_comparable, read_runs, render_summary, summarize

MS = 1_000_000


def run_report(policy: str, *, violations: float, cold: int, gpu_s: float) -> Report:
    """A one-function report whose totals say ``violations`` (0..1), ``cold`` cold-start
    requests and ``gpu_s`` active GPU·s."""
    records = [Record(id=f"r{i}", function="f", scheduled_ns=i * MS, sent_ns=i * MS, done_ns=(i + 10) * MS,
                      status="ok", cold_start=False) for i in range(100)]
    facts = RunFacts(functions={"f": FunctionFacts(instance_launches=2, quota_seconds=5.0)},
                     active_gpu_seconds=gpu_s, allocation_fragmentation=0.2, idle_fragmentation=0.5,
                     mechanism=Mechanism(profiler_trials=1, grant_changes=0, token_wait_ms=0.0, scale_outs=1,
                                         retirements=0, scale_to_zero=0))
    rep = build_report(records, {"f": FunctionMeta(model="bert_base", slo_ms=100)}, facts,
                       RunInfo(wall_s=10.0, policy=policy, functions=1)).to_dict()
    rep["totals"].update(slo_violation_rate=violations, cold_start_requests=cold)
    return Report.from_dict(rep)


def pair(v_a, c_a, g_a, v_b, c_b, g_b) -> dict[str, Report]:
    return {"dilu": run_report("dilu", violations=v_a, cold=c_a, gpu_s=g_a),
            "horizontal-only": run_report("horizontal-only", violations=v_b, cold=c_b, gpu_s=g_b)}


RUNS = [pair(0.065, 11, 127.0, 0.094, 46, 123.0), pair(0.104, 12, 149.0, 0.077, 58, 124.0),
        pair(0.091, 7, 132.0, 0.138, 107, 175.0)]


def row(summary, label):
    return next(r for r in summary.rows if r.label == label)


def test_means_ranges_and_the_comparison_of_means_with_its_range_run_by_run():
    s = summarize(RUNS)
    assert s.policies == ["dilu", "horizontal-only"] and s.runs == {"dilu": 3, "horizontal-only": 3}
    gpu = row(s, "active GPU·s")
    assert gpu.spreads["dilu"] == Spread(pytest.approx(136.0), 127.0, 149.0, (127.0, 149.0, 132.0))
    assert gpu.of_means["horizontal-only"] == pytest.approx((123 + 124 + 175) / (127 + 149 + 132))
    assert gpu.per_run["horizontal-only"] == pytest.approx((123 / 127, 124 / 149, 175 / 132))
    slo = row(s, "SLO violation rate")  # a rate: differences in percentage points
    assert slo.rate and slo.of_means["horizontal-only"] == pytest.approx(100 * ((0.094 + 0.077 + 0.138) / 3
                                                                                   - (0.065 + 0.104 + 0.091) / 3))
    assert slo.per_run["horizontal-only"] == pytest.approx((2.9, -2.7, 4.7))
    assert row(s, "cold-start requests").spreads["horizontal-only"].mean == pytest.approx(211 / 3)


def test_a_policy_missing_from_a_run_is_summarised_over_the_runs_that_have_it():
    runs = [*RUNS, {"dilu": RUNS[0]["dilu"]}]
    s = summarize(runs)
    assert s.runs == {"dilu": 4, "horizontal-only": 3}
    gpu = row(s, "active GPU·s")
    assert gpu.spreads["dilu"].values == (127.0, 149.0, 132.0, 127.0)
    assert len(gpu.per_run["horizontal-only"]) == 3  # paired runs only
    with pytest.raises(ValueError):
        summarize([{}])


def test_the_printed_summary_fits_100_columns_and_defines_its_columns():
    console = Console(width=100, record=True)
    render_summary(summarize(RUNS), console)
    text = console.export_text()
    assert all(len(line.rstrip()) <= 100 for line in text.splitlines())
    gpu = next(line for line in text.splitlines() if line.startswith("│ active GPU·s"))
    assert "136.0 (127.0–149.0)" in gpu
    versus = next(line for line in text.splitlines() if line.startswith("│ SLO violation rate")
                  and "pp" in line)
    assert "+1.6 pp (-2.7 … +4.7)" in versus
    assert "horizontal-only / dilu  the mean of horizontal-only's figure" in text
    one = Console(width=100, record=True)
    render_summary(summarize(RUNS[:1]), one)  # one run: values, no ranges
    assert "│ active GPU·s" in one.export_text() and "(127.0–" not in one.export_text()


def test_read_runs_takes_compare_sim_and_demo_files_and_names_a_bad_one(tmp_path):
    compare = tmp_path / "cmp.json"
    compare.write_text(json.dumps({"policies": {p: r.to_dict() for p, r in RUNS[0].items()}, "sim": {}}))
    assert list(read_runs(compare)) == ["dilu", "horizontal-only"]
    demo = tmp_path / "demo.json"
    demo.write_text(json.dumps(RUNS[1]["horizontal-only"].to_dict()))
    assert list(read_runs(demo)) == ["horizontal-only"]  # named by its run.policy
    for bad, why in (("{not json", "not a dilu compare"), ('{"policies": {"x": {"totals": 1}}}', "not a dilu compare"),
                     ('{"policies": {}}', "no run in it")):  # refused by name even beside good files
        path = tmp_path / "bad.json"
        path.write_text(bad)
        with pytest.raises(ValueError, match=f"{path}: {why}"):
            read_runs(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="cannot read it"):
        read_runs(fifo)  # refused, never waited on


@pytest.mark.parametrize("change, why", [
    (dict(offered=-5), "dilu's totals: offered below 0"),
    (dict(completed=150), "dilu's totals: completed \\+ dropped \\+ failed \\+ timed_out = 150, not the 100 offered"),
    (dict(slo_violation_rate=7.5), "dilu's totals: slo_violation_rate 7.5 outside 0..1"),
])
def test_a_report_holding_what_no_run_can_is_refused(tmp_path, change, why):
    rep = RUNS[0]["dilu"].to_dict()
    rep["totals"].update(change)  # summarised as 2.01x (-327.00 ... 1.00) or 375.0 % before
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(rep))
    with pytest.raises(ValueError, match=f"{path}: {why}: not a report dilu wrote"):
        read_runs(path)


def test_the_command_writes_json_and_refuses_a_bad_file_in_one_line(tmp_path):
    paths = []
    for i, run in enumerate(RUNS):
        p = tmp_path / f"s1-{i}.json"
        p.write_text(json.dumps({"policies": {k: r.to_dict() for k, r in run.items()}}))
        paths.append(str(p))
    dilu = [sys.executable, "-m", "dilu.cli.main", "summarize"]
    out = subprocess.run([*dilu, *paths, "--json", str(tmp_path / "sum.json")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    js = json.loads((tmp_path / "sum.json").read_text())
    assert js["runs"] == {"dilu": 3, "horizontal-only": 3}
    assert js["policies"]["dilu"]["active GPU·s"]["values"] == [127.0, 149.0, 132.0]
    assert js["policies"]["dilu"]["active GPU·s"]["stderr"] == pytest.approx((266 / 2) ** 0.5 / 3 ** 0.5)  # sd / √n
    assert js["versus"]["horizontal-only / dilu"]["active GPU·s"]["of_means"] == pytest.approx(422 / 408)
    assert js["files"] == paths
    for args, param, why in (([paths[0], paths[0]], "RUN_FILES", "is given twice"),
                             ([*paths, "--json", paths[1]], "'--json'", "would overwrite it")):
        out = subprocess.run([*dilu, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"Invalid value for {param}" in out.stderr and why in out.stderr, out.stderr
    assert json.loads(open(paths[1]).read())["policies"]  # not overwritten
    (tmp_path / "junk.json").write_text("[1, 2]")
    bad = subprocess.run([*dilu, paths[0], str(tmp_path / "junk.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "junk.json: not a dilu compare, sim or demo report" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_runs_of_other_spans_are_refused_naming_the_files():
    other = {p: Report.from_dict({**r.to_dict(), "run": {**r.to_dict()["run"], "seed": 2}}) for p, r in RUNS[1].items()}
    check_comparable([("a.json", RUNS[0]), ("b.json", RUNS[1])])
    with pytest.raises(ValueError, match="seed 0 in a.json, 2 in b.json"):
        check_comparable([("a.json", RUNS[0]), ("b.json", other)])
    bigger = {p: Report.from_dict({**r.to_dict(), "run": {**r.to_dict()["run"], "gpus": 8}})
              for p, r in RUNS[1].items()}
    with pytest.raises(ValueError, match="GPUs .* in a.json, 8 in b.json"):
        check_comparable([("a.json", RUNS[0]), ("b.json", bigger)])


def with_run(runs: dict[str, Report], policy: str | None = None, **run) -> dict[str, Report]:
    """``runs`` with ``run`` fields changed in every report, or in ``policy``'s only."""
    return {p: Report.from_dict({**r.to_dict(), "run": {**r.to_dict()["run"], **run}}) if policy in (None, p) else r
            for p, r in runs.items()}


def test_runs_made_with_other_settings_are_refused_and_unrecorded_ones_are_not_compared():
    """Training jobs beside the functions, and each policy's parking delay and defragmentation
    interval, must match from file to file (dilu parks where horizontal-only does not: that is
    no mismatch); a report of an older build that does not record them is not compared."""
    a = with_run(RUNS[0], training_jobs=4)
    a = with_run(a, "dilu", park_after_s=30.0, defrag_interval_s=30.0)
    a = with_run(a, "horizontal-only", park_after_s=0.0, defrag_interval_s=0.0)
    check_comparable([("a.json", a), ("b.json", a), ("old.json", RUNS[1])])
    with pytest.raises(ValueError, match="training jobs 4 in a.json, 0 in b.json"):
        check_comparable([("a.json", a), ("b.json", with_run(a, training_jobs=0))])
    with pytest.raises(ValueError, match="dilu's parking delay .s. 30.0 in a.json, 0.0 in b.json"):
        check_comparable([("a.json", a), ("b.json", with_run(a, "dilu", park_after_s=0.0))])
    with pytest.raises(ValueError, match="dilu's defragmentation interval .s. 30.0 in a.json, 0.0 in b.json"):
        check_comparable([("a.json", a), ("b.json", with_run(a, "dilu", defrag_interval_s=0.0))])
    with pytest.raises(ValueError, match="dilu's parking delay .s. 0.04 in a.json, 0.0 in b.json"):  # 0: never
        check_comparable([("a.json", with_run(a, "dilu", park_after_s=0.04)),
                          ("b.json", with_run(a, "dilu", park_after_s=0.0))])


def test_a_simulated_run_is_not_averaged_with_a_live_one_and_a_trace_is_compared_by_name():
    sim = with_run(RUNS[1], simulated=True)
    with pytest.raises(ValueError, match="simulated False in live.json, True in sim.json"):
        check_comparable([("live.json", RUNS[0]), ("sim.json", sim)])
    here = with_run(RUNS[0], trace="/work/a/loadgen/data/azure-functions-2019-100")
    there = with_run(RUNS[1], trace="/tmp/b/loadgen/data/azure-functions-2019-100")
    check_comparable([("a.json", here), ("b.json", there)])  # the bundled trace of two checkouts
    with pytest.raises(ValueError, match="trace azure-functions-2019-100 in a.json, other in b.json"):
        check_comparable([("a.json", here), ("b.json", with_run(RUNS[1], trace="/tmp/b/other"))])


def test_a_comparison_defined_in_some_runs_only_says_how_many():
    runs = [pair(0.1, 0, 100.0, 0.1, 5, 100.0), pair(0.1, 2, 100.0, 0.1, 6, 100.0),
            pair(0.1, 4, 100.0, 0.1, 8, 100.0)]  # dilu's cold starts are 0 in the first: no ratio there
    console = Console(width=100, record=True)
    render_summary(summarize(runs), console)
    line = next(x for x in console.export_text().splitlines() if x.startswith("│ cold-start requests"))
    assert "3.17x (2.00 … 3.00; 2 of 3 runs)" in line


def test_a_narrow_console_puts_each_range_under_its_mean():
    console = Console(width=44, record=True)
    render_summary(summarize(RUNS), console)
    text = console.export_text()
    assert all(len(line.rstrip()) <= 44 for line in text.splitlines())
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("│ active GPU·s"))
    assert "136.0" in lines[at] and "(127.0–149.0)" in lines[at + 1]  # nothing cut


def test_simulated_runs_configured_otherwise_are_refused_draws_of_other_overheads_seeds_are_not(tmp_path):
    """A keep-alive or process start of its own makes another experiment (its sim.config says
    so); the overheads seed only draws other samples of the same one."""
    from dilu.loadgen.summary import check_same_simulation

    def sim_file(name, **config):
        base = {"nodes": 1, "gpus_per_node": 4, "keep_alive_s": 600.0, "process_start_ms": 436.0,
                "process_start_by_starting_ms": [], "overheads": None, "overheads_seed": 1,
                "vertical_tick_ms": 250.0, "horizontal_tick_ms": 500.0, "drain_s": 20.0}
        p = tmp_path / name
        run = RUNS[0]
        p.write_text(json.dumps({"policies": {k: r.to_dict() for k, r in run.items()},
                                 "sim": {"config": {**base, **config}, "policies": {}}}))
        return str(p)

    overheads = {"runs": ["s1-r1/dilu"], "transport_samples": 6162}  # sim.config's: the calibration's source
    one = sim_file("k1.json", overheads=overheads)
    draw = sim_file("k2.json", overheads_seed=2, overheads={**overheads, "runs": ["s1-r2/dilu"]})
    check_same_simulation([one, draw])  # another draw of another run's overheads: one comparison
    live = tmp_path / "live.json"
    live.write_text(json.dumps({"policies": {k: r.to_dict() for k, r in RUNS[0].items()}}))
    check_same_simulation([one, str(live)])  # no sim.config: check_comparable refuses the mix
    for name, change, what in (("ka.json", {"keep_alive_s": 30.0}, "keep-alive (s) 600.0"),
                               ("ps.json", {"process_start_ms": 5000.0}, "process start (ms) 436.0"),
                               ("oh.json", {"overheads": None}, "--overheads given True")):
        with pytest.raises(ValueError, match=rf"{re.escape(what)} in .*k1.json, .* in .*{name}"):
            check_same_simulation([one, sim_file(name, **change)])
