"""Encoding and strict decoding of events (JSON via msgspec).

Decoding never raises anything but :class:`MalformedEvent`, whose message says what was wrong,
so a service can reject, log and count a bad message and carry on.

Forward compatibility (docs/events.md): unknown fields are skipped; a value a newer version added
to an enumeration (a ``Literal`` field) skips *that item* instead of the whole event. When the
unknown member sits in an element of a list (e.g. one ``GpuTelemetry.instances`` entry with a new
``priority``), that element is dropped and the rest of the event decoded; when it sits anywhere
else (the event's own field, or a nested struct that is not in a list) the event is the skipped
item and :class:`SkippedEvent` is raised. :func:`decode_counted` returns what was dropped.
"""
from __future__ import annotations

import re
import time
from typing import Generic, TypeVar

import msgspec

from .events import Event

E = TypeVar("E", bound=Event)

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}

MAX_SKIPPED_ITEMS = 64  # list elements one message may lose to unknown enum members; more: malformed
REASON_UNKNOWN_ENUM = "unknown-enum"  # the reason of every skip (a metrics label value)

# msgspec's message for a Literal/Enum value it does not know, e.g.
# "Invalid enum value 'new' - at `$.instances[0].priority`"
_UNKNOWN_ENUM = re.compile(r"^Invalid enum value (?P<value>.*) - at `(?P<path>\$[^`]*)`$")
_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]")


class MalformedEvent(ValueError):
    """A message that is not a valid instance of the subject's event type."""


class SkippedEvent(MalformedEvent):
    """A valid message of a newer version whose own field (not a list element) holds an enum member
    this version does not know: the event is skipped and counted apart from malformed ones.
    ``path``: where (``$.direction``); ``value``: the unknown member as the decoder quotes it."""

    def __init__(self, message: str, path: str, value: str) -> None:
        super().__init__(message)
        self.path = path
        self.value = value


class Skip(msgspec.Struct, frozen=True):
    """One list element dropped while decoding: ``path`` of the unknown member
    (``$.instances[0].priority``), ``value`` as the decoder quotes it (``'new'``), ``reason``."""

    path: str
    value: str
    reason: str = REASON_UNKNOWN_ENUM

    @property
    def field(self) -> str:
        """``path`` without list indices (``$.instances[].priority``): one per kind of skip."""
        return re.sub(r"\[\d+\]", "[]", self.path)


class Decoded(msgspec.Struct, Generic[E], frozen=True):
    """An event and the list elements dropped to decode it (empty: nothing skipped)."""

    event: E
    skipped: tuple[Skip, ...] = ()


def encode(event: msgspec.Struct) -> bytes:
    """Event (or any contracts Struct) -> JSON bytes; stamps an event's ``ts_ns`` (Unix epoch ns)
    when it is 0."""
    if isinstance(event, Event) and event.ts_ns == 0:
        event.ts_ns = time.time_ns()
    return _encoder.encode(event)


def decode(data: bytes, kind: type[E]) -> E:  # kind: an Event or any contracts Struct
    """JSON bytes -> ``kind``. Unknown fields are skipped, list elements holding an unknown enum
    member are dropped (forward compatible; :func:`decode_counted` tells which).

    Raises SkippedEvent (a MalformedEvent) when an unknown enum member is not in a list element;
    MalformedEvent with the decoder's reason (e.g. "Expected `float`, got `str` - at `$.quota`")
    for invalid JSON, wrong types, values out of bounds, missing required fields, nesting deeper
    than the decoder's recursion limit or more than :data:`MAX_SKIPPED_ITEMS` dropped elements.
    """
    return decode_counted(data, kind).event


def decode_counted(data: bytes, kind: type[E]) -> Decoded[E]:
    """Like :func:`decode`, also returning the list elements dropped (same errors raised)."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    skipped: list[Skip] = []
    tree = None  # the message as plain JSON values, parsed on the first unknown member
    while True:
        try:
            return Decoded(dec.decode(data), tuple(skipped))
        except msgspec.ValidationError as exc:
            text = _one_line(str(exc))
            found = _UNKNOWN_ENUM.match(text)
            if found is None:
                raise MalformedEvent(f"{kind.__name__}: {text}") from None
            path, value = found["path"], found["value"]
            if tree is None:
                tree = _plain(data, kind)
            if not _drop_element(tree, path):
                raise SkippedEvent(f"{kind.__name__}: {text}", path, value) from None
            skipped.append(Skip(path, value))
            if len(skipped) > MAX_SKIPPED_ITEMS:
                raise MalformedEvent(f"{kind.__name__}: more than {MAX_SKIPPED_ITEMS} items with unknown "
                                     "enum members") from None
            data = _encoder.encode(tree)
        except msgspec.DecodeError as exc:
            raise MalformedEvent(f"{kind.__name__}: {_one_line(str(exc))}") from None
        except RecursionError:  # msgspec's depth limit, reached even in skipped unknown fields
            raise MalformedEvent(f"{kind.__name__}: JSON nested too deeply") from None


def _plain(data: bytes, kind: type) -> object:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedEvent(f"{kind.__name__}: {_one_line(str(exc))}") from None


def _drop_element(tree: object, path: str) -> bool:
    """Remove from ``tree`` the innermost list element on ``path`` (``$.a[2].b`` -> ``a[2]``).
    False when the path crosses no list index, or is not one this function can follow."""
    segments = [(m[1], m[2]) for m in _SEGMENT.finditer(path)]
    if "".join(f".{n}" if n else f"[{i}]" for n, i in segments) != path[1:]:
        return False  # e.g. a dict key (`[...]`): no element to drop
    last = max((k for k, (_, i) in enumerate(segments) if i), default=None)
    if last is None:
        return False
    node = tree
    for name, index in segments[:last]:
        if name and isinstance(node, dict) and name in node:
            node = node[name]
        elif index and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        else:
            return False
    i = int(segments[last][1])
    if not isinstance(node, list) or i >= len(node):
        return False
    del node[i]
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())
