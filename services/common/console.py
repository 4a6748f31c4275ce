"""The console every command prints through: a rich Console whose reader leaving raises; and
counts in words."""
from __future__ import annotations

import errno

from rich.console import Console

# wall seconds between two progress lines of a long command (dilu demo, compare, sim, crosscheck)
# whose output is not a terminal: often enough that a log or CI shows it alive
PROGRESS_EVERY_S = 10.0
# what a write to a full, broken or over-quota output says (the reader leaving is EPIPE, apart)
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def output_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a write to the output that the device refused (``dilu status >/dev/full``):
    an OSError of :data:`OUTPUT_ERRNOS`, which no network or bad-input error raises."""
    return isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS


class PipeConsole(Console):
    """A rich Console whose reader leaving (a closed stdout: ``dilu status | head -1``) raises
    BrokenPipeError, which the command line ends with 141 as SIGPIPE ends a Unix tool; rich's
    own ``on_broken_pipe`` exits 1, the code of a failed function or deploy."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("the reader of the output left")


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in its number: "1 request", "2,000 requests" (``plural``: when not
    noun + s)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
