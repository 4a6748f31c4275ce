"""Fuzzing invocation messages: parse_request on any Dilu-* headers and payload gives a Request
or raises MalformedRequest with a one-line message; nothing else escapes."""
from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings, strategies as st
from nats.aio.msg import Msg

from dilu.contracts import subjects as subj
from dilu.services.common.workqueue import MalformedRequest, Request, parse_request

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ACK = "$JS.ACK.DILU_INVOKE.worker.{delivered}.7.7.1700000000123456789.0"  # v1 ack subject

values = (
    st.text(max_size=40)
    | st.integers().map(str)
    | st.sampled_from(["", " ", "-1", "1e9", "0x10", "١٢٣", "9" * 5000, "\udcff\udcfe", "a\r\nb: c"])
    | st.binary(max_size=20).map(lambda b: b.decode("utf-8", "surrogateescape"))  # non-UTF-8 bytes
)
names = st.sampled_from([subj.H_REQUEST_ID, subj.H_REPLY_TO, subj.H_SCHEDULED_NS, "Dilu-Other", "x"])


def message(headers: dict | None, payload: bytes, delivered: int = 1) -> Msg:
    return Msg(_client=None, subject=subj.invoke("f"), reply=ACK.format(delivered=delivered), data=payload,
               headers=headers)


def check(msg: Msg) -> None:
    try:
        req = parse_request(msg)
    except MalformedRequest as exc:
        assert str(exc) and "\n" not in str(exc), str(exc)
    else:
        assert isinstance(req, Request)
        assert isinstance(req.scheduled_ns, int) and req.enqueued_ns == 1700000000123456789
        assert req.payload == msg.data


@FUZZ
@given(headers=st.none() | st.dictionaries(names, values, max_size=5), payload=st.binary(max_size=64))
@example(headers=None, payload=b"")
@example(headers={subj.H_REQUEST_ID: "r", subj.H_REPLY_TO: "_INBOX.x", subj.H_SCHEDULED_NS: "9" * 5000},
         payload=b"")  # past int()'s digit limit: a ValueError, caught
@example(headers={subj.H_REQUEST_ID: "r", subj.H_REPLY_TO: "_INBOX.x", subj.H_SCHEDULED_NS: "1\n2"},
         payload=b"\xff")
def test_any_headers_and_payload(headers, payload):
    check(message(headers, payload))


@FUZZ
@given(scheduled=values, request_id=values, reply_to=values, payload=st.binary(max_size=256))
def test_all_headers_present_with_any_values(scheduled, request_id, reply_to, payload):
    headers = {subj.H_REQUEST_ID: request_id, subj.H_REPLY_TO: reply_to, subj.H_SCHEDULED_NS: scheduled}
    check(message(headers, payload))


def test_a_well_formed_message_parses():
    headers = {subj.H_REQUEST_ID: "r1", subj.H_REPLY_TO: "_INBOX.a", subj.H_SCHEDULED_NS: "42"}
    req = parse_request(message(headers, b"\x00payload", delivered=3))
    assert (req.request_id, req.reply_to, req.scheduled_ns, req.payload, req.delivered) == (
        "r1", "_INBOX.a", 42, b"\x00payload", 3)
