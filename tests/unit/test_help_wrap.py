"""Every command's --help wraps between words: click rewraps help text to the terminal, so a
word longer than the help column (a path, say) would be cut in the middle; such text goes in a
``\\b`` paragraph, which click prints as it is. Nor does it break inside a hyphenated word
(``--data-dir``, ``horizontal-only``), which click's wrapper would do by default."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from dilu.cli.main import BENCHES, COMMANDS, main

COMMAND_ARGS = [[name] for name in sorted(COMMANDS)] + [["bench", name] for name in sorted(BENCHES)]


def command_of(args: list[str]) -> click.Command:
    cmd, ctx = main, click.Context(main)
    for name in args:
        cmd = cmd.get_command(ctx, name)
    return cmd


def words(cmd: click.Command) -> set[str]:
    """The words of the command's help, epilog and option helps, as written."""
    texts = [cmd.help or "", cmd.epilog or ""]
    texts += [p.help or "" for p in cmd.params if isinstance(p, click.Option)]
    return {w for text in texts for w in text.replace("\b", "").split()}


@pytest.mark.parametrize("width", [60, 80])
@pytest.mark.parametrize("args", COMMAND_ARGS, ids=" ".join)
def test_help_breaks_lines_between_words_only(args, width):
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=width)
    assert result.exit_code == 0, result.output
    # nor inside a hyphenated word ("horizontal-" / "only" reads as two; cliopts keeps them whole)
    joined = " ".join(result.output.split())
    cut = sorted(w for w in words(command_of(args)) if w not in joined)
    assert not cut, f"cut inside a word: {cut}"


@pytest.mark.parametrize("args", COMMAND_ARGS, ids=" ".join)
def test_help_names_the_variable_of_every_option(args):
    """Every option can also come from a DILU_* variable; --help says which."""
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    options = [p for p in command_of(args).params if isinstance(p, click.Option) and not p.hidden and p.name != "help"]
    unnamed = [p.opts[0] for p in options if not p.envvar
               or not all(v in result.output for v in ([p.envvar] if isinstance(p.envvar, str) else p.envvar))]
    assert not unnamed, f"options whose variable --help does not name: {unnamed}"


@pytest.mark.parametrize("args", COMMAND_ARGS, ids=" ".join)
def test_durations_show_their_unit(args):
    """--keep-alive-s S, --process-start-ms MS: the same metavar for a unit in every command."""
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=400)
    flags = [o for p in command_of(args).params if isinstance(p, click.Option) and not p.is_flag
             for o in p.opts if o.startswith("--") and o.rsplit("-", 1)[-1] in ("s", "ms")]
    shown = [f for f in flags if f"{f} {f.rsplit('-', 1)[-1].upper()}" not in result.output]
    assert not shown, f"durations without their unit as metavar: {shown}"
