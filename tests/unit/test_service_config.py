"""How an operator starts a service: every option from DILU_* by one rule, the documented metrics
ports as defaults, /healthz alive (and /readyz not ready) while NATS is unreachable, and a clear
one-line exit when the service cannot run (its port taken)."""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from dilu.services.common.cliopts import METRICS_PORTS

PACKAGES = sorted(METRICS_PORTS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.mark.parametrize("pkg", PACKAGES)
def test_help_shows_the_documented_port_and_env_rule(pkg):
    out = subprocess.run([sys.executable, "-m", f"dilu.services.{pkg}", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert f"default: {METRICS_PORTS[pkg]}" in out.stdout.replace("\n", " ")


@pytest.mark.parametrize("pkg", ["profiler", "scheduler", "node_agent"])
def test_options_come_from_dilu_env_and_health_answers_without_nats(pkg, tmp_path):
    port, nats_port = free_port(), free_port()  # nothing listens on nats_port
    env = {**os.environ, "DILU_NATS_URL": f"nats://127.0.0.1:{nats_port}", "DILU_METRICS_PORT": str(port),
           "DILU_LOG_LEVEL": "debug", "DILU_DEVICE": "emulated"}
    log = tmp_path / "log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", f"dilu.services.{pkg}"], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while status(f"http://127.0.0.1:{port}/healthz") != 200:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no /healthz within 30 s on the port DILU_METRICS_PORT names"
            time.sleep(0.1)
        assert status(f"http://127.0.0.1:{port}/readyz") == 503  # alive, not ready: NATS is down
        time.sleep(1.5)
        assert f"127.0.0.1:{nats_port}" in log.read_text()  # it tries the URL DILU_NATS_URL names
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_taken_metrics_port_is_one_line_and_exit_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "dilu.services.scheduler", "--metrics-port", str(port),
                              "--nats-url", "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("dilu scheduler: cannot serve /metrics") and "Traceback" not in out.stderr


@pytest.mark.parametrize(("args", "interval"), [
    ([], 30.0), (["--policy", "static-mps"], 0.0), (["--policy", "exclusive"], 0.0),
    (["--policy", "static-mps", "--defrag-interval-s", "5"], 5.0),
])
def test_the_scheduler_defragments_by_default_only_under_the_dilu_allocation(monkeypatch, args, interval):
    """The baselines never defragment (README, Policies): a scheduler started alone with one of
    their allocations must not either unless told to."""
    from click.testing import CliRunner

    import dilu.services.scheduler.__main__ as entry

    seen = []
    monkeypatch.setattr(entry, "run", lambda svc, *a, **kw: seen.append(svc.defrag_interval_s))
    out = CliRunner().invoke(entry.main, args, env={"DILU_DEFRAG_INTERVAL_S": None})
    assert out.exit_code == 0, out.output
    assert seen == [interval]


def test_an_instance_process_logs_at_the_level_dilu_log_level_names(monkeypatch):
    """The node agent starts each instance in its own environment, with no --log-level: the
    instance reads DILU_LOG_LEVEL as the services do (at debug, its expired and withdrawn requests
    are logged), and a bad value is refused, not taken as info."""
    import click

    from dilu.services.node_agent import instance

    args = ["--instance-id", "fn-a-1", "--function", "fn-a", "--model", "none"]
    monkeypatch.setenv("DILU_LOG_LEVEL", "debug")
    assert instance.main.make_context("instance", list(args)).params["log_level"] == "debug"
    assert instance.main.make_context("instance", [*args, "--log-level", "error"]).params["log_level"] == "error"
    monkeypatch.setenv("DILU_LOG_LEVEL", "loud")
    with pytest.raises(click.BadParameter):
        instance.main.make_context("instance", list(args))
    monkeypatch.delenv("DILU_LOG_LEVEL")
    assert instance.main.make_context("instance", list(args)).params["log_level"] == "info"
