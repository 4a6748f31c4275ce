"""``dilu bench loadgen``: its JSON fields, the unreachable-NATS error, and the send time it reads."""
import asyncio
import json
import socket

from click.testing import CliRunner

from dilu.cli.main import main
from dilu.loadgen.arrivals import Invocation
from dilu.loadgen.bench import steady_plan
from dilu.loadgen.generator import OpenLoopGenerator, Outcome

MS = 1_000_000


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_short_run_reports_sane_figures(tmp_path):
    out = tmp_path / "loadgen.json"
    res = CliRunner().invoke(main, ["bench", "loadgen", "--rate", "200", "--seconds", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    assert fig == json.loads(res.output)
    assert fig["sent"] == 200
    assert fig["send_rate_rps"] > 0
    assert 0 < fig["send_error_ms_p50"] <= fig["send_error_ms_p99"] <= fig["send_error_ms_max"]
    assert 0 <= fig["late_sends"] <= fig["sent"]


def test_unreachable_nats_is_one_clear_line():
    url = f"nats://127.0.0.1:{closed_port()}"
    res = CliRunner().invoke(main, ["bench", "loadgen", "--nats-url", url, "--seconds", "1"])
    assert res.exit_code == 5  # every command's code for an unreachable NATS
    assert res.output.strip().splitlines() == [res.output.strip()]
    assert f"cannot reach NATS at {url}" in res.output


def test_steady_plan_spacing():
    plan = steady_plan(4, 1)
    assert [i.scheduled_ns for i in plan] == [0, 250 * MS, 500 * MS, 750 * MS]


class StepClock:
    """A manual clock: time moves only when a send advances it."""

    def __init__(self) -> None:
        self.ns = 0

    def now_ns(self) -> int:
        return self.ns

    async def sleep_until(self, deadline_ns: int) -> None:
        self.ns = max(self.ns, deadline_ns)


def test_send_time_is_when_the_request_leaves_not_when_it_was_queued():
    # Three requests due at once; each send holds the loop 1 ms (a blocking socket write). The
    # generator queues all three in one pass, but they leave at 0, 1 and 2 ms.
    clock = StepClock()

    async def invoke(inv: Invocation) -> Outcome:
        clock.ns += MS
        return Outcome()

    plan = [Invocation(id=f"r{i}", function="f", scheduled_ns=0, trace_minute=0) for i in range(3)]
    result = asyncio.run(OpenLoopGenerator(invoke, clock=clock).run(plan))
    assert [r.sent_ns for r in result.records] == [0, MS, 2 * MS]
    assert result.max_late_ms == 2.0
