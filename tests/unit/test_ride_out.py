"""Riding out a NATS outage while setting up JetStream resources (jsresources.ride_out): an
instance starting while nats-server restarts waits for it instead of crashing."""
from __future__ import annotations

import nats.errors
import pytest

from dilu.services.common.jsresources import ride_out


async def test_a_transient_error_is_retried_until_the_call_succeeds():
    calls = []

    async def consumer_info():
        calls.append(1)
        if len(calls) < 3:  # the request went out with a connection that died, then JetStream was restoring
            raise nats.errors.TimeoutError if len(calls) == 1 else nats.errors.NoRespondersError
        return "info"

    assert await ride_out(consumer_info, budget_s=5.0) == "info"
    assert len(calls) == 3


async def test_another_error_is_raised_at_once_and_a_spent_budget_raises_the_last():
    calls = []

    async def refused():
        calls.append(1)
        raise PermissionError("not allowed")

    with pytest.raises(PermissionError):
        await ride_out(refused, budget_s=5.0)
    assert len(calls) == 1

    async def down():
        raise nats.errors.TimeoutError

    with pytest.raises(nats.errors.TimeoutError):
        await ride_out(down, budget_s=0.2)
