"""The HTTP gateway against a real nats-server: requests go through dilu.client over the work
queue to a hand-written instance that answers by the data-plane header protocol (ok, error, chunks),
and every outcome comes back as its HTTP status; llm streams arrive as server-sent events; a stop
lets in-flight requests finish within the drain time and answers the rest 503."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import httpx
import msgspec
import nats
import nats.errors
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dilu.contracts import subjects as subj
from dilu.contracts.events import FunctionDeployed, FunctionSpec, FunctionUndeployed
from dilu.services.common.runner import running
from dilu.services.common.workqueue import consumer_name, ensure_consumer
from dilu.services.gateway.app import Limits

from client_fakes import seed_functions
from dilu.services.gateway.service import HTTP_KEEP_ALIVE_S, Gateway

pytestmark = pytest.mark.nats

SPECS = [
    FunctionSpec(name="echo", slo_ms=100.0),
    FunctionSpec(name="chat", kind="llm", ttft_ms=100.0, tpot_ms=10.0),
    FunctionSpec(name="boom", slo_ms=100.0),
    FunctionSpec(name="slow", slo_ms=100.0),
    FunctionSpec(name="full", slo_ms=100.0),  # unplaceable, no instance (dilu-function-state)
]
BODY_LIMIT = 64 * 1024


class Instance:
    """Plays the instances of the test functions: pulls each function's queue and answers as
    the node agent would (headers of contracts/subjects.py).

    echo: the payload reversed, cold start. chat: one chunk per word, then the whole output
    (payload "fail": one chunk, then an error; "hang": one chunk, then nothing). boom: an error.
    slow: payload "hold" is never answered; "lag" is answered once :attr:`release` is set.
    :attr:`arrived` gets each request of slow as it comes.
    """

    def __init__(self, nc, js) -> None:
        self.nc, self.js = nc, js
        self.arrived: asyncio.Queue[bytes] = asyncio.Queue()
        self.hung: list[str] = []  # reply subjects of the "hang" streams
        self.release = asyncio.Event()
        self.stop = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for fn in ("echo", "chat", "boom", "slow"):
            await ensure_consumer(self.js, fn, ack_wait_s=30)
            psub = await self.js.pull_subscribe_bind(durable=consumer_name(fn), stream=subj.INVOKE_STREAM)
            self._spawn(self._pull(fn, psub))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        self.stop.set()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _pull(self, fn: str, psub) -> None:
        while not self.stop.is_set():
            try:
                msgs = await psub.fetch(8, timeout=0.2)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                self._spawn(self._answer(fn, msg))

    async def _send(self, msg, status: str, data: bytes = b"", **extra: str) -> None:
        headers = {subj.H_REQUEST_ID: msg.headers[subj.H_REQUEST_ID], subj.H_STATUS: status,
                   subj.H_INSTANCE: f"inst-{msg.subject.rsplit('.', 1)[-1]}", **extra}
        await self.nc.publish(msg.headers[subj.H_REPLY_TO], data, headers=headers)

    async def _answer(self, fn: str, msg) -> None:
        if fn == "echo":
            await self._send(msg, "ok", msg.data[::-1], **{subj.H_COLD_START: "1"})
        elif fn == "boom":
            await self._send(msg, "error", **{subj.H_ERROR: "ValueError: bad input"})
        elif fn == "chat" and msg.data == b"hang":
            self.hung.append(msg.headers[subj.H_REPLY_TO])
            await self._send(msg, subj.STATUS_CHUNK, b"first", **{subj.H_CHUNK: "0"})
            return  # never finished
        elif fn == "chat":
            words = msg.data.split() if msg.data != b"fail" else [b"partial"]
            for i, word in enumerate(words):
                await self._send(msg, subj.STATUS_CHUNK, word, **{subj.H_CHUNK: str(i)})
            if msg.data == b"fail":
                await self._send(msg, "error", **{subj.H_ERROR: "RuntimeError: out of memory"})
            else:
                await self._send(msg, "ok", b" ".join(words), **{subj.H_CHUNK: str(len(words))})
        elif fn == "slow":
            await self.arrived.put(msg.data)
            if msg.data == b"hold":
                return  # never answered
            await self.release.wait()
            await self._send(msg, "ok", b"late")
        await msg.ack()


@pytest.fixture
async def instance(nats_url):
    nc = await nats.connect(nats_url)
    js = await seed_functions(nc, SPECS)
    inst = Instance(nc, js)
    await inst.start()
    yield inst
    await inst.close()
    await nc.close()


def gateway(drain_s: float = 5.0) -> Gateway:
    return Gateway(port=0, limits=Limits(max_body_bytes=BODY_LIMIT, default_timeout_s=10.0, max_timeout_s=60.0),
                   drain_s=drain_s)


def problem(resp: httpx.Response, status: int, slug: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    body = resp.json()
    assert body["status"] == status and body["type"] == f"urn:dilu:problem:{slug}" and body["title"]
    return body


def sse_events(text: str) -> list[tuple[str, str]]:
    """(event, data) of each server-sent event."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        fields = dict(line.split(": ", 1) for line in lines if not line.startswith("data"))
        data = "\n".join(line.split(": ", 1)[1] if ": " in line else "" for line in lines if line.startswith("data"))
        if lines:
            out.append((fields.get("event", "message"), data))
    return out


async def test_every_outcome_has_its_status(nats_url, instance):
    gw = gateway()
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=30) as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200

        resp = await http.post("/v1/functions/echo:invoke", content=b"hello", headers={"Dilu-Timeout": "10"})
        assert resp.status_code == 200, resp.text
        assert resp.content == b"olleh" and resp.headers["content-type"] == "application/octet-stream"
        assert resp.headers["dilu-instance"] == "inst-echo" and resp.headers["dilu-cold-start"] == "1"
        assert len(resp.headers["dilu-request-id"]) >= 8

        problem(await http.post("/v1/functions/nobody:invoke", content=b"x"), 404, "not-deployed")
        problem(await http.post("/v1/functions/echo:invoke", content=b"x", headers={"Dilu-Timeout": "-3"}),
                400, "bad-request")
        problem(await http.post("/v1/functions/echo:invoke?stream=1", content=b"x"), 400, "bad-request")
        problem(await http.post("/v1/functions/e%20cho:invoke", content=b"x"), 400, "bad-request")
        problem(await http.post("/v1/functions/echo:invoke", content=b"x" * (BODY_LIMIT + 1)), 413,
                "payload-too-large")
        body = problem(await http.post("/v1/functions/boom:invoke", content=b"x"), 500, "function-error")
        assert body["detail"] == "ValueError: bad input"
        body = problem(await http.post("/v1/functions/full:invoke", content=b"x"), 503, "no-capacity")
        assert "no GPU with room" in body["detail"]
        problem(await http.post("/v1/functions/slow:invoke", content=b"hold", headers={"Dilu-Timeout": "0.3"}),
                504, "timeout")
        problem(await http.get("/v1/functions/echo:invoke"), 405, "method-not-allowed")
        problem(await http.get("/v2/anything"), 404, "not-found")

        metrics = (await http.get("/metrics")).text
        answered = {(s.labels["function"], s.labels["code"]) for family in text_string_to_metric_families(metrics)
                    for s in family.samples if s.name == "dilu_gateway_requests_total"}
        assert {("echo", "200"), ("boom", "500"), ("full", "503"), ("slow", "504"), ("(unknown)", "404")} <= answered
        assert "nobody" not in metrics


async def test_llm_streams_as_server_sent_events(nats_url, instance):
    gw = gateway()
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=30) as http:
        resp = await http.post("/v1/functions/chat:invoke", content=b"one two three",
                               headers={"Accept": "text/event-stream"})
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.text)
        assert events[:3] == [("chunk", "one"), ("chunk", "two"), ("chunk", "three")]
        assert events[3][0] == "done" and len(events) == 4
        done = json.loads(events[3][1])
        assert done["instance"] == "inst-chat" and done["chunks"] == 3 and done["cold_start"] is False
        assert done["ttft_ms"] > 0 and done["tpot_ms"] >= 0 and done["request_id"]

        events = sse_events((await http.post("/v1/functions/chat:invoke?stream=1", content=b"fail")).text)
        assert [e for e, _ in events] == ["chunk", "error"]
        err = json.loads(events[1][1])
        assert err["status"] == 500 and err["detail"] == "RuntimeError: out of memory"

        # without asking for a stream, an llm function answers with its whole output
        resp = await http.post("/v1/functions/chat:invoke", content=b"a b")
        assert resp.status_code == 200 and resp.content == b"a b"


async def test_a_stream_whose_http_client_goes_away_is_withdrawn(nats_url, instance):
    """The caller closes its connection after the first chunk: the gateway withdraws the call on
    dilu.v1.cancel.<fn>, so the instance can stop generating."""
    withdrawn = await instance.nc.subscribe(subj.cancel("chat"))
    await instance.nc.flush()
    gw = gateway()
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=30) as http:
        async with http.stream("POST", "/v1/functions/chat:invoke?stream=1", content=b"hang") as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data"):
                    break  # the first chunk came; the caller leaves
        msg = await withdrawn.next_msg(timeout=10)
    assert msg.data.decode() == instance.hung[0]


async def test_a_plain_call_whose_http_client_goes_away_is_withdrawn(nats_url, instance):
    """Without a stream too: the caller gives up (its own HTTP timeout) before the reply, and the
    gateway withdraws the call instead of waiting out Dilu-Timeout for nobody."""
    withdrawn = await instance.nc.subscribe(subj.cancel("slow"))
    await instance.nc.flush()
    gw = gateway()
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/functions/slow:invoke", content=b"hold", headers={"Dilu-Timeout": "30"}, timeout=1.0)
        assert await instance.arrived.get() == b"hold"
        msg = await withdrawn.next_msg(timeout=10)
        assert msg.data.decode().startswith("_INBOX")


async def test_functions_deployed_and_undeployed_while_running(nats_url, instance):
    gw = gateway()
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=30) as http:
        listed = {f["name"] for f in (await http.get("/v1/functions")).json()["functions"]}
        assert listed == {s.name for s in SPECS}

        late = FunctionSpec(name="late", kind="llm", ttft_ms=50.0, tpot_ms=5.0)
        kv = await instance.js.key_value(subj.FUNCTIONS_BUCKET)
        await kv.put("late", msgspec.json.encode(late))
        await instance.nc.publish(subj.function_deployed("late"), msgspec.json.encode(FunctionDeployed(spec=late)))
        resp = await http.get("/v1/functions/late")
        assert resp.status_code == 200 and resp.json()["kind"] == "llm"
        listed = {f["name"] for f in (await http.get("/v1/functions")).json()["functions"]}
        assert "late" in listed

        await kv.delete("late")
        await instance.nc.publish(subj.function_undeployed("late"),
                                  msgspec.json.encode(FunctionUndeployed(name="late")))
        deadline = asyncio.get_running_loop().time() + 5
        while (await http.get("/v1/functions/late")).status_code != 404:
            assert asyncio.get_running_loop().time() < deadline, "undeployed function still served"
            await asyncio.sleep(0.05)
        listed = {f["name"] for f in (await http.get("/v1/functions")).json()["functions"]}
        assert "late" not in listed


async def test_stop_finishes_in_flight_requests_and_answers_the_rest(nats_url, instance):
    gw = gateway(drain_s=1.0)
    http = httpx.AsyncClient(timeout=30)
    ctx = running(gw, nats_url)
    await ctx.__aenter__()
    url = f"http://127.0.0.1:{gw.port}/v1/functions/slow:invoke"
    lag = asyncio.create_task(http.post(url, content=b"lag"))
    hold = asyncio.create_task(http.post(url, content=b"hold"))
    assert {await instance.arrived.get(), await instance.arrived.get()} == {b"lag", b"hold"}
    streaming = asyncio.Event()

    async def hanging_stream() -> tuple[int, str]:
        async with http.stream("POST", f"http://127.0.0.1:{gw.port}/v1/functions/chat:invoke", content=b"hang",
                               headers={"Accept": "text/event-stream"}) as resp:
            text = ""
            async for part in resp.aiter_text():
                text += part
                if "event: chunk" in text:
                    streaming.set()
            return resp.status_code, text

    hang = asyncio.create_task(hanging_stream())
    await streaming.wait()

    stopping = asyncio.create_task(ctx.__aexit__(None, None, None))
    deadline = asyncio.get_running_loop().time() + 5
    while gw.ready():  # the stop has begun: no longer ready, requests still in flight
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    instance.release.set()  # the lagging one can answer now, within the drain time

    resp = await lag
    assert resp.status_code == 200 and resp.content == b"late"
    body = problem(await hold, 503, "stopping")
    assert body["function"] == "slow"
    status, text = await hang  # the stream in progress ends with an error event
    assert status == 200
    events = sse_events(text)
    assert [e for e, _ in events] == ["chunk", "error"] and json.loads(events[1][1])["status"] == 503
    await stopping
    await http.aclose()

    with pytest.raises(httpx.ConnectError):  # nothing listens any more
        async with httpx.AsyncClient() as again:
            await again.get(f"http://127.0.0.1:{gw.port}/healthz")
    assert gw.bus.nc.is_closed and gw.client is None
    assert [t for t in asyncio.all_tasks() if _runs_in(t, "uvicorn", "starlette", "/gateway/", "/client/")] == []


async def test_the_body_limit_fits_what_nats_carries(nats_url, instance):
    gw = Gateway(port=0)  # asks for 8 MiB; the test server carries 1 MiB messages (its default)
    async with running(gw, nats_url), httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=30) as http:
        max_payload = gw.bus.nc.max_payload
        assert gw.limits.max_body_bytes < max_payload < 8 << 20
        problem(await http.post("/v1/functions/echo:invoke", content=b"x" * max_payload), 413, "payload-too-large")
        resp = await http.post("/v1/functions/echo:invoke", content=b"y" * gw.limits.max_body_bytes)
        assert resp.status_code == 200 and len(resp.content) == gw.limits.max_body_bytes


async def test_an_idle_connection_is_closed_by_the_client_first(nats_url, instance):
    """The server keeps an idle connection past the client pool's idle expiry: were it to close
    first, a request sent as it closes would be reset (ECONNRESET, seen under overload)."""
    assert HTTP_KEEP_ALIVE_S > httpx.Limits().keepalive_expiry
    for keep_alive_s, open_at_s in ((0.3, None), (3.0, 0.6)):
        gw = Gateway(port=0, keep_alive_s=keep_alive_s)
        async with running(gw, nats_url):
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            if open_at_s is None:  # closed by the server once idle for keep_alive_s
                assert await asyncio.wait_for(reader.read(), 3.0) == b""
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(reader.read(), open_at_s)
            writer.close()


def _runs_in(task: asyncio.Task, *places: str) -> bool:
    """Whether ``task``'s coroutine is defined in a file whose path contains one of ``places``."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and any(p in code.co_filename for p in places)


def test_a_taken_http_port_is_one_line_and_exit_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "dilu.services.gateway", "--port", str(port),
                              "--nats-url", "nats://127.0.0.1:1", "--metrics-port", "0"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "DILU_HOST": "127.0.0.1"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"dilu gateway: cannot serve HTTP on 127.0.0.1:{port}")
    assert "Traceback" not in out.stderr
