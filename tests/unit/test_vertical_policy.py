"""Vertical scaling policy: fake clock (ms), no I/O."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilu.contracts.events import InstanceTelemetry
from dilu.services.vertical_scaler.policy import VerticalConfig, VerticalPolicy

GPU = 0


def tel(iid, prio="latency-sensitive", req=0.3, lim=0.6, quota=None, used=0.0, wait_us=0, queue=0,
        slo_ms=0.0, latency_ms=0.0):
    return InstanceTelemetry(instance_id=iid, function=f"f-{iid}", priority=prio, quota=req if quota is None else quota,
                             request_quota=req, limit_quota=lim, width=lim, sm_time_share=used,
                             busy_share=min(1.0, used / lim), wait_us=wait_us, queue_depth=queue,
                             slo_ms=slo_ms, latency_ms_recent=latency_ms)


class Node:
    """Applies grants like a node agent would and reports them back in the next telemetry."""

    def __init__(self, policy, specs, check_sum=True):
        self.policy, self.specs, self.check_sum = policy, specs, check_sum  # iid -> dict(prio, req, lim)
        self.quota = {i: s["req"] for i, s in specs.items()}
        self.sent = []

    def report(self, now_ms, **load):
        """``load``: iid -> dict(used=..., wait_us=..., queue=...) (default idle)."""
        rows = [tel(i, s["prio"], s["req"], s["lim"], quota=self.quota[i], **load.get(i, {}))
                for i, s in self.specs.items()]
        return self.apply(self.policy.on_telemetry(GPU, now_ms, rows))

    def stretch(self, now_ms, iid, ratio=3.0):
        return self.apply(self.policy.on_stretch(GPU, now_ms, iid, ratio))

    def apply(self, grants):
        running = dict(self.quota)
        for g in grants:  # in order: the sum must never exceed 1, even between two grants
            if g.instance_id not in self.specs:
                continue  # retired here: the node agent has no block to write it to
            running[g.instance_id] = g.quota
            assert not self.check_sum or sum(running.values()) <= 1.0 + 1e-6, grants
        self.quota = running
        self.sent.extend(grants)
        return {g.instance_id: g for g in grants}


SPECS = {
    "ls": dict(prio="latency-sensitive", req=0.3, lim=0.7),
    "tr": dict(prio="training", req=0.3, lim=0.6),
    "be": dict(prio="best-effort", req=0.2, lim=0.5),
}


def busy(q):
    return dict(used=q, wait_us=500)


def test_idle_share_goes_to_the_instances_that_can_use_it():
    node = Node(VerticalPolicy(), SPECS)
    node.report(0.0, tr=busy(0.3), be=busy(0.2), ls=dict(used=0.05))
    # LS idle at its request 0.3; 0.2 left over: training (higher tier) gets it before best-effort.
    assert node.quota["ls"] == pytest.approx(0.3)
    assert node.quota["tr"] == pytest.approx(0.5)
    assert node.quota["be"] == pytest.approx(0.2)
    # training stops wanting more: its extra share flows to best-effort, up to be's limit,
    # released gradually (release_per_s 0.5: at most 0.05 per 100 ms window)
    tr_series = []
    for k in range(1, 11):
        node.report(100.0 * k, tr=dict(used=0.1), be=busy(node.quota["be"]), ls=dict(used=0.05))
        tr_series.append(node.quota["tr"])
        assert sum(node.quota.values()) <= 1.0 + 1e-9
    assert tr_series[0] == pytest.approx(0.45)
    assert node.quota["tr"] == pytest.approx(0.3)
    assert node.quota["be"] == pytest.approx(0.4)


def test_stretch_raises_latency_sensitive_at_once_taking_from_best_effort_then_training():
    node = Node(VerticalPolicy(), SPECS)
    node.report(0.0, tr=busy(0.3), be=busy(0.2), ls=dict(used=0.05))
    node.report(100.0, tr=dict(used=0.1), be=busy(0.2), ls=dict(used=0.05))
    before = dict(node.quota)
    grants = node.stretch(150.0, "ls", ratio=2.5)
    # toward its limit 0.7 in one step, as far as the floors (training 0.3, best-effort 0.05) allow
    assert node.quota["ls"] == pytest.approx(0.65)
    assert "stretch" in grants["ls"].reason
    assert node.quota["be"] < before["be"]  # best-effort yields
    assert node.quota["tr"] >= 0.3 - 1e-9  # training never below its request
    assert node.quota["be"] >= 0.05 - 1e-9  # best-effort keeps its floor
    # decreases are sent before the increase
    order = [g.instance_id for g in node.sent[-len(grants):]]
    assert order.index("ls") == len(order) - 1


def test_training_gives_back_only_down_to_its_request():
    specs = {"ls": dict(prio="latency-sensitive", req=0.2, lim=0.9),
             "tr": dict(prio="training", req=0.4, lim=0.8),
             "be": dict(prio="best-effort", req=0.1, lim=0.4)}
    node = Node(VerticalPolicy(), specs)
    node.report(0.0, tr=busy(0.4), be=busy(0.1), ls=dict(used=0.0))
    node.stretch(10.0, "ls")
    assert node.quota["tr"] == pytest.approx(0.4)
    assert node.quota["be"] == pytest.approx(0.05)
    assert node.quota["ls"] == pytest.approx(1.0 - 0.4 - 0.05)  # as close to its limit as floors allow


def test_slo_pressure_from_telemetry_acts_like_a_stretch():
    node = Node(VerticalPolicy(), SPECS)
    node.report(0.0, tr=busy(0.3), be=busy(0.2), ls=dict(used=0.05))
    grants = node.report(100.0, tr=busy(0.3), be=busy(0.2), ls=dict(used=0.05, slo_ms=50.0, latency_ms=48.0))
    assert node.quota["ls"] == pytest.approx(0.65)
    assert grants["ls"].reason.startswith("pressure: slo")


def test_unknown_weak_or_non_latency_sensitive_stretch_changes_nothing():
    node = Node(VerticalPolicy(), SPECS)
    node.report(0.0, tr=busy(0.3), be=busy(0.2))
    assert node.stretch(10.0, "nobody") == {}
    assert node.stretch(10.0, "ls", ratio=1.2) == {}
    assert node.stretch(10.0, "be", ratio=5.0) == {}
    with pytest.raises(ValueError, match="ratio"):
        node.policy.on_stretch(GPU, 10.0, "ls", math.nan)


def test_recovery_after_pressure_is_gradual_and_additive():
    cfg = VerticalConfig(pressure_hold_ms=200.0, recovery_per_s=0.5, hysteresis=0.02)
    node = Node(VerticalPolicy(cfg), SPECS)
    node.report(0.0, tr=busy(0.3), be=busy(0.2), ls=dict(used=0.05))
    node.stretch(10.0, "ls")
    cut = node.quota["be"] + node.quota["tr"]
    history = []
    for k in range(1, 31):  # 3 s of 100 ms windows, LS now idle again
        now = 10.0 + 100.0 * k
        node.report(now, tr=busy(node.quota["tr"]), be=busy(node.quota["be"]), ls=dict(used=0.05))
        history.append((now, node.quota["be"], node.quota["tr"], node.quota["ls"]))
    victims = [b + t for _, b, t, _ in history]  # what best-effort and training got back
    assert all(v2 >= v1 - 1e-9 for v1, v2 in zip(victims, victims[1:]))  # monotone recovery
    # additive: no window gives back more than 2 victims x recovery_per_s x 100 ms (+ hysteresis)
    steps = [v2 - v1 for v1, v2 in zip([cut] + victims, victims)]
    assert max(steps) <= 2 * 0.5 * 0.1 + 0.02 + 1e-9
    assert len([s for s in steps if s > 1e-9]) >= 3  # gradual: several steps, not one jump
    assert history[-1][1] == pytest.approx(0.2) and history[-1][2] == pytest.approx(0.5)  # fully back
    assert history[-1][3] == pytest.approx(0.3)  # the LS instance released back to its request


def test_hysteresis_suppresses_small_changes():
    node = Node(VerticalPolicy(VerticalConfig(hysteresis=0.05)), SPECS)
    for k in range(20):  # settle under a steady load
        node.report(100.0 * k, ls=dict(used=0.2), tr=dict(used=0.2), be=dict(used=0.1))
    before = dict(node.quota)
    grants = node.report(2000.0, ls=dict(used=0.21), tr=dict(used=0.21), be=dict(used=0.11))
    assert grants == {} and node.quota == before


def test_withheld_decrease_is_sent_when_needed_for_the_sum():
    # be sits at 0.38 (reported); a pressured LS needs room: even a small be decrease must go out
    specs = {"ls": dict(prio="latency-sensitive", req=0.3, lim=0.62),
             "be": dict(prio="best-effort", req=0.2, lim=0.7)}
    node = Node(VerticalPolicy(VerticalConfig(hysteresis=0.05)), specs)
    node.quota = {"ls": 0.6, "be": 0.4}
    node.report(0.0, ls=dict(used=0.6, wait_us=10), be=busy(0.4))
    assert sum(node.quota.values()) <= 1.0 + 1e-9
    assert node.quota["ls"] >= 0.3


def test_malformed_telemetry_is_rejected_without_touching_state():
    policy = VerticalPolicy()
    node = Node(policy, SPECS)
    node.report(0.0, tr=busy(0.3))
    before = policy.quotas(GPU)
    bad = [tel("ls", used=0.1), tel("x", used=1.7)]
    with pytest.raises(ValueError, match="sm_time_share"):
        policy.on_telemetry(GPU, 10.0, bad)
    with pytest.raises(ValueError, match="instance_id"):
        policy.on_telemetry(GPU, 10.0, [tel("", used=0.1)])
    assert policy.quotas(GPU) == before


def test_retired_instances_are_forgotten_once_missing_for_forget_after_ms():
    node = Node(VerticalPolicy(VerticalConfig(forget_after_ms=1000.0)), SPECS)
    node.report(0.0)
    node.policy.on_telemetry(GPU, 100.0, [tel("ls")])
    assert set(node.policy.quotas(GPU)) == {"ls", "tr", "be"}  # one window's omission: kept
    node.policy.on_telemetry(GPU, 1100.0, [tel("ls")])
    assert set(node.policy.quotas(GPU)) == {"ls"}


@pytest.mark.parametrize("mode,expect", [("static", "req"), ("static-limit", "lim")])
def test_static_modes_pin_quotas(mode, expect):
    node = Node(VerticalPolicy(VerticalConfig(mode=mode)), SPECS, check_sum=mode == "static")
    node.quota = {"ls": 0.5, "tr": 0.2, "be": 0.1}
    node.apply(node.policy.on_telemetry(GPU, 0.0, [
        tel(i, s["prio"], s["req"], s["lim"], quota=node.quota[i], used=0.9 * s["lim"], wait_us=5)
        for i, s in SPECS.items() if mode == "static" or i != "tr"]))  # static-limit: Σ 1.2 allowed
    for i, q in node.quota.items():
        if i in node.policy.quotas(GPU):
            assert q == pytest.approx(SPECS[i][expect])
    assert node.stretch(10.0, "ls") == {}  # pinned: pressure changes nothing


def test_off_mode_never_grants():
    node = Node(VerticalPolicy(VerticalConfig(mode="off")), SPECS)
    assert node.report(0.0, be=busy(0.2)) == {}
    assert node.stretch(5.0, "ls") == {}


def test_bad_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="mode"):
        VerticalConfig(mode="turbo")


# ---------------------------------------------------------------------- properties

PRIOS = ["latency-sensitive", "training", "best-effort"]


@st.composite
def gpus(draw):
    n = draw(st.integers(1, 5))
    reqs = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    total = sum(reqs) or 1.0
    scale = draw(st.floats(0.1, 0.9)) / max(total, 1.0)
    specs = {}
    for k, r in enumerate(reqs):
        req = round(r * scale, 4)
        lim = min(1.0, req + draw(st.floats(0.0, 0.6)))
        specs[f"i{k}"] = dict(prio=draw(st.sampled_from(PRIOS)), req=req, lim=max(lim, 0.01))
    return specs


step = st.one_of(
    st.tuples(st.just("tel"), st.dictionaries(st.sampled_from([f"i{k}" for k in range(5)]),
                                              st.tuples(st.floats(0, 1), st.booleans(), st.floats(0, 200)))),
    st.tuples(st.just("stretch"), st.sampled_from([f"i{k}" for k in range(5)])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=gpus(), steps=st.lists(st.tuples(st.floats(1, 400), step), min_size=1, max_size=25),
       hysteresis=st.sampled_from([0.0, 0.02, 0.1]))
def test_grants_respect_sum_floors_and_limits(specs, steps, hysteresis):
    policy = VerticalPolicy(VerticalConfig(hysteresis=hysteresis))
    node = Node(policy, specs)
    now = 0.0
    node.report(now)
    for dt, (kind, arg) in steps:
        now += dt
        if kind == "stretch":
            node.stretch(now, arg)
        else:
            load = {}
            for iid, (frac, waiting, lat) in arg.items():
                if iid in specs:
                    load[iid] = dict(used=frac * node.quota[iid], wait_us=1000 if waiting else 0,
                                     slo_ms=100.0, latency_ms=lat)
            node.report(now, **load)
        assert sum(node.quota.values()) <= 1.0 + 1e-6  # Node.apply also checks every prefix
        for iid, s in specs.items():
            q = node.quota[iid]
            assert q <= s["lim"] + 1e-6
            assert q > 0
            if s["prio"] != "best-effort":
                assert q >= s["req"] - 1e-6


def test_share_nobody_asked_for_is_parked_on_latency_sensitive_instances_and_taken_back():
    specs = {"a": dict(prio="latency-sensitive", req=0.1, lim=0.4),
             "b": dict(prio="latency-sensitive", req=0.1, lim=0.2),
             "be": dict(prio="best-effort", req=0.1, lim=0.3)}
    parked = Node(VerticalPolicy(VerticalConfig(park_idle=True)), specs)
    parked.report(0.0)  # all idle: 0.7 nobody wants; a and b have 0.3 + 0.1 of room
    assert parked.quota["a"] == pytest.approx(0.4) and parked.quota["b"] == pytest.approx(0.2)
    assert parked.quota["be"] < 0.1 + 1e-9  # best-effort gets no parked share
    # best-effort becomes hungry: it takes its want first, the parked share shrinks to what is left
    parked.report(100.0, be=busy(parked.quota["be"]))
    assert parked.quota["be"] == pytest.approx(0.3)
    assert sum(parked.quota.values()) <= 1.0 + 1e-9
    plain = Node(VerticalPolicy(), specs)  # the default
    plain.report(0.0)
    assert plain.quota["a"] == pytest.approx(0.1) and plain.quota["b"] == pytest.approx(0.1)  # left unallocated
