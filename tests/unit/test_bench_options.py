"""Every bench refuses NaN and infinities while parsing: exit 2 and one line, before any work."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from dilu.cli.main import main


@pytest.mark.parametrize("args", [
    ["bench", "invoke", "--rate", "nan"], ["bench", "invoke", "--seconds", "inf"], ["bench", "invoke", "--search-s", "nan"],
    ["bench", "loadgen", "--rate", "nan"], ["bench", "sim", "--hours", "nan"], ["bench", "sim", "--training-jobs", "nan"],
    ["bench", "scheduler", "--gamma", "nan"],
])
def test_a_non_finite_number_is_refused_while_parsing(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and ("finite" in lines[0] or "range" in lines[0]), r.output
