"""``dilu bench invoke``: a short real run reports sane figures; an unreachable NATS is one clear line."""
import json
import socket

import pytest
from click.testing import CliRunner

from dilu.cli.main import main

pytestmark = pytest.mark.nats


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_short_run_reports_overhead_baseline_and_max_rate(tmp_path, nats_url):
    out = tmp_path / "invoke.json"
    res = CliRunner().invoke(main, ["bench", "invoke", "--nats-url", nats_url, "--rate", "100", "--seconds", "1",
                                    "--search-s", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    assert fig["rate_rps"] == 100
    assert fig["sent"] == fig["completed"] == 100 and fig["errors"] == 0
    assert fig["baseline_completed"] == 100 and fig["baseline_errors"] == 0
    assert 0 < fig["overhead_ms_p50"] <= fig["overhead_ms_p99"] <= fig["overhead_ms_max"]
    assert 0 < fig["baseline_ms_p50"] <= fig["baseline_ms_p99"] <= fig["baseline_ms_max"]
    # one 3 s search step fits in 4 s: double the rate (or halve it if 100 req/s failed)
    assert len(fig["steps"]) == 1
    held = [s["rate_rps"] for s in fig["steps"] if s["held"]]
    if fig["overhead_ms_p99"] < fig["held_p99_ms"]:
        held.append(100.0)
    assert fig["max_rate_rps"] == max(held, default=0.0)
    for step in fig["steps"]:
        assert step["p50_ms"] <= step["p99_ms"]
        assert step["held"] == (step["completed"] == step["sent"] and step["p99_ms"] < fig["held_p99_ms"])


def test_unreachable_nats_is_one_clear_line():
    url = f"nats://127.0.0.1:{closed_port()}"
    res = CliRunner().invoke(main, ["bench", "invoke", "--nats-url", url, "--seconds", "1"])
    assert res.exit_code == 5  # every command's code for an unreachable NATS
    assert len(res.output.strip().splitlines()) == 1
    assert f"cannot reach NATS at {url}" in res.output
