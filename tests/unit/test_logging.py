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
