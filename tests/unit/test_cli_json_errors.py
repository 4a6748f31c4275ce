"""Under --json every error is {"error", "exit_code"} on stdout, a bad option's too (click's
usage errors: a value out of range, a missing file, an unknown option, a missing argument);
without --json they stay click's usage text on stderr. Exit 2 either way."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dilu.cli.main import main


@pytest.mark.parametrize("args, says", [
    (["invoke", "x", "--timeout", "-1"], "Invalid value for '--timeout'"),
    (["invoke", "x", "--timeout", "1e308"], "1e+308 is not in the range 0.001<=x<=3600"),
    (["deploy", "f.toml", "--wait-ready", "1e308"], "Invalid value for '--wait-ready'"),
    (["status", "--creds", "/nonexistent/user.creds"], "Invalid value for '--creds'"),
    (["invoke", "x", "--bogus"], "No such option '--bogus'"),
    (["invoke"], "Missing argument 'NAME'"),
    (["undeploy", "a/b"], "is not a function name"),
])
def test_a_usage_error_under_json_is_a_json_result(args, says):
    res = CliRunner().invoke(main, args + ["--json"], prog_name="dilu")
    assert res.exit_code == 2, res.output
    out = json.loads(res.stdout)
    assert out["exit_code"] == 2 and says in out["error"], out
    plain = CliRunner().invoke(main, args, prog_name="dilu")
    assert plain.exit_code == 2 and plain.stdout == "" and plain.stderr.count("\n") == 1, plain.stderr
    assert plain.stderr.startswith("Error: ") and says in plain.stderr and "--help')" in plain.stderr


@pytest.mark.parametrize("args, command", [(["calibrate", ".", "--json"], "dilu calibrate"),
                                           (["sim", "--json"], "dilu sim"),
                                           (["bench", "sim", "--json"], "dilu bench sim")])
def test_an_option_without_its_value_says_the_commands_help(args, command):
    """The parser raises that error before the command's context exists: it still names the
    command's --help, in one line."""
    res = CliRunner().invoke(main, args, prog_name="dilu")
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr == f"Error: Option '--json' requires an argument. (see '{command} --help')\n"


def test_an_option_without_its_value_under_json_is_a_json_result():
    for env in ({}, {"DILU_JSON": "1"}):
        args = ["invoke", "x", "--timeout"] if env else ["invoke", "x", "--json", "--timeout"]
        res = CliRunner().invoke(main, args, env=env, prog_name="dilu")
        assert res.exit_code == 2, res.output
        assert json.loads(res.stdout) == {"error": "Option '--timeout' requires an argument.", "exit_code": 2}

def test_json_from_its_variable_makes_a_usage_error_json_too():
    res = CliRunner().invoke(main, ["invoke", "x", "--timeout", "abc"], env={"DILU_JSON": "1"}, prog_name="dilu")
    assert res.exit_code == 2 and json.loads(res.stdout)["exit_code"] == 2
    res = CliRunner().invoke(main, ["invoke", "x", "--timeout", "abc"], env={"DILU_JSON": "0"}, prog_name="dilu")
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith("Error: ")
    assert res.stderr.strip().endswith("(see 'dilu invoke --help')"), res.stderr


def test_a_bad_value_from_the_environment_names_its_variable_under_json_too():
    res = CliRunner().invoke(main, ["invoke", "x", "--json"], env={"DILU_TIMEOUT": "soon"}, prog_name="dilu")
    assert res.exit_code == 2 and "(from DILU_TIMEOUT)" in json.loads(res.stdout)["error"]


def test_an_option_named_json_that_takes_a_path_keeps_the_one_line_usage_error():
    """`dilu sim --json PATH` writes a file: its usage errors are not JSON results."""
    res = CliRunner().invoke(main, ["sim", "--hours", "-1", "--json", "x.json"], prog_name="dilu")
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.count("\n") == 1
    assert res.stderr.startswith("Error: Invalid value for '--hours'") and "dilu sim --help" in res.stderr


@pytest.mark.parametrize("args", [["nosuch"], ["bench", "nosuch"], ["bench", "sim", "--hours", "-1"]])
def test_a_usage_error_of_a_group_or_a_nested_command_is_one_line_too(args):
    res = CliRunner().invoke(main, args, prog_name="dilu")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and res.stderr.startswith("Error: "), res.stderr


@pytest.mark.parametrize("group", ["events", "bench"])
def test_a_group_named_without_its_command_shows_its_help_not_an_error(group):
    """`dilu bench` alone: its help (its commands listed), as `dilu` alone shows, not the help
    text wrapped in an "Error: ..." line."""
    res = CliRunner().invoke(main, [group], prog_name="dilu")
    assert res.exit_code in (0, 2)  # click 8.1 exits 0 there, click >= 8.2 exits 2
    assert res.output.startswith(f"Usage: dilu {group} ") and "Commands:" in res.output, res.output
    assert "Error" not in res.output


def test_deploy_help_lists_its_exit_codes():
    out = CliRunner().invoke(main, ["deploy", "--help"]).output
    assert "Exit codes:" in out and "4  no capacity: no GPU of the cluster can take one instance" in out
