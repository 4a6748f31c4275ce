"""The ``dilu`` command line (click). Subcommands live next to what they drive and load lazily,
so ``dilu --help`` stays fast and a missing optional piece breaks only its own command.
"""
from __future__ import annotations

import functools
import importlib
import os
import signal
import sys

from dilu.cli.early_stop import OutsideCommand

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "dilu":  # the command line: before the imports below
    OutsideCommand.install()

import click  # noqa: E402

from dilu.services.common.cliopts import JsonUsageError, OneLineUsageError, asks_json, flag_envvars, name_envvar  # noqa: E402
from dilu.services.common.console import output_failed  # noqa: E402

# name -> "module:attribute" of a click command
COMMANDS: dict[str, str] = {
    "demo": "dilu.cli.demo:demo",
    "compare": "dilu.cli.demo:compare",
    "chaos": "dilu.cli.chaos:chaos_cmd",
    "up": "dilu.cli.up:up",
    "service": "dilu.cli.service:service",
    "profile": "dilu.services.profiler.cli:profile",
    "deploy": "dilu.cli.functions:deploy",
    "undeploy": "dilu.cli.functions:undeploy",
    "invoke": "dilu.cli.functions:invoke",
    "status": "dilu.cli.functions:status",
    "creds": "dilu.cli.creds:creds",
    "events": "dilu.cli.events:events",
    "sim": "dilu.cli.sim:sim",
    "calibrate": "dilu.cli.sim:calibrate",
    "crosscheck": "dilu.cli.sim:crosscheck",
    "summarize": "dilu.cli.summarize:summarize",
}
BENCHES: dict[str, str] = {
    "interceptor": "dilu.interceptor.bench:bench_interceptor",
    "scheduler": "dilu.services.scheduler.bench:bench_scheduler",
    "vertical": "dilu.services.vertical_scaler.bench:bench_vertical",
    "loadgen": "dilu.loadgen.bench:bench_loadgen",
    "invoke": "dilu.loadgen.bench_invoke:bench_invoke",
    "sim": "dilu.loadgen.sim.bench:bench_sim",
}


# click >= 8.2 raises this (a UsageError whose text is the group's help) for a group run without its
# command; click 8.1 prints the help itself
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def stops_itself(command: click.Command) -> click.Command:
    """``command`` (each command of a group) with :class:`OutsideCommand` removed as its callback
    starts, so that from its first line on it stops itself (its own SignalExit or loop handler,
    or Python's KeyboardInterrupt). Not at import: click still parses the options then, and a
    SIGTERM in between met Python's default and ended the process as -15. Returns ``command``."""
    if isinstance(command, click.Group):  # a lazy one's commands come through get_command again
        for sub in command.commands.values():
            stops_itself(sub)
        return command
    callback = command.callback
    if callback is None or getattr(callback, "_hands_over", False):
        return command

    @functools.wraps(callback)
    def run(*args, **kwargs):
        OutsideCommand.remove()
        return callback(*args, **kwargs)

    run._hands_over = True  # type: ignore[attr-defined]
    command.callback = run
    return command


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when used, and whose bad values say
    which variable they came from (:func:`name_envvar`)."""

    def __init__(self, *args, lazy: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def main(self, args=None, *rest, **kwargs):
        command_line = args is None  # not a caller's (a test's CliRunner) in its own process
        self._argv = list(sys.argv[1:] if args is None else args)  # for asks_json
        if command_line:
            OutsideCommand.install()
            # a command's own output is for people: the client library's warnings (e.g. a bucket it
            # may not watch with these credentials) stay off it; a service, the demo and chaos set
            # their own level and stream
            from dilu.services.common import logging as dlog
            dlog.configure("dilu", level="error")
        try:
            return super().main(args, *rest, **kwargs)
        except OSError as exc:  # stdout on a full device (>/dev/full): one line, not a traceback
            if not output_failed(exc):
                raise
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush stays quiet
            click.echo(f"Error: cannot write the output: {exc.strerror}", err=True)
            raise SystemExit(1) from None
        finally:
            OutsideCommand.remove()
            if command_line:  # the command has ended: a signal while Python exits stops it at once
                OutsideCommand.install()

    def get_command(self, ctx, name):
        if name in self._lazy:
            module, attr = self._lazy[name].split(":")
            return stops_itself(flag_envvars(getattr(importlib.import_module(module), attr)))
        return super().get_command(ctx, name)

    def _unparsed_context(self, ctx: click.Context, name: str) -> click.Context | None:
        """A context of subcommand ``name`` under ``ctx`` with nothing parsed (None: no such
        command), for an error raised before its own context existed."""
        command = self.get_command(ctx, name)
        return None if command is None else click.Context(command, info_name=name, parent=ctx)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (JsonUsageError, OneLineUsageError):  # a nested group's (dilu bench), already shaped
            raise
        except BrokenPipeError:  # the reader of stdout left (dilu status | head -1): quietly, and not as a
            # failure of the command (exit 1 says a function or a deploy failed), but as a Unix tool
            # that SIGPIPE ended: 128 + 13; stdout goes to /dev/null so the exit's flush stays quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(128 + signal.SIGPIPE) from None
        except KeyboardInterrupt:  # Ctrl-C the command did not take itself: 128 + SIGINT, as a shell
            # reports it (click's own "Aborted!" and exit 1 would read as a failed function or deploy)
            raise SystemExit(128 + signal.SIGINT) from None
        except _NO_ARGS_IS_HELP:  # a group named without its command (dilu bench): its help, as `dilu` shows
            raise
        except click.UsageError as exc:  # a subcommand's: both its parsing and its body run in here
            if exc.ctx is None and ctx.invoked_subcommand:  # the parser's own (an option without its
                # value) names no context: the subcommand's, so the error says its --help and
                # answers as JSON under --json as every other bad option does
                exc.ctx = self._unparsed_context(ctx, ctx.invoked_subcommand)
            if isinstance(exc, click.BadParameter):
                name_envvar(exc)
            if asks_json(exc.ctx, getattr(self, "_argv", [])):
                raise JsonUsageError(exc.format_message(), exc.ctx) from None
            raise OneLineUsageError(exc.format_message(), exc.ctx) from None


@click.group(cls=LazyGroup, lazy=COMMANDS)
def main() -> None:
    """Dilu: serverless DL functions on shared GPUs with introspective elasticity."""


@main.group(cls=LazyGroup, lazy=BENCHES)
def bench() -> None:
    """Benchmarks; each writes its figures as JSON (--json PATH)."""
if __name__ == "__main__":
    main()
