"""JSON Schema of every event, exported from the msgspec types and checked in under schema/, and
the AsyncAPI 3.0 document of the bus (``schema/asyncapi.json``) generated from the same types and
:data:`~dilu.contracts.subjects.SUBJECT_EVENTS`.

``python -m dilu.contracts.schema --write`` regenerates the files; ``--check`` exits 1 when the
checked-in files drifted from the types (a test runs the same comparison).
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import msgspec

from . import cloudevents, subjects
from .events import EVENT_TYPES, Event

SCHEMA_DIR = Path(__file__).parent / "schema"
ASYNCAPI_FILE = "asyncapi.json"
ASYNCAPI_VERSION = "3.0.0"


def _clean(node):
    """Descriptions through ``inspect.cleandoc``: msgspec versions differ in how they dedent
    docstrings, and the checked-in schema must not depend on which one is installed."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def schemas() -> dict[str, str]:
    """File name -> JSON Schema text (sorted keys, 2-space indent, trailing newline)."""
    out = {}
    for kind in EVENT_TYPES:
        doc = _clean(msgspec.json.schema(kind))
        out[f"{kind.__name__}.json"] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return out


def _builders() -> dict[str, list[str]]:
    """Subject builder name -> its parameter names (the functions of :mod:`subjects` returning a
    subject from identifiers, e.g. ``telemetry_gpu(node, gpu)``)."""
    out = {}
    for name, f in vars(subjects).items():
        if inspect.isfunction(f) and f.__module__ == subjects.__name__ and name != "token":
            out[name] = list(inspect.signature(f).parameters)
    return out


def _parameters(pattern: str) -> tuple[str, dict[str, dict]]:
    """A SUBJECT_EVENTS pattern -> (AsyncAPI address with ``{param}`` for each ``*``, parameters),
    the names taken from the subject builder that makes such subjects; ``p1``, ``p2``... when none
    does."""
    want = pattern.split(".")
    for builder, params in _builders().items():
        got = getattr(subjects, builder)(*params).split(".")
        if len(got) != len(want):
            continue
        names: list[str] = []
        for w, g in zip(want, got):
            if w == "*" and g in params and g not in names:
                names.append(g)
            elif w != "*" and (w == g or g in params):
                continue
            else:
                break
        else:
            if len(names) == want.count("*"):
                break
    else:
        builder, names = "", [f"p{k + 1}" for k in range(want.count("*"))]
    it = iter(names)
    address = ".".join("{" + next(it) + "}" if w == "*" else w for w in want)
    made_by = f" (argument of subjects.{builder})" if builder else ""
    return address, {n: {"description": f"`{n}`{made_by}, one subject token: [A-Za-z0-9_-]+"} for n in names}


def _channel_id(pattern: str) -> str:
    return "_".join(t for t in pattern.split(".")[2:] if t != "*")


def _summary(kind: type) -> str:
    doc = inspect.cleandoc(kind.__doc__ or "")
    return doc.split("\n\n")[0].replace("\n", " ")


def asyncapi() -> dict:
    """The AsyncAPI 3.0 document: one channel per SUBJECT_EVENTS pattern (its ``*`` as parameters)
    with the one message it carries (JSON Schema payload, CloudEvents headers), an operation per
    channel (``send`` for events Dilu publishes, ``receive`` with its reply for request-reply
    subjects whose ``<X>Request`` has an ``<X>Reply``), and every type under components/schemas."""
    ref = "#/components/schemas/{name}"
    _, schemas_ = msgspec.json.schema_components(EVENT_TYPES, ref_template=ref)
    by_name = {k.__name__: k for k in EVENT_TYPES}
    channels: dict[str, dict] = {}
    operations: dict[str, dict] = {}
    messages: dict[str, dict] = {}

    def message(kind: type[Event]) -> dict:
        messages[kind.__name__] = {
            "name": kind.__name__,
            "title": kind.__name__,
            "summary": _summary(kind),
            "contentType": cloudevents.CONTENT_TYPE,
            "headers": cloudevents.header_schema(kind),
            "payload": {"$ref": ref.format(name=kind.__name__)},
        }
        return {kind.__name__: {"$ref": f"#/components/messages/{kind.__name__}"}}

    for pattern, kind in subjects.SUBJECT_EVENTS.items():
        cid = _channel_id(pattern)
        if cid in channels:
            raise ValueError(f"two subjects make channel id {cid!r}")
        address, params = _parameters(pattern)
        channels[cid] = {"address": address, "title": pattern, "messages": message(kind)}
        if params:
            channels[cid]["parameters"] = params
        op = {"channel": {"$ref": f"#/channels/{cid}"},
              "messages": [{"$ref": f"#/channels/{cid}/messages/{kind.__name__}"}]}
        reply = by_name.get(kind.__name__.removesuffix("Request") + "Reply") if kind.__name__.endswith("Request") else None
        if reply is None:
            operations[cid] = {"action": "send", "summary": f"Dilu publishes {kind.__name__} on {pattern}", **op}
            continue
        rid = f"{cid}_reply"
        channels[rid] = {"address": None, "title": f"reply inbox of {pattern}",
                         "description": "the requester's inbox (the NATS message's reply subject)",
                         "messages": message(reply)}
        operations[cid] = {"action": "receive", "summary": f"Dilu answers {kind.__name__} on {pattern} with {reply.__name__}",
                           **op, "reply": {"channel": {"$ref": f"#/channels/{rid}"},
                                           "messages": [{"$ref": f"#/channels/{rid}/messages/{reply.__name__}"}]}}
    return _clean({
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "Dilu event bus",
            "version": subjects.PREFIX.split(".")[1],
            "description": "Events of Dilu's services on NATS, JSON-encoded, one type per subject, with the "
                           "CloudEvents attributes as NATS headers. Versioning rule and examples: docs/events.md.",
        },
        "defaultContentType": cloudevents.CONTENT_TYPE,
        "servers": {"local": {"host": "127.0.0.1:4222", "protocol": "nats", "description": "the default `dilu up` server"}},
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas_},
    })


def documents() -> dict[str, str]:
    """Every file under schema/: the JSON Schemas and the AsyncAPI document."""
    out = schemas()
    out[ASYNCAPI_FILE] = json.dumps(asyncapi(), indent=2, sort_keys=True) + "\n"
    return out


def drift() -> list[str]:
    """Names of schema files that are missing, stale or no longer produced."""
    want = documents()
    have = {p.name for p in SCHEMA_DIR.glob("*.json")}
    bad = [n for n, text in want.items() if not (SCHEMA_DIR / n).exists() or (SCHEMA_DIR / n).read_text() != text]
    return bad + sorted(have - set(want))


def main(argv: list[str]) -> int:
    if "--write" in argv:
        SCHEMA_DIR.mkdir(exist_ok=True)
        for p in SCHEMA_DIR.glob("*.json"):
            p.unlink()
        for name, text in documents().items():
            (SCHEMA_DIR / name).write_text(text)
        return 0
    bad = drift()
    for n in bad:
        print(f"schema drift: {n} (run `make schema`)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
