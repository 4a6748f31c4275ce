"""Loggers made before a service configures logging (module-level ones, or bound in a service's
constructor, as the node agent binds its node) follow its level and stream."""
import io
import json

import pytest

from dilu.services.common import logging as dlog


@pytest.mark.parametrize("service, values", [("early", {}), ("node_agent", {"node": "n0"})])
def test_a_logger_made_before_configure_follows_its_level(service, values):
    early = dlog.get(service, **values)
    buf = io.StringIO()
    try:
        dlog.configure("svc", "warning", stream=buf)
        early.info("hidden")
        early.warning("shown")
    finally:
        dlog.configure("dilu")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(e["event"], e["service"], {k: e[k] for k in values}) for e in lines] == [("shown", service, values)]
