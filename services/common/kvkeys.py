"""Listing the keys of a JetStream KV bucket from the stream's own state."""
from __future__ import annotations


async def kv_keys(js, bucket: str) -> list[str]:
    """Keys of KV ``bucket`` with at least one message, read from the bucket stream's per-subject
    state (``STREAM.INFO`` with a subjects filter). nats-py's ``KeyValue.keys()`` lists through an
    ordered watcher that now and then signals the end before the entries and returns a short
    list; a state rebuilt from a short list silently forgets placements. Deleted keys are listed
    too (their delete marker is a message): callers ``get`` each key and skip
    ``KeyNotFoundError`` and ``KeyDeletedError`` (in nats-py neither is the other's subclass).
    Raises ``nats.js.errors.NotFoundError`` for a missing bucket."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(s[len(prefix):] for s in (info.state.subjects or {}))
