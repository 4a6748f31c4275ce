"""The AsyncAPI 3.0 document generated from contracts/: checked in without drift, every subject
present with its parameters and message, every $ref resolvable."""
from __future__ import annotations

import json
import re

from dilu.contracts import cloudevents, subjects
from dilu.contracts.schema import ASYNCAPI_FILE, SCHEMA_DIR, asyncapi, drift


def resolve(doc: dict, ref: str):
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"unresolvable $ref {ref}"
        node = node[part]
    return node


def refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def test_checked_in_document_is_current_and_parses():
    assert ASYNCAPI_FILE not in drift(), "run `make schema` and commit contracts/schema/"
    assert json.loads((SCHEMA_DIR / ASYNCAPI_FILE).read_text()) == asyncapi()


def test_structure():
    doc = asyncapi()
    assert doc["asyncapi"] == "3.0.0" and doc["info"]["title"] and doc["info"]["version"] == "v1"
    all_refs = list(refs(doc))
    assert len(all_refs) > 50
    for ref in all_refs:
        resolve(doc, ref)
    by_title = {c["title"]: c for c in doc["channels"].values()}
    for pattern, kind in subjects.SUBJECT_EVENTS.items():
        channel = by_title[pattern]
        assert channel["address"].replace("{", "").count("}") == pattern.count("*")
        assert set(re.findall(r"\{(\w+)\}", channel["address"])) == set(channel.get("parameters", {}))
        assert re.sub(r"\{\w+\}", "*", channel["address"]) == pattern
        (msg,) = channel["messages"].values()
        message = resolve(doc, msg["$ref"])
        assert resolve(doc, message["payload"]["$ref"])["title"] == kind.__name__
        assert message["headers"]["properties"]["ce-type"]["const"] == cloudevents.ce_type(kind)
        assert set(message["headers"]["required"]) == set(cloudevents.HEADERS)


def test_operations_reference_their_channels_and_replies():
    doc = asyncapi()
    ops = doc["operations"]
    assert {op["channel"]["$ref"] for op in ops.values()} == {
        f"#/channels/{cid}" for cid, c in doc["channels"].items() if c["address"] is not None}
    place = next(op for op in ops.values() if resolve(doc, op["channel"]["$ref"])["title"] == subjects.SCHEDULER_PLACE)
    assert place["action"] == "receive"
    assert resolve(doc, place["reply"]["messages"][0]["$ref"]) == {"$ref": "#/components/messages/PlaceReply"}
    trial = next(op for op in ops.values() if resolve(doc, op["channel"]["$ref"])["title"] == "dilu.v1.node.trial.*")
    assert "reply" in trial
    gpu = next(c for c in doc["channels"].values() if c["title"] == "dilu.v1.telemetry.gpu.*.*")
    assert gpu["address"] == "dilu.v1.telemetry.gpu.{node}.{gpu}"
    sends = [op for op in ops.values() if op["action"] == "send"]
    assert sends and all(op["messages"][0]["$ref"].startswith(op["channel"]["$ref"] + "/messages/") for op in ops.values())
    assert len(sends) + sum(1 for op in ops.values() if "reply" in op) == len(subjects.SUBJECT_EVENTS)
