"""Every bench refuses NaN and infinities while parsing: exit 2 and one line, before any work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli_errors import one_line_error
from dilu.cli.main import main

WORKLOAD = Path(__file__).resolve().parents[2] / "services" / "scheduler" / "workloads" / "instances-100.txt"


@pytest.mark.parametrize("args", [
    ["bench", "invoke", "--rate", "nan"], ["bench", "invoke", "--seconds", "inf"], ["bench", "invoke", "--search-s", "nan"],
    ["bench", "loadgen", "--rate", "nan"], ["bench", "sim", "--hours", "nan"], ["bench", "sim", "--training-jobs", "nan"],
    ["bench", "scheduler", "--gamma", "nan"],
])
def test_a_non_finite_number_is_refused_while_parsing(args):
    line = one_line_error(CliRunner().invoke(main, args), 2)
    assert "finite" in line or "range" in line


@pytest.mark.parametrize("args, words", [
    (["bench", "scheduler", "--gpu-memory-gib", "1e-300", "--nodes", "2", "--instances", "10", "--churn", "0"],
     "positive memory"),  # was a traceback
    (["bench", "scheduler", "--nodes", "100000000"], "--nodes"),  # was a MemoryError
    (["bench", "scheduler", "--gpu-memory-gib", "1e300", "--nodes", "2", "--instances", "10", "--churn", "1"],
     "--gpu-memory-gib"),  # was an OverflowError traceback
    (["bench", "scheduler", "--instances", "1", "--churn", "0", "--nodes", "1", "--json", "/dev/full"], "cannot write"),
])
def test_a_bench_that_cannot_run_or_write_says_so_in_one_line(args, words):
    assert words in one_line_error(CliRunner().invoke(main, args))


def test_bench_sim_says_when_the_trace_holds_fewer_hours_than_asked(tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "sim", "--hours", "100", "--nodes", "1", "--functions", "1",
                                  "--training-jobs", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "the trace has only 8 hours" in r.output
    assert json.loads(out.read_text())["hours"] == pytest.approx(8.0)


@pytest.mark.parametrize("extra, words", [
    (["--instances", "10"], "--instances is for the synthetic mode only"),
    (["--churn", "0", "--seed", "3"], "--churn, --seed are for the synthetic mode only"),
])
def test_bench_scheduler_refuses_synthetic_options_with_a_workload(extra, words):
    line = one_line_error(CliRunner().invoke(main, ["bench", "scheduler", "--workload", str(WORKLOAD), *extra]), 2)
    assert words in line  # they were ignored: the workload's own events were replayed


def test_bench_scheduler_replays_a_workload_with_the_options_it_reads():
    # a variable set for the synthetic runs is no refusal: only what is typed beside --workload is
    r = CliRunner().invoke(main, ["bench", "scheduler", "--workload", str(WORKLOAD), "--nodes", "50"],
                           env={"DILU_SEED": "3"})
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command", [["bench", "scheduler"], ["sim"]])
def test_a_bad_workload_file_is_bad_input_in_both_commands(tmp_path, command):
    bad = tmp_path / "w.txt"
    bad.write_text("not an event\n")
    line = one_line_error(CliRunner().invoke(main, [*command, "--workload", str(bad)]), 2)  # bench scheduler: 1
    assert f"{bad}:1: not a dict literal" in line and "--workload" in line
