"""The benches' stop on a signal (:class:`SignalExit`: cleanup runs, one line, 128 + the signal)
and their --help: every size or time option says its unit, and --nats-url shows what a bench
does without it, not a server it never connects to."""
from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
import time

import click
import pytest
import uvloop

from dilu.cli.main import BENCHES
from dilu.services.common.interrupt import SignalExit


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_plain_code_runs_the_cleanup_and_exits_with_its_status(sig, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    cleaned = []
    with pytest.raises(SystemExit) as ended:
        with SignalExit():
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)
                pytest.fail("the signal did not stop the block")
            finally:
                cleaned.append(True)
    assert ended.value.code == 128 + sig
    assert cleaned == [True]
    assert capsys.readouterr().err == "interrupted\n"
    assert {s: signal.getsignal(s) for s in before} == before  # handlers given back



STOP_IN_EXEC = """
import os, signal, sys
from dilu.services.common.interrupt import SignalExit
with SignalExit():
    exec(f"os.kill(os.getpid(), {sys.argv[1]})\\nwhile True: pass")
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_exec_still_exits_with_its_status(sig, tmp_path):
    """A signal landing in code run by exec (an import, a dataclass being made: the first second
    of every command) must not turn the exit into a death by SIGINT (-2): CPython does that for a
    plain KeyboardInterrupt that left exec, even one caught later, when run with -m as dilu is."""
    (tmp_path / "stop_in_exec.py").write_text(STOP_IN_EXEC)
    run = subprocess.run([sys.executable, "-m", "stop_in_exec", str(int(sig))], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (128 + sig, "interrupted\n")


STOP_IN_FINALISER = """
import signal, sys
from dilu.services.common.interrupt import SignalExit, raise_if_stopped
hook = sys.unraisablehook
class Finalised:
    def __del__(self):
        signal.raise_signal(signal.SIGTERM)
try:
    with SignalExit():
        Finalised()  # dropped at once: the handler runs inside __del__, where its exception is lost
        raise_if_stopped()
        print("the lost stop was not raised again", file=sys.stderr)
finally:
    assert sys.unraisablehook is hook, "the hook was not given back"
"""


def test_a_stop_lost_in_a_finaliser_prints_only_its_line_and_still_stops(tmp_path):
    """A signal handled in an object's finaliser (the simulator drops many): Python cannot raise
    its exception there and would print it as "Exception ignored in ..." with a traceback; the
    stop goes on, with its one line. In a process of its own: pytest catches unraisable
    exceptions itself."""
    (tmp_path / "stop_in_finaliser.py").write_text(STOP_IN_FINALISER)
    run = subprocess.run([sys.executable, "-m", "stop_in_finaliser"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (128 + signal.SIGTERM, "interrupted\n")

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_line_imports_its_command_is_one_line_and_its_status(sig):
    """Before a command can install its stop (dilu.cli.main and the command's module still
    importing: NATS, numpy), Python would print a traceback (SIGINT) or end without a word
    (SIGTERM); the command line's own stop is in force from the start of dilu.cli.main."""
    start = f"import os, sys, time; sys.argv[0] = 'dilu'; import dilu.cli.main; os.kill(os.getpid(), {int(sig)}); time.sleep(30)"
    run = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (128 + sig, "interrupted\n")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_cancels_the_event_loop_task_and_its_cleanup_awaits(sig, capsys):
    cleaned = []

    async def bench() -> None:
        try:
            os.kill(os.getpid(), sig)
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.01)  # a cleanup that awaits (closing a connection) still runs
            os.kill(os.getpid(), sig)  # a second signal does not cut it short
            await asyncio.sleep(0.01)
            cleaned.append(True)

    with pytest.raises(SystemExit) as ended:
        with SignalExit() as stop:
            uvloop.run(stop.cancelling(bench()))
    assert ended.value.code == 128 + sig
    assert cleaned == [True]
    assert capsys.readouterr().err == "interrupted\n"


def test_without_a_signal_the_block_is_left_alone():
    with SignalExit() as stop:
        assert uvloop.run(stop.cancelling(asyncio.sleep(0, "done"))) == "done"
    with pytest.raises(click.ClickException):
        with SignalExit():
            raise click.ClickException("a bench's own error")
    assert stop.signum is None


def _command(name: str) -> click.Command:
    module, attr = BENCHES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def _help(name: str, option: str) -> str:
    """The --help text of ``option`` of ``dilu bench NAME``, its [default: ...] included."""
    command = _command(name)
    param = next(p for p in command.params if f"--{option}" in p.opts)
    with click.Context(command) as ctx:
        return " ".join(param.get_help_record(ctx)[1].split())


@pytest.mark.parametrize("bench, option, unit", [
    ("invoke", "seconds", "in s"), ("loadgen", "seconds", "in s"),
    ("vertical", "events", "a count"), ("vertical", "interval-ms", "in ms"), ("vertical", "telemetry-ms", "in ms"),
    ("sim", "nodes", "a count"), ("sim", "gpus-per-node", "a count"), ("sim", "hours", "simulated"),
    ("scheduler", "nodes", "a count"), ("scheduler", "gpus-per-node", "a count"),
])
def test_every_size_and_time_option_says_its_unit(bench, option, unit):
    assert unit in _help(bench, option)


@pytest.mark.parametrize("bench, shown", [
    ("invoke", "a nats-server of its own"), ("vertical", "a nats-server of its own"),
    ("loadgen", "nothing is published"),
])
def test_nats_url_shows_what_the_bench_does_without_it(bench, shown):
    text = _help(bench, "nats-url")
    assert "127.0.0.1:4222" not in text  # it never connects there unless told to
    assert shown in text
