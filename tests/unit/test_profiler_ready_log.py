"""A deploy asks the profiler for a function's profile, then its FunctionDeployed asks again
(answered from the cache, trials 0): the profiler publishes and stores it both times, but logs
"profile ready" once per profile a function gets, the repeat at debug."""
from __future__ import annotations

from types import SimpleNamespace

from dilu.contracts.events import FunctionSpec
from dilu.services.profiler.service import ProfilerService


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []
        self.stored: list[str] = []
        self.published: list[str] = []

    def info(self, event: str, **kw) -> None:
        self.lines.append(("info", event, kw))

    def debug(self, event: str, **kw) -> None:
        self.lines.append(("debug", event, kw))

    async def put(self, key: str, _value: bytes) -> None:
        self.stored.append(key)

    async def publish(self, subject: str, _event) -> None:
        self.published.append(subject)


async def test_the_same_profile_twice_is_one_profile_ready_line():
    svc = ProfilerService(backend="surface")
    rec = Recorder()
    svc.bus, svc.kv = SimpleNamespace(log=rec, publish=rec.publish), rec
    spec = FunctionSpec(name="fn-a", model="resnet152")
    first = await svc.profile(spec)  # the deploy's request: a search on the surface
    again = await svc.profile(spec)  # its FunctionDeployed: the cache
    assert first.trials > 0 and again.trials == 0 and again.request_quota == first.request_quota
    assert [(level, event) for level, event, _ in rec.lines] == [("info", "profile ready"), ("debug", "profile unchanged")]
    assert len(rec.stored) == len(rec.published) == 2  # stored and published both times, as before
    await svc.profile(FunctionSpec(name="fn-b", model="resnet152"))  # another function: its own first profile
    assert rec.lines[-1][:2] == ("info", "profile ready") and rec.lines[-1][2]["function"] == "fn-b"
    looser = await svc.profile(FunctionSpec(name="fn-a", model="resnet152", slo_ms=first.latency_ms * 4))
    assert (looser.request_quota, looser.batch_size) != (first.request_quota, first.batch_size)
    assert rec.lines[-1][:2] == ("info", "profile ready")  # a profile that changed is news again
