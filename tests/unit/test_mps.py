"""The node agent's MPS handling against a stand-in ``nvidia-cuda-mps-control`` (a script that
answers as the real one does on its pipe directory): start, attach, unavailable, client settings,
and the rule that tells an MPS server failure from one instance crashing."""
import os
import stat
import textwrap

import pytest

from dilu.services.node_agent import mps

CONTROL = textwrap.dedent("""\
    #!/bin/sh
    # stand-in for nvidia-cuda-mps-control: -d starts the "daemon" (a file in the pipe directory);
    # commands on stdin are answered while it "runs"
    state="$CUDA_MPS_PIPE_DIRECTORY/control"
    if [ "$1" = "-d" ]; then
        [ -n "$FAIL_START" ] && exit 1
        echo 4242 > "$state"; echo started >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0
    fi
    [ -f "$state" ] || exit 1
    read cmd
    case "$cmd" in
        get_server_list) head -n 1 "$state" ;;
        quit) rm -f "$state" ;;
    esac
""")


@pytest.fixture
def control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / mps.CONTROL
    path.write_text(CONTROL)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return path


def test_starts_its_own_daemon_and_makes_clients(control, tmp_path):
    m = mps.Mps(tmp_path / "mps")
    assert m.start() == "on" and m.started_here
    assert m.servers() == {4242}
    env = m.client_env(width=0.37, memory_bytes=3 * 2**30 + 1)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "37"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3073M"  # MiB, rounded up
    m.stop()
    assert m.servers() == set() and not (tmp_path / "mps" / "pipe" / "control").exists()


def test_attaches_to_a_running_daemon_and_leaves_it_running(control, tmp_path):
    first = mps.Mps(tmp_path / "mps")
    first.start()
    second = mps.Mps(tmp_path / "mps")
    assert second.start() == "on" and not second.started_here
    second.stop()
    assert first.servers() == {4242}  # not ours to quit


def test_unavailable_when_missing_or_failing(control, tmp_path, monkeypatch):
    missing = mps.Mps(tmp_path / "a", control="no-such-mps-control")
    assert missing.start() == "unavailable" and "not installed" in missing.reason
    assert missing.client_env(width=0.5, memory_bytes=2**30) == {}  # tokens alone
    monkeypatch.setenv("FAIL_START", "1")
    failing = mps.Mps(tmp_path / "b")
    assert failing.start() == "unavailable" and "-d failed" in failing.reason


def test_server_failure_rule():
    # a server gone and a crash within the window: the server's failure
    assert mps.server_failed([10.0], 10.5, {1, 2}, {2})
    # the server still there: the instance's own crash
    assert not mps.server_failed([10.0], 10.5, {1, 2}, {1, 2})
    # a server gone long after the crash: unrelated
    assert not mps.server_failed([1.0], 10.0, {1}, set())
    assert mps.pinned_mem_limit(1) == "0=1M" and mps.pinned_mem_limit(2**30) == "0=1024M"
