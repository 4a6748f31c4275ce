"""Loggers made before a service configures logging (module-level ones) follow its level and stream."""
import io
import json

from dilu.services.common import logging as dlog


def test_a_logger_made_at_import_follows_a_later_configure():
    early = dlog.get("early")
    buf = io.StringIO()
    try:
        dlog.configure("svc", "warning", stream=buf)
        early.info("hidden")
        early.warning("shown")
    finally:
        dlog.configure("dilu")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(e["event"], e["service"]) for e in lines] == [("shown", "early")]


def test_a_logger_with_values_made_before_configure_follows_its_level():
    """The node agent binds its node in its constructor, before run() configures the level
    (DILU_LOG_LEVEL): bound through dlog.get, its info lines still go at warning."""
    agent = dlog.get("node_agent", node="n0")
    buf = io.StringIO()
    try:
        dlog.configure("node_agent", "warning", stream=buf)
        agent.info("hidden")
        agent.warning("shown")
    finally:
        dlog.configure("dilu")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(e["event"], e["service"], e["node"]) for e in lines] == [("shown", "node_agent", "n0")]
