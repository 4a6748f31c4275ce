"""Ctrl-C (SIGINT) and SIGTERM on every ``dilu bench``: exit 130 / 143 with one line, no
traceback, and nothing left behind: not the nats-server a bench started (nor its store), not the
test processes of the interceptor bench. The signal goes to the bench alone, not to its process
group, as a supervisor or ``kill`` sends it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

DILU = [sys.executable, "-m", "dilu.cli.main"]
READY_S = 10.0  # longest wait for the bench to be under way
EXIT_S = 15.0  # longest wait for it to stop once signalled (a nats-server stops in < 1 s)
SIGTERM_CAUGHT = 1 << (signal.SIGTERM - 1)


def _children(pid: int, name: str) -> dict[psutil.Process, list[str]]:
    """The running processes named ``name`` under ``pid``, with their command lines (one that
    ends while being looked at is left out)."""
    found = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for c in children:
        try:
            if c.name() == name:
                found[c] = c.cmdline()
        except psutil.Error:  # gone, or a zombie not yet reaped
            pass
    return found


def _catches_sigterm(pid: int) -> bool:
    """True once the process handles SIGTERM itself (the bench's stop is in place): Python
    leaves it at the default, which ends the process on the spot."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & SIGTERM_CAUGHT)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie is not running: its parent, or init, has yet to reap it)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _store(cmdline: list[str]) -> Path:
    """The JetStream store directory of a nats-server's command line."""
    return Path(cmdline[cmdline.index("-sd") + 1])


def _interrupt(args: list[str], sig: int, ready: Callable[[int], bool], child: str | None,
               settle_s: float) -> tuple[int, str, dict[psutil.Process, list[str]]]:
    """Start ``dilu ARGS``, wait until ``ready(pid)`` (at most READY_S), ``settle_s`` more, send
    ``sig`` to it alone and wait for its end. Returns its exit status, its stderr and the
    ``child`` processes (by name) it had when signalled, with their command lines; whatever of
    them survives is killed afterwards (a nats-server's store removed), so a failing run leaves
    nothing either."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILU_")}  # no DILU_NATS_URL
    proc = subprocess.Popen([*DILU, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: dict[psutil.Process, list[str]] = {}
    try:
        deadline = time.monotonic() + READY_S
        while proc.poll() is None and time.monotonic() < deadline and not ready(proc.pid):
            time.sleep(0.05)
        time.sleep(settle_s)
        assert proc.poll() is None, f"the bench ended before the signal: {proc.communicate()}"
        seen = _children(proc.pid, child) if child else {}
        proc.send_signal(sig)
        try:
            _out, err = proc.communicate(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"dilu {' '.join(args)} still runs {EXIT_S:g} s after signal {sig}")
        return proc.returncode, err, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _alive(list(seen)):
            p.kill()
            if child == "nats-server":
                shutil.rmtree(_store(seen[p]), ignore_errors=True)


def _has_nats_server(pid: int) -> bool:
    return bool(_children(pid, "nats-server"))


@pytest.mark.nats
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("args", [
    ["bench", "invoke", "--seconds", "60", "--search-s", "0"],
    ["bench", "vertical", "--events", "100000"],
], ids=["invoke", "vertical"])
def test_a_bench_with_its_own_nats_server_stops_it_on_a_signal(args, sig):
    code, err, servers = _interrupt(args, sig, _has_nats_server, "nats-server", settle_s=1.0)
    assert len(servers) == 1, "expected the bench's own nats-server as its child"
    stores = [_store(cmdline) for cmdline in servers.values()]
    assert code == 128 + sig, err[-3000:]
    assert err.splitlines() == ["interrupted"]  # no traceback, no click "Aborted!"
    assert _alive(list(servers)) == [], "nats-server left running"
    assert [s for s in stores if s.exists()] == [], "the nats-server's temporary store left behind"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("args", [
    ["bench", "loadgen", "--seconds", "60"],
    ["bench", "sim"],  # 1000 nodes x 4 GPUs x 8 h: minutes
    ["bench", "scheduler", "--instances", "100000000"],
], ids=["loadgen", "sim", "scheduler"])
def test_every_other_bench_exits_with_the_signal_status_and_one_line(args, sig):
    code, err, _ = _interrupt(args, sig, _catches_sigterm, None, settle_s=0.5)
    assert code == 128 + sig, err[-3000:]
    assert err.splitlines() == ["interrupted"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("args", [["sim", "--functions", "50", "--hours", "2"], ["bench", "sim"]], ids=["sim", "bench-sim"])
def test_a_signal_as_the_command_starts_is_one_line_and_its_status(args, sig):
    """Signalled as soon as it handles SIGTERM (the command line's stop, before its imports)."""
    code, err, _ = _interrupt(args, sig, _catches_sigterm, None, settle_s=0.0)
    assert code == 128 + sig, err[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("interrupted"), err[-3000:]


def _sharing(pid: int) -> bool:
    """True once a share cell runs: a dilu_launch test process with a run length (-t)."""
    return any("-t" in cmdline for cmdline in _children(pid, "dilu_launch").values())


@pytest.mark.native
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_bench_interceptor_stops_its_test_processes_on_a_signal(sig, tmp_path):
    from dilu.interceptor import native

    native.build()  # before the clock starts: the bench would build it too
    code, err, launched = _interrupt(["bench", "interceptor", "--json", str(tmp_path / "i.json"),
                                      "--seconds", "10"], sig, _sharing, "dilu_launch", settle_s=0.3)
    assert launched, "expected a dilu_launch test process under way"
    assert code == 128 + sig, err[-3000:]
    assert err.splitlines() == ["interrupted"]
    assert _alive(list(launched)) == [], "dilu_launch left running"
    assert not (tmp_path / "i.json").exists()
