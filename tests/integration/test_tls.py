"""TLS with client verification against a real nats-server (``tls { verify: true }``).

trustme makes a CA, a server certificate for 127.0.0.1 and a client certificate. A service (the
scheduler, through the runner) and ``dilu status`` connect with ``--tls-ca/--tls-cert/--tls-key``;
a client without a certificate, or one that does not trust the CA, is refused with one clear line.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import nats
import nkeys
import pytest
import trustme

from dilu.services.common.natsconn import NatsOptions, PlainTextRefused, connect, encrypted
from dilu.services.common.natsserver import find_binary, free_port
from dilu.services.common.runner import running
from dilu.services.scheduler.service import SchedulerService

pytestmark = pytest.mark.nats

DILU = [sys.executable, "-m", "dilu.cli.main"]


@pytest.fixture
def pki(tmp_path):
    """CA, server and client certificates as PEM files: dict of name -> Path."""
    ca = trustme.CA()
    other = trustme.CA()  # a CA the server does not know
    files = {}

    def write(name: str, blob) -> None:
        files[name] = tmp_path / f"{name}.pem"
        blob.write_to_path(str(files[name]))

    write("ca", ca.cert_pem)
    server = ca.issue_cert("127.0.0.1")
    write("server-cert", server.cert_chain_pems[0])
    write("server-key", server.private_key_pem)
    client = ca.issue_cert("dilu-operator")
    write("client-cert", client.cert_chain_pems[0])
    write("client-key", client.private_key_pem)
    write("other-ca", other.cert_pem)
    stranger = other.issue_cert("stranger")
    write("stranger-cert", stranger.cert_chain_pems[0])
    write("stranger-key", stranger.private_key_pem)
    return files


@contextlib.contextmanager
def nats_with_tls(folder, pki, *, optional: bool = False):
    """nats-server with JetStream and TLS in ``folder``, verifying client certificates, or with
    ``optional`` TLS offered and not required (``allow_non_tls``, no client verification); its URL."""
    port = free_port()
    conf = folder / "tls.conf"
    conf.write_text(f"""
listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{folder / 'js'}" }}
{"allow_non_tls: true" if optional else ""}
tls {{
  cert_file: "{pki['server-cert']}"
  key_file: "{pki['server-key']}"
  ca_file: "{pki['ca']}"
  verify: {"false" if optional else "true"}
  timeout: 2
}}
""")
    log = open(folder / "nats.log", "wb")
    proc = subprocess.Popen([find_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, (folder / "nats.log").read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def tls_url(tmp_path, pki):
    """nats-server with JetStream, TLS and client certificate verification; its URL."""
    with nats_with_tls(tmp_path, pki) as url:
        yield url


def tls_options(url: str, pki, cert: str = "client", ca: str = "ca") -> NatsOptions:
    return NatsOptions(servers=(url,), tls_ca=pki[ca], tls_cert=pki[f"{cert}-cert"], tls_key=pki[f"{cert}-key"])


async def test_a_service_connects_with_a_client_certificate(tls_url, pki):
    options = tls_options(tls_url, pki)
    svc = SchedulerService()
    async with running(svc, options, ready_timeout_s=15):
        assert svc.ready()
        # the same options open a connection of their own; a plain client is refused
        nc = await connect(options, name="test")
        assert nc.is_connected and nc.connected_url.hostname == "127.0.0.1" and encrypted(nc)
        await nc.close()
    with pytest.raises(Exception):
        await nats.connect(tls_url, connect_timeout=2, allow_reconnect=False)


def dilu_status(tls_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILU_")}
    return subprocess.run([*DILU, "status", "--nats-url", tls_url, "--listen", "0", "--json", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_dilu_status_over_tls_and_clear_refusals(tls_url, pki):
    ok = dilu_status(tls_url, "--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client-cert"]),
                     "--tls-key", str(pki["client-key"]))
    assert ok.returncode == 0, ok.stderr
    assert '"nodes"' in ok.stdout

    refusals = {
        "no client certificate": ["--tls-ca", str(pki["ca"])],
        "a CA the server did not sign with": ["--tls-ca", str(pki["other-ca"]), "--tls-cert",
                                              str(pki["client-cert"]), "--tls-key", str(pki["client-key"])],
        "a certificate from another CA": ["--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["stranger-cert"]),
                                          "--tls-key", str(pki["stranger-key"])],
        "no TLS at all": [],
    }
    for case, args in refusals.items():
        proc = dilu_status(tls_url, *args)  # under --json the error is the result on stdout
        assert proc.returncode != 0, case
        assert proc.stderr == "", (case, proc.stderr)
        error = json.loads(proc.stdout)
        assert error["exit_code"] == proc.returncode and tls_url in error["error"], (case, error)
        assert "\n" not in error["error"], (case, error)


def test_bad_tls_files_are_one_line(tls_url, pki, tmp_path):
    missing = dilu_status(tls_url, "--tls-ca", str(tmp_path / "missing.pem"))  # a usage error, under --json
    assert missing.returncode == 2 and missing.stderr == "", missing.stderr
    assert json.loads(missing.stdout) == {
        "error": f"Invalid value for '--tls-ca': File '{tmp_path / 'missing.pem'}' does not exist.", "exit_code": 2}
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for args in (["--tls-ca", str(garbage)], ["--tls-ca", str(pki["ca"]), "--tls-cert", str(garbage),
                                             "--tls-key", str(pki["client-key"])]):
        proc = dilu_status(tls_url, *args)  # refused on the command line, before any connection
        assert proc.returncode == 2 and proc.stderr == "", proc.stderr
        error = json.loads(proc.stdout)
        assert error["exit_code"] == 2 and "cannot load the TLS files" in error["error"], error
        assert "\n" not in error["error"], error


def test_benches_take_the_tls_options(tls_url, pki):
    from click.testing import CliRunner

    from dilu.cli.main import main

    tls = ["--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client-cert"]), "--tls-key", str(pki["client-key"])]
    runner = CliRunner()
    res = runner.invoke(main, ["bench", "loadgen", "--nats-url", tls_url, *tls, "--rate", "100", "--seconds", "0.3"])
    assert res.exit_code == 0, res.output
    assert '"core NATS publish"' not in res.output and "core NATS publish" in res.output
    res = runner.invoke(main, ["bench", "invoke", "--nats-url", tls_url, *tls, "--rate", "50", "--seconds", "0.3",
                               "--search-s", "0"])
    assert res.exit_code == 0, res.output
    assert f'"transport": "{tls_url}"' in res.output
    # refused (no client certificate): one line naming the server, no traceback
    res = runner.invoke(main, ["bench", "loadgen", "--nats-url", tls_url, "--tls-ca", str(pki["ca"]),
                               "--seconds", "0.3"])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and tls_url in res.output, res.output
    # TLS options without --nats-url would not apply to the bench's own server: refused
    res = runner.invoke(main, ["bench", "vertical", *tls, "--events", "10"])
    assert res.exit_code == 2 and "--nats-url" in res.output, res.output


async def test_tls_asked_of_a_server_in_clear_is_refused_before_anything_is_sent(nats_url, pki, tmp_path):
    """nats-py speaks TLS only when the server requires it, and would send its CONNECT line (the
    identity's nonce signature, which a machine in the middle could pass on) to a server in clear.
    A tls:// URL, or a --tls-* file, is refused at the server's greeting instead."""
    received: list[bytes] = []

    async def greet_in_clear(reader, writer):  # what a machine in the middle would answer
        writer.write(b'INFO {"server_id":"x","version":"2.10.0","proto":1,"max_payload":1048576,'
                     b'"nonce":"abc","auth_required":true}\r\n')
        await writer.drain()
        received.append(await reader.read(4096))  # b"" once the client hangs up
        writer.close()

    fake = await asyncio.start_server(greet_in_clear, "127.0.0.1", 0)
    fake_url = f"tls://127.0.0.1:{fake.sockets[0].getsockname()[1]}"
    creds = tmp_path / "op.seed"
    creds.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
    for reconnect in ({"allow_reconnect": False}, {"max_reconnect_attempts": -1}):  # a service's: no retry either
        with pytest.raises(PlainTextRefused, match="offers no TLS"):
            await asyncio.wait_for(connect(NatsOptions(servers=(fake_url,), creds=creds), name="test",
                                           connect_timeout=2, error_cb=_quiet, **reconnect), 10)
    fake.close()
    assert received == [b"", b""], "nothing may be sent to a server that offers no TLS"

    clear_as_tls = nats_url.replace("nats://", "tls://")
    with pytest.raises(PlainTextRefused, match="offers no TLS"):
        await connect(NatsOptions(servers=(nats_url,), tls_ca=pki["ca"]), name="test", allow_reconnect=False,
                      error_cb=_quiet)
    nc = await connect(nats_url, name="test")  # nats:// without TLS files: clear text, as asked
    assert nc.is_connected and not encrypted(nc)
    await nc.close()

    proc = dilu_status(clear_as_tls)  # a command: one line under --json
    assert proc.returncode != 0 and proc.stderr == "", proc.stderr
    assert "offers no TLS" in json.loads(proc.stdout)["error"]
    # a service: exit 2 with the one line, as for any deployment mistake it cannot run with
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILU_")}
    svc = subprocess.run([sys.executable, "-m", "dilu.services.scheduler", "--nats-url", clear_as_tls,
                          "--metrics-port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert svc.returncode == 2, svc.stderr
    assert svc.stderr.strip().splitlines()[-1].startswith("dilu scheduler: ") and "offers no TLS" in svc.stderr


async def _quiet(exc: Exception) -> None:
    """An error callback that keeps nats-py from printing each failed attempt."""


async def test_a_server_that_offers_tls_without_requiring_it_is_used_over_tls(tmp_path, pki):
    with nats_with_tls(tmp_path, pki, optional=True) as url:
        clear = await connect(url, name="test")  # it admits clients in clear
        assert not encrypted(clear)
        await clear.close()
        nc = await connect(NatsOptions(servers=(url.replace("nats://", "tls://"),), tls_ca=pki["ca"]), name="test")
        assert nc.is_connected and encrypted(nc)
        await nc.close()
