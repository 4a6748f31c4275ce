"""What ``dilu deploy`` prints: its summary keeps a value whole when a narrow terminal or a pipe
(100 columns) wraps it, e.g. never "code" at one line's end and "sha256-…" on the next."""
from __future__ import annotations

from dilu.cli import functions
from dilu.client import admin
from dilu.contracts import events as ev


def test_the_deployed_line_keeps_the_code_digest_beside_its_label(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "60")
    spec = ev.FunctionSpec(name="a-rather-long-function-name", kind="inference", slo_ms=100.0,
                           memory_bytes=2_000_000_000)
    result = admin.DeployResult(spec=spec, profile=None, ready=None, code="sha256-" + "ab" * 32,
                                existing_instances=0, waited_s=0.0)
    functions._print_deployed(result, 5.0)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("deployed a-rather-long-function-name") and first.endswith("code sha256-abababababab…")
