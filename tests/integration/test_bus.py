"""The typed bus against a real nats-server: a malformed message is rejected with a logged
reason and counted, and the service keeps handling the next valid message."""
from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from structlog.testing import capture_logs

from dilu.contracts import encode, subjects as subj
from dilu.contracts.events import FunctionDeployed, FunctionSpec, PlaceReply, PlaceRequest
from dilu.services.common.bus import Bus
from dilu.services.common.metrics import HANDLER_ERRORS, MALFORMED

pytestmark = pytest.mark.nats


def deployed(name: str) -> FunctionDeployed:
    return FunctionDeployed(spec=FunctionSpec(name=name, model="bert-base"))


@pytest.fixture
async def bus(nats_url):
    b = await Bus.connect(nats_url, "bus-test")
    yield b
    await b.close()


@pytest.fixture
async def peer(nats_url):
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


def rejections(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e.get("event") == "message rejected"]


async def test_malformed_event_is_rejected_counted_and_the_next_one_handled(bus, peer):
    subject = subj.function_deployed("f1")
    seen: asyncio.Queue = asyncio.Queue()

    async def handler(event, msg):
        await seen.put(event)

    pattern = f"{subj.PREFIX}.function.deployed.*"
    await bus.subscribe(pattern, FunctionDeployed, handler)  # wildcard
    before = MALFORMED.labels("bus-test", pattern)._value.get()
    with capture_logs() as logs:
        await peer.publish(subject, b"{not json")
        await peer.publish(subject, msgspec.json.encode({"spec": {"model": "bert_base"}}))  # no name
        await peer.publish(subject, encode(deployed("f1")))
        event = await asyncio.wait_for(seen.get(), 5)
    assert event.spec.name == "f1" and seen.empty()
    assert bus.malformed == 2 and bus.ready
    # counted per subscription pattern: random subjects cannot mint new time series
    assert MALFORMED.labels("bus-test", pattern)._value.get() - before == 2
    reasons = [e["reason"] for e in rejections(logs)]
    assert len(reasons) == 2 and any("name" in r for r in reasons), reasons


async def test_raising_handler_is_counted_and_does_not_stop_the_subscription(bus, peer):
    subject = subj.function_deployed("f2")
    seen: asyncio.Queue = asyncio.Queue()

    async def handler(event, msg):
        if event.spec.name == "poison":
            raise KeyError("no such model")
        await seen.put(event)

    await bus.subscribe(subject, FunctionDeployed, handler)
    before = HANDLER_ERRORS.labels("bus-test", subject)._value.get()
    with capture_logs() as logs:
        await peer.publish(subject, encode(deployed("poison")))
        await peer.publish(subject, encode(deployed("fine")))
        event = await asyncio.wait_for(seen.get(), 5)
    assert event.spec.name == "fine"
    assert bus.handler_errors == 1 and bus.malformed == 0
    assert HANDLER_ERRORS.labels("bus-test", subject)._value.get() - before == 1
    [entry] = rejections(logs)
    assert entry["handler_error"] and "no such model" in entry["reason"]


async def test_malformed_request_gets_an_error_reply_and_the_next_is_served(bus, peer):
    async def place(req: PlaceRequest, msg) -> PlaceReply:
        if req.count > 8:
            raise ValueError("too many instances")
        return PlaceReply(ok=True)

    await bus.serve(subj.SCHEDULER_PLACE, PlaceRequest, place)
    with capture_logs() as logs:
        bad = await peer.request(subj.SCHEDULER_PLACE, b'{"count": "two"}', timeout=5)
        failing = await peer.request(subj.SCHEDULER_PLACE, encode(PlaceRequest(function="f", count=9)), timeout=5)
        good = await peer.request(subj.SCHEDULER_PLACE, encode(PlaceRequest(function="f", count=1)), timeout=5)
    bad_reply = msgspec.json.decode(bad.data)
    assert bad_reply["ok"] is False and "PlaceRequest" in bad_reply["error"], bad_reply
    failing_reply = msgspec.json.decode(failing.data)
    assert failing_reply["ok"] is False and "too many instances" in failing_reply["error"]
    assert msgspec.json.decode(good.data, type=PlaceReply).ok
    assert bus.malformed == 1 and bus.handler_errors == 1
    assert len(rejections(logs)) == 2


async def test_concurrent_serve_answers_a_quick_request_while_a_slow_one_runs(bus, peer):
    release = asyncio.Event()
    order: list[str] = []

    async def place(req: PlaceRequest, msg) -> PlaceReply:
        if req.function == "slow":
            await release.wait()
        order.append(req.function)
        return PlaceReply(ok=True, error=req.function)

    await bus.serve(subj.SCHEDULER_PLACE, PlaceRequest, place, concurrent=True)
    slow = asyncio.ensure_future(peer.request(subj.SCHEDULER_PLACE, encode(PlaceRequest(function="slow")), timeout=5))
    await asyncio.sleep(0.1)
    quick = await peer.request(subj.SCHEDULER_PLACE, encode(PlaceRequest(function="quick")), timeout=5)
    assert msgspec.json.decode(quick.data, type=PlaceReply).error == "quick" and order == ["quick"]
    release.set()
    assert msgspec.json.decode((await slow).data, type=PlaceReply).error == "slow"
    # a request still being handled at close is cancelled, not left running
    release.clear()
    hung = asyncio.ensure_future(peer.request(subj.SCHEDULER_PLACE, encode(PlaceRequest(function="slow")), timeout=1))
    await asyncio.sleep(0.1)
    assert len(bus._tasks) == 1
    await bus.close()
    assert not bus._tasks
    with pytest.raises(nats.errors.TimeoutError):
        await hung
