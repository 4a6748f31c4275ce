"""Shared fixtures. ``nats_url``: a real nats-server with JetStream in a temp dir, one per test."""
from __future__ import annotations

import nats
import pytest

from dilu.services.common.natsserver import EmbeddedNats


@pytest.fixture
def nats_url():
    with EmbeddedNats() as server:
        yield server.url


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
