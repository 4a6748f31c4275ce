"""Odd input a new user tried: a FIFO where a file is read or written, a digit that is not ASCII,
a wildcard inside a subject token. Each is one line and exit 2, never a hang or a traceback."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from cli_errors import one_line_error
from dilu.cli.main import main


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)  # opening it, to read or to write, would wait for the other end
    return str(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, words", [
    (["status", "--tls-ca", "FIFO"], "cannot load the TLS files (a named pipe, not a regular file)"),
    (["sim", "--hours", "0.01", "--json", "FIFO"], "a named pipe that nobody reads"),
    (["profile", "--surface", "FIFO", "--slo-ms", "60"], "cannot read: a named pipe, not a regular file"),
])
def test_a_fifo_is_refused_without_waiting_for_its_other_end(fifo, args, words):
    out = one_line_error(CliRunner().invoke(main, [fifo if a == "FIFO" else a for a in args]), 2)
    assert words in out


@pytest.mark.parametrize("args, words", [
    (["demo", "--gpus", "\u00b2"], "expected a GPU count"),  # '²': str.isdigit says yes, int() raised
    (["events", "tail", "--subject", "a.b*"], "is not a NATS subject pattern"),  # nats-py raised BadSubjectError
    (["events", "tail", "--subject", "a>b"], "is not a NATS subject pattern"),
])
def test_odd_values_are_bad_options(args, words):
    assert words in one_line_error(CliRunner().invoke(main, args), 2)


def test_columns_that_are_not_an_ascii_number_are_ignored():
    r = CliRunner(env={"COLUMNS": "\u00b2"}).invoke(main, ["sim", "--functions", "1", "--hours", "0.01"])
    assert r.exit_code == 0, r.output
