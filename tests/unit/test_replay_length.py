"""The length of a live replay (dilu demo, compare, chaos): every --speedup the commands accept
derives horizontal-scaler windows the service accepts; a span that sends nothing is refused in
one line; a span the trace cuts short is said, and chaos checks its faults against that real
length before anything starts. Nothing here starts NATS or a service."""
from __future__ import annotations

import asyncio
import importlib
import json
import tempfile

import pytest
from click.testing import CliRunner

from cli_errors import one_line_error
from dilu.cli.main import COMMANDS, main
from dilu.loadgen import arrivals


@pytest.mark.parametrize("speedup", [arrivals.SPEEDUP_MIN, 0.02, 0.1, 1.0, 10.0, arrivals.SPEEDUP_MAX])
def test_the_horizontal_scaler_accepts_the_windows_of_every_documented_speedup(speedup):
    from dilu.cli.demo import scaler_windows
    from dilu.services.horizontal_scaler.__main__ import main as scaler_main
    from dilu.services.horizontal_scaler.policy import HorizontalConfig

    args = scaler_windows(speedup)
    ctx = scaler_main.make_context("horizontal_scaler", list(args))  # was: 6000.0 is not in 0.1<=x<=3600
    given = {a.lstrip("-").replace("-", "_") for a in args[::2]}
    HorizontalConfig(**{k: v for k, v in ctx.params.items() if k in given})


def test_a_replay_names_the_target_utilisation_so_the_environment_cannot_change_it(monkeypatch):
    """dilu demo and compare start the scaler with the caller's environment; the simulator has
    no such variable. The replay's arguments name the value, which wins over the variable."""
    from dilu.cli.demo import horizontal_config, scaler_windows
    from dilu.services.horizontal_scaler.__main__ import main as scaler_main
    from dilu.services.common.cliopts import ENV_PREFIX
    from dilu.services.horizontal_scaler.policy import TARGET_UTILIZATION

    monkeypatch.setenv("DILU_TARGET_UTILIZATION", "0.35")
    ctx = scaler_main.make_context("horizontal_scaler", scaler_windows(10.0), auto_envvar_prefix=ENV_PREFIX)
    assert ctx.params["target_utilization"] == TARGET_UTILIZATION == horizontal_config("lazy", 10.0).target_utilization
    bare = scaler_main.make_context("horizontal_scaler", [], auto_envvar_prefix=ENV_PREFIX)
    assert bare.params["target_utilization"] == 0.35  # the variable works where nothing names the option


def _tiny_trace(tmp_path):
    """A 3-minute trace whose only function is idle for its first two minutes."""
    (tmp_path / "invocations.csv").write_text("HashOwner,HashApp,HashFunction,Trigger,1,2,3\no,a,f,http,0,0,5\n")
    return str(tmp_path)


def _failing_start(monkeypatch):
    """A cluster that fails to start (so a run past its checks ends there, starting nothing)."""
    from dilu.cli import demo as demo_cli

    def start(self, abort=None):
        raise RuntimeError("stub: the cluster would start here")

    monkeypatch.setattr(demo_cli.Cluster, "start", start)
    monkeypatch.setattr(demo_cli.dlog, "configure", lambda *a, **k: None)
    monkeypatch.setattr(tempfile, "tempdir", None)  # the run's temporary log directory goes under TMPDIR


@pytest.mark.parametrize("args", [
    ["demo", "--speedup", "0.01", "--duration", "5"],  # 0.05 trace s of the bundled trace
    ["compare", "--speedup", "0.01", "--duration", "5"],
    ["demo", "--trace", "TINY", "--duration", "5", "--functions", "1"],  # 50 s of an idle first minute
    ["chaos", "--trace", "TINY", "--speedup", "1", "--minutes", "0.5", "--soak"],
])
def test_a_span_without_invocations_is_refused_in_one_line(tmp_path, monkeypatch, args):
    _failing_start(monkeypatch)  # without the check, the run would get as far as the cluster
    args = [_tiny_trace(tmp_path) if a == "TINY" else a for a in args]
    r = CliRunner(env={"TMPDIR": str(tmp_path)}).invoke(main, args)
    assert "holds no invocation" in one_line_error(r, 2)  # a bad option, as dilu sim says it
    assert "policy" not in r.output  # refused before the run's first line: "policy dilu: 0 functions"


@pytest.mark.parametrize("args, words", [
    (["demo", "--start-minute", "959", "--duration", "30"],
     "--duration 30: from minute 959 the trace holds only 6 s at --speedup 10 (its last 1 minute); replaying those"),
    (["compare", "--duration", "1e12"],
     "--duration 1e+12: from minute 480 the trace holds only 2,880 s at --speedup 10 (its last 480 minutes)"),
    (["chaos", "--minutes", "100", "--soak"],
     "--minutes 100: from minute 480 the trace holds only 48 minutes at --speedup 10 (its last 480 minutes)"),
])
def test_a_span_the_trace_cuts_short_is_said(tmp_path, monkeypatch, args, words):
    _failing_start(monkeypatch)
    r = CliRunner(env={"TMPDIR": str(tmp_path), "COLUMNS": "300"}).invoke(main, [*args, "--functions", "1"])
    assert "stub: the cluster would start here" in one_line_error(r, 1)
    assert words in r.output


def test_a_span_the_trace_does_not_cut_is_not_said(tmp_path, monkeypatch):
    _failing_start(monkeypatch)
    r = CliRunner(env={"TMPDIR": str(tmp_path)}).invoke(main, ["demo", "--start-minute", "958", "--duration", "12",
                                                                "--functions", "1"])
    one_line_error(r, 1)
    assert "holds only" not in r.output


def _stub_run(monkeypatch):
    """dilu chaos's run, reduced to scheduling the faults over the run's real length as run_chaos
    does (then it stops: nothing starts)."""
    from dilu.cli import chaos as chaos_cli
    from dilu.loadgen import chaos, trace

    async def run_chaos(opts, kinds, *args):
        length_s = arrivals.replay_s(trace.read_trace(opts.trace_dir), duration_s=opts.duration, speedup=opts.speedup)
        lead_s, tail_s = chaos.margins_s(length_s)
        faults = chaos.schedule([k for k in kinds if k != chaos.LOSE_AGENT], length_s, lead_s=lead_s, tail_s=tail_s)
        raise RuntimeError(f"stub: {len(faults)} faults scheduled")

    monkeypatch.setattr(chaos_cli, "run_chaos", run_chaos)


@pytest.mark.parametrize("extra, what", [([], "too short for 9 faults (at least 1.65 minutes)"),
                                         (["--soak"], "too short for a run without faults (at least 0.5 minutes)")])
def test_chaos_checks_its_faults_against_the_length_the_trace_allows_up_front(monkeypatch, extra, what):
    _stub_run(monkeypatch)
    line = one_line_error(CliRunner().invoke(main, ["chaos", "--speedup", "1000", "--minutes", "2", *extra]), 2)
    assert "--minutes 2 at --speedup 1000 replays only 28.8 s (the trace's 480 minutes): " + what in line
    fastest = line.split("at most --speedup ")[1].split(" ")[0]
    r = CliRunner().invoke(main, ["chaos", "--speedup", fastest, "--minutes", "2", *extra])
    assert "stub:" in one_line_error(r, 1)  # the speed-up named runs, and its schedule fits
    faster = f"{float(fastest) + 0.1:g}"
    assert "replays only" in one_line_error(CliRunner().invoke(main, ["chaos", "--speedup", faster, "--minutes", "2",
                                                                      *extra]), 2)


def test_chaos_records_the_real_length_and_prints_slo_violations_and_latency(tmp_path, monkeypatch):
    """A soak whose replay is stubbed out (no request): the JSON's minutes are those replayed,
    and the printed summary has the SLO violation rate and latency the JSON holds."""
    from dilu.cli import chaos as chaos_cli
    from dilu.cli.demo import Replay
    from dilu.loadgen.generator import RunResult
    from dilu.services.common.invoke import InvokeStats

    async def start(cluster, created):
        pass

    async def replay(opts, cluster, plan, chosen, llm_plan, console, stop, **kw):
        await asyncio.sleep(0)
        result = RunResult(records=[], wall_s=plan.duration_s, started_unix_ns=0, late_sends=0,
                           late_threshold_ms=10.0, max_late_ms=0.0)
        return Replay(result, [], {}, InvokeStats())

    monkeypatch.setattr(chaos_cli, "_start", start)
    monkeypatch.setattr(chaos_cli, "_replay", replay)
    monkeypatch.setattr(chaos_cli, "quota_sum_max", lambda cluster: None)
    monkeypatch.setattr(chaos_cli.Cluster, "stop", lambda self: None)
    monkeypatch.setattr(chaos_cli.dlog, "configure", lambda *a, **k: None)
    out = tmp_path / "c.json"
    r = CliRunner(env={"COLUMNS": "300"}).invoke(main, ["chaos", "--soak", "--minutes", "100", "--functions", "1",
                                                       "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert r.exit_code == 0, r.output
    run = json.loads(out.read_text())["run"]
    assert (run["minutes"], run["minutes_asked"]) == (48.0, 100.0)
    assert "SLO violations over the run 0.0 %, latency p50/p99 – / –" in r.output


@pytest.mark.parametrize("args, options", [
    (["chaos"], ["--speedup", "--seed", "--trace", "--log-dir", "--json", "--gpus", "--minutes", "--sample-s"]),
    (["demo"], ["--seed", "--policy"]),
    (["compare"], ["--json", "--seed"]),
])
def test_every_option_has_help(args, options):
    module, attr = COMMANDS[args[0]].split(":")
    command = getattr(importlib.import_module(module), attr)
    helps = {p.opts[0]: p.help for p in command.params if hasattr(p, "help")}
    assert all(helps[o] for o in options), {o: helps[o] for o in options}


def test_chaos_help_says_units_cpu_and_its_variables():
    text = " ".join(CliRunner().invoke(main, ["chaos", "--help"]).output.split())
    assert "wall-clock minutes of load" in text and "'cpu'" in text and "trace seconds per wall-clock second" in text
    assert "[env var: DILU_MINUTES; default: 3.0]" in text and "env var: DILU_SPEEDUP" in text


def test_a_soak_sampling_period_over_a_twelfth_of_the_run_is_shortened_and_said(monkeypatch):
    """--sample-s above a twelfth of the run (the slopes need a dozen samples) samples at a
    twelfth, and the run says so; one within it is kept, silently."""
    from dilu.cli import chaos as chaos_cli
    periods = []

    async def run_chaos(opts, kinds, soak, sample_s, *args):
        periods.append(sample_s)
        raise RuntimeError("stub: nothing starts")

    monkeypatch.setattr(chaos_cli, "run_chaos", run_chaos)
    r = CliRunner().invoke(main, ["chaos", "--soak", "--minutes", "1", "--sample-s", "30"])
    one_line_error(r, 1)
    assert periods == [5.0] and "--sample-s 30 is more than a twelfth of this 60-s run: sampling every 5 s" in r.output
    r = CliRunner().invoke(main, ["chaos", "--soak", "--minutes", "1", "--sample-s", "4"])
    one_line_error(r, 1)
    assert periods[1] == 4.0 and "twelfth" not in r.output
