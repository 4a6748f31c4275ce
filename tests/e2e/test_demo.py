"""``dilu demo`` stopped by Ctrl-C: it still reports and leaves nothing running. (A whole demo's
accounting, and that it leaves nothing running, is checked by tests/e2e/test_crosscheck.py on its
live run.)"""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctree import OutputLines, alive, tree

pytestmark = [pytest.mark.nats, pytest.mark.native, pytest.mark.slow]

DILU = [sys.executable, "-m", "dilu.cli.main"]


def test_ctrl_c_stops_cleanly_still_accounts_and_exits_130(tmp_path: Path):
    report = tmp_path / "r.json"
    proc = subprocess.Popen([*DILU, "demo", "--duration", "60", "--functions", "2", "--json", str(report),
                             "--log-dir", str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output = OutputLines(proc)
    seen: set[int] = set()
    started = time.monotonic()  # interrupted once the replay is under way (its progress line says so)
    while time.monotonic() - started < 60 and proc.poll() is None and not output.seen("] replay "):
        seen |= tree(proc.pid)
        time.sleep(0.5)
    seen |= tree(proc.pid)
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    proc.wait(timeout=60)
    out = output.close()
    assert proc.returncode == 130, out[-3000:]  # 128 + SIGINT, as a shell reports it, after the report
    assert "interrupted (SIGINT)" in out and "] replay " in out
    assert time.monotonic() - signalled < 45
    time.sleep(1)
    assert alive(seen) == []
    data = json.loads(report.read_text())
    t = data["totals"]
    assert t["offered"] == t["completed"] + t["dropped"] + t["failed"] + t["timed_out"]
    run = data["run"]  # what the policy ran with (dilu summarize compares them): one job per GPU
    assert (run["training_jobs"], run["park_after_s"], run["defrag_interval_s"], run["simulated"]) == (4, 30.0, 30.0, False)
