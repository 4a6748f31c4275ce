"""A real client in another language: a Node.js program (nats.js and ajv from the npm registry) reads
the bus of a ``dilu up`` as the integrator while a function is deployed and invoked, validates every
event against the exported JSON Schemas and the CloudEvents headers, and is refused when it
publishes (tests/e2e/integrator/integrator.mjs)."""
from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import platformdirs
import pytest

from dilu.contracts import cloudevents as ce
from dilu.contracts import subjects as sj
from dilu.contracts.codec import encode
from dilu.contracts.events import FunctionDeployed, FunctionSpec, FunctionUndeployed, TokenGrant
from dilu.services.common.natsconn import ENV_INBOX_PREFIX
from dilu.services.common.permissions import inbox_prefix
from dilu.services.common.bus import settle

from test_up import DILU, invoke, start, stop, ups  # noqa: F401  (ups: the fixture)

pytestmark = [pytest.mark.nats]

HERE = Path(__file__).parent / "integrator"
SCHEMAS = Path(__file__).parents[2] / "contracts" / "schema"
NODE = "integ0"
FUNCTION = "integrator-probe"
INSTALL_TIMEOUT_S = 300
SUBSCRIBED_TIMEOUT_S = 30
INVOCATIONS = 24  # in CONCURRENCY threads: enough demand for the vertical scaler to raise the quota
CONCURRENCY = 8
# the events that a deploy and its first invocations must produce
EXPECTED = {"NodeInventory", "GpuTelemetry", "FunctionDeployed", "ProfileReady", "PlacementDecided",
            "InstanceLaunched", "InstanceReady"}

SPEC = f"""\
name = "{FUNCTION}"
slo_ms = 500.0
initial_scale = 1
max_instances = 1

[emulation]
model = "bert_base"

[profile]
request_quota = 0.3
limit_quota = 1.0
batch_size = 1
"""


def npm_modules() -> Path:
    """node_modules with the pinned nats.js and ajv, installed from the registry once per version of
    package.json/package-lock.json into the user cache (outside the repository) and reused."""
    files = ("package.json", "package-lock.json")
    key = hashlib.sha256(b"".join((HERE / f).read_bytes() for f in files)).hexdigest()[:16]
    home = Path(platformdirs.user_cache_dir("dilu")) / "npm-integrator" / key
    if (home / "node_modules" / ".dilu-complete").exists():
        return home / "node_modules"
    staging = home.with_name(f"{key}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in files:
        shutil.copy(HERE / f, staging / f)
    done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=staging,
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
    (staging / "node_modules" / ".dilu-complete").write_text(key)
    try:
        staging.rename(home)  # a concurrent run may have won: then use its copy
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return home / "node_modules"


@pytest.fixture
def integrator_dir(tmp_path) -> Path:
    """A folder holding integrator.mjs and (a link to) its node_modules; skips without node/npm."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: the Node.js integrator cannot run")
    work = tmp_path / "integrator"
    work.mkdir()
    shutil.copy(HERE / "integrator.mjs", work / "integrator.mjs")
    (work / "node_modules").symlink_to(npm_modules())
    return work


def every_subject() -> dict[str, dict[str, str]]:
    """SUBJECT_EVENTS for integrator.mjs: pattern -> its event type and that type's JSON Schema."""
    return {pattern: {"type": kind.__name__, "schema": str(SCHEMAS / f"{kind.__name__}.json")}
            for pattern, kind in sj.SUBJECT_EVENTS.items()}


def run_integrator(work: Path, config: dict) -> subprocess.Popen:
    """Start integrator.mjs with ``config``; returns once it has subscribed to every pattern."""
    (work / "config.json").write_text(json.dumps(config))
    proc = subprocess.Popen(["node", str(work / "integrator.mjs"), str(work / "config.json")], cwd=work,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], SUBSCRIBED_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        pytest.fail(f"the integrator did not subscribe within {SUBSCRIBED_TIMEOUT_S} s:\n{proc.communicate()}")
    assert json.loads(line) == {"subscribed": len(config["subjects"])}
    return proc


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    """Close the integrator's stdin (it then tries its publishes); its summary and a report for failures."""
    try:
        out, err = proc.communicate("", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = out.strip().splitlines()
    assert lines, f"no summary (exit code {proc.returncode}):\n{err}"
    summary = json.loads(lines[-1])
    return summary, json.dumps(summary, indent=1) + "\n" + err


@pytest.mark.native
@pytest.mark.slow
def test_a_node_integrator_validates_every_event_and_may_not_publish(tmp_path, ups, integrator_dir):  # noqa: F811
    """During a short demo on ``dilu up`` (deploy, a cold start, a burst of invocations) the
    integrator, connected with D/creds/integrator.creds, sees the events a deploy and its
    invocations produce, every one valid, and the server refuses its own TokenGrant and
    FunctionDeployed."""
    data, fn = tmp_path / "data", tmp_path / "fn"
    fn.mkdir()
    (fn / "function.toml").write_text(SPEC)
    up = start(ups, data, "--node", NODE)
    url = f"nats://127.0.0.1:{up.nats_port}"
    creds = data / "creds" / "integrator.creds"
    assert creds.is_file(), f"dilu up wrote no {creds}"

    # well-formed events a rogue integrator might send: a full GPU for itself, a function of its own
    grant = json.loads(encode(TokenGrant(node=NODE, gpu=0, instance_id="forged", quota=1.0)))
    deployed = json.loads(encode(FunctionDeployed(spec=FunctionSpec(name="forged", slo_ms=500.0))))
    publish = [{"subject": sj.grant_issued(NODE, 0), "type": "TokenGrant", "payload": grant},
               {"subject": sj.function_deployed("forged"), "type": "FunctionDeployed", "payload": deployed}]
    node = run_integrator(integrator_dir, {"url": url, "creds": str(creds), "subjects": every_subject(),
                                           "publish": publish})
    subscribed = time.monotonic()
    try:
        done = subprocess.run([DILU, "deploy", str(fn / "function.toml"), "--nats-url", url,
                               "--creds", str(data / "creds" / "operator.creds")],
                              capture_output=True, text=True, timeout=200, env={**os.environ, ENV_INBOX_PREFIX: inbox_prefix("operator")})
        assert done.returncode == 0, done.stdout + done.stderr
        code, instance, body = invoke(up, FUNCTION)  # the cold start
        assert code == 200 and instance, body
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for code, instance, body in pool.map(lambda _: invoke(up, FUNCTION), range(INVOCATIONS)):
                assert code == 200 and instance, body
        # a node agent's inventory heartbeat comes at least once in this long
        time.sleep(max(0.0, subscribed + sj.NODE_HEARTBEAT_S + 1.0 - time.monotonic()))
    finally:
        summary, report = finish(node)
    assert summary["invalid_count"] == 0 and node.returncode == 0, report
    assert EXPECTED <= set(summary["counts"]), report
    assert summary["errors"] == [], report  # e.g. a subscription to an event subject refused
    assert summary["publish_refused"], report
    assert sorted(summary["publish"]["refused"]) == sorted(p["subject"] for p in publish), report
    print(json.dumps({k: summary[k] for k in ("counts", "total", "sources", "publish")}))
    stop(up)


async def test_the_integrator_reports_each_kind_of_invalid_event(nc, nats_url, integrator_dir):
    """The checks themselves: one valid event passes and each defect is named (an open test server:
    no credentials, nothing to publish)."""
    def event(case: str) -> tuple[str, bytes, dict[str, str]]:
        ev = FunctionUndeployed(name=case, ts_ns=time.time_ns())
        return sj.function_undeployed(case), encode(ev), ce.headers(ev, ce.source("test"))

    subject, data, good = event("valid")
    cases = {  # case -> (payload, headers or None, the reason expected)
        "schema": (b'{"name": 5}', good | {ce.H_ID: "id-schema"}, "schema: /name must be string"),
        "no-id": (data, {k: v for k, v in good.items() if k != ce.H_ID}, "header ce-id missing"),
        "type": (data, good | {ce.H_ID: "id-type", ce.H_TYPE: "io.dilu.v1.TokenGrant"}, "ce-type"),
        "twice": (data, good, "seen before"),
        "time": (data, good | {ce.H_ID: "id-time", ce.H_TIME: "yesterday"}, "not an RFC 3339 time"),
        "skew": (data, good | {ce.H_ID: "id-skew", ce.H_TIME: "2001-01-01T00:00:00Z"}, "ns from ts_ns"),
        "json": (b"{", good | {ce.H_ID: "id-json"}, "not UTF-8 JSON"),
        "content": (data, good | {ce.H_ID: "id-ct", ce.H_CONTENT_TYPE: "text/plain"}, "content-type"),
        "bare": (data, None, "no headers"),
    }
    proc = run_integrator(integrator_dir, {"url": nats_url, "creds": None, "subjects": every_subject(), "publish": []})
    try:
        await nc.publish(subject, data, headers=good)
        for case, (payload, headers, _) in cases.items():
            await nc.publish(sj.function_undeployed(case), payload, headers=headers)
        await settle(nc)  # in the server: the integrator's own flush (after stdin closes) then sees them all
    finally:
        summary, report = finish(proc)
    assert proc.returncode == 1, report
    assert summary["counts"] == {"FunctionUndeployed": 1 + len(cases)}, report
    assert summary["invalid_count"] == len(cases), report
    reasons = {item["subject"]: " | ".join(item["reasons"]) for item in summary["invalid"]}
    for case, (_, _, reason) in cases.items():
        assert reason in reasons.get(sj.function_undeployed(case), ""), (case, report)
    assert not summary["publish_refused"]
