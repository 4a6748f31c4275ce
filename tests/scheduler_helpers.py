"""What the scheduler's integration tests share: waiting for an asynchronous effect, an inventory
as an agent would put it, deploying a function, asking for placements, reading the table as the
scheduler lists it. Importable from every test folder (pytest puts tests/ on sys.path)."""
from __future__ import annotations

import asyncio

import msgspec
import nats

from dilu.contracts import decode, encode, subjects
from dilu.contracts.events import (
    FunctionDeployed,
    FunctionSpec,
    GpuInfo,
    NodeInventory,
    PlaceReply,
    PlaceRequest,
    Placement,
    Profile,
    ProfileReady,
)
from dilu.services.common.kvkeys import kv_keys
from dilu.services.common.bus import settle

GiB = 2**30


async def wait_for(cond, what: str, timeout_s: float = 30.0):
    """Poll ``cond()`` (sync or async) until it is truthy; returns its value. Up to ``timeout_s``
    (a loaded 2-core host is slow), leaving as soon as it holds. Raises AssertionError naming ``what``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


def inventory(node: str, gpus: int = 1, memory: int = 40 * GiB, first_index: int = 0, **gpu_kw) -> NodeInventory:
    """An emulated node's inventory: ``gpus`` A100s of ``memory`` bytes from index ``first_index``."""
    return NodeInventory(node=node, agent_id=f"agent-{node}", device="emulated", gpus=[
        GpuInfo(index=first_index + i, uuid=f"GPU-{node}-{i}", name="NVIDIA A100-SXM4-40GB", memory_bytes=memory,
                sms=108, **gpu_kw)
        for i in range(gpus)])


async def deploy(nc, svc, name, request=0.5, limit=0.5, memory=4 * GiB, profile=True):
    """Publish FunctionDeployed (and ProfileReady unless ``profile`` is False) and wait until the
    scheduler ``svc`` has learnt them."""
    spec = FunctionSpec(name=name, model="bert_base", memory_bytes=memory, slo_ms=80)
    await nc.publish(subjects.function_deployed(name), encode(FunctionDeployed(spec=spec)))
    if profile:
        p = Profile(function=name, request_quota=request, limit_quota=limit, batch_size=4)
        await nc.publish(subjects.profile_ready(name), encode(ProfileReady(profile=p)))
    await settle(nc)
    await wait_for(lambda: name in svc.functions and (not profile or name in svc.profiles), f"scheduler learnt {name}")


async def place(nc, fn, count=1) -> PlaceReply:
    msg = await nc.request(subjects.SCHEDULER_PLACE, encode(PlaceRequest(function=fn, count=count)), timeout=10)
    return decode(msg.data, PlaceReply)


async def table(js) -> dict[str, Placement]:
    """The placement table, listed like the scheduler lists it (:func:`kv_keys`: nats-py's own
    ``keys()`` now and then ends its listing early)."""
    kv = await js.key_value(subjects.PLACEMENT_BUCKET)
    rows = {}
    for k in await kv_keys(js, subjects.PLACEMENT_BUCKET):
        try:
            rows[k] = msgspec.json.decode((await kv.get(k)).value, type=Placement)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):  # deleted
            pass
    return rows
