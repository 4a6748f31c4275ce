"""Every command that takes --nats-url fails within seconds, with one line on stderr and no
traceback, when nothing listens there (``dilu service X`` is exempt: services wait for NATS)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "image-classifier" / "function.toml"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


COMMANDS = {
    "bench vertical": ["bench", "vertical"],  # retried for ever before
    "demo": ["demo"],
    "compare": ["compare"],
    "deploy": ["deploy", str(EXAMPLE)],
    "undeploy": ["undeploy", "fn"],
    "invoke": ["invoke", "fn"],
    "status": ["status"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_command_fails_fast_with_one_line_when_nats_is_unreachable(name, tmp_path):
    url = f"nats://127.0.0.1:{closed_port()}"
    env = {**os.environ, "DILU_NATS_URL": url}
    proc = subprocess.run([sys.executable, "-m", "dilu.cli.main", *COMMANDS[name], "--nats-url", url],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 5, proc.stderr  # every command's code for an unreachable NATS
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert url in lines[0] and "reach" in lines[0], lines[0]


@pytest.mark.parametrize("command", ["invoke", "undeploy"])
@pytest.mark.parametrize("name", ["../x", "a/b", "x" * 5000, ""])
def test_a_bad_function_name_is_a_usage_error_before_any_connection(command, name):
    from click.testing import CliRunner

    from dilu.cli.main import main

    r = CliRunner().invoke(main, [command, name, "--nats-url", f"nats://127.0.0.1:{closed_port()}"])
    assert r.exit_code == 2, r.output
    assert "is not a function name" in r.output and len(r.output) < 1000  # a long name is cut
