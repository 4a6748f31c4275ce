"""Shared fixtures. ``nats_url``: a real nats-server with JetStream in a temp dir, one per test."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import nats
import pytest

from dilu.services.common.natsserver import EmbeddedNats


# ``make test`` runs the pure computation first, on both cores (pytest-xdist); then the tests that
# read the clock through other processes (a nats-server, live services: the ``serial`` mark), two
# at a time too, except the ``native`` ones (the emulated device's timeline) and the ``slow`` ones
# (each a whole live cluster under load), which then run one at a time (the Makefile says why).
# Under xdist ``slow`` tests take turns all the same (:func:`_one_live_cluster_at_a_time`), so no
# two live clusters ever run at once. A ``solo`` test (marked in its module: it must outpace the
# emulated GPU, or makes its own overload) runs last, alone.
_PARALLEL_DIRS = ("unit", "sim", "fuzz")
_SERIAL_MARKS = ("nats", "native", "slow")


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    for item in items:
        top = item.path.relative_to(tests).parts[0]
        if top not in _PARALLEL_DIRS or any(item.get_closest_marker(m) for m in _SERIAL_MARKS):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(autouse=True)
def _one_live_cluster_at_a_time(request, tmp_path_factory):
    """A ``slow`` test holds an exclusive lock on a file all xdist workers of the run share (beside
    their base temp folders) while it runs; the lock goes with the process if it dies. (xdist's
    ``xdist_group`` would do it, but pytest 9.2 no longer reads the node id xdist 3.8 rewrites.)"""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "dilu-live-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def nats_url():
    with EmbeddedNats() as server:
        yield server.url


# the project's shared report checker: DILU_CHECK_REPORT, else beside the checkout, else the
# workplace's copy (a fresh clone elsewhere has none beside it)
_CHECKERS = [Path(__file__).resolve().parents[2] / "shared" / "tools" / "check-report.py",
             Path("/work/shared/tools/check-report.py")]
CHECK_REPORT = Path(os.environ.get("DILU_CHECK_REPORT") or next((p for p in _CHECKERS if p.exists()), _CHECKERS[0]))


@pytest.fixture
def check_report() -> Path:
    """The path of check-report.py; the test is skipped where the checkout has no shared tools."""
    if not CHECK_REPORT.exists():
        pytest.skip(f"no report checker at {CHECK_REPORT} (set DILU_CHECK_REPORT)")
    return CHECK_REPORT


@pytest.fixture
async def nc(nats_url):
    """A NATS connection to ``nats_url``, closed after the test."""
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


@pytest.fixture
async def services(nc):
    """Fake scheduler, profiler and node answering as the real services do (tests/client_fakes.py)."""
    from client_fakes import FakeServices

    fakes = await FakeServices(nc).start()
    yield fakes
    await fakes.stop()


@pytest.fixture(autouse=True)
def _default_logging():
    """Every test starts and ends with the default log set-up: a command run in-process (a bench
    configures its own level and stream) must not silence the logs a later test captures."""
    from dilu.services.common import logging as dlog

    yield
    dlog.configure("dilu")
