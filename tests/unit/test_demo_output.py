"""dilu demo / compare as a new user meets them: progress lines in a file or pipe (fake clock),
every column defined in --help, the report's width off a terminal, the exit status of a stop."""
from __future__ import annotations

import asyncio
import io
import signal

import pytest
from click.testing import CliRunner
from rich.console import Console

from dilu.cli import demo
from dilu.loadgen.report import LEGEND


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def lines_of(console: Console) -> list[str]:
    return [line for line in console.file.getvalue().splitlines() if line]


def test_progress_lines_come_every_period_with_the_counts():
    clock = FakeClock()
    console = Console(file=io.StringIO(), width=100)
    p = demo.ProgressLines(console, every_s=10, clock=clock)
    clock.t += 9.9
    assert not p.tick() and lines_of(console) == []
    clock.t += 0.1
    assert p.tick()
    assert lines_of(console) == ["[10 s] starting the services"]
    p.phase = "profiling"
    p.active_gpus = 2
    clock.t += 5
    assert not p.tick()  # the next is due at 20 s
    clock.t += 5
    p.tick()
    assert lines_of(console)[-1] == "[20 s] profiling, active GPUs 2"
    p.replay(planned=5000, duration_s=120)
    p.sent, p.completed = 1234, 1200
    clock.t += 35  # 55 s: two periods missed, one line, the next due at 60 s
    assert p.tick() and not p.tick()
    assert lines_of(console)[-1] == "[55 s] replay 35 of 120 s: sent 1,234 of 5,000, completed 1,200, active GPUs 2"
    clock.t += 5
    assert p.tick() and len(lines_of(console)) == 4
    clock.t += 90  # past the replay's 120 s: the answers still arriving
    p.tick()
    assert lines_of(console)[-1].startswith("[150 s] replay done, waiting for answers: 130 of 120 s: sent 1,234")
    with pytest.raises(ValueError):
        demo.ProgressLines(console, every_s=0)


def test_progress_run_prints_on_its_own_and_survives_a_failing_refresh():
    console = Console(file=io.StringIO(), width=100)
    p = demo.ProgressLines(console, every_s=0.01)

    async def refresh() -> None:
        raise OSError("metrics gone")

    async def main() -> None:
        task = asyncio.create_task(p.run(refresh))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert len(lines_of(console)) >= 2 and all("starting the services" in line for line in lines_of(console))


def test_a_pipe_gets_the_report_width_unless_columns_says(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    console = demo.make_console()
    assert not console.is_terminal and console.width == demo.REPORT_WIDTH
    monkeypatch.setenv("COLUMNS", "140")
    assert demo.make_console().width == 140
    for narrow in ("0", "1", "39"):  # 0 would print nothing at all
        monkeypatch.setenv("COLUMNS", narrow)
        assert demo.make_console().width == demo.REPORT_MIN_WIDTH


def test_signal_exit_is_128_plus_the_signal():
    stop = asyncio.Event()
    assert demo.signal_exit(stop) == 0 and demo.signal_exit(None) == 0
    stop.signum = signal.SIGINT
    assert demo.signal_exit(stop) == 130
    stop.signum = signal.SIGTERM
    assert demo.signal_exit(stop) == 143


def test_a_stop_before_anything_was_offered_exits_with_the_signal_status():
    async def main():
        raise demo.Interrupted("stopped while profiling: nothing was offered", 143)

    with pytest.raises(SystemExit) as exc:
        demo._run_or_explain(main)
    assert exc.value.code == 143


@pytest.mark.parametrize("command", [demo.demo, demo.compare])
def test_help_defines_every_column(command):
    out = CliRunner().invoke(command, ["--help"], terminal_width=100).output
    defined = {line.strip().split("  ")[0] for line in out.splitlines() if line.startswith("  ") and "  " in line.strip()}
    assert set(LEGEND) <= defined, set(LEGEND) - defined
    if command is demo.compare:
        assert "(0.53x)" in out and "(pp)" in out
