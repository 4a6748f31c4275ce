"""Stand-ins for the services a client talks to, for the client and CLI tests: each speaks the
real contract (subjects, events, KV buckets, the data plane's headers) and nothing more.

- :class:`FakeServices`: a scheduler answering admission, a profiler answering profiles (and
  storing them in ``dilu-profiles``), a node that places and readies an instance of each
  deployed function (``dilu-placement`` + ``InstanceReady``) and removes it on undeploy;
- :class:`FakeInstance`: pulls one function's consumer and answers each request by what its
  payload asks for (see :meth:`FakeInstance.answer`).
"""
from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats.errors
from nats.js.api import KeyValueConfig, StorageType

from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common.workqueue import consumer_name, ensure_stream
from dilu.services.common.bus import settle

FAKE_PROFILE = dict(request_quota=0.3, limit_quota=0.6, batch_size=4)


class FakeServices:
    """Scheduler, profiler and node, each optional. ``admitted``/``profiled``: the specs they
    were asked about; ``deployed``: FunctionDeployed events seen by the node."""

    def __init__(self, nc, *, admit_error: str = "", profile_error: str = "", ready: bool = True,
                 cold_start_ms: float = 1234.0, drain_delay_s: float = 0.3) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.admit_error, self.profile_error = admit_error, profile_error
        self.ready, self.cold_start_ms, self.drain_delay_s = ready, cold_start_ms, drain_delay_s
        self.admitted: list[ev.FunctionSpec] = []
        self.profiled: list[ev.FunctionSpec] = []
        self.deployed: list[ev.FunctionDeployed] = []
        self.undeployed: list[str] = []
        self._subs = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self, *, scheduler: bool = True, profiler: bool = True, node: bool = True) -> "FakeServices":
        self.placements = await self.js.create_key_value(KeyValueConfig(bucket=subjects.PLACEMENT_BUCKET, history=5))
        self.profiles = await self.js.create_key_value(KeyValueConfig(bucket=subjects.PROFILES_BUCKET, history=5))
        if scheduler:
            self._subs.append(await self.nc.subscribe(subjects.SCHEDULER_ADMIT, cb=self._admit))
        if profiler:
            self._subs.append(await self.nc.subscribe(subjects.PROFILER_PROFILE, cb=self._profile))
        if node:
            p = subjects.PREFIX
            self._subs.append(await self.nc.subscribe(f"{p}.function.deployed.*", cb=self._deployed))
            self._subs.append(await self.nc.subscribe(f"{p}.function.undeployed.*", cb=self._undeployed))
        await settle(self.nc)
        return self

    async def _admit(self, msg) -> None:
        spec = decode(msg.data, ev.AdmitRequest).spec
        self.admitted.append(spec)
        error = f"function {spec.name!r} cannot be placed: {self.admit_error}" if self.admit_error else ""  # as the scheduler says it
        reply = ev.AdmitReply(ok=not error, nodes=0 if error else 1, error=error)
        await msg.respond(encode(reply))

    async def _profile(self, msg) -> None:
        spec = decode(msg.data, ev.ProfileRequest).spec
        self.profiled.append(spec)
        if self.profile_error:
            await msg.respond(encode(ev.ProfileReply(ok=False, error=self.profile_error)))
            return
        profile = spec.profile or ev.Profile(function=spec.name, backend="fake", **FAKE_PROFILE)
        await self.profiles.put(subjects.token(spec.name), encode(profile))
        await msg.respond(encode(ev.ProfileReply(ok=True, profile=profile)))

    async def _deployed(self, msg) -> None:
        event = decode(msg.data, ev.FunctionDeployed)
        self.deployed.append(event)
        if not self.ready:
            return
        spec = event.spec
        iid = f"{spec.name}-i1"
        placement = ev.Placement(instance_id=iid, function=spec.name, node="node-a", gpu=1, request_quota=0.3,
                                 limit_quota=0.6, width=0.6, memory_bytes=spec.memory_bytes, batch_size=4)
        await self.placements.put(iid, encode(placement))
        ready = ev.InstanceReady(instance_id=iid, function=spec.name, node="node-a", gpu=1,
                                 cold_start_ms=self.cold_start_ms)
        await self.nc.publish(subjects.instance_state("ready", "node-a"), encode(ready))

    async def _undeployed(self, msg) -> None:
        name = decode(msg.data, ev.FunctionUndeployed).name
        self.undeployed.append(name)
        task = asyncio.create_task(self._drain(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, name: str) -> None:
        await asyncio.sleep(self.drain_delay_s)  # an instance takes a moment to drain
        with contextlib.suppress(Exception):
            await self.placements.delete(f"{name}-i1")

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class FakeInstance:
    """An instance of ``function`` that pulls its consumer (which must exist) and answers by
    the data plane's header protocol (:meth:`answer`). ``served``: request payloads seen."""

    def __init__(self, nc, function: str, instance_id: str = "inst-1") -> None:
        self.nc, self.js, self.function, self.instance_id = nc, nc.jetstream(), function, instance_id
        self.served: list[bytes] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> "FakeInstance":
        psub = await self.js.pull_subscribe_bind(durable=consumer_name(self.function), stream=subjects.INVOKE_STREAM)
        self._task = asyncio.create_task(self._loop(psub))
        return self

    async def _loop(self, psub) -> None:
        while True:
            try:
                msgs = await psub.fetch(1, timeout=0.3)
            except asyncio.TimeoutError:
                continue
            except nats.errors.ConnectionClosedError:  # the test ended without stopping us
                return
            for msg in msgs:
                await self.answer(msg)

    async def _send(self, msg, data: bytes, status: str, **extra: str) -> None:
        h = msg.headers
        headers = {subjects.H_REQUEST_ID: h[subjects.H_REQUEST_ID], subjects.H_STATUS: status,
                   subjects.H_INSTANCE: self.instance_id, **extra}
        await self.nc.publish(h[subjects.H_REPLY_TO], data, headers=headers)

    async def _chunks(self, msg, parts: list[bytes], start: int = 0) -> None:
        for seq, part in enumerate(parts, start):
            await self._send(msg, part, subjects.STATUS_CHUNK, **{subjects.H_CHUNK: str(seq)})

    async def answer(self, msg) -> None:
        """Payloads: ``fail:<why>`` -> an error reply ``ValueError: <why>``; ``hang`` -> no
        reply; ``stream:a,b,c`` -> chunks a, b, c then the final reply ``abc``; ``restream:...``
        -> the first two chunks, then (as a redelivered request would) every chunk again from
        0, plus a stray chunk out of order, then the final reply; ``chunkfail:a,b`` -> chunks
        then an error; ``chunkhang:a,b`` -> chunks, then no final reply; anything else ->
        ``echo:<payload>``."""
        data = msg.data
        self.served.append(data)
        kind, _, arg = data.partition(b":")
        parts = arg.split(b",") if arg else []
        if data == b"hang":
            await msg.ack()
            return
        if kind == b"fail":
            await self._send(msg, b"", "error", **{subjects.H_ERROR: f"ValueError: {arg.decode()}"})
        elif kind == b"stream":
            await self._chunks(msg, parts)
            await self._send(msg, b"".join(parts), "ok", **{subjects.H_CHUNK: str(len(parts))})
        elif kind == b"restream":
            await self._chunks(msg, parts[:2])
            await self._chunks(msg, [b"STRAY"], start=len(parts) + 5)
            await self._chunks(msg, parts)
            await self._send(msg, b"".join(parts), "ok", **{subjects.H_CHUNK: str(len(parts))})
        elif kind == b"chunkhang":
            await self._chunks(msg, parts)
        elif kind == b"chunkfail":
            await self._chunks(msg, parts)
            await self._send(msg, b"", "error", **{subjects.H_ERROR: "RuntimeError: generation broke"})
        else:
            await self._send(msg, b"echo:" + data, "ok", **{subjects.H_COLD_START: "0"})
        await msg.ack()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def spec_toml(name: str = "echo", *, kind: str = "inference", extra: str = "") -> str:
    """A spec file's text for an emulated-only function (no code to ship)."""
    objectives = {"inference": "slo_ms = 500.0", "llm": "ttft_ms = 200.0\ntpot_ms = 20.0", "training": ""}[kind]
    return f'name = "{name}"\nkind = "{kind}"\n{objectives}\n{extra}\n[emulation]\nmodel = "resnet152"\n'


async def put_state(js, state: ev.FunctionState) -> None:
    """Store a horizontal scaler's FunctionState (creating the bucket)."""
    kv = await js.create_key_value(KeyValueConfig(bucket=subjects.FUNCTION_STATE_BUCKET, history=1))
    await kv.put(subjects.token(state.function), msgspec.json.encode(state))


async def seed_functions(nc, specs, *, unplaceable: str = "full"):
    """A gateway's world without the services: the invocation stream (in memory), ``specs`` in
    ``dilu-functions`` and a FunctionState saying ``unplaceable`` has no GPU with room. Returns
    the JetStream context."""
    js = nc.jetstream()
    await ensure_stream(js, storage=StorageType.MEMORY)
    kv = await js.create_key_value(bucket=subjects.FUNCTIONS_BUCKET)
    for spec in specs:
        await kv.put(subjects.token(spec.name), msgspec.json.encode(spec))
    states = await js.create_key_value(bucket=subjects.FUNCTION_STATE_BUCKET)
    await states.put(unplaceable, msgspec.json.encode(ev.FunctionState(function=unplaceable, placeable=False,
                                                                       reason="no GPU with room")))
    return js
