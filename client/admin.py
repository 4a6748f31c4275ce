"""Operating a Dilu cluster: deploy and undeploy functions, read its status.

Used by ``dilu deploy/undeploy/status``, the gateway and ``dilu up``/``dilu demo``. Each call
takes a NATS connection (``nats.aio.client.Client``) or a :class:`~dilu.client.aio.AsyncClient`
of the running event loop, and speaks only the platform's contracts:

- :func:`deploy`: code bundle -> admission (scheduler) -> profile (profiler) -> invocation
  queue -> KV ``dilu-functions`` -> ``FunctionDeployed`` -> wait for the first instance;
- :func:`undeploy`: delete the KV key -> ``FunctionUndeployed`` (the scheduler drains the
  instances) -> once none is left, remove the function's consumer and queued requests;
- :func:`status`: nodes and GPUs, and per function its spec, profile, instances (quotas and
  current grant), backlog and recent scale decisions. Every result is a msgspec Struct, so
  ``msgspec.json.encode`` gives its JSON.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig

from dilu.contracts import MalformedEvent, cloudevents, decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import bundle, workqueue
from dilu.services.common import logging as dlog
from dilu.services.common.bus import settle
from dilu.services.common.jsresources import ensure_kv
from dilu.services.common.nodes import read_inventories

from .aio import AsyncClient, decode_spec, read_bucket
from .errors import BadCode, DeployError, NotAdmitted, NotDeployed
from .spec import LoadedSpec

log = dlog.get("client.admin")

# Same configuration as the other buckets of records the services keep (dilu-placement,
# dilu-profiles): a short history for inspection. The services only read this one.
FUNCTIONS_KV_CONFIG = KeyValueConfig(bucket=subjects.FUNCTIONS_BUCKET, history=5,
                                     description="Dilu deployed functions (FunctionSpec JSON)")
ADMIT_TIMEOUT_S = 10.0  # admission is a look at the inventory: seconds, not a search
UNDEPLOY_POLL_S = 0.5
CE_SOURCE = cloudevents.source("client")  # ce-source of the events a client publishes
TELEMETRY_S = 2.0


class ReadyInstance(msgspec.Struct, kw_only=True):
    """The first instance of a freshly deployed function that became ready;
    ``cold_start_ms``: its launch to ready, as its node agent measured."""

    instance_id: str
    node: str
    gpu: int
    cold_start_ms: float = 0.0


class DeployResult(msgspec.Struct, kw_only=True):
    """What :func:`deploy` did.

    ``spec``: as stored (``code`` = the bundle key, empty when nothing was shipped);
    ``profile``: the profiler's answer (quotas and batch size); ``ready``: the instance that
    became ready within the wait, or None (none asked for, still starting, or
    ``existing_instances`` already run a redeployed function); ``waited_s``: time spent waiting
    for it; ``unplaceable``: when none became ready, why the scheduler refuses the function's
    instances now (the horizontal scaler's state: e.g. no GPU with room; it is placed once one
    has room), else empty.
    """

    spec: ev.FunctionSpec
    profile: ev.Profile | None
    ready: ReadyInstance | None = None
    code: str = ""
    existing_instances: int = 0
    waited_s: float = 0.0
    unplaceable: str = ""


class UndeployResult(msgspec.Struct, kw_only=True):
    """What :func:`undeploy` did. ``remaining_instances``: placements of the function still in
    the table when the wait ended (draining); ``cleaned``: its consumer and queued requests were
    removed (only once no instance remains, since instances pull from that consumer);
    ``answered``: requests answered with the undeployed error, queued or held by an instance its
    drain stopped (:func:`undeploy`)."""

    name: str
    kind: str = "inference"
    remaining_instances: int = 0
    cleaned: bool = False
    answered: int = 0


class InstanceStatus(msgspec.Struct, kw_only=True):
    """One placed instance: where it runs and its quotas (fractions 0..1 of its GPU);
    ``draining``: being retired; ``parked``: idle and off its GPU (``Placement.parked``: no SM
    share held, weights in host memory; ``node``/``gpu`` say where it resumes, the quotas what it
    takes back then); ``grant``: the quota its node last reported for it (None: no telemetry heard)."""

    instance_id: str
    node: str
    gpu: int
    request_quota: float
    limit_quota: float
    width: float
    memory_bytes: int
    batch_size: int = 1
    draining: bool = False
    parked: bool = False
    grant: float | None = None


class FunctionStatus(msgspec.Struct, kw_only=True):
    """One function: ``spec`` (None: undeployed, its instances still draining), ``profile``,
    ``instances``, ``backlog`` (requests queued + in flight; None: no queue) and the horizontal
    scaler's ``state`` (its recent decisions; None: not reported)."""

    name: str
    spec: ev.FunctionSpec | None = None
    profile: ev.Profile | None = None
    instances: list[InstanceStatus] = []
    backlog: int | None = None
    state: ev.FunctionState | None = None


class NodeStatus(msgspec.Struct, kw_only=True):
    """A node's last inventory and its age (s since its agent published it)."""

    inventory: ev.NodeInventory
    age_s: float


class Status(msgspec.Struct, kw_only=True):
    """The cluster at ``taken_ns`` (Unix ns)."""

    nodes: list[NodeStatus] = []
    functions: list[FunctionStatus] = []
    taken_ns: int = 0


def _nc(target: NATS | AsyncClient) -> NATS:
    """The NATS connection of ``target`` (a connection or an AsyncClient); it must belong to
    the running event loop."""
    return target.nc if isinstance(target, AsyncClient) else target


def _replicas(target: NATS | AsyncClient) -> int | None:
    """The replicas ``target`` was configured with (``--replicas``), None when unknown (a bare
    connection): resources are then created with one and existing ones not compared."""
    options = getattr(target, "options", None) if isinstance(target, AsyncClient) else None
    return options.replicas if options is not None else None


async def functions_bucket(js, *, replicas: int | None = None):
    """KV ``dilu-functions``, created with :data:`FUNCTIONS_KV_CONFIG` and ``replicas`` (None: one)
    if it does not exist; an existing one is used as it is, differing settings logged as warnings
    (:func:`~dilu.services.common.jsresources.ensure_kv`)."""
    kv, _found = await ensure_kv(js, FUNCTIONS_KV_CONFIG, replicas=replicas)
    return kv


async def publish_event(nc: NATS, subject: str, event: ev.Event) -> None:
    """Publish ``event`` with its CloudEvents headers, as the services' bus does."""
    data = encode(event)  # stamps ts_ns, which ce-time is made from
    await nc.publish(subject, data, headers=cloudevents.headers(event, CE_SOURCE))


async def _ask(nc: NATS, subject: str, request: ev.Event, reply_kind: type, *, who: str, timeout_s: float):
    """Request-reply with a service; every failure is a DeployError naming the service."""
    try:
        data = encode(request)  # stamps ts_ns, which ce-time is made from
        msg = await nc.request(subject, data, timeout=timeout_s, headers=cloudevents.headers(request, CE_SOURCE))
    except nats.errors.NoRespondersError:
        raise DeployError(f"no {who} answering on {subject} (is the {who} running?)") from None
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        raise DeployError(f"the {who} did not answer within {timeout_s:g} s") from None
    try:
        return decode(msg.data, reply_kind)
    except MalformedEvent as exc:
        raise DeployError(f"the {who} sent a malformed reply: {exc}") from None


async def placements(js, function: str | None = None) -> list[ev.Placement]:
    """Placements in KV ``dilu-placement`` (of ``function`` only, when given); undecodable
    entries are skipped."""
    out = []
    for raw in (await read_bucket(js, subjects.PLACEMENT_BUCKET)).values():
        try:
            p = msgspec.json.decode(raw, type=ev.Placement)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if function is None or p.function == function:
            out.append(p)
    return out


class _ReadyWatch:
    """The first InstanceReady of one function, or the first instance of it that failed to load
    (InstanceRetired with reason LOAD_FAILED or GAVE_UP: the deploy fails with its error).
    Subscribed before the deploy is announced."""

    def __init__(self, function: str) -> None:
        self.function = function
        self.ready: asyncio.Future[ReadyInstance] = asyncio.get_running_loop().create_future()
        self._subs = []

    async def start(self, nc: NATS) -> "_ReadyWatch":
        async def on_ready(msg) -> None:
            try:
                e = decode(msg.data, ev.InstanceReady)
            except MalformedEvent:
                return
            if e.function == self.function and not self.ready.done():
                self.ready.set_result(ReadyInstance(instance_id=e.instance_id, node=e.node, gpu=e.gpu,
                                                    cold_start_ms=e.cold_start_ms))

        async def on_retired(msg) -> None:
            try:
                e = decode(msg.data, ev.InstanceRetired)
            except MalformedEvent:
                return
            if e.function == self.function and e.reason in (ev.LOAD_FAILED, ev.GAVE_UP) and not self.ready.done():
                why = e.error or f"exit code {e.exit_code}"
                self.ready.set_exception(DeployError(
                    f"{self.function}: its instance on {e.node} could not start ({e.reason}): {why}"))

        self._subs = [await nc.subscribe(f"{subjects.PREFIX}.instance.ready.*", cb=on_ready),
                      await nc.subscribe(f"{subjects.PREFIX}.instance.retired.*", cb=on_retired)]
        await settle(nc)  # the server has both SUBs before the deploy can make an instance ready
        return self

    async def wait(self, timeout_s: float) -> ReadyInstance | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self.ready), timeout=max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return None

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        if self.ready.done() and not self.ready.cancelled():
            self.ready.exception()  # retrieved: a failure nobody awaited is not logged as lost


async def deploy(target: NATS | AsyncClient, loaded: LoadedSpec | ev.FunctionSpec, *, code_dir=None,
                 timeout_s: float = 150.0, wait_ready_s: float = 60.0,
                 on_step: Callable[[str], None] | None = None) -> DeployResult:
    """Deploy a function (or redeploy it with a new spec).

    In order: upload ``code_dir`` (default ``loaded.code_dir``) to ``dilu-code`` and set
    ``spec.code`` to its key; ask the scheduler whether an instance could be placed
    (``AdmitRequest``); have the profiler profile it (``ProfileRequest``; an operator profile in
    the spec is used as is); create the invocation queue and the function's consumer (not for
    training); store the spec in KV ``dilu-functions``; publish ``FunctionDeployed``; then, if
    an instance is due at once (initial scale or min instances >= 1, or training) and none runs
    yet, wait up to ``wait_ready_s`` seconds for it to be ready (still starting is no error).

    ``timeout_s`` bounds the profiling answer (seconds; admission gets at most
    :data:`ADMIT_TIMEOUT_S`). ``on_step(text)`` is told each step as it starts (for progress
    output). ``loaded`` is not modified. Raises :class:`DeployError` with the reason (failed
    profiling, a service not answering; its subclasses :class:`BadCode` for a code folder that
    cannot be bundled and :class:`NotAdmitted` for a refused admission). The stream, bucket
    and object store it creates get the replicas ``target`` connected with (an AsyncClient's
    ``options.replicas``; one for a bare connection); existing ones are used as they are.
    """
    step = on_step or (lambda _text: None)
    nc = _nc(target)
    js = nc.jetstream()
    replicas = _replicas(target)
    if isinstance(loaded, LoadedSpec):
        spec, folder = msgspec.structs.replace(loaded.spec), loaded.code_dir
    else:
        spec, folder = msgspec.structs.replace(loaded), None
    folder = code_dir if code_dir is not None else folder
    if folder is not None:
        step(f"uploading the code folder {folder}")
        try:
            spec.code = await bundle.upload(js, folder, replicas=replicas)
        except bundle.BundleError as exc:
            raise BadCode(str(exc)) from None
    step("asking the scheduler whether an instance can be placed")
    admit = await _ask(nc, subjects.SCHEDULER_ADMIT, ev.AdmitRequest(spec=spec), ev.AdmitReply, who="scheduler",
                       timeout_s=min(ADMIT_TIMEOUT_S, timeout_s))
    if not admit.ok:
        raise NotAdmitted(admit.error or f"{spec.name} cannot be placed: refused by the scheduler")
    step("profiling (operator profile)" if spec.profile else "profiling")
    prof = await _ask(nc, subjects.PROFILER_PROFILE, ev.ProfileRequest(spec=spec), ev.ProfileReply, who="profiler",
                      timeout_s=timeout_s)
    if not prof.ok or prof.profile is None:
        raise DeployError(f"profiling {spec.name} failed: {prof.error or 'no profile in the reply'}")
    if spec.kind != "training":
        await workqueue.ensure_stream(js, replicas=replicas)
        await workqueue.ensure_consumer(js, spec.name)
    running = [p for p in await placements(js, spec.name) if not p.draining]
    # the scaler's default initial scale (-1) is Knative's 1: an instance is due unless the spec says 0
    due = spec.kind == "training" or spec.initial_scale != 0 or spec.min_instances >= 1
    watch = await _ReadyWatch(spec.name).start(nc) if due and not running else None
    try:
        kv = await functions_bucket(js, replicas=replicas)
        await kv.put(subjects.token(spec.name), encode(spec))
        await publish_event(nc, subjects.function_deployed(spec.name), ev.FunctionDeployed(spec=spec))
        await settle(nc)
        started = time.monotonic()
        if watch:
            step(f"waiting up to {wait_ready_s:g} s for the first instance")
        ready = await watch.wait(wait_ready_s) if watch else None
        waited = time.monotonic() - started if watch else 0.0
    finally:
        if watch:
            await watch.stop()
    unplaceable = await _unplaceable(js, spec.name) if watch and ready is None else ""
    return DeployResult(spec=spec, profile=prof.profile, ready=ready, code=spec.code,
                        existing_instances=len(running), waited_s=round(waited, 3), unplaceable=unplaceable)


async def _unplaceable(js, name: str) -> str:
    """Why ``name``'s instances cannot be placed now, from the horizontal scaler's state in KV
    ``dilu-function-state`` (empty: placeable, or no state written)."""
    try:
        kv = await js.key_value(subjects.FUNCTION_STATE_BUCKET)
        state = msgspec.json.decode((await kv.get(subjects.token(name))).value, type=ev.FunctionState)
    except (nats.js.errors.NotFoundError, msgspec.DecodeError, msgspec.ValidationError, TypeError):
        return ""
    return (state.reason or "refused by the scheduler") if not state.placeable and state.ready == 0 else ""


async def undeploy(target: NATS | AsyncClient, name: str, *, wait_s: float = 30.0) -> UndeployResult:
    """Remove function ``name``: delete its key from ``dilu-functions`` and publish
    ``FunctionUndeployed`` (the scheduler drains its instances); answer the requests still queued
    for it with the error :data:`subjects.ERROR_UNDEPLOYED` (their callers get NotDeployed at once
    instead of waiting out their timeouts; the instances finish the batches they hold); wait up to
    ``wait_s`` seconds until no placement of it remains, then delete its consumer, answer every
    request still stored for it (come meanwhile, or held by an instance the drain's end stopped)
    and purge its queue (left in place while instances remain, as they still pull from it).
    Credentials without the right to answer (an operator's issued before it had it) only purge.

    Raises :class:`NotDeployed` when it is not deployed.
    """
    nc = _nc(target)
    js = nc.jetstream()
    key = subjects.token(name)
    try:
        kv = await js.key_value(subjects.FUNCTIONS_BUCKET)
        entry = await kv.get(key)
    except nats.js.errors.NotFoundError:  # no bucket, no key, or a deleted key
        raise NotDeployed(name) from None
    try:
        kind = decode_spec(entry.value).kind
    except (msgspec.DecodeError, msgspec.ValidationError):  # removed all the same
        kind = "inference"
    await kv.delete(key)
    await publish_event(nc, subjects.function_undeployed(name), ev.FunctionUndeployed(name=name))
    await settle(nc)
    answered = await _answer_queued(nc, js, name) if kind != "training" else 0
    deadline = time.monotonic() + wait_s
    while (remaining := len(await placements(js, name))) and time.monotonic() < deadline:
        await asyncio.sleep(min(UNDEPLOY_POLL_S, max(0.0, deadline - time.monotonic())))
    if remaining:
        return UndeployResult(name=name, kind=kind, remaining_instances=remaining, answered=answered)
    try:
        await js.delete_consumer(subjects.INVOKE_STREAM, workqueue.consumer_name(name))
    except nats.js.errors.NotFoundError:  # a training function has no queue
        pass
    # what came meanwhile, and what an instance held when the drain's end stopped it
    answered += await _answer_queued(nc, js, name, orphans=True) if kind != "training" else 0
    try:
        await js.purge_stream(subjects.INVOKE_STREAM, subject=subjects.invoke(name))
    except nats.js.errors.NotFoundError:  # no invocation stream at all
        pass
    return UndeployResult(name=name, kind=kind, cleaned=True, answered=answered)


async def _answer_queued(nc: NATS, js, name: str, orphans: bool = False) -> int:
    """:func:`workqueue.answer_queued` with the undeployed error; 0 where there is no queue or
    these credentials may not pull from it (the purge still removes the requests)."""
    try:
        return await workqueue.answer_queued(nc, js, name, subjects.ERROR_UNDEPLOYED, orphans=orphans)
    except workqueue.ConsumerMissing:
        return 0
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        log.warning("queued requests not answered", function=name, error=repr(exc))
        return 0


async def _grants(nc: NATS, instance_ids: set[str], listen_s: float) -> dict[str, float]:
    """Each instance's current quota from GpuTelemetry, listening up to ``listen_s`` seconds
    (less once every instance in ``instance_ids`` was heard)."""
    grants: dict[str, float] = {}
    if not instance_ids or listen_s <= 0:
        return grants
    all_heard = asyncio.Event()

    async def on_telemetry(msg) -> None:
        try:
            t = decode(msg.data, ev.GpuTelemetry)
        except MalformedEvent:
            return
        for inst in t.instances:
            grants[inst.instance_id] = inst.quota
        if instance_ids <= set(grants):
            all_heard.set()

    sub = await nc.subscribe(f"{subjects.PREFIX}.telemetry.gpu.>", cb=on_telemetry)
    try:
        await asyncio.wait_for(all_heard.wait(), timeout=listen_s)
    except asyncio.TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return grants


def _decoded(raw_by_key: dict[str, bytes], kind: type) -> list:
    out = []
    for raw in raw_by_key.values():
        try:
            out.append(msgspec.json.decode(raw, type=kind))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return out


async def status(target: NATS | AsyncClient, *, telemetry_s: float = TELEMETRY_S) -> Status:
    """The cluster as the platform records it: nodes (KV ``dilu-nodes``), functions (KV
    ``dilu-functions``) with their profile (``dilu-profiles``), instances (``dilu-placement``),
    current grants (``GpuTelemetry`` heard within ``telemetry_s`` seconds), backlog (consumer
    info) and the horizontal scaler's state (``dilu-function-state``; absent bucket: none).
    Functions whose key is gone but whose instances still drain are listed with ``spec`` None.
    """
    nc = _nc(target)
    js = nc.jetstream()
    now = time.time_ns()
    nodes = [NodeStatus(inventory=inv, age_s=max(0.0, (now - inv.ts_ns) / 1e9) if inv.ts_ns else 0.0)
             for inv, _rev in (await read_inventories(js)).values()]
    specs = {}
    for raw in (await read_bucket(js, subjects.FUNCTIONS_BUCKET)).values():
        try:
            s = decode_spec(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        specs[s.name] = s
    profiles = {p.function: p for p in _decoded(await read_bucket(js, subjects.PROFILES_BUCKET), ev.Profile)}
    states = {s.function: s for s in _decoded(await read_bucket(js, subjects.FUNCTION_STATE_BUCKET), ev.FunctionState)}
    placed = await placements(js)
    grants = await _grants(nc, {p.instance_id for p in placed}, telemetry_s)
    functions = []
    for name in sorted(set(specs) | {p.function for p in placed}):
        spec = specs.get(name)
        instances = [InstanceStatus(instance_id=p.instance_id, node=p.node, gpu=p.gpu, request_quota=p.request_quota,
                                    limit_quota=p.limit_quota, width=p.width, memory_bytes=p.memory_bytes,
                                    batch_size=p.batch_size, draining=p.draining, parked=p.parked,
                                    grant=grants.get(p.instance_id))
                     for p in sorted(placed, key=lambda p: (p.node, p.gpu, p.instance_id)) if p.function == name]
        backlog = None
        if spec is None or spec.kind != "training":
            try:
                backlog = await workqueue.backlog(js, name)
            except workqueue.ConsumerMissing:
                backlog = None
        functions.append(FunctionStatus(name=name, spec=spec, profile=profiles.get(name), instances=instances,
                                        backlog=backlog, state=states.get(name)))
    return Status(nodes=sorted(nodes, key=lambda n: n.inventory.node), functions=functions, taken_ns=now)
