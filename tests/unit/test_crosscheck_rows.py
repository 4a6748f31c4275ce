"""dilu crosscheck's arithmetic (loadgen/sim/crosscheck.py): a row's figure against the live runs,
and its refusals; the whole path, live run to row, is tests/e2e/test_crosscheck.py's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dilu.loadgen.sim import crosscheck as xc
from dilu.loadgen.summary import Spread


def test_a_figure_is_the_relative_difference_of_the_means_and_that_in_standard_errors():
    live = Spread.of([1.0, 0.6])  # mean 0.8, stdev 0.283, SE 0.2
    sims = Spread.of([0.9, 1.0, 0.7, 0.6])  # every draw: mean 0.8
    runs = Spread.of([0.95, 0.65])  # each run's mean over its draws: SE 0.15
    f = xc.Figure(live, sims, runs)
    assert f.relative == pytest.approx(0.0) and f.within
    f = xc.Figure(live, Spread.of([1.1, 1.3]), Spread.of([1.05, 1.35]))  # mean 1.2: +50 %, 0.4 over SE 0.25
    assert f.relative == pytest.approx(0.5) and not f.within
    assert f.standard_errors == pytest.approx(0.4 / 0.25)
    f = xc.Figure(live, Spread.of([0.69]), Spread.of([0.69]))  # 13.75 % below: within 15 %
    assert f.within and f.standard_errors is None  # one run: no standard error
    f = xc.Figure(Spread.of([0.0, 0.0]), Spread.of([0.1, 0.2]), Spread.of([0.1, 0.2]))
    assert f.relative is None and not f.within  # nothing late live, some simulated


def test_a_row_writes_every_figure_with_its_spreads():
    f = xc.Figure(Spread.of([1.0, 3.0]), Spread.of([2.0]), Spread.of([2.0]))
    d = xc.Row(2, "dilu", ("a/dilu", "b/dilu"), {"active GPU·s": f}).to_dict()
    g = d["figures"]["active GPU·s"]
    assert d["seed"] == 2 and d["runs"] == ["a/dilu", "b/dilu"]
    assert g["live"] == {"mean": 2.0, "min": 1.0, "max": 3.0, "stderr": pytest.approx(1.0), "values": [1.0, 3.0]}
    assert g["sim"]["stderr"] is None and g["relative_difference"] == 0.0 and g["within_tolerance"]


def test_no_draw_is_refused():
    with pytest.raises(ValueError, match="draws must be at least 1"):
        xc.crosscheck([Path("x")], draws=0)


def test_the_command_names_a_directory_that_is_no_run(tmp_path: Path):
    out = subprocess.run([sys.executable, "-m", "dilu.cli.main", "crosscheck", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"cannot cross-check: {tmp_path} holds no report.json: not the log directory of a run" in out.stderr
    assert "Traceback" not in out.stderr
