"""Least privilege on the bus: who may publish and subscribe to what (pure, no I/O).

Each role (:data:`ROLES`) gets publish and subscribe allow lists built from
:mod:`dilu.contracts.subjects` (event patterns come from ``SUBJECT_EVENTS``, so no subject is
typed twice) plus the JetStream API subjects its client library calls need, per stream:

- ``$JS.API.STREAM.INFO.<stream>`` and, where the role may create it, ``STREAM.CREATE``;
- ``$JS.API.CONSUMER.*`` on that stream (KV watches and key listings are ordered consumers);
- ``$JS.API.DIRECT.GET.<stream>`` / ``STREAM.MSG.GET`` (KV gets) and ``$JS.FC.<stream>.>``
  (flow control of ordered consumers);
- ``$KV.<bucket>.<key>`` puts only where the role writes, ``$O.dilu-code.>`` for the code store,
  ``$JS.ACK.<stream>.>`` where it acknowledges.

Replies: every role but the integrator has its own reply inbox prefix (:func:`inbox_prefix`,
nats-py's ``inbox_prefix`` connect option, ``DILU_NATS_INBOX_PREFIX``), ``_INBOX_<role>`` or
``_INBOX_<role>_<node>``, and may subscribe only under it, so no role reads another's replies;
instances keep nats-py's default ``_INBOX`` (their agent's environment is not theirs).
Responders (scheduler, profiler, node agent) get ``allow_responses``.

Node-scoped roles (:data:`NODE_SCOPED`) get one user per node. Callers may also have a user
each (named callers, ``_INBOX_caller-<name>``), so that no caller reads another's replies; the
instances' permissions then list those callers' inboxes. :func:`render_authorization`
writes the nats-server ``authorization`` block for users given by public nkey.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from dilu.contracts import events as ev
from dilu.contracts import subjects as sj

ROLES = ("node-agent", "vertical-scaler", "scheduler", "profiler", "horizontal-scaler", "gateway", "instance",
         "caller", "operator", "integrator")
NODE_SCOPED = ("node-agent", "vertical-scaler")
# the service packages the local cluster starts -> the role each connects as
SERVICE_ROLES = {"node_agent": "node-agent", "vertical_scaler": "vertical-scaler", "scheduler": "scheduler",
                 "profiler": "profiler", "horizontal_scaler": "horizontal-scaler", "gateway": "gateway"}

DEFAULT_INBOX = "_INBOX"  # nats-py's default inbox prefix (the instances')
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
JS_FC = "$JS.FC"
KV_PREFIX = "$KV"
OBJ_PREFIX = "$O"


class RoleError(ValueError):
    """An unknown role, or a node-scoped role without its node (one-line message)."""


def kv_stream(bucket: str) -> str:
    """The JetStream stream behind KV ``bucket``."""
    return f"KV_{bucket}"


def obj_stream(bucket: str) -> str:
    """The JetStream stream behind object store ``bucket``."""
    return f"OBJ_{bucket}"


def pattern(event: type[ev.Event], *ids: str) -> str:
    """The subject pattern carrying ``event`` (its ``SUBJECT_EVENTS`` key), its first ``*``
    tokens replaced by ``ids`` (sanitised with :func:`subjects.token`). Raises KeyError for an
    event no subject carries, ValueError for more ids than wildcards."""
    matches = [k for k, v in sj.SUBJECT_EVENTS.items() if v is event]
    if len(matches) != 1:
        raise KeyError(f"{event.__name__} is carried by {len(matches)} subject patterns, not one")
    parts = matches[0].split(".")
    stars = [i for i, p in enumerate(parts) if p == "*"]
    if len(ids) > len(stars):
        raise ValueError(f"{matches[0]} has {len(stars)} wildcards, got {len(ids)} ids")
    for i, ident in zip(stars, ids):
        parts[i] = sj.token(ident)
    return ".".join(parts)


def instance_pattern(state: str, node: str = "*") -> str:
    """Subjects of instance ``state`` events (launched, ready, retired, parked) of ``node`` (``*``: all)."""
    event = {"launched": ev.InstanceLaunched, "ready": ev.InstanceReady, "retired": ev.InstanceRetired,
             "parked": ev.InstanceParked}[state]
    return pattern(event) if node == "*" else pattern(event, node)


def inbox_prefix(role: str, node: str | None = None, *, caller: str | None = None) -> str:
    """The reply inbox prefix of ``role`` (of ``node`` for a node-scoped role; of the named
    caller ``caller``, whose replies no other caller reads). Raises RoleError."""
    _check(role, node)
    if role == "instance":
        return DEFAULT_INBOX
    if caller is not None:
        if role != "caller":
            raise RoleError(f"only the caller role has named users, not {role}")
        return f"_INBOX_caller-{sj.token(caller)}"
    return f"_INBOX_{role}" + (f"_{sj.token(node)}" if role in NODE_SCOPED else "")


def _check(role: str, node: str | None) -> None:
    if role not in ROLES:
        raise RoleError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    if role in NODE_SCOPED and not node:
        raise RoleError(f"role {role} is per node: name the node")


# --- JetStream access, per stream -----------------------------------------------------------

def _read(stream: str) -> list[str]:
    """Read a stream: info, consumers (watches, listings, pulls), direct and message gets, flow control."""
    return [f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.CONSUMER.CREATE.{stream}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.>", f"{JS_API}.CONSUMER.INFO.{stream}.*",
            f"{JS_API}.CONSUMER.DELETE.{stream}.*", f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
            f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>", f"{JS_API}.STREAM.MSG.GET.{stream}",
            f"{JS_FC}.{stream}.>"]


def _create(stream: str) -> list[str]:
    """Create a stream that is missing (services start in any order and create what they use)."""
    return [f"{JS_API}.STREAM.CREATE.{stream}"]


def kv_read(bucket: str, *, create: bool = False) -> list[str]:
    """Publish rights to read (and, with ``create``, create) KV ``bucket``."""
    return _read(kv_stream(bucket)) + (_create(kv_stream(bucket)) if create else [])


def kv_write(bucket: str, key: str = ">", *, create: bool = True) -> list[str]:
    """Publish rights to read KV ``bucket`` and put/delete ``key`` (``>``: every key)."""
    k = key if key == ">" else sj.token(key)
    return kv_read(bucket, create=create) + [f"{KV_PREFIX}.{bucket}.{k}"]


def invoke_queue(access: str) -> list[str]:
    """Publish rights on the invocation work queue (stream DILU_INVOKE) for ``access``:
    ``publish`` (callers: the stream's info; the invocations themselves are ``dilu.v1.invoke.>``),
    ``watch`` (the horizontal scaler: consumers' backlog), ``pull`` (instances: fetch and
    acknowledge through the functions' durable consumers, creating a missing one) or ``manage``
    (the operator: create, delete, purge, and pull and acknowledge, to answer the requests of a
    function it undeploys). Never a consumer deletion for anyone but the operator."""
    api, stream = JS_API, sj.INVOKE_STREAM
    rights = [f"{api}.STREAM.INFO.{stream}"]
    if access in ("watch", "pull", "manage"):
        rights += [f"{api}.CONSUMER.INFO.{stream}.*", f"{api}.CONSUMER.LIST.{stream}", f"{api}.CONSUMER.NAMES.{stream}"]
    if access in ("pull", "manage"):
        rights += [f"{api}.STREAM.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
                   f"{api}.CONSUMER.DURABLE.CREATE.{stream}.*"]
    if access in ("pull", "manage"):
        rights += [f"{api}.CONSUMER.MSG.NEXT.{stream}.*", f"{JS_ACK}.{stream}.>"]
    if access == "manage":
        rights += [f"{api}.CONSUMER.DELETE.{stream}.*", f"{api}.STREAM.PURGE.{stream}"]
    return rights


# --- the roles ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Permissions:
    """One user's rights: subjects it may publish to and subscribe to (allow lists; an empty
    publish list denies every publish), whether it may answer requests (``allow_responses``) and
    the inbox prefix its connection must use."""

    role: str
    node: str | None
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool
    inbox_prefix: str | None
    caller: str | None = None


def permissions(role: str, node: str | None = None, *, caller: str | None = None,
                callers: tuple[str, ...] = ()) -> Permissions:
    """The permissions of ``role`` (of ``node`` for a node-scoped role; ``caller``: a named
    caller's own user, with its own inbox). ``callers``: the named callers instances (and the
    operator's undeploy) may answer (the instance and operator roles only). Raises RoleError."""
    _check(role, node)
    p = sj.PREFIX
    pub: list[str] = []
    sub: list[str] = []
    responds = False
    reply_roles = ("caller", "gateway", "operator")  # whose invocations instances answer
    # the inboxes of every invocation's caller: instances answer there, and so does the operator's
    # undeploy for requests still queued (it may deploy code that answers anyone, so it gains no trust)
    answers = [f"{inbox_prefix(r)}.>" for r in reply_roles] + [f"{inbox_prefix('caller', caller=c)}.>" for c in callers]
    if role == "node-agent":
        pub += [pattern(ev.GpuTelemetry, node), pattern(ev.KernelCycleStretch, node),
                *(instance_pattern(s, node) for s in ("launched", "ready", "retired", "parked")),
                sj.node_inventory(node)]
        pub += kv_write(sj.NODES_BUCKET, node) + kv_read(sj.PLACEMENT_BUCKET, create=True)
        pub += kv_read(sj.FUNCTIONS_BUCKET)
        sub += [pattern(ev.TokenGrant, node), sj.node_trial(node), pattern(ev.FunctionStats)]
        responds = True
    elif role == "vertical-scaler":
        pub += [pattern(ev.TokenGrant, node)]
        sub += [pattern(ev.KernelCycleStretch, node), pattern(ev.GpuTelemetry, node),
                instance_pattern("retired", node), instance_pattern("parked", node)]
    elif role == "scheduler":
        pub += [pattern(ev.PlacementDecided)]
        pub += kv_write(sj.PLACEMENT_BUCKET) + kv_read(sj.PROFILES_BUCKET, create=True)
        pub += kv_read(sj.NODES_BUCKET, create=True) + kv_read(sj.FUNCTIONS_BUCKET)
        sub += [pattern(ev.FunctionDeployed), pattern(ev.FunctionUndeployed), pattern(ev.ProfileReady),
                instance_pattern("ready"), instance_pattern("retired"),
                sj.SCHEDULER_PLACE, sj.SCHEDULER_RETIRE, sj.SCHEDULER_ADMIT, sj.SCHEDULER_PARK]
        responds = True
    elif role == "profiler":
        pub += [pattern(ev.ProfileReady), pattern(ev.TrialRequest)]
        pub += kv_write(sj.PROFILES_BUCKET) + kv_read(sj.NODES_BUCKET)  # nodes: where to run trials
        sub += [pattern(ev.FunctionDeployed), sj.PROFILER_PROFILE]
        responds = True
    elif role == "horizontal-scaler":
        pub += [pattern(ev.ScaleDecision), pattern(ev.BurstWindowBreach), sj.SCHEDULER_PLACE, sj.SCHEDULER_RETIRE,
                sj.SCHEDULER_PARK]
        pub += kv_write(sj.FUNCTION_STATE_BUCKET)
        pub += kv_read(sj.FUNCTIONS_BUCKET) + kv_read(sj.PROFILES_BUCKET) + kv_read(sj.PLACEMENT_BUCKET)
        pub += invoke_queue("watch")
        sub += [pattern(ev.FunctionDeployed), pattern(ev.FunctionUndeployed), pattern(ev.ProfileReady),
                *(instance_pattern(s) for s in ("launched", "ready", "retired")), pattern(ev.GpuTelemetry),
                pattern(ev.PlacementDecided),
                sj.INVOKE_SUBJECTS]  # a parked function's requests wake it (as Knative's activator)
    elif role in ("gateway", "caller"):
        pub += [sj.INVOKE_SUBJECTS, sj.CANCEL_SUBJECTS] + invoke_queue("publish")  # cancel: withdraw a call
        pub += kv_read(sj.FUNCTIONS_BUCKET) + kv_read(sj.FUNCTION_STATE_BUCKET)
        if role == "gateway":
            sub += [pattern(ev.FunctionDeployed), pattern(ev.FunctionUndeployed)]
    elif role == "instance":
        pub += answers
        pub += [pattern(ev.FunctionStats)] + invoke_queue("pull")
        # the code store's chunks are read by a subscription that looks its stream up by subject
        pub += kv_read(sj.FUNCTIONS_BUCKET) + _read(obj_stream(sj.CODE_BUCKET)) + [f"{JS_API}.STREAM.NAMES"]
        sub += [sj.CANCEL_SUBJECTS]  # callers withdrawing requests
    elif role == "operator":
        pub += [pattern(ev.FunctionDeployed), pattern(ev.FunctionUndeployed),
                sj.SCHEDULER_ADMIT, sj.PROFILER_PROFILE, sj.INVOKE_SUBJECTS, sj.CANCEL_SUBJECTS]
        pub += kv_write(sj.FUNCTIONS_BUCKET) + kv_read(sj.FUNCTION_STATE_BUCKET, create=True)
        pub += kv_read(sj.PLACEMENT_BUCKET) + kv_read(sj.PROFILES_BUCKET) + kv_read(sj.NODES_BUCKET)
        code = obj_stream(sj.CODE_BUCKET)
        pub += _read(code) + _create(code) + [f"{OBJ_PREFIX}.{sj.CODE_BUCKET}.>", f"{JS_API}.STREAM.PURGE.{code}"]
        pub += invoke_queue("manage") + [f"{JS_API}.STREAM.NAMES"] + answers
        sub += [instance_pattern("ready"), instance_pattern("retired"), f"{p}.telemetry.gpu.>"]
    elif role == "integrator":
        sub += list(sj.SUBJECT_EVENTS)
    if role != "integrator":
        sub.append(f"{inbox_prefix(role, node, caller=caller)}.>")
        pub.append(f"{JS_API}.INFO")
    return Permissions(role=role, node=node, publish=tuple(dict.fromkeys(pub)), subscribe=tuple(dict.fromkeys(sub)),
                       allow_responses=responds,
                       inbox_prefix=None if role == "integrator" else inbox_prefix(role, node, caller=caller),
                       caller=caller)


def _user_block(nkey: str, perms: Permissions) -> str:
    publish = {"allow": list(perms.publish)} if perms.publish else {"deny": [">"]}
    body = {"publish": publish, "subscribe": {"allow": list(perms.subscribe)}}
    if perms.allow_responses:
        body["allow_responses"] = True
    who = perms.role + (f" of node {perms.node}" if perms.node else "") + (f" {perms.caller}" if perms.caller else "")
    return f"    # {who}\n    {{nkey: {json.dumps(nkey)}, permissions: {json.dumps(body, indent=None)}}}"


def render_authorization(users: list[tuple[str, Permissions]]) -> str:
    """The nats-server ``authorization { users = [...] }`` block for ``users`` given as
    (public user nkey ``U...``, permissions). JSON values are valid nats-server configuration.
    Raises ValueError for a key that is not a public user nkey."""
    for nkey, _ in users:
        if not (nkey.startswith("U") and len(nkey) == 56):
            raise ValueError(f"{nkey[:8]}... is not a public user nkey (U..., 56 characters)")
    lines = ",\n".join(_user_block(k, p) for k, p in users)
    return f"authorization {{\n  users = [\n{lines}\n  ]\n}}\n"
