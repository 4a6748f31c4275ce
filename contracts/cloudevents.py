"""CloudEvents attributes of every event, as NATS headers (CloudEvents 1.0 NATS protocol binding,
binary content mode: the event's JSON is the message data, each attribute a ``ce-`` header).

Pure: the caller gives the event (its ``ts_ns`` already stamped by :func:`~dilu.contracts.codec.encode`),
the producer and, for a reproducible result, the id.
"""
from __future__ import annotations

import time
import uuid

from .events import Event
from .subjects import token

SPECVERSION = "1.0"
TYPE_PREFIX = "io.dilu.v1."  # ce-type = TYPE_PREFIX + the event class's name
CONTENT_TYPE = "application/json"

H_SPECVERSION = "ce-specversion"
H_TYPE = "ce-type"
H_SOURCE = "ce-source"
H_ID = "ce-id"
H_TIME = "ce-time"
H_CONTENT_TYPE = "content-type"
HEADERS = (H_SPECVERSION, H_TYPE, H_SOURCE, H_ID, H_TIME, H_CONTENT_TYPE)  # every one is always sent


def ce_type(kind: type[Event]) -> str:
    """``io.dilu.v1.<EventClass>``, e.g. ``io.dilu.v1.GpuTelemetry``: the one rule for ``ce-type``."""
    return TYPE_PREFIX + kind.__name__


def source(service: str, node: str = "") -> str:
    """``dilu/<service>[/<node>]`` (``ce-source``, a URI reference); names sanitised like subject
    tokens. Raises ValueError for an empty ``service``."""
    return f"dilu/{token(service)}/{token(node)}" if node else f"dilu/{token(service)}"


def rfc3339(ts_ns: int) -> str:
    """Unix epoch nanoseconds -> RFC 3339 UTC with nanoseconds (``2026-11-30T20:47:52.123456789Z``).
    Raises ValueError for a time before 1970 or after 9999."""
    if ts_ns < 0:
        raise ValueError(f"ts_ns {ts_ns} is before the Unix epoch")
    seconds, nanos = divmod(ts_ns, 1_000_000_000)
    if seconds >= 253402300800:  # 10000-01-01T00:00:00Z
        raise ValueError(f"ts_ns {ts_ns} is after year 9999")
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos:09d}Z"


def headers(event: Event, src: str, event_id: str = "") -> dict[str, str]:
    """The NATS headers of ``event`` from producer ``src`` (see :func:`source`): ``ce-specversion``,
    ``ce-type``, ``ce-source``, ``ce-id`` (``event_id``, else a new random UUID), ``ce-time`` (from
    ``event.ts_ns``) and ``content-type``. Raises ValueError for a ``ts_ns`` :func:`rfc3339` rejects."""
    return {
        H_SPECVERSION: SPECVERSION,
        H_TYPE: ce_type(type(event)),
        H_SOURCE: src,
        H_ID: event_id or str(uuid.uuid4()),
        H_TIME: rfc3339(event.ts_ns),
        H_CONTENT_TYPE: CONTENT_TYPE,
    }


def header_schema(kind: type[Event]) -> dict:
    """JSON Schema of the headers an event of ``kind`` carries (for the AsyncAPI document)."""
    return {
        "type": "object",
        "description": "CloudEvents 1.0 attributes (NATS protocol binding, binary content mode)",
        "properties": {
            H_SPECVERSION: {"type": "string", "const": SPECVERSION},
            H_TYPE: {"type": "string", "const": ce_type(kind)},
            H_SOURCE: {"type": "string", "description": "the producer: dilu/<service>[/<node>]"},
            H_ID: {"type": "string", "description": "unique per message (a UUID)"},
            H_TIME: {"type": "string", "format": "date-time", "description": "the event's ts_ns, RFC 3339 UTC"},
            H_CONTENT_TYPE: {"type": "string", "const": CONTENT_TYPE},
        },
        "required": list(HEADERS),
    }
