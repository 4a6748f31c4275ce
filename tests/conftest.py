"""Shared fixtures. ``nats_url``: a real nats-server with JetStream in a temp dir, one per test."""
from __future__ import annotations

import pytest

from dilu.services.common.natsserver import EmbeddedNats


@pytest.fixture
def nats_url():
    with EmbeddedNats() as server:
        yield server.url
