"""How the horizontal scaler reports a backlog it cannot read: a function just deployed, whose
consumer no instance has created yet, is as expected (info); a consumer gone after it was read, or
a failed listing, is an outage (one warning each, then "readable again")."""
from __future__ import annotations

from types import SimpleNamespace

from nats.js.api import ConsumerInfo, SequenceInfo

from dilu.services.common.workqueue import consumer_name
from dilu.services.horizontal_scaler.service import HorizontalScaler, _Consumers


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, event: str, **_kw) -> None:
        self.lines.append(("info", event))

    def warning(self, event: str, **_kw) -> None:
        self.lines.append(("warning", event))


def listing(*functions: str) -> _Consumers:
    return _Consumers({consumer_name(f): ConsumerInfo(name=consumer_name(f), stream_name="DILU_INVOKE", config=None, created=None,
                                                      num_pending=2, num_ack_pending=1,
                                                      delivered=SequenceInfo(consumer_seq=5, stream_seq=5))
                       for f in functions})


def test_a_consumer_not_created_yet_is_info_and_one_gone_later_is_a_warning():
    svc = HorizontalScaler()
    log = Log()
    svc.bus = SimpleNamespace(log=log)
    for _ in range(3):  # deployed, its first instance not bound yet: ticks hold the scale, one line
        assert svc._backlog("f", listing()) == (None, None)
    assert log.lines == [("info", "no backlog yet: the function's first instance creates its consumer")]
    assert svc._backlog("f", listing("f"))[0] == 3  # its instance bound: read, no "again"
    assert len(log.lines) == 1
    assert svc._backlog("f", listing()) == (None, None)  # gone after it was read: an outage
    assert svc._backlog("f", listing()) == (None, None)
    assert log.lines[1:] == [("warning", "backlog unknown: holding the current scale")]
    assert svc._backlog("f", listing("f"))[0] == 3
    assert log.lines[2:] == [("info", "backlog readable again")]
    assert svc._backlog("g", _Consumers(None, "error", "timeout")) == (None, None)  # a failed listing
    assert svc._backlog("h", _Consumers(None, "missing", "no stream DILU_INVOKE")) == (None, None)  # no stream
    assert log.lines[3:] == [("warning", "backlog unknown: holding the current scale")] * 2
    assert svc.backlog_errors == 7  # every unread tick counted (dilu_backlog_errors)
