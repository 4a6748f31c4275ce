"""A child started with ``tied_to_caller`` ends when its launcher is killed (kill -9 included);
without it the child lives on."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from proctree import running

from dilu.services.common.lifetime import ORPHANED_EXIT, tied_to_caller

LAUNCHER = textwrap.dedent("""
    import os, signal, subprocess, sys
    from dilu.services.common.lifetime import tied_to_caller
    child = subprocess.Popen(["sleep", "60"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=tied_to_caller() if sys.argv[1] == "tied" else None)
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def orphan_of_killed_launcher(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", LAUNCHER, mode], capture_output=True, text=True, timeout=30)
    assert out.returncode == -signal.SIGKILL, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(tied_to_caller() is None, reason="PR_SET_PDEATHSIG is Linux's")
def test_a_tied_child_ends_with_its_killed_launcher_an_untied_one_lives_on():
    tied, untied = orphan_of_killed_launcher("tied"), orphan_of_killed_launcher("untied")
    try:
        deadline = time.monotonic() + 10
        while running(tied) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not running(tied), "the tied child outlived its launcher's kill -9"
        assert running(untied), "the control: a child without the tie must still run"
    finally:
        for pid in (tied, untied):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_whose_launcher_is_already_gone_exits_before_exec():
    """The check after the request: run in a process whose parent is not the launcher (the
    preexec made here, called in a grandchild), it exits with ORPHANED_EXIT and never execs."""
    preexec = tied_to_caller()
    if preexec is None:
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pid = os.fork()
    if pid == 0:  # the child: its parent is this test's process, the launcher; the grandchild's is not
        try:
            grandchild = subprocess.Popen(["sleep", "60"], preexec_fn=preexec)
            os._exit(grandchild.wait())
        except BaseException:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == ORPHANED_EXIT
