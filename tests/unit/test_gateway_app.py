"""The gateway's HTTP layer over a stand-in client: status codes and problem details for each
client error, limits on the body and the timeout header, server-sent event framing, headers,
bounded metric labels. (The real NATS side: tests/integration/test_gateway.py.)"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import REGISTRY

from dilu.client import BadRequest, DiluError, FunctionError, InvocationTimeout, NoCapacity, NotDeployed, Reply
from dilu.contracts.events import FunctionSpec
from dilu.services.gateway.app import UNKNOWN, Limits
from dilu.services.gateway.service import Gateway

SPECS = {
    "echo": FunctionSpec(name="echo", slo_ms=100.0, config={"secret": "s3"}),
    "chat": FunctionSpec(name="chat", kind="llm", ttft_ms=100.0, tpot_ms=10.0),
    "trainer": FunctionSpec(name="trainer", kind="training"),
}


class FakeStream:
    """Like dilu.client.aio.Stream: chunks, then ``reply`` set, or the error raised at the end."""

    def __init__(self, chunks: list[bytes], error: Exception | None, reply: Reply) -> None:
        self.chunks, self.error, self.reply_at_end = list(chunks), error, reply
        self.reply = None
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        if self.error is not None:
            raise self.error
        self.reply = self.reply_at_end
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


class FakeClient:
    """A stand-in for dilu.client.AsyncClient: ``outcome`` (per function) is a Reply to return or
    an exception to raise; ``chunks``/``stream_error`` shape streams."""

    def __init__(self) -> None:
        self.specs = dict(SPECS)
        self.outcome: dict[str, Reply | Exception] = {}
        self.chunks: list[bytes] = []
        self.stream_error: Exception | None = None
        self.calls: list[tuple[str, bytes, float]] = []
        self.streams: list[FakeStream] = []

    async def functions(self):
        return dict(self.specs)

    async def function(self, name):
        if name not in self.specs:
            raise NotDeployed(name)
        return self.specs[name]

    async def invoke(self, name, payload, *, timeout_s):
        self.calls.append((name, payload, timeout_s))
        out = self.outcome.get(name) or Reply(payload=payload[::-1], request_id="r1", instance="i-7", cold_start=True)
        if isinstance(out, Exception):
            raise out
        return out

    def stream(self, name, payload, *, timeout_s):
        self.calls.append((name, payload, timeout_s))
        reply = Reply(payload=b"".join(self.chunks), request_id="r2", instance="i-9", chunks=len(self.chunks),
                      ttft_ms=12.5, tpot_ms=3.0)
        s = FakeStream(self.chunks, self.stream_error, reply)
        self.streams.append(s)
        return s

    async def close(self):
        pass


@pytest.fixture
async def env():
    fake = FakeClient()
    gw = Gateway(port=0, limits=Limits(max_body_bytes=1024, default_timeout_s=30.0, max_timeout_s=60.0))
    await gw.load(fake)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app), base_url="http://gw") as http:
        yield fake, gw, http


def problem(resp: httpx.Response, status: int, slug: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    body = resp.json()
    assert body["status"] == status and body["type"] == f"urn:dilu:problem:{slug}"
    assert body["title"] and body["detail"]
    return body


def sse_events(text: str) -> list[dict]:
    """Server-sent events as dicts of their fields (data lines joined by newlines)."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            fields[key] = fields[key] + "\n" + value if key in fields else value
        if fields:
            out.append(fields)
    return out


def count(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_invoke_returns_the_output_with_its_headers_and_timeout(env):
    fake, _, http = env
    resp = await http.post("/v1/functions/echo:invoke", content=b"abc", headers={"Dilu-Timeout": "2.5"})
    assert resp.status_code == 200
    assert resp.content == b"cba"
    assert resp.headers["content-type"] == "application/octet-stream"
    assert (resp.headers["dilu-request-id"], resp.headers["dilu-instance"], resp.headers["dilu-cold-start"]) == \
        ("r1", "i-7", "1")
    assert fake.calls == [("echo", b"abc", 2.5)]
    await http.post("/v1/functions/echo:invoke", content=b"x")
    assert fake.calls[-1][2] == 30.0  # the default timeout


@pytest.mark.parametrize("error, status, slug", [
    (NotDeployed("echo"), 404, "not-deployed"),
    (FunctionError("ValueError: bad image"), 500, "function-error"),
    (NoCapacity("stream full"), 503, "no-capacity"),
    (InvocationTimeout("no reply within 2 s"), 504, "timeout"),
    (BadRequest("echo: malformed request"), 400, "bad-request"),
    (DiluError("something else"), 502, "bad-gateway"),
    (RuntimeError("a bug"), 500, "internal-error"),
])
async def test_client_errors_map_to_problems(env, error, status, slug):
    fake, _, http = env
    fake.outcome["echo"] = error
    body = problem(await http.post("/v1/functions/echo:invoke", content=b"x"), status, slug)
    assert body["function"] == "echo"
    if isinstance(error, FunctionError):
        assert body["detail"] == "ValueError: bad image"


async def test_no_capacity_says_when_to_retry(env):
    fake, _, http = env
    fake.outcome["echo"] = NoCapacity("dropped")
    resp = await http.post("/v1/functions/echo:invoke", content=b"x")
    assert resp.headers["retry-after"] == "1"


async def test_unknown_and_bad_names(env):
    fake, _, http = env
    problem(await http.post("/v1/functions/nope:invoke", content=b"x"), 404, "not-deployed")
    problem(await http.post("/v1/functions/bad.name:invoke", content=b"x"), 400, "bad-request")
    problem(await http.post("/v1/functions/" + "a" * 64 + ":invoke", content=b"x"), 400, "bad-request")
    long = problem(await http.post("/v1/functions/" + "a" * 5000 + ":invoke", content=b"x"), 400, "bad-request")
    assert "a" * 40 + "..." in long["detail"] and len(long["detail"]) < 120  # the name is cut, not repeated whole
    problem(await http.post("/v1/functions/trainer:invoke", content=b"x"), 400, "bad-request")
    assert fake.calls == []


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "60.5", "", "1_0"])
async def test_bad_timeout_header_is_400(env, value):
    fake, _, http = env
    body = problem(await http.post("/v1/functions/echo:invoke", content=b"x", headers={"Dilu-Timeout": value}),
                   400, "bad-request")
    assert "Dilu-Timeout" in body["detail"]
    assert fake.calls == []


async def test_a_timeout_header_given_twice_is_400_whatever_the_first_says(env):
    fake, _, http = env
    body = problem(await http.post("/v1/functions/echo:invoke", content=b"x",
                                   headers=[("Dilu-Timeout", "1"), ("Dilu-Timeout", "abc")]), 400, "bad-request")
    assert "once" in body["detail"]
    assert fake.calls == []


async def test_body_limit_is_413_declared_or_streamed(env):
    fake, _, http = env
    problem(await http.post("/v1/functions/echo:invoke", content=b"x" * 1025), 413, "payload-too-large")

    async def chunked():  # no Content-Length: counted while read
        for _ in range(5):
            yield b"y" * 300

    problem(await http.post("/v1/functions/echo:invoke", content=chunked()), 413, "payload-too-large")
    assert (await http.post("/v1/functions/echo:invoke", content=b"z" * 1024)).status_code == 200
    assert [c[1] for c in fake.calls] == [b"z" * 1024]


async def test_stream_frames_chunks_then_done(env):
    fake, _, http = env
    fake.chunks = [b"Hel", b"lo\nworld", b"\xff!"]
    resp = await http.post("/v1/functions/chat:invoke", content=b"hi", headers={"Accept": "text/event-stream"})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert [e["event"] for e in events] == ["chunk", "chunk", "chunk", "done"]
    assert [e["data"] for e in events[:3]] == ["Hel", "lo\nworld", "\ufffd!"]
    assert [e["id"] for e in events[:3]] == ["0", "1", "2"]
    done = json.loads(events[3]["data"])
    assert done == {"request_id": "r2", "instance": "i-9", "cold_start": False, "chunks": 3, "ttft_ms": 12.5,
                    "tpot_ms": 3.0}
    assert fake.streams[0].closed


async def test_stream_by_query_and_plain_llm_call(env):
    fake, _, http = env
    fake.chunks = [b"a"]
    resp = await http.post("/v1/functions/chat:invoke?stream=1", content=b"hi")
    assert [e["event"] for e in sse_events(resp.text)] == ["chunk", "done"]
    resp = await http.post("/v1/functions/chat:invoke?stream=0", content=b"hi", headers={"Accept": "text/event-stream"})
    assert resp.headers["content-type"] == "application/octet-stream"  # the whole output at once
    problem(await http.post("/v1/functions/chat:invoke?stream=maybe", content=b"hi"), 400, "bad-request")


async def test_stream_error_after_chunks_is_an_error_event(env):
    fake, _, http = env
    fake.chunks, fake.stream_error = [b"partial"], FunctionError("RuntimeError: out of memory")
    resp = await http.post("/v1/functions/chat:invoke", content=b"hi", headers={"Accept": "text/event-stream"})
    events = sse_events(resp.text)
    assert [e["event"] for e in events] == ["chunk", "error"]
    err = json.loads(events[1]["data"])
    assert err["status"] == 500 and err["detail"] == "RuntimeError: out of memory"
    assert err["type"] == "urn:dilu:problem:function-error"
    assert fake.streams[0].closed


async def test_stream_failing_before_its_first_chunk_is_a_plain_error(env):
    fake, _, http = env
    fake.stream_error = InvocationTimeout("no reply")
    resp = await http.post("/v1/functions/chat:invoke", content=b"hi", headers={"Accept": "text/event-stream"})
    problem(resp, 504, "timeout")
    assert fake.streams[0].closed


async def test_streaming_a_non_llm_function_is_400_when_asked_and_plain_when_only_accepted(env):
    fake, _, http = env
    body = problem(await http.post("/v1/functions/echo:invoke?stream=1", content=b"x"), 400, "bad-request")
    assert "llm" in body["detail"] and body["function"] == "echo"
    assert fake.calls == []
    # an Accept naming server-sent events among others is a preference the function cannot meet
    resp = await http.post("/v1/functions/echo:invoke", content=b"x",
                           headers={"Accept": "application/json, text/event-stream;q=0.1"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/octet-stream"


async def test_unknown_routes_and_methods_are_problems(env):
    _, _, http = env
    problem(await http.get("/nowhere"), 404, "not-found")
    resp = await http.get("/v1/functions/echo:invoke")
    problem(resp, 405, "method-not-allowed")
    assert resp.headers["allow"] == "POST"
    resp = await http.delete("/v1/functions")
    problem(resp, 405, "method-not-allowed")
    assert "GET" in resp.headers["allow"]
    # an action that does not exist is no route at all (a 404, not a 405)
    body = problem(await http.post("/v1/functions/echo:invokes", content=b"x"), 404, "not-found")
    assert "':invokes'" in body["detail"] and ":invoke)" in body["detail"]
    resp = await http.delete("/v1/functions/echo")
    problem(resp, 405, "method-not-allowed")
    assert resp.headers["allow"] == "GET"
    resp = await http.put("/v1/functions/echo:invoke", content=b"x")  # the route exists: a 405
    problem(resp, 405, "method-not-allowed")
    assert resp.headers["allow"] == "POST"


async def test_function_listing_hides_operator_fields(env):
    fake, _, http = env
    listed = (await http.get("/v1/functions")).json()["functions"]
    assert [f["name"] for f in listed] == ["chat", "echo", "trainer"]
    assert all("config" not in f and "entry" not in f for f in listed)
    one = (await http.get("/v1/functions/chat")).json()
    assert one["kind"] == "llm" and one["ttft_ms"] == 100.0
    problem(await http.get("/v1/functions/nope"), 404, "not-deployed")
    problem(await http.get("/v1/functions/no.pe"), 400, "bad-request")


async def test_metrics_count_by_function_and_code_with_bounded_labels(env):
    fake, _, http = env
    ok_before = count("dilu_gateway_requests_total", function="echo", code="200")
    unknown_before = count("dilu_gateway_requests_total", function=UNKNOWN, code="404")
    await http.post("/v1/functions/echo:invoke", content=b"x")
    for i in range(3):  # three made-up names: one label value between them
        await http.post(f"/v1/functions/made-up-{i}:invoke", content=b"x")
    text = (await http.get("/metrics")).text
    assert count("dilu_gateway_requests_total", function="echo", code="200") == ok_before + 1
    assert count("dilu_gateway_requests_total", function=UNKNOWN, code="404") == unknown_before + 3
    assert "made-up" not in text
    assert 'dilu_gateway_request_seconds_count{function="echo"}' in text
    assert count("dilu_gateway_in_flight") == 0


async def test_in_flight_gauge_counts_a_waiting_call(env):
    fake, _, http = env
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(name, payload, *, timeout_s):
        entered.set()
        await release.wait()
        return Reply(payload=b"late", request_id="r", instance="i")

    fake.invoke = slow
    call = asyncio.create_task(http.post("/v1/functions/echo:invoke", content=b"x"))
    await entered.wait()
    assert count("dilu_gateway_in_flight") == 1
    release.set()
    assert (await call).content == b"late"
    assert count("dilu_gateway_in_flight") == 0


async def test_health_and_readiness(env):
    _, _, http = env
    assert (await http.get("/healthz")).status_code == 200
    # loaded but not serving under uvicorn (nor connected to NATS): not ready
    assert (await http.get("/readyz")).status_code == 503
