import msgspec
import pytest

from dilu.contracts import MalformedEvent, decode, encode, subjects
from dilu.contracts.events import EVENT_TYPES, TokenGrant
from dilu.contracts.schema import drift


def test_checked_in_schema_matches_types():
    assert drift() == [], "run `make schema` and commit contracts/schema/"


def test_roundtrip_and_unknown_fields_skipped():
    g = TokenGrant(node="n0", gpu=1, instance_id="i-1", quota=0.25, epoch=3)
    data = encode(g)
    assert decode(data, TokenGrant) == g
    newer = msgspec.json.encode({**msgspec.to_builtins(g), "field_from_the_future": 1})
    assert decode(newer, TokenGrant) == g


@pytest.mark.parametrize("bad", [b"", b"{", b"[]", b'{"node": 1}', b'{"node":"n","gpu":0,"instance_id":"i","quota":"x"}'])
def test_malformed_is_one_clear_error(bad):
    with pytest.raises(MalformedEvent) as info:
        decode(bad, TokenGrant)
    assert "TokenGrant" in str(info.value)


def test_subject_tokens_are_sanitised():
    assert subjects.invoke("a.b c>*") == "dilu.v1.invoke.a_b_c__"
    with pytest.raises(ValueError):
        subjects.invoke("")


def test_every_event_type_has_a_subject_or_is_a_reply():
    carried = set(subjects.SUBJECT_EVENTS.values())
    replies = {t for t in EVENT_TYPES if t.__name__.endswith("Reply")}
    assert set(EVENT_TYPES) - carried - replies == set()


def test_cloudevents_headers_follow_the_nats_binding():
    from dilu.contracts import cloudevents as ce

    g = TokenGrant(node="n0", gpu=1, instance_id="i-1", quota=0.25, ts_ns=1_700_000_000_000_000_007)
    h = ce.headers(g, ce.source("vertical-scaler", "n.0"))
    assert h == {"ce-specversion": "1.0", "ce-type": "io.dilu.v1.TokenGrant", "ce-source": "dilu/vertical-scaler/n_0",
                 "ce-id": h["ce-id"], "ce-time": "2023-11-14T22:13:20.000000007Z", "content-type": "application/json"}
    assert ce.headers(g, "x")["ce-id"] != h["ce-id"] and ce.headers(g, "x", "id-1")["ce-id"] == "id-1"
    assert ce.rfc3339(0) == "1970-01-01T00:00:00.000000000Z" and ce.source("gateway") == "dilu/gateway"
    for bad in (-1, 253402300800 * 10**9):
        with pytest.raises(ValueError):
            ce.rfc3339(bad)
