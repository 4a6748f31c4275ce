"""The main job end to end, scaled down: ``dilu demo`` on the bundled trace, then the report's
accounting and that nothing it started is left running."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.native, pytest.mark.slow]

DILU = [sys.executable, "-m", "dilu.cli.main"]


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _tree(pid: int) -> set[int]:
    seen, todo = set(), [pid]
    while todo:
        for child in _children_of(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _alive(pids) -> list[int]:
    alive = []
    for p in pids:
        try:
            os.kill(p, 0)
            alive.append(p)
        except ProcessLookupError:
            pass
    return alive


def test_demo_reports_every_request_and_leaves_nothing_running(tmp_path: Path):
    report = tmp_path / "r.json"
    proc = subprocess.Popen([*DILU, "demo", "--duration", "12", "--functions", "3", "--seed", "3",
                             "--json", str(report), "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _tree(proc.pid)  # every service, instance and nats-server it started
        time.sleep(0.5)
    out = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    assert proc.returncode == 0, out[-3000:]
    assert len(seen) >= 6, "expected nats-server and five services as child processes"
    time.sleep(1)
    assert _alive(seen) == [], "processes left behind by the demo"

    r = json.loads(report.read_text())
    t = r["totals"]
    assert t["offered"] > 0 and t["offered"] == t["completed"] + t["dropped"] + t["failed"] + t["timed_out"]
    assert t["offered"] == sum(f["offered"] for f in r["functions"])
    assert len(r["functions"]) == 3 and t["completed"] > 0.9 * t["offered"]
    assert 0 <= t["allocation_fragmentation"] <= 1 and 0 <= t["idle_fragmentation"] <= 1
    assert t["active_gpu_seconds"] > 0 and t["instance_launches"] >= 3
    m = r["mechanism"]
    assert m["profiler_trials"] > 0 and m["scale_outs"] >= 3
    assert "policy dilu" in out


def test_ctrl_c_stops_cleanly_still_accounts_and_exits_130(tmp_path: Path):
    report = tmp_path / "r.json"
    proc = subprocess.Popen([*DILU, "demo", "--duration", "60", "--functions", "2", "--json", str(report),
                             "--log-dir", str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: set[int] = set()
    started = time.monotonic()
    while time.monotonic() - started < 25 and proc.poll() is None:
        seen |= _tree(proc.pid)
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out[-3000:]  # 128 + SIGINT, as a shell reports it, after the report
    assert "interrupted (SIGINT)" in out
    assert time.monotonic() - started < 25 + 45
    time.sleep(1)
    assert _alive(seen) == []
    t = json.loads(report.read_text())["totals"]
    assert t["offered"] == t["completed"] + t["dropped"] + t["failed"] + t["timed_out"]
