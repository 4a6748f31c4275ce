"""A cluster counts a service ready only when its own process answers /readyz: a port another
process took first (the service could not bind it and is exiting) is not its readiness."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest

from dilu.cli.cluster import Cluster, ServiceProc
from dilu.services.common.metrics import PID_HEADER, HealthServer


@pytest.fixture
def other():
    """A ready health server of this (test) process, on a free port."""
    server = HealthServer(lambda: True)
    server.start()
    yield server
    server.stop()


def service_on(tmp_path, port: int, argv: list[str]) -> tuple[Cluster, subprocess.Popen]:
    proc = subprocess.Popen(argv)
    cluster = Cluster(log_dir=tmp_path)
    cluster.services["profiler"] = ServiceProc("profiler", proc, port, tmp_path / "profiler.log")
    return cluster, proc


def test_every_health_answer_names_the_process_that_served_it(other):
    for path in ("/healthz", "/readyz", "/metrics"):
        with urllib.request.urlopen(f"http://127.0.0.1:{other.port}{path}", timeout=5) as resp:
            assert resp.headers.get(PID_HEADER) == str(os.getpid()), path


def test_another_process_answering_on_the_port_is_not_the_service_being_ready(tmp_path, other):
    cluster, proc = service_on(tmp_path, other.port, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not cluster.ready("profiler")
        with pytest.raises(RuntimeError, match="not ready after 1 s: profiler"):
            cluster.wait_ready(timeout_s=1.0)
    finally:
        proc.kill()
        proc.wait()


def test_a_service_that_lost_its_port_is_reported_as_exited_not_ready(tmp_path, other):
    (tmp_path / "profiler.log").write_text("dilu profiler: cannot serve /metrics on 127.0.0.1: taken\n")
    cluster, proc = service_on(tmp_path, other.port, [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(2)"])
    with pytest.raises(RuntimeError, match="dilu profiler: cannot serve /metrics"):
        cluster.wait_ready(timeout_s=20.0)
    proc.wait()
