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


def _closed_stdout(*args: str, cwd=None) -> tuple[int, bytes]:
    proc = subprocess.Popen([*DILU, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


def test_a_simulation_whose_reader_left_is_141_not_a_failure():
    # its progress and report both go through the command's console; a write after the reader
    # left used to be caught as an OSError and said as "Error: ..." with exit 1
    rc, err = _closed_stdout("sim", "--functions", "2", "--hours", "0.02", "--policies", "dilu")
    assert rc == 141 and b"Error" not in err, err[-2000:]


def test_a_profile_keeps_its_json_when_its_reader_left(tmp_path):
    out = tmp_path / "p.json"
    rc, err = _closed_stdout("profile", "--json", str(out))
    assert rc == 141 and b"Error" not in err, err[-2000:]
    assert out.read_text().startswith("[")  # written before the table


def test_counts_are_printed_in_their_number():
    from dilu.services.common.console import count_of

    assert count_of(1, "function") == "1 function"
    assert count_of(0, "function") == "0 functions"
    assert count_of(2000, "request") == "2,000 requests"
    assert count_of(2, "replica", "replicas kept") == "2 replicas kept"


def test_a_json_report_to_a_stdout_whose_reader_left_is_141_too():
    # --json /dev/stdout | head -1: the write failed with EPIPE and was said as "cannot write" with exit 1
    rc, err = _closed_stdout("bench", "scheduler", "--nodes", "2", "--instances", "5", "--churn", "0",
                             "--json", "/dev/stdout")
    assert rc == 141 and b"Error" not in err, err[-2000:]


def _to_full_device(*args: str) -> tuple[int, str]:
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([*DILU, *args], stdout=full, stderr=subprocess.PIPE, timeout=120)
    return proc.returncode, proc.stderr.decode()


def test_an_output_on_a_full_device_is_one_line():
    # a traceback ending in OSError: [Errno 28] before, or "Error: [Errno 28] ..."
    for args in (["--help"], ["sim", "--functions", "2", "--hours", "0.02", "--policies", "dilu"]):
        rc, err = _to_full_device(*args)
        assert rc == 1 and err.splitlines() == ["Error: cannot write the output: No space left on device"], err[-2000:]
