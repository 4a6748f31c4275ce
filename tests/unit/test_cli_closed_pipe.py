"""A reader of stdout that leaves early (``dilu status | head -1``) ends a command as SIGPIPE ends
a Unix tool, 141 and nothing on stderr, not with exit 1, which says a function or a deploy failed."""
from __future__ import annotations

import subprocess
import sys

DILU = [sys.executable, "-m", "dilu.cli.main"]


def test_a_closed_stdout_is_exit_141_and_quiet():
    proc = subprocess.Popen([*DILU, "invoke", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes: its first write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == b"", err[-2000:]
