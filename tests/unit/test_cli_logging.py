"""The client library's warnings stay off a dilu command's stderr (its output is for people);
errors still show. A caller's own program (no dilu command line) keeps the library's default."""
from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
from dilu.services.common import logging as dlog
if sys.argv[1] == "command":
    from dilu.cli.main import main
    sys.argv = ["dilu", "--help"]
    try:
        main()
    except SystemExit:
        pass
log = dlog.get("client")
log.warning("cannot watch bucket", bucket="b")
log.error("an error still shows")
"""


def _stderr(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_a_command_shows_the_librarys_errors_not_its_warnings():
    err = _stderr("command")
    assert "cannot watch bucket" not in err and "an error still shows" in err, err


def test_a_program_of_its_own_keeps_the_default_level():
    err = _stderr("library")
    assert "cannot watch bucket" in err and "an error still shows" in err, err
