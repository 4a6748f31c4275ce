"""``dilu deploy / undeploy / invoke / status`` through click's CliRunner against a real
nats-server and stand-in services (tests/client_fakes.py): outputs, --json, exit codes, and
bad input as one line.

The commands block (each runs its own event loop), so they run in a worker thread while the
stand-ins serve from the test's loop.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import msgspec
import pytest
from click.testing import CliRunner, Result

from client_fakes import FakeInstance, FakeServices, put_state, spec_toml
from dilu.cli.main import main
from dilu.client import admin
from dilu.client.spec import parse_spec
from dilu.contracts import encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import workqueue
from dilu.services.common.natsserver import free_port
from dilu.services.common.nodes import nodes_bucket

pytestmark = pytest.mark.nats


async def dilu(*args: str, env: dict | None = None, stdin: bytes | None = None) -> Result:
    """Run ``dilu ARGS`` in a worker thread; the result has stdout and stderr apart."""
    return await asyncio.to_thread(CliRunner().invoke, main, list(args), input=stdin, env=env)


def one_line_error(result: Result, code: int) -> str:
    """The error line (after any "… step" progress lines of deploy), checked to be the only one."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("… ")]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.stderr
    return lines[0]


async def deployed(nc, name="echo", kind="inference") -> FakeInstance:
    fakes = await FakeServices(nc, ready=False).start()
    await admin.deploy(nc, parse_spec(spec_toml(name, kind=kind, extra="initial_scale = 0")))
    await fakes.stop()
    return await FakeInstance(nc, name).start()


# ---------------------------------------------------------------- deploy


async def test_deploy_prints_the_profile_and_the_ready_instance(nc, nats_url, services, tmp_path):
    (tmp_path / "model.py").write_text("class Model:\n    pass\n")
    (tmp_path / "function.toml").write_text(
        'name = "cls"\nentry = "model:Model"\nslo_ms = 80\nmemory_bytes = 2_000_000_000\ninitial_scale = 1\n')
    r = await dilu("deploy", str(tmp_path / "function.toml"), "--nats-url", nats_url)
    assert r.exit_code == 0, r.output
    assert "deployed cls (inference, SLO 80 ms" in r.stdout
    assert "request quota 0.30, limit quota 0.60, batch 4" in r.stdout
    assert "ready: instance cls-i1 on node-a GPU 1, cold start 1234 ms" in r.stdout
    assert "profiling" in r.stderr  # progress goes to stderr


async def test_a_code_folder_holding_a_pipe_is_bad_input_not_a_hang(nats_url, services, tmp_path):
    (tmp_path / "model.py").write_text("class Model:\n    pass\n")
    os.mkfifo(tmp_path / "requests.fifo")  # reading it would wait for a writer for good
    (tmp_path / "function.toml").write_text('name = "cls"\nentry = "model:Model"\nslo_ms = 80\nmemory_bytes = 2_000_000_000\n')
    r = await asyncio.wait_for(dilu("deploy", str(tmp_path / "function.toml"), "--nats-url", nats_url), 60)
    assert "'requests.fifo' is not a regular file" in one_line_error(r, 2)
    assert services.deployed == []  # nothing stored


async def test_deploy_json_is_the_deploy_result(nats_url, services, tmp_path):
    (tmp_path / "f.toml").write_text(spec_toml("echo", extra="initial_scale = 0"))
    r = await dilu("deploy", str(tmp_path / "f.toml"), "--json", env={"DILU_NATS_URL": nats_url})
    assert r.exit_code == 0, r.output
    result = msgspec.json.decode(r.stdout, type=admin.DeployResult)
    assert result.spec.name == "echo" and result.profile.batch_size == 4 and result.ready is None


async def test_deploy_bad_input_is_one_line_and_exit_2(nats_url, tmp_path):
    r = await dilu("deploy", str(tmp_path / "missing.toml"), "--nats-url", nats_url)
    assert "missing.toml: cannot read the spec file" in one_line_error(r, 2)
    r = await dilu("deploy", "", "--nats-url", nats_url)  # not the current folder's function.toml
    assert "an empty path" in one_line_error(r, 2)
    (tmp_path / "bad.toml").write_text('name = "x\n')
    r = await dilu("deploy", str(tmp_path / "bad.toml"), "--nats-url", nats_url)
    assert "bad.toml: not valid TOML" in one_line_error(r, 2)
    (tmp_path / "typo.toml").write_text(spec_toml("x", extra="slo = 5"))
    r = await dilu("deploy", str(tmp_path / "typo.toml"), "--nats-url", nats_url)
    assert "typo.toml: slo: unknown key" in one_line_error(r, 2)


async def test_deploy_refused_by_the_scheduler_says_why(nc, nats_url, tmp_path):
    fakes = await FakeServices(nc, admit_error="no GPU has 90 GB of memory").start()
    (tmp_path / "f.toml").write_text(spec_toml("big"))
    r = await dilu("deploy", str(tmp_path / "f.toml"), "--nats-url", nats_url)
    assert "function 'big' cannot be placed: no GPU has 90 GB of memory" in one_line_error(r, 4)  # no capacity
    await fakes.stop()


async def test_a_deploy_no_gpu_can_take_now_is_no_capacity_not_still_starting(nc, nats_url, tmp_path):
    """Admitted (some GPU could hold it when empty) but refused placement now: after the wait,
    the horizontal scaler's state says why, and the deploy says so with exit 4 (no capacity)
    rather than "still starting" with exit 0. The function stays deployed."""
    fakes = await FakeServices(nc, ready=False).start()  # no instance ever becomes ready
    await put_state(nc.jetstream(), ev.FunctionState(function="full", placeable=False, reason="no GPU has room"))
    (tmp_path / "f.toml").write_text(spec_toml("full"))
    r = await dilu("deploy", str(tmp_path / "f.toml"), "--wait-ready", "0.5", "--nats-url", nats_url)
    line = one_line_error(r, 4)
    assert "full is deployed, but no GPU can take an instance now: no GPU has room" in line, line
    r = await dilu("deploy", str(tmp_path / "f.toml"), "--wait-ready", "0.5", "--json", "--nats-url", nats_url)
    assert r.exit_code == 4 and msgspec.json.decode(r.stdout)["exit_code"] == 4
    await fakes.stop()


# ---------------------------------------------------------------- invoke


async def test_invoke_writes_the_raw_reply_from_text_file_and_stdin(nc, nats_url, tmp_path):
    inst = await deployed(nc)
    r = await dilu("invoke", "echo", "--data", "hello", "--nats-url", nats_url)
    assert r.exit_code == 0 and r.stdout_bytes == b"echo:hello"
    (tmp_path / "in.bin").write_bytes(b"\x00\xff")
    r = await dilu("invoke", "echo", "--data", f"@{tmp_path / 'in.bin'}", "--nats-url", nats_url)
    assert r.stdout_bytes == b"echo:\x00\xff"
    r = await dilu("invoke", "echo", "--data", "-", "--nats-url", nats_url, stdin=b"piped")
    assert r.stdout_bytes == b"echo:piped"
    # a command-line byte that is not UTF-8 ($'a\xff' in a shell) reaches Python as a surrogate: sent as given
    r = await dilu("invoke", "echo", "--data", "a\udcff", "--nats-url", nats_url)
    assert r.exit_code == 0 and r.stdout_bytes == b"echo:a\xff", r.output
    r = await dilu("invoke", "echo", "--data", "hi", "--json", "--nats-url", nats_url)
    out = json.loads(r.stdout)
    assert out["payload"] == "echo:hi" and out["instance"] == "inst-1" and out["latency_ms"] > 0
    await inst.stop()


async def test_invoke_stream_writes_each_chunk(nc, nats_url):
    inst = await deployed(nc, "chat", kind="llm")
    r = await dilu("invoke", "chat", "--stream", "--data", "stream:Hel,lo", "--nats-url", nats_url)
    assert r.exit_code == 0 and r.stdout_bytes == b"Hello"
    r = await dilu("invoke", "chat", "--stream", "--json", "--data", "restream:a,b,c", "--nats-url", nats_url)
    out = json.loads(r.stdout)
    assert out["payload"] == "abc" and out["chunks"] == 3 and out["ttft_ms"] > 0
    # a stream cut short by the timeout: its chunks were written, its end is what did not come
    r = await dilu("invoke", "chat", "--stream", "--timeout", "0.5", "--data", "chunkhang:x,y", "--nats-url", nats_url)
    assert r.stdout_bytes == b"xy"
    assert "incomplete within 0.5 s: 2 chunks, then no final reply" in one_line_error(r, 3)
    await inst.stop()


async def test_invoke_exit_codes(nc, nats_url, tmp_path):
    inst = await deployed(nc)
    r = await dilu("invoke", "ghost", "--nats-url", nats_url)
    assert "'ghost' is not deployed" in one_line_error(r, 2)
    r = await dilu("invoke", "echo", "--data", "fail:bad pixels", "--nats-url", nats_url)
    assert one_line_error(r, 1) == "Error: ValueError: bad pixels"
    r = await dilu("invoke", "echo", "--data", "hang", "--timeout", "0.5", "--nats-url", nats_url)
    assert "within 0.5 s" in one_line_error(r, 3)
    # under --json the error is a result on stdout, with the same exit code
    for args, code in ((("ghost",), 2), (("echo", "--data", "hang", "--timeout", "0.5"), 3)):
        r = await dilu("invoke", *args, "--json", "--nats-url", nats_url)
        assert r.exit_code == code and r.stderr == "", (r.stdout, r.stderr)
        out = json.loads(r.stdout)
        assert out["exit_code"] == code and ("not deployed" in out["error"] or "0.5 s" in out["error"])
    r = await dilu("invoke", "echo", "--data", f"@{tmp_path / 'nope'}", "--nats-url", nats_url)
    assert "--data: cannot read" in one_line_error(r, 2)
    r = await dilu("invoke", "echo", "--timeout", "-1", "--nats-url", nats_url)
    assert r.exit_code == 2  # click's usage error
    await inst.stop()
    await put_state(nc.jetstream(), ev.FunctionState(function="echo", placeable=False, reason="no room"))
    r = await dilu("invoke", "echo", "--nats-url", nats_url)
    assert "cannot be placed now" in one_line_error(r, 4)


async def test_every_command_fails_fast_on_unreachable_nats(tmp_path):
    url = f"nats://127.0.0.1:{free_port()}"
    (tmp_path / "f.toml").write_text(spec_toml("echo"))
    for args in (["invoke", "echo"], ["status"], ["undeploy", "echo"], ["deploy", str(tmp_path / "f.toml")]):
        started = time.monotonic()
        r = await dilu(*args, "--nats-url", url)
        assert f"cannot reach NATS at {url}" in one_line_error(r, 5)
        assert time.monotonic() - started < 10
    r = await dilu("status", "--nats-url", "http://x:1")
    assert r.exit_code == 2 and "not a NATS URL" in r.stderr


# ---------------------------------------------------------------- status and undeploy


async def test_status_shows_nodes_functions_and_instances(nc, nats_url, services, tmp_path):
    (tmp_path / "f.toml").write_text(spec_toml("echo", extra="initial_scale = 1"))
    assert (await dilu("deploy", str(tmp_path / "f.toml"), "--nats-url", nats_url)).exit_code == 0
    gpu = ev.GpuInfo(index=1, uuid="GPU-1", name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * 2**30, sms=108)
    await (await nodes_bucket(nc.jetstream())).put("node-a", encode(ev.NodeInventory(node="node-a", gpus=[gpu])))
    decision = ev.ScaleDecision(function="echo", direction="out", count=1, reason="burst", ts_ns=time.time_ns())
    await put_state(nc.jetstream(), ev.FunctionState(function="echo", instances=1, ready=1, desired=1,
                                                     decisions=[decision]))
    parked = ev.Placement(instance_id="echo-i2", function="echo", node="node-a", gpu=2, request_quota=0.3,
                          limit_quota=0.6, width=0.6, memory_bytes=2**30, parked=True)
    await (await nc.jetstream().key_value(subjects.PLACEMENT_BUCKET)).put("echo-i2", encode(parked))
    # the report's width in a pipe (xdist workers set COLUMNS=80, which splits the tables differently)
    r = await dilu("status", "--listen", "0.2", "--nats-url", nats_url, env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    for text in ("Nodes (1)", "NVIDIA A100-SXM4-40GB", "40.0 GiB", "108", "Functions (1)", "echo", "500 ms", "0.30 / 0.60 / 4",
                 "ready 1, desired 1, parked 1", "out 1 (burst)", "echo-i1", "node-a"):
        assert text in r.stdout, text
    states = {line.split("│")[2].strip(): line.split("│")[-2].strip() for line in r.stdout.splitlines()
              if "│ echo-i" in line}
    assert states == {"echo-i1": "placed", "echo-i2": "parked"}
    r = await dilu("status", "--listen", "0", "--json", "--nats-url", nats_url)
    st = msgspec.json.decode(r.stdout, type=admin.Status)
    assert [f.name for f in st.functions] == ["echo"]
    assert [(i.instance_id, i.parked) for i in st.functions[0].instances] == [("echo-i1", False), ("echo-i2", True)]
    assert json.loads(r.stdout)["functions"][0]["instances"][1]["parked"] is True


async def test_undeploy_reports_and_an_unknown_name_is_exit_2(nats_url, services, tmp_path):
    name = "echo-" + "x" * 50  # its line is longer than any console is wide: still one line
    (tmp_path / "f.toml").write_text(spec_toml(name, extra="initial_scale = 1"))
    assert (await dilu("deploy", str(tmp_path / "f.toml"), "--nats-url", nats_url)).exit_code == 0
    r = await dilu("undeploy", name, "--nats-url", nats_url)
    assert r.exit_code == 0 and r.stdout == f"undeployed {name}: no instance left, its request queue removed\n"
    r = await dilu("undeploy", name, "--nats-url", nats_url)
    assert f"'{name}' is not deployed" in one_line_error(r, 2)


# ---------------------------------------------------------------- signals and pipes, as a shell runs dilu


DILU = [sys.executable, "-m", "dilu.cli.main"]


def _default_signals() -> None:
    """In the child, before exec: SIGINT and SIGTERM as a shell's foreground command has them. An
    ignored disposition is inherited through exec, and a test run started in the background (or
    a test before this one) may have left SIGINT ignored in this process."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
async def test_a_signal_ends_an_invoke_with_128_plus_it_and_withdraws_its_call(nc, nats_url, sig, code):
    """Ctrl-C, ``timeout`` and ``kill``: the call is withdrawn (the instance would drop it) and the
    command exits 128 + the signal, as a shell reports it: not 1 (a failed function), and not
    killed mid-call with nothing said to the platform."""
    fakes = await FakeServices(nc, ready=False).start()
    await admin.deploy(nc, parse_spec(spec_toml("idle", extra="initial_scale = 0")))
    await fakes.stop()
    withdrawn = await nc.subscribe(subjects.cancel("idle"))
    await nc.flush()
    proc = await asyncio.create_subprocess_exec(*DILU, "invoke", "idle", "--data", "x", "--timeout", "60",
                                                "--nats-url", nats_url, stderr=asyncio.subprocess.PIPE,
                                                preexec_fn=_default_signals)
    js = nc.jetstream()
    while (await js.consumer_info(subjects.INVOKE_STREAM, workqueue.consumer_name("idle"))).num_pending == 0:
        await asyncio.sleep(0.05)  # stored: the call is waiting for its reply
    proc.send_signal(sig)
    rc = await asyncio.wait_for(proc.wait(), 30)
    err = await proc.stderr.read()
    assert rc == code and b"Traceback" not in err, (rc, err[-3000:])
    msg = await withdrawn.next_msg(timeout=5)
    assert msg.data.decode().startswith("_INBOX")


async def test_a_closed_stdout_ends_status_with_141_quietly(nats_url):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the first line
    proc = await asyncio.create_subprocess_exec(*DILU, "status", "--listen", "0", "--nats-url", nats_url,
                                                stdout=write_end, stderr=asyncio.subprocess.PIPE)
    os.close(write_end)
    err = await proc.stderr.read()
    assert await asyncio.wait_for(proc.wait(), 30) == 141 and err == b"", err[-2000:]
