"""``dilu events tail`` against a real nats-server: events published through the bus come out one
line each (or as JSON with their CloudEvents headers), malformed ones are shown and counted,
Ctrl-C exits 0 with a count line, an unreachable server fails at once with one line."""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading

import msgspec
import pytest
from click.testing import CliRunner

from dilu.cli.events import events
from dilu.contracts import subjects as subj
from dilu.contracts.events import GpuTelemetry, InstanceTelemetry, ScaleDecision, TokenGrant
from dilu.services.common.bus import Bus

pytestmark = pytest.mark.nats

GRANT = TokenGrant(node="n0", gpu=1, instance_id="i-1", quota=0.25, epoch=3, reason="burst")


def test_json_lines_carry_the_subject_the_cloudevents_headers_and_the_event(nats_url):
    stop = threading.Event()

    async def publish() -> None:  # until the tail has what it wants (its subscription time unknown)
        bus = await Bus.connect(nats_url, "vertical-scaler", node="n0")
        try:
            while not stop.is_set():
                await bus.publish(subj.grant_issued("n0", 1), msgspec.structs.replace(GRANT, ts_ns=0))
                await asyncio.sleep(0.05)
        finally:
            await bus.close()

    publisher = threading.Thread(target=asyncio.run, args=(publish(),))
    publisher.start()
    try:
        result = CliRunner().invoke(events, ["tail", "--nats-url", nats_url, "--subject", "dilu.v1.grant.>", "--json", "--max", "2"])
    finally:
        stop.set()
        publisher.join(10)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert len(lines) == 2 and lines[0]["headers"]["ce-id"] != lines[1]["headers"]["ce-id"]
    first = lines[0]
    assert first["subject"] == "dilu.v1.grant.issued.n0.1" and first["type"] == "TokenGrant"
    assert first["event"]["quota"] == 0.25 and first["event"]["ts_ns"] > 0
    h = first["headers"]
    assert (h["ce-specversion"], h["ce-type"], h["ce-source"], h["content-type"]) == (
        "1.0", "io.dilu.v1.TokenGrant", "dilu/vertical-scaler/n0", "application/json")
    assert h["ce-time"].endswith("Z") and h["ce-time"][:4] >= "2024"
    assert "2 events, 0 malformed" in result.stderr


def test_unreachable_nats_fails_within_seconds_with_one_line():
    result = CliRunner().invoke(events, ["tail", "--nats-url", "nats://127.0.0.1:1"])
    assert result.exit_code == 5
    assert result.output.strip().count("\n") == 0 and "cannot reach NATS" in result.output


def _sigint_as_from_a_terminal() -> None:
    """In the child before exec: SIGINT at its default and unblocked, as a shell starts a command. A
    signal mask or an ignored disposition left in this test process by earlier tests would
    otherwise be inherited and the Ctrl-C below never arrive."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_lines_for_people_malformed_counted_and_ctrl_c_exits_0(nats_url):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dilu.cli.main", "events", "tail", "--nats-url", nats_url,  # as `dilu` runs it
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=_sigint_as_from_a_terminal)
    bus = await Bus.connect(nats_url, "node-agent", node="n0")
    peer = bus.nc  # raw publishes on the bus's own connection: one order for all
    try:
        ready = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert b"listening on" in ready, ready
        telemetry = GpuTelemetry(node="n0", gpu=1, window_ms=100.0,
                                 instances=[InstanceTelemetry(instance_id="i-1", function="f"),
                                            InstanceTelemetry(instance_id="i-2", function="f")])
        await bus.publish(subj.telemetry_gpu("n0", 1), telemetry)
        newer = msgspec.to_builtins(telemetry)
        newer["instances"][1]["priority"] = "realtime"
        await peer.publish(subj.telemetry_gpu("n0", 2), msgspec.json.encode(newer))
        await peer.publish(subj.invoke("f"), b"opaque payload: not an event subject")
        await peer.publish(subj.grant_issued("n0", 1), b'{"node": 7}')
        await peer.publish(subj.scale_decided("f"), b'{"function": "f", "direction": "sideways", "count": 1}')
        await bus.publish(subj.scale_decided("f"), ScaleDecision(function="f", direction="out", count=2))
        await peer.flush()
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(5)]
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 30)
        rest = (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await bus.close()
    assert rc == 0, rest
    gpu1, gpu2, bad, skipped, scale = lines
    assert "dilu.v1.telemetry.gpu.n0.1  GpuTelemetry  node=n0 gpu=1 window_ms=100 instances=[2]" in gpu1
    assert gpu1[:2] == "20" and gpu1[23] == "Z"
    assert "instances=[1]" in gpu2 and "skipped 1 item(s)" in gpu2 and "$.instances[1].priority" in gpu2
    assert "dilu.v1.grant.issued.n0.1  MALFORMED: TokenGrant: " in bad
    assert "ScaleDecision  SKIPPED (newer version)" in skipped and "'sideways'" in skipped
    assert "ScaleDecision  function=f direction=out count=2" in scale
    assert "3 events, 1 malformed, 1 skipped (newer version; 1 items within events), 0 on other subjects" in rest


async def test_the_reader_leaving_ends_it_with_141(nats_url):
    """`dilu events tail | head -1`: once the reader has gone, the next line ends the command with
    128 + SIGPIPE, quietly, as a Unix tool ends (it used to print the broken pipe and go on)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dilu.cli.main", "events", "tail", "--nats-url", nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    bus = await Bus.connect(nats_url, "node-agent", node="n0")
    try:
        assert b"listening on" in await asyncio.wait_for(proc.stderr.readline(), 60)
        await bus.publish(subj.grant_issued("n0", 1), GRANT)
        assert b"TokenGrant" in await asyncio.wait_for(proc.stdout.readline(), 30)
        proc._transport.get_pipe_transport(1).close()  # the reader leaves, as head does after its line
        for _ in range(50):  # a write or two after the reader left hits the broken pipe
            await bus.publish(subj.grant_issued("n0", 1), GRANT)
            await asyncio.sleep(0.1)
            if proc.returncode is not None:
                break
        rc = await asyncio.wait_for(proc.wait(), 30)
        err = (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await bus.close()
    assert rc == 128 + signal.SIGPIPE, err
    assert "BrokenPipe" not in err and "Traceback" not in err, err


def test_its_options_come_from_dilu_variables_too(monkeypatch):
    from dilu.cli.main import main
    monkeypatch.setenv("DILU_MAX", "abc")
    res = CliRunner().invoke(main, ["events", "tail"])
    assert res.exit_code == 2 and "DILU_MAX" in res.output, res.output
    assert "DILU_MAX" in CliRunner().invoke(main, ["events", "tail", "--help"]).output


def test_a_bad_pattern_is_one_line_and_the_url_comes_from_dilu_nats_url(monkeypatch):
    for bad in ("", "a b", "dilu..x", "dilu.>.x", "dilu.\udcff", "dilu.é"):  # \udcff: a byte not UTF-8
        res = CliRunner().invoke(events, ["tail", "--subject", bad])
        assert res.exit_code == 2 and "is not a NATS subject pattern" in res.output, res.output
        assert "Traceback" not in res.output
    monkeypatch.setenv("DILU_NATS_URL", "nats://127.0.0.1:7")  # nothing listens on port 7
    res = CliRunner().invoke(events, ["tail", "--max", "1"])
    assert res.exit_code == 5 and "nats://127.0.0.1:7" in res.output, res.output
