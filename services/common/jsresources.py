"""JetStream streams, KV buckets and object stores: created with the configured replicas when
missing, bound to as they are when they exist (docs/operations.md, "Replicas and existing state").

Every creation site in Dilu goes through :func:`ensure_stream`, :func:`ensure_kv` or
:func:`ensure_object_store`. When the resource is missing it is created with ``replicas``
(``--replicas`` / ``DILU_REPLICAS``: 1 on a single server, 3 in the cluster configuration). When it
exists, created beforehand by an operator or an older Dilu with other settings, it is used as it is:
one warning per setting that differs from what Dilu would have created (:class:`Mismatch`), never a
failed start and never a silent reset of data or limits. A concurrent creator (another service
creating the same resource at the same moment) is bound to the same way.

Only the settings Dilu relies on are compared (:data:`STREAM_SETTINGS`): replicas, subjects,
retention, history (max messages per subject), max age, storage, discard policy, max bytes and
max message size; a setting the caller leaves unset (None) is not compared. ``replicas=None``
means "no opinion": create with one replica, do not compare (for processes, such as instances,
that do not know the deployment's replica count).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import tenacity
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, ObjectStoreConfig, StorageType, StreamConfig, StreamInfo
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from dilu.contracts import subjects

from . import logging as dlog

# JetStream API errors a retry mends: no answer (the request was lost with a connection that
# died, or the server is restarting), no responders or no stream leader yet (JetStream is still
# restoring its streams after a restart), JetStream not ready.
TRANSIENT_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
                    nats.js.errors.ServiceUnavailableError)
# How long a process setting up its JetStream resources rides out a NATS outage (a nats-server
# restart takes about 2 s here, a cluster's leader election a few more) before giving up.
OUTAGE_BUDGET_S = 60.0
T = TypeVar("T")


async def ride_out(call: Callable[[], Awaitable[T]], budget_s: float = OUTAGE_BUDGET_S) -> T:
    """``await call()``, retried on :data:`TRANSIENT_ERRORS` (exponential back-off from 50 ms to
    1 s) for up to ``budget_s`` seconds; raises the last error after that, any other at once."""
    retrying = tenacity.AsyncRetrying(retry=tenacity.retry_if_exception_type(TRANSIENT_ERRORS),
                                      stop=tenacity.stop_after_delay(budget_s),
                                      wait=tenacity.wait_exponential(multiplier=0.05, max=1.0), reraise=True)
    async for attempt in retrying:
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity reraises")  # for type checkers


# stream setting -> how the operator knows it (log field); the settings Dilu relies on
STREAM_SETTINGS: dict[str, str] = {
    "num_replicas": "replicas",
    "subjects": "subjects",
    "retention": "retention",
    "max_msgs_per_subject": "history",
    "max_age": "max_age_s",
    "storage": "storage",
    "discard": "discard",
    "max_bytes": "max_bytes",
    "max_msg_size": "max_msg_size",
}
_LIMITS = {"max_msgs_per_subject", "max_age", "max_bytes", "max_msg_size"}  # <= 0 or None: unlimited
_ERR_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"

_log = dlog.get("jsresources")


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One setting of an existing stream (``stream``: its JetStream name, e.g. ``KV_dilu-nodes``)
    that differs from what Dilu would create. ``setting``: the name in :data:`STREAM_SETTINGS`'s
    values (``replicas``, ``history``, ``max_age_s`` ...); ``wanted`` / ``found``: normalised values
    (None = unlimited; enums as their string value; subjects as a sorted list)."""

    stream: str
    setting: str
    wanted: Any
    found: Any


def _norm(field: str, value: Any) -> Any:
    if field in _LIMITS:
        if value is None or value <= 0:
            return None
        return round(float(value), 3) if field == "max_age" else int(value)
    if field == "subjects":
        return sorted(value or [])
    return getattr(value, "value", value)


def mismatches(wanted: StreamConfig, found: StreamConfig) -> list[Mismatch]:
    """The settings of :data:`STREAM_SETTINGS` that ``wanted`` sets (not None) and ``found`` has
    otherwise. Pure."""
    out = []
    for field, label in STREAM_SETTINGS.items():
        want = getattr(wanted, field, None)
        if want is None:
            continue
        w, f = _norm(field, want), _norm(field, getattr(found, field, None))
        if w != f:
            out.append(Mismatch(stream=str(wanted.name), setting=label, wanted=w, found=f))
    return out


def _warn(found: list[Mismatch], log) -> None:
    log = log or _log
    for m in found:
        log.warning("existing JetStream resource differs from Dilu's settings; using it as it is",
                    stream=m.stream, setting=m.setting, wanted=m.wanted, found=m.found)


def _with_replicas(config: StreamConfig, replicas: int | None) -> StreamConfig:
    return config.evolve(num_replicas=replicas)


async def _bind(js: JetStreamContext, wanted: StreamConfig, log) -> tuple[StreamInfo, list[Mismatch]]:
    info = await js.stream_info(str(wanted.name))
    found = mismatches(wanted, info.config)
    _warn(found, log)
    return info, found


async def ensure_stream(
    js: JetStreamContext, config: StreamConfig, *, replicas: int | None, log=None
) -> tuple[StreamInfo, list[Mismatch]]:
    """The stream ``config.name``: created from ``config`` with ``replicas`` when missing, else
    bound to as it is, with one warning on ``log`` per differing setting.

    Returns its StreamInfo and the mismatches found (empty when created or identical). Raises
    what nats-py raises for anything other than "exists" (no JetStream, no permission, a
    replica count the cluster cannot place: ``nats.js.errors.APIError``).
    """
    wanted = _with_replicas(config, replicas)
    try:
        return await _bind(js, wanted, log)
    except nats.js.errors.NotFoundError:
        pass
    create = wanted if replicas is not None else wanted.evolve(num_replicas=1)
    try:
        return await js.add_stream(create), []
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _ERR_STREAM_NAME_IN_USE:
            raise
    return await _bind(js, wanted, log)  # a concurrent creator with other settings won


def kv_stream_config(config: KeyValueConfig) -> StreamConfig:
    """The stream settings that a KV bucket created from ``config`` has (nats-py's layout:
    stream ``KV_<bucket>``), for comparing with an existing bucket: no ttl is "keep for ever" and
    no storage is the server's default, file. Pure."""
    return StreamConfig(
        name=f"KV_{config.bucket}", subjects=[f"$KV.{config.bucket}.>"],
        max_msgs_per_subject=config.history, max_age=config.ttl or 0, max_bytes=config.max_bytes,
        max_msg_size=config.max_value_size, storage=config.storage or StorageType.FILE,
        discard=DiscardPolicy.NEW, num_replicas=config.replicas,
    )


async def ensure_kv(
    js: JetStreamContext, config: KeyValueConfig, *, replicas: int | None, log=None
) -> tuple[KeyValue, list[Mismatch]]:
    """The KV bucket ``config.bucket``: created from ``config`` with ``replicas`` when missing,
    else bound to as it is (one warning per differing setting: replicas, history, ttl, ...).

    Returns the KeyValue handle and the mismatches. Raises what nats-py raises for anything other
    than "exists".
    """
    wanted = config.evolve(replicas=replicas if replicas is not None else 1)
    compare = kv_stream_config(wanted)
    if replicas is None:
        compare = compare.evolve(num_replicas=None)
    try:
        kv = await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_key_value(wanted), []
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _ERR_STREAM_NAME_IN_USE:
                raise
        kv = await js.key_value(config.bucket)  # a concurrent creator with other settings won
    _info, found = await _bind(js, compare, log)
    return kv, found


async def ensure_object_store(
    js: JetStreamContext, config: ObjectStoreConfig, *, replicas: int | None, log=None
) -> tuple[ObjectStore, list[Mismatch]]:
    """The object store ``config.bucket``: created from ``config`` with ``replicas`` when missing,
    else bound to as it is (one warning per differing setting: replicas, max age, max bytes,
    storage). Returns the ObjectStore handle and the mismatches. Raises what nats-py raises for
    anything other than "exists"."""
    bucket = str(config.bucket)
    wanted = config.evolve(replicas=replicas if replicas is not None else 1)
    compare = StreamConfig(
        name=f"OBJ_{bucket}", subjects=[f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"], max_age=config.ttl or 0,
        max_bytes=config.max_bytes, storage=config.storage or StorageType.FILE, discard=DiscardPolicy.NEW,
        num_replicas=replicas,
    )
    try:
        store = await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_object_store(bucket, wanted), []
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _ERR_STREAM_NAME_IN_USE:
                raise
        store = await js.object_store(bucket)
    _info, found = await _bind(js, compare, log)
    return store, found


# Buckets that several services create (whichever starts first): one definition each.
# history 5: a placement or a profile keeps its last few versions for ``dilu status`` and debugging.
PLACEMENT_KV_CONFIG = KeyValueConfig(bucket=subjects.PLACEMENT_BUCKET, history=5)
PROFILES_KV_CONFIG = KeyValueConfig(bucket=subjects.PROFILES_BUCKET, history=5)
