"""Encoding and strict decoding of events (JSON via msgspec).

Decoding never raises anything but :class:`MalformedEvent`, whose message says what was wrong,
so a service can reject, log and count a bad message and carry on.
"""
from __future__ import annotations

import time
from typing import TypeVar

import msgspec

from .events import Event

E = TypeVar("E", bound=Event)

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}


class MalformedEvent(ValueError):
    """A message that is not a valid instance of the subject's event type."""


def encode(event: msgspec.Struct) -> bytes:
    """Event (or any contracts Struct) -> JSON bytes; stamps an event's ``ts_ns`` (Unix epoch ns)
    when it is 0."""
    if isinstance(event, Event) and event.ts_ns == 0:
        event.ts_ns = time.time_ns()
    return _encoder.encode(event)


def decode(data: bytes, kind: type[E]) -> E:  # kind: an Event or any contracts Struct
    """JSON bytes -> ``kind``. Unknown fields are skipped (forward compatible).

    Raises MalformedEvent with the decoder's reason (e.g. "Expected `float`, got `str` - at
    `$.quota`") for invalid JSON, wrong types, values out of bounds, missing required fields
    or nesting deeper than the decoder's recursion limit.
    """
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedEvent(f"{kind.__name__}: {_one_line(str(exc))}") from None
    except RecursionError:  # msgspec's depth limit, reached even in skipped unknown fields
        raise MalformedEvent(f"{kind.__name__}: JSON nested too deeply") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
