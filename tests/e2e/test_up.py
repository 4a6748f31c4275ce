"""``dilu up`` run as the docs run it: ready with every service answering, stopped by a signal with
nothing left running and the store kept; a service that dies stops the rest with its log's end;
a second run on the same data directory serves the functions deployed in the first."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ports import ports_outside_ephemeral_range
from proctree import alive, tree

from dilu.services.common.natsserver import free_ports

from dilu.cli.cluster import STOP_STAGES, STOP_TIMEOUT_S

pytestmark = [pytest.mark.nats, pytest.mark.native, pytest.mark.slow]

DILU = str(Path(sys.executable).parent / "dilu")
READY_TIMEOUT_S = 120.0
# the longest a stop may take: each stage's timeout, nats-server's, and slack for a busy machine
STOP_BOUND_S = STOP_TIMEOUT_S * len(STOP_STAGES) + 10 + 15
METRICS_LINE = re.compile(r"^\s*metrics\s+(\w+)\s+http://127\.0\.0\.1:(\d+)/metrics")


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class Up:
    """``dilu up`` as a subprocess; its output read line by line on a thread (so a wait for a line
    has a deadline), every process it started recorded while it runs."""

    def __init__(self, data_dir: Path, nats_port: int, gateway_port: int, *extra: str) -> None:
        self.nats_port, self.gateway_port = nats_port, gateway_port
        self.proc = subprocess.Popen([DILU, "up", "--nats-port", str(nats_port), "--gateway-port", str(gateway_port),
                                      "--data-dir", str(data_dir), "--device", "emulated", "--gpus", "1", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.metrics: dict[str, int] = {}
        self.pids: set[int] = set()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        """The first output line starting with ``prefix``; fails at the deadline or at EOF."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line within {timeout_s} s:\n" + "\n".join(self.lines[-40:]))
            if line is None:
                pytest.fail(f"dilu up ended (code {self.proc.wait()}) before {prefix!r}:\n" + "\n".join(self.lines[-40:]))
            self.lines.append(line)
            if m := METRICS_LINE.match(line):
                self.metrics[m.group(1)] = int(m.group(2))
            if line.startswith(prefix):
                return line

    def ready(self) -> "Up":
        self.wait_for("ready", READY_TIMEOUT_S)
        self.pids = tree(self.proc.pid)
        return self

    def rest(self, timeout_s: float) -> str:
        """Wait for the exit; the output from here on."""
        self.proc.wait(timeout=timeout_s)
        out = []
        while (line := self._q.get(timeout=10)) is not None:
            out.append(line)
        self.lines += out
        return "\n".join(out)

    def kill(self) -> None:
        """Last resort after a failed test: nothing of it may outlive the test."""
        for pid in [self.proc.pid, *self.pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture
def ups():
    started: list[Up] = []
    yield started
    for up in started:
        if up.proc.poll() is None or alive(up.pids):
            up.kill()


def start(ups: list[Up], data_dir: Path, *extra: str, ports: list[int] | None = None) -> Up:
    nats_port, gateway_port = ports or free_ports(2)
    up = Up(data_dir, nats_port, gateway_port, *extra)
    ups.append(up)
    return up.ready()


def stop(up: Up, sig: int = signal.SIGINT) -> str:
    """Signal ``up``, check it exits 0 within the bound with nothing left running; its last output."""
    up.proc.send_signal(sig)
    t0 = time.monotonic()
    rest = up.rest(STOP_BOUND_S)
    assert up.proc.returncode == 0, "\n".join(up.lines[-40:])
    assert time.monotonic() - t0 < STOP_BOUND_S
    assert alive(up.pids) == [], f"left running after the stop: {alive(up.pids)}"
    return rest


def test_up_serves_then_a_signal_stops_everything_and_keeps_the_store(tmp_path, ups):
    data = tmp_path / "data"
    up = start(ups, data)
    expected = {"scheduler", "profiler", "node_agent", "vertical_scaler", "horizontal_scaler", "gateway"}
    assert set(up.metrics) == expected, up.lines
    assert any(f"nats://127.0.0.1:{up.nats_port}" in line for line in up.lines), up.lines
    assert any(f"http://127.0.0.1:{up.gateway_port}" in line for line in up.lines), up.lines
    for name, port in up.metrics.items():
        assert status(f"http://127.0.0.1:{port}/readyz") == 200, name
    assert status(f"http://127.0.0.1:{up.gateway_port}/healthz") == 200
    assert len(up.pids) >= 7, "expected nats-server, five services and the gateway as child processes"
    # the same data directory is locked while it runs
    second = subprocess.run([DILU, "up", "--data-dir", str(data), *map(str, ["--nats-port", free_ports(1)[0]])],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and "another dilu up" in second.stderr, second.stderr

    rest = stop(up, signal.SIGINT)
    assert "stopped" in rest
    assert (data / "nats" / "jetstream").is_dir(), "the JetStream store must be kept"
    logs = {p.name for p in (data / "logs").iterdir()}
    assert {f"{name}.log" for name in expected} | {"nats-server.log"} <= logs
    assert status(f"http://127.0.0.1:{up.gateway_port}/healthz") == 0


def test_a_service_that_dies_stops_the_rest_with_its_log(tmp_path, ups):
    up = start(ups, tmp_path / "data", "--log-dir", str(tmp_path / "elsewhere"))
    flag = f"--metrics-port\0{up.metrics['profiler']}\0"
    victim = next(pid for pid in up.pids if flag in Path(f"/proc/{pid}/cmdline").read_text())
    os.kill(victim, signal.SIGKILL)
    rest = up.rest(STOP_BOUND_S)
    assert up.proc.returncode == 1, rest
    assert "profiler exited with code -9 (SIGKILL)" in rest and str(tmp_path / "elsewhere" / "profiler.log") in rest
    assert alive(up.pids) == [], f"left running: {alive(up.pids)}"
    assert (tmp_path / "elsewhere" / "scheduler.log").exists()


SPEC = """\
name = "restart-probe"
slo_ms = 500.0
initial_scale = 1
max_instances = 1

[emulation]
model = "bert_base"

[profile]
request_quota = 0.5
limit_quota = 0.5
batch_size = 1
"""


def invoke(up: Up, name: str) -> tuple[int, str, str]:
    """POST one request through the gateway: (HTTP status, Dilu-Instance header, body or problem)."""
    req = urllib.request.Request(f"http://127.0.0.1:{up.gateway_port}/v1/functions/{name}:invoke", data=b"hello",
                                 headers={"Dilu-Timeout": "60"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=90) as resp:
            return resp.status, resp.headers.get("Dilu-Instance", ""), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, "", exc.read().decode(errors="replace")


def test_a_restart_on_the_same_data_dir_serves_the_deployed_functions_and_kill_9_leaves_nothing(tmp_path, ups):
    data, fn = tmp_path / "data", tmp_path / "fn"
    fn.mkdir()
    (fn / "function.toml").write_text(SPEC)
    up = start(ups, data, ports=ports_outside_ephemeral_range(2))  # reused below
    url = f"nats://127.0.0.1:{up.nats_port}"
    # NATS requires credentials: the operator's, generated in the data directory, deploy
    creds = data / "creds" / "operator.creds"
    assert creds.stat().st_mode & 0o777 == 0o600
    refused = subprocess.run([DILU, "deploy", str(fn / "function.toml"), "--nats-url", url],
                             capture_output=True, text=True, timeout=200)
    assert refused.returncode != 0, refused.stdout
    as_caller = subprocess.run([DILU, "deploy", str(fn / "function.toml"), "--nats-url", url,
                                "--creds", str(data / "creds" / "caller.creds")], capture_output=True, text=True,
                               timeout=200)
    assert as_caller.returncode != 0, as_caller.stdout
    # --creds alone, as the docs say: the file names the operator's reply inbox
    deployed = subprocess.run([DILU, "deploy", str(fn / "function.toml"), "--nats-url", url, "--creds", str(creds)],
                              capture_output=True, text=True, timeout=200)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    keys = {p.name: p.read_text() for p in (data / "creds").iterdir()}
    code, first, body = invoke(up, "restart-probe")
    assert code == 200 and first, body
    stop(up, signal.SIGTERM)

    # the same ports, as a user restarting it would: nothing of the first run may still hold them
    again = start(ups, data, ports=[up.nats_port, up.gateway_port])
    assert {p.name: p.read_text() for p in (data / "creds").iterdir()} == keys, "keys are reused, never rotated"
    assert any("resumed" in line for line in again.lines), again.lines
    code, second, body = invoke(again, "restart-probe")
    assert code == 200, body
    # the node kept its name, so its agent found the placement in the kept store and relaunched it
    assert second == first
    # kill -9 of dilu up: Linux signals what it started, which stops as on a SIGTERM (the node
    # agent retires its instance), so nothing is left holding the ports or the store
    pids = tree(again.proc.pid)
    assert len(pids) >= 8, "expected nats-server, five services, the gateway and the instance"
    again.pids = pids  # the fixture's last resort, should this fail
    again.proc.kill()
    deadline = time.monotonic() + STOP_BOUND_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == [], f"left running after kill -9 of dilu up: {alive(pids)}"
