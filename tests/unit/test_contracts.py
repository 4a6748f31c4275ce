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
