"""Fuzzing every subject's decoder: any bytes either decode to the subject's event type or raise
MalformedEvent with a one-line message; nothing else escapes (contracts.codec's promise)."""
from __future__ import annotations

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dilu.contracts import MalformedEvent, decode
from dilu.contracts.subjects import SUBJECT_EVENTS

KINDS = sorted(set(SUBJECT_EVENTS.values()), key=lambda k: k.__name__)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def edge_ints(t: mi.IntType) -> st.SearchStrategy[int]:
    """Integers at and just past the type's bounds, plus any (64-bit and beyond)."""
    edges = [b + d for b in (t.gt, t.ge, t.lt, t.le) if b is not None for d in (-1, 0, 1)]
    return st.sampled_from(edges or [0]) | st.integers() | st.sampled_from([2**63, -(2**63) - 1, 2**64])


def typed(t: mi.Type, depth: int = 0) -> st.SearchStrategy:
    """A JSON value shaped like ``t`` but with values that may break its bounds or types."""
    if isinstance(t, mi.IntType):
        return edge_ints(t)
    if isinstance(t, mi.FloatType):
        edges = [float(b) for b in (t.gt, t.ge, t.lt, t.le) if b is not None]
        return st.sampled_from(edges or [0.0]) | st.floats(allow_nan=False, allow_infinity=False) | st.integers()
    if isinstance(t, mi.StrType):
        return st.text(max_size=20)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(list(t.values)) | st.text(max_size=8)
    if isinstance(t, mi.UnionType):
        return st.one_of([typed(u, depth) for u in t.types])
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)) and depth < 3:
        item = getattr(t, "item_type", None)
        if item is None:
            return st.tuples(*[typed(i, depth + 1) for i in t.item_types]).map(list)
        top = (t.max_length or 3) + 1
        return st.lists(typed(item, depth + 1), max_size=min(top, 5)) | st.just([0] * top)
    if isinstance(t, mi.DictType) and depth < 3:
        return st.dictionaries(st.text(max_size=6), typed(t.value_type, depth + 1), max_size=3)
    if isinstance(t, mi.StructType) and depth < 3:
        return struct_dict(t, depth + 1)
    return json_values


def struct_dict(t: mi.StructType, depth: int = 0) -> st.SearchStrategy[dict]:
    """A JSON object with the struct's fields (each sometimes left out, or of a wrong type)."""
    parts = {f.encode_name: st.one_of(typed(f.type, depth), typed(f.type, depth), json_values) for f in t.fields}
    required = {k: v for k, v in parts.items() if any(f.encode_name == k and f.required for f in t.fields)}
    optional = {k: v for k, v in parts.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional)


def check(data: bytes, kind: type) -> None:
    try:
        event = decode(data, kind)
    except MalformedEvent as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, msg
        assert msg.startswith(kind.__name__ + ": ")
    else:
        assert isinstance(event, kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(data=st.binary(max_size=200))
@example(data=b"[" * 2_000)  # nesting past msgspec's recursion limit raised RecursionError
@example(data=b'{"x":' * 2_000)
@example(data=b'"\\ud800"')  # a lone surrogate
@example(data=b"\xff\xfe{}")
def test_random_bytes(kind, data):
    check(data, kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(value=json_values)
def test_random_json(kind, value):
    check(msgspec.json.encode(value), kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(data=st.data())
def test_structurally_valid_json_with_wrong_types_and_bounds(kind, data):
    value = data.draw(struct_dict(mi.type_info(kind)))
    check(msgspec.json.encode(value), kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_unknown_fields_nested_deeply_are_rejected_not_crashing(kind):
    with pytest.raises(MalformedEvent, match="nest"):
        decode(b'{"extra":' + b"[" * 2000 + b"]" * 2000 + b"}", kind)


BAD_INVENTORIES = [
    b'{"node": "n1", "x": ' + b"[" * 2000,  # too deep: RecursionError escaped the decoder before
    b"\xff\xfe",
    b'{"node": "n1", "gpus": [{"index": 5000, "uuid": "u", "name": "g", "memory_bytes": 1, "sms": 1}]}',
    b'{"node": "n1", "heartbeat_s": 0}',
    b'{"node": 7}',
    b"null",
]


@pytest.mark.nats
async def test_bus_rejects_counts_and_logs_each_malformed_message_then_handles_the_next(nats_url):
    import asyncio

    import nats
    from structlog.testing import capture_logs

    from dilu.contracts import encode, subjects as subj
    from dilu.contracts.events import NodeInventory
    from dilu.services.common.bus import Bus
    from dilu.services.common.metrics import MALFORMED

    bus = await Bus.connect(nats_url, "fuzz-bus")
    peer = await nats.connect(nats_url)
    try:
        seen: asyncio.Queue = asyncio.Queue()

        async def handler(event, msg):
            await seen.put(event)

        pattern = f"{subj.PREFIX}.node.inventory.*"
        await bus.subscribe(pattern, NodeInventory, handler)
        before = MALFORMED.labels("fuzz-bus", pattern)._value.get()
        with capture_logs() as logs:
            for data in BAD_INVENTORIES:
                await peer.publish(subj.node_inventory("n1"), data)
            await peer.publish(subj.node_inventory("n1"), encode(NodeInventory(node="n1")))
            event = await asyncio.wait_for(seen.get(), 5)
        assert event.node == "n1" and seen.empty()
        assert bus.malformed == len(BAD_INVENTORIES) and bus.ready
        assert MALFORMED.labels("fuzz-bus", pattern)._value.get() - before == len(BAD_INVENTORIES)
        reasons = [e["reason"] for e in logs if e.get("event") == "message rejected"]
        assert len(reasons) == len(BAD_INVENTORIES)
        assert all(r.startswith("NodeInventory: ") and "\n" not in r for r in reasons)
        assert any("nested too deeply" in r for r in reasons)
    finally:
        await peer.close()
        await bus.close()
