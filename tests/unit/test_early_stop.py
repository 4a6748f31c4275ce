"""The stop of the dilu command line outside its command (cli/early_stop.py): in force while a
command is imported and its options parsed, handed over as the command's own code starts."""
from __future__ import annotations

import signal

import click
import pytest

from dilu.cli.early_stop import OutsideCommand
from dilu.cli.main import main, stops_itself


@pytest.fixture
def default_signals():
    """Python's own SIGINT and SIGTERM handlers (the ones OutsideCommand installs over), restored after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    OutsideCommand.remove()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_the_stop_is_handed_over_as_the_command_starts_not_when_it_is_imported(default_signals):
    """dilu bench loadgen signalled between its import and its first line ended by SIGTERM (-15)
    instead of 143: the stop was removed at import, while click still parsed the options."""
    OutsideCommand.install()
    ctx = click.Context(main)
    bench = main.get_command(ctx, "bench")
    loadgen = bench.get_command(click.Context(bench, parent=ctx), "loadgen")
    assert signal.getsignal(signal.SIGTERM) == OutsideCommand._stop  # imported: still in force
    seen = []
    command = stops_itself(click.Command("x", callback=lambda: seen.append(signal.getsignal(signal.SIGTERM))))
    command.callback()
    assert seen == [signal.SIG_DFL]  # the command's first line: its own to install
    assert loadgen.callback.__wrapped__ is not None  # the bench's command hands over the same way


def test_a_group_hands_over_in_each_of_its_commands(default_signals):
    events = main.get_command(click.Context(main), "events")
    assert all(getattr(c.callback, "_hands_over", False) for c in events.commands.values())
    assert stops_itself(events) is events  # once: a second call wraps nothing again
    tail = events.commands["tail"].callback
    assert not getattr(tail.__wrapped__, "_hands_over", False)
