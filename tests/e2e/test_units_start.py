"""The services started exactly as the shipped systemd units start them (their ExecStart and
Environment lines, the example environment file), on this machine's emulated node, serve requests,
also over HTTP through the gateway.

What systemd does around a unit is reproduced: ``${VAR}`` expansion in ExecStart from the
environment file, the unit's Environment= assignments, and State/Cache/RuntimeDirectory= folders
(here under a temp dir). Only two things differ from the shipped files: the install prefix
/opt/dilu is this checkout (installed by ``make`` exactly as docs/operations.md installs
/opt/dilu), DILU_NATS_URL points at this test's server, and /etc/dilu/auth (what ``dilu creds --out
/etc/dilu/auth`` writes, the server's users and each unit's credentials) is a temp dir.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.request

import msgspec
import pytest
from unitfiles import DEPLOY, env_file, exec_start, parse_unit, unit_environment

from dilu.cli.creds import AUTH_CONF, ensure_creds
from dilu.cli.deploy import deploy_all, function_spec
from dilu.contracts import subjects
from dilu.contracts.events import NodeInventory
from dilu.services.common.cliopts import METRICS_PORTS, default_node
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsconn import NatsOptions, connect
from dilu.services.common.natsserver import EmbeddedNats

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.native]

PREFIX = "/opt/dilu"  # where docs/operations.md installs Dilu
ROOT = str(DEPLOY.parent)
AUTH = "/etc/dilu/auth"  # docs/operations.md, Credentials
UNITS = {pkg: DEPLOY / "systemd" / f"dilu-{pkg.replace('_', '-')}.service" for pkg in METRICS_PORTS}


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _start(pkg: str, base_env: dict[str, str], tmp_path) -> tuple[subprocess.Popen, int]:
    unit = parse_unit(UNITS[pkg])
    env = dict(base_env)
    dirs = {"/var/lib/dilu": tmp_path / "state", "/var/cache/dilu": tmp_path / "cache", "/run/dilu": tmp_path / "run",
            AUTH: tmp_path / "auth"}
    for key, value in unit_environment(unit).items():
        for real, here in dirs.items():
            value = value.replace(real, str(here))
        env[key] = value
    for here in dirs.values():
        here.mkdir(exist_ok=True)
    argv = [w.replace(PREFIX, ROOT) for w in exec_start(unit, env)]
    assert argv[0] == f"{ROOT}/.venv/bin/python", argv
    port = int(argv[argv.index("--metrics-port") + 1])
    assert port == METRICS_PORTS[pkg]
    log = open(tmp_path / f"{pkg}.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port


@pytest.fixture
def secured_nats(tmp_path):
    """A nats-server admitting only the users ``dilu creds`` wrote for this host's node."""
    ensure_creds(tmp_path / "auth", [default_node()])
    with EmbeddedNats(config=tmp_path / "auth" / AUTH_CONF) as server:
        yield server.url


async def test_units_start_a_cluster_that_serves(secured_nats, tmp_path):
    nats_url = secured_nats
    shipped = env_file(DEPLOY / "systemd" / "dilu.env.example")
    env = {**os.environ, **{k: v.replace(PREFIX, ROOT) for k, v in shipped.items()}, "DILU_NATS_URL": nats_url}
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for pkg in ("scheduler", "profiler", "node_agent", "vertical_scaler", "horizontal_scaler", "gateway"):
            procs[pkg] = _start(pkg, env, tmp_path)
        deadline = time.monotonic() + 90
        while not all(_ready(port) for _, port in procs.values()):
            for pkg, (proc, _) in procs.items():
                assert proc.poll() is None, (pkg, (tmp_path / f"{pkg}.log").read_text()[-3000:])
            assert time.monotonic() < deadline, "services not ready within 90 s"
            await asyncio.sleep(0.2)

        # the operator deploys, a caller invokes: each with the credentials file alone
        creds = tmp_path / "auth" / "creds"
        nc = await connect(NatsOptions(servers=(nats_url,), creds=creds / "operator.creds"), name="test-operator")
        caller = await connect(NatsOptions(servers=(nats_url,), creds=creds / "caller.creds"), name="test-caller")
        js = nc.jetstream()
        # the agent named itself after the host and published its emulated GPUs
        kv = await js.key_value(subjects.NODES_BUCKET)
        inv = msgspec.json.decode((await kv.get(subjects.token(default_node()))).value, type=NodeInventory)
        assert inv.device == "emulated" and len(inv.gpus) == 4
        assert {g.memory_bytes for g in inv.gpus} == {40 * 2**30} and {g.sms for g in inv.gpus} == {108}
        assert len({g.uuid for g in inv.gpus}) == 4

        # deployed as `dilu deploy` does: admitted, profiled on that node, stored in KV
        # dilu-functions, given its initial instance, invoked
        spec = function_spec("unit-fn", "resnet152", peak_rps=20)
        await deploy_all(nc, [spec], timeout_s=150)
        client = InvokeClient(caller, caller.jetstream())
        await client.start()
        now = time.time_ns()
        results = await asyncio.gather(*(client.invoke("unit-fn", b"x", request_id=f"u{i}", scheduled_ns=now,
                                                       timeout_s=120) for i in range(20)))
        await client.close()
        assert [r.status for r in results] == ["ok"] * 20, {r.error for r in results}
        # and over HTTP, on the address and port the gateway's unit and the environment file give
        argv = exec_start(parse_unit(UNITS["gateway"]), env)
        url = f"http://{env['DILU_HOST']}:{argv[argv.index('--port') + 1]}/v1/functions/unit-fn:invoke"
        request = urllib.request.Request(url, data=b"x", headers={"Dilu-Timeout": "60"}, method="POST")
        with urllib.request.urlopen(request, timeout=90) as resp:
            assert resp.status == 200 and resp.headers["Dilu-Instance"]
        await nc.drain()
        await caller.drain()
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for pkg, (proc, _) in procs.items():
            try:
                code = proc.wait(timeout=35)  # TimeoutStopSec=30 in the units
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"{pkg} did not stop within the unit's stop timeout")
            assert code == 0, (pkg, code, (tmp_path / f"{pkg}.log").read_text()[-2000:])
