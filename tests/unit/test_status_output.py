"""``dilu status`` printed into a pipe or file: every line within the report width (100 columns,
as the demo's report), wide tables split by columns with their key columns repeated, free text
(decision reasons, why a function is unplaceable) wrapped at words, nothing cut."""
from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

import dilu.cli.functions as functions
from dilu.cli.demo import REPORT_WIDTH
from dilu.client import admin
from dilu.contracts import events as ev

NODE = "gpu-node-17.cluster.example.org"
REASON = "stable: window 12.3 in flight, target 4; headroom 0.35 unused for 3.2 s"
UNPLACEABLE = "no GPU has room for a request of 0.30 and 1.9 GiB of memory [gamma 1.5]"


def wide_status() -> admin.Status:
    now = time.time_ns()
    gpus = [ev.GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * 2**30, sms=108)
            for i in range(4)]
    node = admin.NodeStatus(inventory=ev.NodeInventory(node=NODE, device="emulated", gpus=gpus), age_s=3.0)
    decisions = [ev.ScaleDecision(function="image-classifier", direction="out", count=1, reason=REASON,
                                  ts_ns=now - 12 * 10**9),
                 ev.ScaleDecision(function="image-classifier", direction="park", count=1,
                                  reason="idle 31.0 s >= 30 s: parked", ts_ns=now - 5 * 10**9)]
    spec = ev.FunctionSpec(name="image-classifier", model="resnet152", slo_ms=100, memory_bytes=2_000_000_000)
    profile = ev.Profile(function="image-classifier", request_quota=0.3, limit_quota=0.6, batch_size=8)

    def instance(n: int, **kw) -> admin.InstanceStatus:
        return admin.InstanceStatus(instance_id=f"image-classifier-{n:010x}", node=NODE, gpu=n, request_quota=0.3,
                                    limit_quota=0.6, width=0.6, memory_bytes=2_000_000_000, batch_size=8, grant=0.45,
                                    **kw)

    functions_ = [
        admin.FunctionStatus(name="image-classifier", spec=spec, profile=profile, backlog=12,
                             instances=[instance(0), instance(1, draining=True), instance(2, parked=True)],
                             state=ev.FunctionState(function="image-classifier", instances=3, ready=2, desired=3,
                                                    decisions=decisions)),
        admin.FunctionStatus(name="text-generator", spec=spec, profile=profile, instances=[instance(3)],
                             state=ev.FunctionState(function="text-generator", placeable=False, reason=UNPLACEABLE)),
        admin.FunctionStatus(name="text-encoder", instances=[instance(4, parked=True)]),  # undeployed, no state
    ]
    return admin.Status(nodes=[node], functions=functions_, taken_ns=now)


@pytest.fixture
def status_output(monkeypatch) -> str:
    st = wide_status()
    monkeypatch.setattr(functions, "run", lambda options, work: st)
    result = CliRunner().invoke(functions.status, [], env={"COLUMNS": None})
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def test_status_fits_the_report_width_in_a_pipe(status_output):
    widths = [len(line.rstrip()) for line in status_output.splitlines()]
    assert max(widths) <= REPORT_WIDTH, "\n".join(line for line in status_output.splitlines()
                                                  if len(line.rstrip()) > REPORT_WIDTH)


def test_status_split_tables_keep_every_figure_and_their_key_columns(status_output):
    text = status_output
    for piece in ("Nodes (1)", NODE, "NVIDIA A100-SXM4-40GB", "40.0 GiB", "Functions (3)", "100 ms",
                  "0.30 / 0.60 / 8", "ready 2, desired 3, parked 1", "(parked 1)", "undeployed", "12 s ago", "1.9 GiB",
                  "draining", "parked", "0.45"):
        assert piece in text, piece
    # free text wraps at words: every word of it is there, none cut
    for phrase in (REASON, UNPLACEABLE, "unplaceable:"):
        for word in phrase.split():
            assert f" {word}" in text or f"({word}" in text, word
    # the instance tables are split with function and instance repeated: each id once per part
    parts = text.count("Instances (")
    assert parts >= 2 and text.count("image-classifier-0000000002") == parts
