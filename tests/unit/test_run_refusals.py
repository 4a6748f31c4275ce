"""dilu demo, compare and chaos refuse option combinations that would mean nothing, in one line
and before anything starts (no NATS, no service is started for them)."""
from __future__ import annotations

import tempfile

import pytest
from click.testing import CliRunner

from cli_errors import one_line_error
from dilu.cli.main import main
from dilu.client.errors import Unreachable


@pytest.mark.parametrize("args, words", [
    (["demo", "--gpus", "1", "--training-jobs", "2"], "at most one training job per GPU: 2 on 1 GPUs"),
    (["compare", "--gpus", "2", "--training-jobs", "3"], "at most one training job per GPU"),
    (["chaos", "--soak", "--faults", "kill-scheduler"], "--faults does not apply"),
    (["compare", "--defrag-interval-s", "0.05"], "a round every 0.005 s, below the scheduler's 0.01 s"),
    (["demo", "--defrag-interval-s", "-1"], "--defrag-interval-s"),
    (["chaos", "--sample-s", "30"], "it needs --soak"),
    (["compare", "--policies", "dilu,"], "an empty policy name in 'dilu,'"),
    (["compare", "--policies", "dilu,nope"], "unknown policies nope"),
    (["compare", "--policies", "dilu, dilu"], "a policy is named twice"),
])
def test_a_combination_that_means_nothing_is_refused_in_one_line(args, words):
    assert words in one_line_error(CliRunner().invoke(main, args), 2)


@pytest.mark.parametrize("command", ["demo", "compare", "chaos"])
def test_a_trace_that_cannot_be_read_is_a_bad_trace_option(tmp_path, command):
    (tmp_path / "invocations.csv").write_text("garbage\n")
    line = one_line_error(CliRunner().invoke(main, [command, "--trace", str(tmp_path)]), 2)
    assert "Invalid value for '--trace'" in line and "header must start with HashOwner" in line


@pytest.mark.parametrize("command", ["demo", "compare"])
def test_a_start_minute_outside_the_trace_is_a_bad_option(command):
    line = one_line_error(CliRunner().invoke(main, [command, "--start-minute", "-5"]), 2)
    assert "Invalid value for '--start-minute': start minute -5 is outside the trace (minutes 480..959)" in line


def test_one_training_job_per_gpu_and_a_cpu_node_are_accepted():
    from dilu.cli.demo import RunOptions

    base = dict(duration=10.0, speedup=10.0, seed=1, trace_dir=None, start_minute=None, functions=4,
                nats_url=None, log_dir=None)
    assert RunOptions(**base, gpus="4", training_jobs=4).training_count() == 4
    assert RunOptions(**base, gpus="cpu", training_jobs=3).training_count() == 0


@pytest.mark.parametrize("args, words", [
    (["demo", "--log-dir", ""], "--log-dir': an empty path"),  # was a temp dir, as if not given
    (["compare", "--log-dir", ""], "--log-dir': an empty path"),
    (["chaos", "--log-dir", ""], "--log-dir': an empty path"),
    (["demo", "--nats-url", ""], "--nats-url': an empty URL"),  # was a nats-server of its own
    (["compare", "--nats-url", ""], "--nats-url': an empty URL"),
    (["status", "--nats-url", ""], "--nats-url': an empty URL"),
    (["up", "--data-dir", ""], "--data-dir': an empty path"),  # was the current directory
    (["up", "--log-dir", ""], "--log-dir': an empty path"),
    (["creds", "--out", ""], "--out': an empty path"),
])
def test_an_empty_path_or_url_is_refused_not_read_as_the_default(args, words):
    assert words in one_line_error(CliRunner().invoke(main, args), 2)


@pytest.mark.parametrize("args, words", [
    (["demo", "--nats-url", "http://127.0.0.1:1"], "is not a NATS URL like nats://host:4222"),  # it tried to connect
    (["compare", "--nats-url", "nats://127.0.0.1:99999"], "has no valid port (1..65535)"),  # exit 1, after the start
])
def test_a_replay_checks_its_nats_url_as_every_other_command_does(args, words):
    assert words in one_line_error(CliRunner().invoke(main, args), 2)


@pytest.mark.parametrize("cmd", [["sim"], ["summarize", "x.json"], ["calibrate", "x"]])
def test_an_output_file_in_a_folder_that_takes_no_file_is_refused_in_those_words(cmd):
    line = one_line_error(CliRunner().invoke(main, [*cmd, "--json", "/proc/x.json"]), 2)
    assert "cannot write /proc/x.json: nothing can be created in /proc" in line  # was: No such file or directory


@pytest.mark.parametrize("cmd", [["sim", "--functions", "1", "--hours", "0.01"], ["demo"], ["bench", "sim"]])
def test_an_output_file_of_the_kernels_is_refused_before_the_run(cmd):
    line = one_line_error(CliRunner().invoke(main, [*cmd, "--json", "/proc/self/status"]), 2)
    assert "cannot write /proc/self/status: a file of the kernel's" in line  # was refused after the run


def test_all_in_a_list_of_fault_kinds_is_refused_as_such():
    line = one_line_error(CliRunner().invoke(main, ["chaos", "--faults", "all,kill-profiler"]), 2)
    assert "'all' stands alone" in line and "unknown" not in line  # was: unknown fault kinds ['all']; ... or 'all'


@pytest.mark.parametrize("args", [["creds", "--out", "/dev/null"], ["sim", "--plots", "/dev/null"]])
def test_a_folder_option_naming_a_device_is_refused_as_not_a_folder(args):
    assert "/dev/null is not a folder" in one_line_error(CliRunner().invoke(main, args), 2)


@pytest.mark.parametrize("args", [["creds", "--out", "/proc/nope"], ["sim", "--plots", "/proc/nope"],
                                  ["demo", "--log-dir", "/proc/nope"], ["compare", "--log-dir", "/proc/nope"],
                                  ["chaos", "--log-dir", "/proc/nope"]])
def test_a_folder_option_that_cannot_be_made_is_refused_as_bad_input(args):
    line = one_line_error(CliRunner().invoke(main, args), 2)
    assert "cannot write into /proc/nope: nothing can be created in /proc" in line  # not the OS's "No such file"


@pytest.mark.parametrize("args", [["sim", "--plots", "/proc"], ["demo", "--log-dir", "/proc"],
                                  ["up", "--data-dir", "/proc"]])
def test_a_folder_that_exists_but_takes_no_file_is_refused_in_those_words(args):
    """/proc is there, but nothing can be created in it (the kernel says "No such file")."""
    line = one_line_error(CliRunner().invoke(main, args), 2)
    assert "/proc" in line and "No such file" not in line and ": nothing can be created in it" in line


def _stub_run(monkeypatch):
    """Replace dilu chaos's run by one that only schedules the faults as the run would (from the
    run's own length and margins) and stops there, so a command that passes its checks starts nothing."""
    from dilu.cli import chaos as chaos_cli
    from dilu.loadgen import chaos

    async def run_chaos(opts, kinds, *args):
        lead_s, tail_s = chaos.margins_s(opts.duration)
        faults = chaos.schedule([k for k in kinds if k != chaos.LOSE_AGENT], opts.duration, lead_s=lead_s, tail_s=tail_s)
        raise RuntimeError(f"stub: {len(faults)} faults scheduled")

    monkeypatch.setattr(chaos_cli, "run_chaos", run_chaos)


@pytest.mark.parametrize("faults", [["--faults", "all"], ["--faults", "kill-scheduler,restart-nats"],
                                    ["--faults", "lose-node-agent"], ["--soak"]])
def test_chaos_names_the_one_minimum_of_minutes_for_the_faults_asked_and_that_minimum_runs(monkeypatch, faults):
    _stub_run(monkeypatch)
    line = one_line_error(CliRunner().invoke(main, ["chaos", "--minutes", "0.05", *faults]), 2)
    assert "--minutes" in line and "too short" in line
    shortest = line.split("at least ")[1].split(" minutes")[0]
    r = CliRunner().invoke(main, ["chaos", "--minutes", shortest, *faults])
    assert "stub:" in one_line_error(r, 1)  # past every check, and the schedule fits: no second minimum
    below = f"{float(shortest) - 0.01:g}"
    assert f"at least {shortest} minutes" in one_line_error(CliRunner().invoke(main, ["chaos", "--minutes", below, *faults]), 2)


def test_chaos_with_all_faults_needs_the_minutes_its_help_names():
    from dilu.cli.chaos import min_minutes
    from dilu.loadgen import chaos

    assert min_minutes([*chaos.KINDS, chaos.LOSE_AGENT]) == 1.65  # 98.75 s: 15 s lead, 8 x 8 s, 19.75 s tail
    assert "all of them: 1.65" in " ".join(CliRunner().invoke(main, ["chaos", "--help"]).output.split())


@pytest.mark.parametrize("args, env, hint", [
    (["chaos"], {"DILU_MINUTES": "0.2"}, "'--minutes' (from DILU_MINUTES)"),
    (["sim"], {"DILU_NODES": "0"}, "'--nodes' (from DILU_NODES)"),  # shows its variable in --help
    (["bench", "scheduler"], {"DILU_GAMMA": "nan"}, "'--gamma' (from DILU_GAMMA)"),
    (["demo", "--gpus", "1"], {"DILU_TRAINING_JOBS": "2"}, "'--training-jobs' (from DILU_TRAINING_JOBS)"),  # raised in the body
    (["status"], {"DILU_NATS_URL": "nats://host:0"}, "'--nats-url' (from DILU_NATS_URL)"),
    (["status"], {"DILU_NATS_URL": "nats://\udcff:4222"}, "'--nats-url' (from DILU_NATS_URL)"),  # bytes not UTF-8
    (["status"], {"DILU_NATS_CREDS": "/dev/zero"}, "'--creds' (from DILU_NATS_CREDS)"),  # endless: never read
])
def test_a_bad_value_from_the_environment_names_its_variable(args, env, hint):
    assert f"Invalid value for {hint}:" in one_line_error(CliRunner(env=env).invoke(main, args), 2)


@pytest.mark.parametrize("args, env, hint", [
    (["chaos", "--minutes", "0.2"], {"DILU_MINUTES": "3"}, "'--minutes':"),
    (["sim", "--nodes", "0"], {"DILU_NODES": "1"}, "'--nodes':"),  # not click's "(env var: 'DILU_NODES')"
])
def test_a_bad_value_typed_names_no_variable(args, env, hint):
    line = one_line_error(CliRunner(env=env).invoke(main, args), 2)
    assert f"Invalid value for {hint}" in line and "DILU_" not in line


def _failing_start(monkeypatch, logged: str = ""):
    """Make the cluster fail to start, as with an unreachable --nats-url, after its services wrote
    ``logged`` (nothing by default); the load generator's log configuration is left alone."""
    from dilu.cli import demo as demo_cli

    def start(self, abort=None):
        if logged:
            (self.log_dir / "scheduler.log").write_text(logged)
        raise Unreachable("cannot reach NATS at nats://127.0.0.1:1: connection refused")

    monkeypatch.setattr(demo_cli.Cluster, "start", start)
    monkeypatch.setattr(demo_cli.dlog, "configure", lambda *a, **k: None)
    monkeypatch.setattr(tempfile, "tempdir", None)


@pytest.mark.parametrize("command, prefix", [("demo", "dilu-logs-"), ("compare", "dilu-logs-"), ("chaos", "dilu-chaos-")])
def test_a_run_that_fails_before_logging_leaves_no_temporary_log_directory(tmp_path, monkeypatch, command, prefix):
    _failing_start(monkeypatch)
    length = ["--minutes", "3"] if command == "chaos" else ["--duration", "5"]
    r = CliRunner(env={"TMPDIR": str(tmp_path)}).invoke(main, [command, *length, "--functions", "1"])
    assert "cannot reach NATS" in one_line_error(r, 5)  # the exit code every command gives it
    assert list(tmp_path.glob(f"{prefix}*")) == []


def test_a_failed_run_keeps_the_users_log_directory_and_what_was_logged(tmp_path, monkeypatch):
    _failing_start(monkeypatch)
    mine = tmp_path / "mine"
    one_line_error(CliRunner().invoke(main, ["demo", "--duration", "5", "--functions", "1", "--log-dir", str(mine)]), 5)
    assert (mine / "dilu").is_dir()  # the user's, even empty
    _failing_start(monkeypatch, logged='{"event": "why it failed"}\n')
    r = CliRunner(env={"TMPDIR": str(tmp_path)}).invoke(main, ["demo", "--duration", "5", "--functions", "1"])
    one_line_error(r, 5)
    assert [p.read_text() for p in tmp_path.glob("dilu-logs-*/dilu/scheduler.log")] == ['{"event": "why it failed"}\n']


@pytest.mark.parametrize("env, args, hint", [
    ({"DILU_DEFRAG_INTERVAL_S": "0.001"}, [], "'--defrag-interval-s' (from DILU_DEFRAG_INTERVAL_S)"),
    ({}, ["--defrag-interval-s", "1e-300"], "'--defrag-interval-s':"),  # would spin: neither 0 nor >= 10 ms
    ({"DILU_GAMMA": "abc"}, [], "'--gamma' (from DILU_GAMMA)"),
])
def test_a_service_names_the_variable_a_bad_value_came_from(env, args, hint, monkeypatch):
    """A service started as ``python -m dilu.services.scheduler`` (service_main) says, as dilu's
    commands do, which DILU_* variable a bad value came from, in one line; and refuses a tiny period."""
    from dilu.services.common.cliopts import OneLineUsageError, service_main
    from dilu.services.scheduler.__main__ import main as scheduler_main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(OneLineUsageError) as err:
        service_main(scheduler_main, args=args, standalone_mode=False)
    line = err.value.format_message()
    assert line.startswith(f"Invalid value for {hint}") and "\n" not in line, line
    assert ("DILU_" in line) == bool(env)


@pytest.mark.parametrize("args, env, needle", [
    (["--port", "99999"], {}, "99999 is not in the range"),
    ([], {"DILU_PORT": "abc"}, "(from DILU_PORT)"),
    (["--bogus"], {}, "No such option '--bogus'"),
])
def test_dilu_service_says_a_bad_option_in_one_line(args, env, needle):
    """``dilu service NAME`` as every other command: one line naming the help to read, exit 2."""
    res = CliRunner().invoke(main, ["service", "gateway", *args], env=env)
    assert res.exit_code == 2, res.output
    assert res.output.count("\n") == 1 and needle in res.output, res.output
    assert res.output.startswith("Error: ") and "(see 'dilu service gateway --help')" in res.output


def test_dilu_service_without_a_name_shows_its_help_as_a_usage_error():
    res = CliRunner().invoke(main, ["service"])
    assert res.exit_code == 2 and "Run service NAME" in res.output, res.output
    assert CliRunner().invoke(main, ["service", "--help"]).exit_code == 0


@pytest.mark.parametrize("url, words", [
    ("nats://[::1", "Invalid IPv6 URL"),  # urlsplit's own ValueError was a traceback
    ("nats://[zz]:4222", "'zz' does not appear to be an IPv4 or IPv6 address"),
    ("nats://host:99999", "has no valid port"),
    ("http://host:4222", "is not a NATS URL like nats://host:4222"),
])
def test_a_malformed_nats_url_is_one_line_before_any_connection(url, words):
    for args in (["status", "--listen", "0"], ["invoke", "f", "--data", "x"]):
        assert words in one_line_error(CliRunner().invoke(main, [*args, "--nats-url", url]), 2)


@pytest.mark.parametrize("args", [["demo", "--duration"], ["demo", "--speedup"], ["compare", "--llm-share"],
                                  ["sim", "--hours"], ["chaos", "--sample-s"], ["profile", "--slo-ms"]])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e309", "abc", "0.5x"])
def test_a_number_that_is_not_finite_reads_the_same_on_every_float_option_bounded_or_not(args, value):
    """One wording for every float option (cliopts.Finite), before its range is checked: a
    bounded option once answered "-inf is not in the range", and "1e309" came back as "inf"."""
    line = one_line_error(CliRunner().invoke(main, [*args, value]), 2)
    assert f"Invalid value for '{args[1]}': '{value}' is not a valid finite number." in line
