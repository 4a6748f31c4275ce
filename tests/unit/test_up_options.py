"""``dilu up`` refuses bad input with one line before starting anything: ports out of range or
taken, a data directory it cannot write, a second ``dilu up`` on the same data directory; and
its options reach the processes it would start."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dilu.services.common.natsserver import free_ports
from click.testing import CliRunner

import dilu.cli.up as up_module
from dilu.cli.main import main
from dilu.cli.up import DataDirLock, Refused, UpOptions, cluster_for, default_data_dir
from dilu.services.common.policies import DEFRAG_INTERVAL_S, PARK_AFTER_S


def up(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["up", *args], env=env)


def one_line_error(result, exit_code: int) -> str:
    """The result's output, checked to be a click error (no traceback) with ``exit_code``."""
    assert result.exit_code == exit_code, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.output
    return result.output


@pytest.fixture
def listening():
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, needle", [
    (["--nats-port", "70000"], "--nats-port"),
    (["--gateway-port", "0"], "--gateway-port"),
    (["--nats-port", "http"], "--nats-port"),
    (["--gpus", "lots"], "--gpus"),
    (["--gpus", "65"], "--gpus"),
    (["--device", "tpu"], "--device"),
    (["--node", "two words"], "--node"),
    (["--policy", "fastest"], "--policy"),
    (["--gpus", "cpu", "--device", "emulated"], "--device emulated"),
    (["--nats-port", "5000", "--gateway-port", "5000"], "both 5000"),
])
def test_bad_options_are_one_line_usage_errors(args, needle, tmp_path):
    out = one_line_error(up(*args, "--data-dir", str(tmp_path)), 2)
    assert needle in out
    assert not (tmp_path / "nats").exists(), "nothing may start on bad input"


def test_options_come_from_dilu_environment_variables(tmp_path):
    out = one_line_error(up("--data-dir", str(tmp_path), env={"DILU_NATS_PORT": "99999"}), 2)
    assert "99999" in out and "--nats-port" in out
    out = one_line_error(up(env={"DILU_DATA_DIR": str(tmp_path), "DILU_GPUS": "cpu", "DILU_DEVICE": "nvml"}), 2)
    assert "--device nvml" in out


def test_data_dir_that_cannot_be_created_or_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # free ports: the default ones may be taken by a dilu up running on this machine
    ports = [f"--{name}-port={port}" for name, port in zip(("nats", "gateway"), free_ports(2))]
    out = one_line_error(up("--data-dir", str(blocker / "dilu"), *ports), 2)
    assert "--data-dir" in out and "not a writable directory" in out
    out = one_line_error(up("--data-dir", str(tmp_path / "ok"), "--log-dir", str(blocker), *ports), 2)
    assert "--log-dir" in out and "not a writable directory" in out
    assert not (tmp_path / "ok").exists(), "a refused dilu up creates nothing, not even the data directory"
    for log_dir in ("/proc", "/proc/dilu/logs"):  # directories that take no file, even from root
        out = one_line_error(up("--data-dir", str(tmp_path / "ok"), "--log-dir", log_dir, *ports), 2)
        assert "--log-dir" in out and "nothing can be created in" in out
        assert not (tmp_path / "ok").exists(), "the data directory was made before the log directory was refused"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_data_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        out = one_line_error(up("--data-dir", str(ro)), 2)
        assert "not a writable directory" in out
    finally:
        ro.chmod(0o700)


def test_a_second_up_on_one_data_dir_is_refused(tmp_path):
    nats_port, gateway_port = free_ports(2)
    with DataDirLock(tmp_path):
        out = one_line_error(up("--data-dir", str(tmp_path), "--nats-port", str(nats_port),
                                "--gateway-port", str(gateway_port)), 2)
    assert f"another dilu up (pid {os.getpid()})" in out and str(tmp_path) in out
    assert not (tmp_path / "nats").exists()


def test_the_lock_dies_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from dilu.cli.up import DataDirLock; l = DataDirLock(Path(sys.argv[1])).acquire(); "
                               "print('held', flush=True); sys.stdin.read()", str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Refused, match=f"pid {holder.pid}"):
            DataDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with DataDirLock(tmp_path) as lock:  # the kernel released it: the stale file does not block
        assert lock.path.read_text().strip() == str(os.getpid())


@pytest.mark.parametrize("option", ["--nats-port", "--gateway-port"])
def test_a_taken_port_is_refused_and_the_lock_released(option, listening, tmp_path):
    nats_port, gateway_port = free_ports(2)
    ports = {"--nats-port": nats_port, "--gateway-port": gateway_port, option: listening}
    out = one_line_error(up("--data-dir", str(tmp_path), *[str(x) for kv in ports.items() for x in kv]), 2)
    assert f"port {listening}" in out and f"in use ({option})" in out
    DataDirLock(tmp_path).acquire().release()


@pytest.mark.parametrize("option", ["--nats-port", "--gateway-port"])
def test_a_refused_start_leaves_nothing_behind(option, listening, tmp_path):
    nats_port, gateway_port = free_ports(2)
    ports = [str(x) for kv in {"--nats-port": nats_port, "--gateway-port": gateway_port, option: listening}.items()
             for x in kv]
    fresh = tmp_path / "fresh"  # a data directory not there yet stays absent
    out = one_line_error(up("--data-dir", str(fresh), "--log-dir", str(tmp_path / "logs"), *ports), 2)
    assert f"in use ({option})" in out
    assert list(tmp_path.iterdir()) == []
    used = tmp_path / "used"  # one from an earlier run gets no logs/ and no up.lock
    (used / "nats").mkdir(parents=True)
    one_line_error(up("--data-dir", str(used), *ports), 2)
    assert [p.name for p in used.iterdir()] == ["nats"]


def test_a_second_up_holding_the_ports_too_is_named(listening, tmp_path):
    with DataDirLock(tmp_path):
        out = one_line_error(up("--data-dir", str(tmp_path), "--nats-port", str(listening)), 2)
    assert f"another dilu up (pid {os.getpid()})" in out


def test_options_reach_the_services(tmp_path):
    opts = UpOptions(nats_port=4333, gateway_port=8111, data_dir=tmp_path, device="emulated", gpus="2",
                     node="rack1-n3", policy="exclusive", log_dir=tmp_path / "logs")
    cluster = cluster_for(opts)
    assert cluster.nats_port == 4333 and cluster.nats_store == tmp_path / "nats"
    assert cluster.gateway and cluster.gateway_url == "http://127.0.0.1:8111"
    assert "gateway" in cluster.service_names
    agent = cluster._args("node_agent")
    assert agent[agent.index("--device") + 1] == "emulated" and agent[agent.index("--gpus") + 1] == "2"
    assert agent[agent.index("--node") + 1] == "rack1-n3"
    assert agent[agent.index("--initial-grant") + 1] == "limit"  # the exclusive policy's
    gateway = cluster._args("gateway")
    assert gateway[gateway.index("--port") + 1] == "8111"
    cpu = cluster_for(UpOptions(**{**opts.__dict__, "gpus": "cpu", "device": "auto"}))._args("node_agent")
    assert cpu[cpu.index("--device") + 1] == "auto" and cpu[cpu.index("--gpus") + 1] == "cpu"


def test_default_data_dir_is_the_user_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_data_dir() == Path(tmp_path) / "dilu"


def hs_params(opts: UpOptions) -> dict:
    """The horizontal scaler's parameters as it would parse the arguments ``dilu up`` gives it."""
    from dilu.services.horizontal_scaler.__main__ import main as horizontal_scaler

    return horizontal_scaler.make_context("horizontal_scaler", cluster_for(opts)._args("horizontal_scaler")).params


def test_park_after_s_reaches_the_horizontal_scaler(tmp_path):
    opts = UpOptions(nats_port=4333, gateway_port=8111, data_dir=tmp_path, device="emulated", gpus="2",
                     node="n1", policy="dilu", log_dir=tmp_path / "logs")
    assert hs_params(opts)["park_after_s"] == PARK_AFTER_S  # the policy's by default
    assert hs_params(UpOptions(**{**opts.__dict__, "policy": "exclusive"}))["park_after_s"] == 0
    assert hs_params(UpOptions(**{**opts.__dict__, "park_after_s": 5.0}))["park_after_s"] == 5
    assert hs_params(UpOptions(**{**opts.__dict__, "policy": "exclusive", "park_after_s": 12.5}))["park_after_s"] == 12.5
    assert hs_params(UpOptions(**{**opts.__dict__, "park_after_s": 0.0}))["park_after_s"] == 0


def test_park_after_s_comes_from_the_option_or_dilu_park_after_s(monkeypatch, tmp_path):
    seen: list[UpOptions] = []
    monkeypatch.setattr(up_module, "run_up", seen.append)
    assert up("--data-dir", str(tmp_path), "--park-after-s", "7").exit_code == 0
    assert up("--data-dir", str(tmp_path), env={"DILU_PARK_AFTER_S": "9"}).exit_code == 0
    assert up("--data-dir", str(tmp_path)).exit_code == 0
    assert [o.park_after_s for o in seen] == [7, 9, None]
    for value in ("-1", "nan", "86401"):
        out = one_line_error(up("--data-dir", str(tmp_path), "--park-after-s", value), 2)
        assert "--park-after-s" in out
    out = one_line_error(up("--data-dir", str(tmp_path), env={"DILU_PARK_AFTER_S": "soon"}), 2)
    assert "DILU_PARK_AFTER_S" in out
    assert len(seen) == 3


def test_defrag_interval_s_reaches_the_scheduler_from_the_option_or_its_variable(monkeypatch, tmp_path):
    from dilu.services.scheduler.__main__ import main as scheduler

    def interval(opts: UpOptions) -> float:
        return scheduler.make_context("scheduler", cluster_for(opts)._args("scheduler")).params["defrag_interval_s"]

    opts = UpOptions(nats_port=4333, gateway_port=8111, data_dir=tmp_path, device="emulated", gpus="2",
                     node="n1", policy="dilu", log_dir=tmp_path / "logs")
    assert interval(opts) == DEFRAG_INTERVAL_S  # the policy's by default
    assert interval(UpOptions(**{**opts.__dict__, "policy": "exclusive"})) == 0
    assert interval(UpOptions(**{**opts.__dict__, "defrag_interval_s": 0.0})) == 0
    assert interval(UpOptions(**{**opts.__dict__, "policy": "exclusive", "defrag_interval_s": 12.5})) == 12.5
    seen: list[UpOptions] = []
    monkeypatch.setattr(up_module, "run_up", seen.append)
    assert up("--data-dir", str(tmp_path), "--defrag-interval-s", "7").exit_code == 0
    assert up("--data-dir", str(tmp_path), env={"DILU_DEFRAG_INTERVAL_S": "0"}).exit_code == 0
    assert [o.defrag_interval_s for o in seen] == [7, 0]
    out = one_line_error(up("--data-dir", str(tmp_path), "--defrag-interval-s", "0.001"), 2)
    assert "--defrag-interval-s" in out


def test_device_nvml_without_a_driver_is_refused_before_anything_is_created(monkeypatch, tmp_path):
    monkeypatch.setattr(up_module.nvml, "available", lambda: False)
    data = tmp_path / "data"
    out = one_line_error(up("--data-dir", str(data), "--device", "nvml"), 2)
    assert "--device nvml" in out and not data.exists()
