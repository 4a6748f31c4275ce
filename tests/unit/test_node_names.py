"""Node names travel as one subject token and name a node's credentials: a name NATS would read
as a wildcard, or that would share its token with another, is refused in one line."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli_errors import one_line_error
from dilu.cli.main import main


@pytest.mark.parametrize("name", [">", "*", "a*b", "x/y", "a'b", "a b", "", "n" * 65])
@pytest.mark.parametrize("command", [["up", "--node"], ["creds", "--out", "/nonexistent-dilu-test", "--nodes"]])
def test_a_node_name_nats_would_misread_is_refused(tmp_path, command, name):
    args = [*command, name]
    r = CliRunner().invoke(main, args)
    out = one_line_error(r, 2)
    assert "node name" in out or "node names" in out


@pytest.mark.parametrize("name", ["gpu-1", "gpu-1.rack2.example.com", "node_7"])
def test_host_names_are_node_names(tmp_path, name):
    r = CliRunner().invoke(main, ["creds", "--out", str(tmp_path / "auth"), "--nodes", name])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("name", [">", "a b", "", "c" * 65])
def test_a_caller_name_nats_would_misread_is_refused_as_a_caller_name(tmp_path, name):
    out = one_line_error(CliRunner().invoke(main, ["creds", "--out", str(tmp_path / "auth"), "--callers", name]), 2)
    assert "caller name" in out and "node name" not in out
