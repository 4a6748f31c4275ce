"""The profiler's node trials: a node agent with no trial responder for a moment (starting,
restarting, reconnecting) is asked again, briefly; one that never answers fails the trial."""
from __future__ import annotations

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from dilu.contracts.events import TrialReply
from dilu.services.profiler.policy import Trial
from dilu.services.profiler.service import NodeTrialBackend, TrialFailed


class _Bus:
    """Raises ``errors`` in turn, then answers."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.asked = list(errors), 0

    async def request(self, subject, req, kind, timeout):
        self.asked += 1
        if self.errors:
            raise self.errors.pop(0)
        return TrialReply(ok=True, latency_ms_p99=12.0, throughput_rps=80.0)


async def test_no_responder_for_a_moment_is_asked_again():
    bus = _Bus(NoRespondersError(), NoRespondersError())
    m = await NodeTrialBackend(bus, "node0", "resnet152", no_responder_wait_s=5.0).run(Trial((0.5,), 1))
    assert bus.asked == 3 and m.latency_ms == 12.0


async def test_no_responder_for_good_fails_the_trial_in_its_wait():
    bus = _Bus(*[NoRespondersError()] * 1000)
    with pytest.raises(TrialFailed, match="NoRespondersError"):
        await NodeTrialBackend(bus, "node0", "resnet152", no_responder_wait_s=0.3).run(Trial((0.5,), 1))
    assert 2 <= bus.asked < 1000


async def test_a_timeout_is_not_asked_again():
    bus = _Bus(NatsTimeout())
    with pytest.raises(TrialFailed, match="TimeoutError"):
        await NodeTrialBackend(bus, "node0", "resnet152").run(Trial((0.5,), 1))
    assert bus.asked == 1
