"""The ``dilu-nodes`` KV bucket: where node agents keep their NodeInventory (DESIGN.md section 4.0).

One definition of the bucket (its TTL drops the entry of a node that stopped heartbeating long
ago), and reading it: :func:`read_inventories` returns every node's latest inventory. Liveness
itself (is this entry fresh?) is the scheduler's policy (``stale_nodes``), on its own clock.
"""
from __future__ import annotations

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from dilu.contracts import subjects
from dilu.contracts.events import NodeInventory

from .jsresources import ensure_kv
from .kvkeys import kv_keys

# history 1: only the latest inventory matters; ttl: 4 x the liveness TTL, so an entry outlives
# the scheduler's staleness decision but a node gone for good is dropped from the bucket.
NODES_KV_CONFIG = KeyValueConfig(bucket=subjects.NODES_BUCKET, history=1, ttl=subjects.NODE_TTL_S * 4)


async def nodes_bucket(js, *, replicas: int | None = None, log=None):
    """The ``dilu-nodes`` bucket, created with :data:`NODES_KV_CONFIG` and ``replicas`` (None: one)
    if it does not exist yet; an existing one is bound to as it is, each differing setting logged
    on ``log`` (:func:`~.jsresources.ensure_kv`). Creating it concurrently from several services is
    safe. Raises what nats-py raises when JetStream refuses it."""
    kv, _found = await ensure_kv(js, NODES_KV_CONFIG, replicas=replicas, log=log)
    return kv


async def read_inventories(js) -> dict[str, tuple[NodeInventory, int]]:
    """Every node's latest inventory and its KV revision, by node name. Entries that fail to decode
    are skipped (the caller counts nothing here: they are logged where they are watched).
    Returns an empty dict when the bucket does not exist yet."""
    try:
        kv = await js.key_value(subjects.NODES_BUCKET)
        keys = await kv_keys(js, subjects.NODES_BUCKET)
    except NotFoundError:  # BucketNotFoundError is one
        return {}
    out: dict[str, tuple[NodeInventory, int]] = {}
    for key in keys:
        try:
            entry = await kv.get(key)
            inv = msgspec.json.decode(entry.value, type=NodeInventory)
        except (KeyNotFoundError, KeyDeletedError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        out[inv.node] = (inv, entry.revision)
    return out


def trial_node(inventories: dict[str, NodeInventory]) -> str | None:
    """The node that runs profiling trials when none is named: the first, by name, of the nodes
    with a healthy GPU (trials measure on a GPU; a CPU node answers none). None when there is none.
    Pure: the caller reads the inventories (:func:`read_inventories`)."""
    for name in sorted(inventories):
        inv = inventories[name]
        if inv.device != "cpu" and any(g.healthy for g in inv.gpus):
            return name
    return None
