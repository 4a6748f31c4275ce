"""Dilu's vertical scaling as published (PublishedVertical) beside ours, on a fake clock."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu.services.common.policies import modes
from dilu.services.vertical_scaler.policy import PublishedVertical, VerticalConfig, VerticalPolicy, vertical_policy

from test_vertical_policy import Node

SPECS = {
    "ls": dict(prio="latency-sensitive", req=0.3, lim=0.7),
    "tr": dict(prio="training", req=0.2, lim=0.7),
}
TICK = 250.0
TRAINING_BUSY = dict(used=0.7, wait_us=500)


def published():
    return Node(PublishedVertical(), SPECS)


def windows(node, start, n, **load):
    """``n`` telemetry windows from window ``start``; the last one's grants."""
    out = {}
    for k in range(start, start + n):
        out = node.report(k * TICK, tr=TRAINING_BUSY, **load)
    return out


def test_the_mode_names_the_class_and_the_platform_policy_selects_it():
    assert type(vertical_policy(VerticalConfig(mode="published"))) is PublishedVertical
    assert type(vertical_policy(VerticalConfig(mode="dilu"))) is VerticalPolicy
    assert modes("dilu-published").vertical == "published"
    with pytest.raises(ValueError):
        PublishedVertical(inference_samples=0)
    with pytest.raises(ValueError, match="park_idle"):  # lending idle share is what it does not do
        VerticalConfig(mode="published", park_idle=True)


def test_a_queue_without_stretch_leaves_inference_at_its_request_where_ours_lends_it_idle_share():
    hungry = dict(used=0.3, wait_us=2000, queue=5)
    ours, theirs = Node(VerticalPolicy(), SPECS), published()
    for k in range(8):
        ours.report(k * TICK, ls=hungry)
        theirs.report(k * TICK, ls=hungry)
    assert ours.quota["ls"] == pytest.approx(0.7)  # work conserving: wants its limit
    assert theirs.quota["ls"] == pytest.approx(0.3)  # not lent: only a stretch raises it


def test_slo_latency_is_no_signal_only_a_stretch_is():
    node = published()
    windows(node, 0, 4, ls=dict(used=0.3, latency_ms=500.0, **{}))
    assert node.quota["ls"] == pytest.approx(0.3)


def test_a_stretch_raises_inference_to_its_limit_for_one_fixed_window_of_20_samples():
    node = published()
    windows(node, 0, 40)  # training has grown to what is left
    assert node.quota["tr"] == pytest.approx(0.7)
    node.stretch(40 * TICK, "ls")
    assert node.quota["ls"] == pytest.approx(0.7)
    assert node.quota["tr"] == pytest.approx(0.3)  # AIMD: its ceiling halved, 0.7 -> 0.35, Σ <= 1
    windows(node, 41, 19)  # 19 quiet samples: still raised
    assert node.quota["ls"] == pytest.approx(0.7)
    windows(node, 60, 1)  # the 20th: back to the request
    assert node.quota["ls"] == pytest.approx(0.3)


def test_training_recovers_additively_one_step_per_40_quiet_samples():
    node = published()
    windows(node, 0, 1)
    node.stretch(TICK, "ls")  # training's ceiling 0.7 -> 0.35
    windows(node, 1, 39)
    assert node.quota["tr"] == pytest.approx(0.35)  # inference back at 0.3 after 20; no step yet
    windows(node, 40, 1)
    assert node.quota["tr"] == pytest.approx(0.45)  # 40 quiet samples: + 0.1
    windows(node, 41, 39)
    assert node.quota["tr"] == pytest.approx(0.45)
    windows(node, 80, 1)
    assert node.quota["tr"] == pytest.approx(0.55)


def test_a_new_stretch_restarts_both_windows():
    node = published()
    windows(node, 0, 1)
    node.stretch(TICK, "ls")
    windows(node, 1, 30)
    node.stretch(31 * TICK, "ls")  # before training's first step
    windows(node, 31, 39)
    assert node.quota["ls"] == pytest.approx(0.3)
    assert node.quota["tr"] < 0.35  # halved again, no step in between
    assert node.policy.windows_to_settle(0) == 1  # its next step is one window away


def test_windows_to_settle_counts_down_and_ends_at_the_limit():
    node = published()
    windows(node, 0, 1)
    assert node.policy.windows_to_settle(0) == 0  # nothing raised, training at its limit
    node.stretch(TICK, "ls")
    assert node.policy.windows_to_settle(0) == 40
    windows(node, 1, 10)
    assert node.policy.windows_to_settle(0) == 30
    windows(node, 11, 200)
    assert node.quota["tr"] == pytest.approx(0.7)
    assert node.policy.windows_to_settle(0) == 0
    assert VerticalPolicy().windows_to_settle(0) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tel", "stretch-ls", "stretch-ls2"]),
                          st.floats(0, 1), st.integers(0, 3)), min_size=1, max_size=120))
def test_grants_never_sum_over_one_nor_leave_floors_and_limits(events):
    specs = dict(SPECS, ls2=dict(prio="latency-sensitive", req=0.25, lim=0.6),
                 be=dict(prio="best-effort", req=0.1, lim=0.4))
    node = Node(PublishedVertical(), specs)  # Node asserts Σ <= 1 after every single grant
    for k, (kind, used, queue) in enumerate(events):
        if kind == "tel":
            node.report(k * TICK, ls=dict(used=used * 0.7, queue=queue), tr=TRAINING_BUSY)
        else:
            node.stretch(k * TICK, kind.removeprefix("stretch-"))
        for iid, s in specs.items():
            floor = s["req"] if s["prio"] != "best-effort" else min(s["lim"], 0.05)
            assert floor - 1e-6 <= node.quota[iid] <= s["lim"] + 1e-6


@pytest.mark.parametrize("args, words", [
    (["--mode", "static", "--release-per-s", "2"], "--mode static does not read --release-per-s"),
    (["--mode", "published", "--pressure-hold-ms", "100"], "does not read --pressure-hold-ms"),
    (["--mode", "off", "--decrease-factor", "0.3"], "does not read --decrease-factor"),
    (["--mode", "published", "--park-idle"], "--park-idle"),
])
def test_the_service_refuses_knobs_its_mode_does_not_read(args, words):
    from click.testing import CliRunner

    from cli_errors import one_line_error
    from dilu.services.vertical_scaler.__main__ import main

    assert words in one_line_error(CliRunner().invoke(main, args), 2)
