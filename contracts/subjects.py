"""NATS subjects: ``dilu.v1.<domain>.<event>[.<ids>]`` (DESIGN.md section 5).

Identifiers come last and are sanitised with :func:`token` (no dots, spaces or wildcards), so a
function called ``a.b`` can never widen a subscription. Each subject carries one event type
(:data:`SUBJECT_EVENTS`), JSON-encoded, except ``dilu.v1.invoke.<fn>`` which carries the caller's
opaque payload on the JetStream work queue :data:`INVOKE_STREAM`.
"""
from __future__ import annotations

import re

from . import events as ev

PREFIX = "dilu.v1"
_BAD = re.compile(r"[^A-Za-z0-9_\-]")


def token(ident: str | int) -> str:
    """Sanitise an identifier into one subject token: every char outside ``[A-Za-z0-9_-]`` -> ``_``.

    Raises ValueError for an empty identifier (it would make an invalid subject).
    """
    s = str(ident)
    if not s:
        raise ValueError("empty identifier in a subject")
    return _BAD.sub("_", s)


def function_deployed(fn: str) -> str:
    return f"{PREFIX}.function.deployed.{token(fn)}"


def function_undeployed(fn: str) -> str:
    return f"{PREFIX}.function.undeployed.{token(fn)}"


def function_stats(fn: str, instance: str) -> str:
    """An instance's :class:`~dilu.contracts.events.FunctionStats` (request counters, ~1 s)."""
    return f"{PREFIX}.telemetry.function.{token(fn)}.{token(instance)}"


def profile_ready(fn: str) -> str:
    return f"{PREFIX}.profile.ready.{token(fn)}"


def placement_decided(fn: str) -> str:
    return f"{PREFIX}.placement.decided.{token(fn)}"


def instance_state(state: str, node: str) -> str:
    """``state`` is one of launched, ready, retired, parked."""
    return f"{PREFIX}.instance.{token(state)}.{token(node)}"


def telemetry_gpu(node: str, gpu: int | str) -> str:
    return f"{PREFIX}.telemetry.gpu.{token(node)}.{token(gpu)}"


def kernel_cycle_stretch(node: str, gpu: int | str) -> str:
    return f"{PREFIX}.event.kernel_cycle_stretch.{token(node)}.{token(gpu)}"


def grant_issued(node: str, gpu: int | str) -> str:
    return f"{PREFIX}.grant.issued.{token(node)}.{token(gpu)}"


def burst_window_breach(fn: str) -> str:
    return f"{PREFIX}.event.burst_window_breach.{token(fn)}"


def scale_decided(fn: str) -> str:
    return f"{PREFIX}.scale.decided.{token(fn)}"


def invoke(fn: str) -> str:
    """Data plane: invocation requests for ``fn`` (JetStream work queue)."""
    return f"{PREFIX}.invoke.{token(fn)}"


def cancel(fn: str) -> str:
    """Data plane: a caller gave up on one of its ``fn`` requests (cancelled, timed out, or its
    client closed). The payload is that call's ``Dilu-Reply-To``: unique to the call and known
    only to its caller and the instances (a request id is the caller's own and may repeat). Core
    NATS, best effort: the instances of ``fn`` running then skip the request if it is still queued
    and stop streaming to it if it runs; one started later does not hear of it, and the request's
    ``Dilu-Deadline-Ns`` still ends it there."""
    return f"{PREFIX}.cancel.{token(fn)}"


CANCEL_SUBJECTS = f"{PREFIX}.cancel.>"


def node_inventory(node: str) -> str:
    """A node agent's :class:`~dilu.contracts.events.NodeInventory` (also kept in KV ``dilu-nodes``)."""
    return f"{PREFIX}.node.inventory.{token(node)}"


def node_trial(node: str) -> str:
    """Request-reply: a profiling trial on ``node``'s emulated GPUs."""
    return f"{PREFIX}.node.trial.{token(node)}"


SCHEDULER_PLACE = f"{PREFIX}.scheduler.place"
SCHEDULER_RETIRE = f"{PREFIX}.scheduler.retire"
SCHEDULER_ADMIT = f"{PREFIX}.scheduler.admit"
SCHEDULER_PARK = f"{PREFIX}.scheduler.park"
PROFILER_PROFILE = f"{PREFIX}.profiler.profile"

# JetStream resources.
INVOKE_STREAM = "DILU_INVOKE"
INVOKE_SUBJECTS = f"{PREFIX}.invoke.>"
PROFILES_BUCKET = "dilu-profiles"
PLACEMENT_BUCKET = "dilu-placement"
FUNCTIONS_BUCKET = "dilu-functions"
NODES_BUCKET = "dilu-nodes"  # key = node token, value = NodeInventory JSON
FUNCTION_STATE_BUCKET = "dilu-function-state"  # key = function token, value = FunctionState JSON
CODE_BUCKET = "dilu-code"  # object store: function code bundles (zip), name = FunctionSpec.code

# Node liveness: an agent re-puts its inventory every NODE_HEARTBEAT_S; the scheduler treats a node
# whose inventory is older than NODE_TTL_S as gone (three missed heartbeats) and places its
# instances again. The bucket's own TTL drops entries of nodes that never come back.
NODE_HEARTBEAT_S = 5.0
NODE_TTL_S = 15.0

# Headers of the data plane (request and reply).
H_REQUEST_ID = "Dilu-Request-Id"
H_SCHEDULED_NS = "Dilu-Scheduled-Ns"  # the request's intended send time, Unix epoch ns
H_REPLY_TO = "Dilu-Reply-To"  # the caller's inbox (msg.reply is JetStream's ack subject)
# request: when its caller stops waiting (its timeout), Unix epoch ns; an instance that takes it
# later skips it unanswered (no one would read the reply). Absent or 0: no deadline.
H_DEADLINE_NS = "Dilu-Deadline-Ns"
H_STATUS = "Dilu-Status"  # reply: ok | error
H_ERROR = "Dilu-Error"
H_COLD_START = "Dilu-Cold-Start"  # reply: "1" when the request waited for an instance launch
H_INSTANCE = "Dilu-Instance"
H_ENQUEUED_NS = "Dilu-Enqueued-Ns"  # reply: when JetStream stored the request, Unix epoch ns
# reply: the serving instance's own times, Unix epoch ns: its batch began (the handler was called)
# and it published this reply; and how many requests that batch held. With the caller's send and
# arrival times they split a latency into the platform's path in and out, the wait in the queue
# and the batch's service (``requests.jsonl`` of ``dilu demo/compare --log-dir``, from which ``dilu
# calibrate`` measures the overheads ``dilu sim --overheads`` replays).
H_STARTED_NS = "Dilu-Started-Ns"
H_REPLIED_NS = "Dilu-Replied-Ns"
H_BATCH = "Dilu-Batch"
# Streamed replies (``llm`` functions): zero or more messages with H_STATUS = STATUS_CHUNK, each
# one output chunk (a token's text) numbered from 0 in H_CHUNK, then the final reply (ok/error)
# whose payload is the whole output and whose H_CHUNK holds the number of chunks sent.
H_CHUNK = "Dilu-Chunk"
STATUS_CHUNK = "chunk"
# The error reply (H_ERROR) of a request its function was undeployed before answering (queued, or
# held by an instance the drain stopped): ``dilu undeploy`` answers each so its caller learns then,
# not at its timeout; the client library raises NotDeployed for it (the gateway: 404 not-deployed).
ERROR_UNDEPLOYED = "function undeployed before the request was answered"

# subject pattern (with '*' for ids) -> the one event type it carries
SUBJECT_EVENTS: dict[str, type[ev.Event]] = {
    f"{PREFIX}.function.deployed.*": ev.FunctionDeployed,
    f"{PREFIX}.function.undeployed.*": ev.FunctionUndeployed,
    f"{PREFIX}.telemetry.function.*.*": ev.FunctionStats,
    f"{PREFIX}.profile.ready.*": ev.ProfileReady,
    f"{PREFIX}.placement.decided.*": ev.PlacementDecided,
    f"{PREFIX}.instance.launched.*": ev.InstanceLaunched,
    f"{PREFIX}.instance.ready.*": ev.InstanceReady,
    f"{PREFIX}.instance.retired.*": ev.InstanceRetired,
    f"{PREFIX}.instance.parked.*": ev.InstanceParked,
    f"{PREFIX}.telemetry.gpu.*.*": ev.GpuTelemetry,
    f"{PREFIX}.event.kernel_cycle_stretch.*.*": ev.KernelCycleStretch,
    f"{PREFIX}.grant.issued.*.*": ev.TokenGrant,
    f"{PREFIX}.event.burst_window_breach.*": ev.BurstWindowBreach,
    f"{PREFIX}.scale.decided.*": ev.ScaleDecision,
    f"{PREFIX}.node.trial.*": ev.TrialRequest,
    f"{PREFIX}.node.inventory.*": ev.NodeInventory,
    SCHEDULER_PLACE: ev.PlaceRequest,
    SCHEDULER_RETIRE: ev.RetireRequest,
    SCHEDULER_ADMIT: ev.AdmitRequest,
    SCHEDULER_PARK: ev.ParkRequest,
    PROFILER_PROFILE: ev.ProfileRequest,
}
