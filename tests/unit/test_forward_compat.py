"""The versioning rule (docs/events.md): v1 changes are additive; unknown fields are ignored; an
unknown enum member skips and counts that item, never the whole event, unless it is the event's own."""
from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from structlog.testing import capture_logs

from dilu.contracts import MalformedEvent, decode, encode, subjects as subj
from dilu.contracts.codec import MAX_SKIPPED_ITEMS, SkippedEvent, decode_counted
from dilu.contracts.events import GpuInfo, GpuTelemetry, InstanceTelemetry, NodeInventory, ScaleDecision


def telemetry(*priorities: str) -> dict:
    """A GpuTelemetry as a newer version would send it (plain JSON values)."""
    event = GpuTelemetry(node="n0", gpu=1, window_ms=100.0, ts_ns=5,
                         instances=[InstanceTelemetry(instance_id=f"i{k}", function="f") for k in range(len(priorities))])
    doc = msgspec.to_builtins(event)
    for item, priority in zip(doc["instances"], priorities):
        item["priority"] = priority
    return doc


def test_one_instance_with_an_unknown_state_never_silences_the_gpu():
    data = msgspec.json.encode(telemetry("latency-sensitive", "realtime", "training"))
    got = decode_counted(data, GpuTelemetry)
    assert (got.event.node, got.event.gpu, got.event.window_ms) == ("n0", 1, 100.0)
    assert [i.instance_id for i in got.event.instances] == ["i0", "i2"]
    assert [(s.path, s.field, s.value, s.reason) for s in got.skipped] == [
        ("$.instances[1].priority", "$.instances[].priority", "'realtime'", "unknown-enum")]
    assert decode(data, GpuTelemetry) == got.event


def test_every_instance_unknown_still_delivers_the_gpu_figures():
    doc = telemetry("a", "b", "c")
    doc["nvml"] = {"utilization_gpu": 0.5, "new_field": [1, 2]}
    got = decode_counted(msgspec.json.encode(doc), GpuTelemetry)
    assert got.event.instances == [] and got.event.nvml.utilization_gpu == 0.5
    assert [s.path for s in got.skipped] == ["$.instances[0].priority"] * 3  # each retry re-indexes


def test_nothing_skipped_for_a_current_message():
    event = GpuTelemetry(node="n0", gpu=0, window_ms=1.0, instances=[InstanceTelemetry(instance_id="i", function="f")])
    got = decode_counted(encode(event), GpuTelemetry)
    assert got.event == event and got.skipped == ()


def test_unknown_member_of_the_events_own_field_skips_the_event():
    data = msgspec.json.encode({"function": "f", "direction": "sideways", "count": 1})
    with pytest.raises(SkippedEvent) as info:
        decode(data, ScaleDecision)
    assert (info.value.path, info.value.value) == ("$.direction", "'sideways'")
    assert isinstance(info.value, MalformedEvent) and str(info.value).startswith("ScaleDecision: ")


def test_other_errors_inside_list_elements_still_reject_the_event():
    doc = telemetry("latency-sensitive")
    doc["instances"][0]["quota"] = "lots"
    with pytest.raises(MalformedEvent) as info:
        decode(msgspec.json.encode(doc), GpuTelemetry)
    assert not isinstance(info.value, SkippedEvent) and "$.instances[0].quota" in str(info.value)
    inventory = {"node": "n", "gpus": [msgspec.to_builtins(GpuInfo(index=0, uuid="u", name="g", memory_bytes=1, sms=1))]}
    inventory["gpus"][0]["index"] = 5000
    with pytest.raises(MalformedEvent):
        decode(msgspec.json.encode(inventory), NodeInventory)


def test_skipping_is_bounded():
    data = msgspec.json.encode(telemetry(*["new"] * (MAX_SKIPPED_ITEMS + 1)))
    with pytest.raises(MalformedEvent, match="more than"):
        decode(data, GpuTelemetry)
    assert len(decode_counted(msgspec.json.encode(telemetry(*["new"] * MAX_SKIPPED_ITEMS)), GpuTelemetry).skipped) == 64


def test_unknown_fields_are_ignored_at_every_level():
    doc = telemetry("training")
    doc["added_in_v1_7"] = {"x": 1}
    doc["instances"][0]["added_too"] = [1]
    assert decode(msgspec.json.encode(doc), GpuTelemetry).instances[0].priority == "training"


@pytest.mark.nats
async def test_bus_delivers_the_rest_counts_and_logs_each_kind_once(nats_url):
    from dilu.services.common.bus import Bus
    from dilu.services.common.metrics import MALFORMED, SKIPPED

    bus = await Bus.connect(nats_url, "compat-bus")
    peer = await nats.connect(nats_url)
    try:
        seen: asyncio.Queue = asyncio.Queue()

        async def handler(event, msg):
            await seen.put(event)

        pattern = f"{subj.PREFIX}.telemetry.gpu.*.*"
        await bus.subscribe(pattern, GpuTelemetry, handler)
        await bus.subscribe(f"{subj.PREFIX}.scale.decided.*", ScaleDecision, handler)
        items = SKIPPED.labels("compat-bus", pattern, "unknown-enum")
        before = items._value.get()
        with capture_logs() as logs:
            for _ in range(2):
                await peer.publish(subj.telemetry_gpu("n0", 1), msgspec.json.encode(telemetry("realtime", "training")))
            await peer.publish(subj.scale_decided("f"), msgspec.json.encode({"function": "f", "direction": "up", "count": 1}))
            await peer.publish(subj.scale_decided("f"), encode(ScaleDecision(function="f", direction="out", count=2)))
            got = [await asyncio.wait_for(seen.get(), 5) for _ in range(3)]
        assert [len(g.instances) for g in got[:2]] == [1, 1] and got[2].direction == "out"
        assert items._value.get() - before == 2
        assert SKIPPED.labels("compat-bus", f"{subj.PREFIX}.scale.decided.*", "unknown-enum-event")._value.get() == 1
        assert bus.skipped == 3 and bus.malformed == 0
        assert MALFORMED.labels("compat-bus", pattern)._value.get() == 0
        logged = [e for e in logs if e.get("event", "").startswith("unknown enum member")]
        assert sorted((e["field"], e["value"]) for e in logged) == [
            ("$.direction", "'up'"), ("$.instances[].priority", "'realtime'")]
    finally:
        await peer.close()
        await bus.close()
