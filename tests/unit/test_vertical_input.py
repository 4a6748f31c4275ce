"""The vertical policy does not trust its telemetry window: omitted instances keep their grant in
Σ, a duplicated instance counts once (fake clock, ms; no I/O)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilu.services.vertical_scaler.policy import VerticalConfig, VerticalPolicy

from test_vertical_policy import GPU, PRIOS, Node, busy, tel


def test_an_omitted_instance_keeps_its_grant_in_the_sum():
    """Field case: a window without the training instance let the others' grants sum to 1.40."""
    specs = {"ls": dict(prio="latency-sensitive", req=0.3, lim=0.7),
             "tr": dict(prio="training", req=0.3, lim=0.7)}
    node = Node(VerticalPolicy(), specs)  # Node.apply asserts Σ ≤ 1 over every instance it runs
    node.report(0.0, tr=busy(0.3))
    assert node.quota["tr"] > 0.6
    node.policy.on_telemetry(GPU, 250.0, [tel("ls", "latency-sensitive", 0.3, 0.7, quota=node.quota["ls"],
                                              used=0.3, wait_us=900)])
    assert sum(node.quota.values()) <= 1.0 + 1e-9
    assert node.policy.omitted_rows == 1
    assert node.policy.quotas(GPU)["tr"] == node.quota["tr"]


def test_a_duplicated_instance_counts_once_and_breaks_no_floor():
    """Field case: an instance listed twice (the second row claiming more) pushed a neighbour to
    0.25, below its 0.30 request."""
    policy = VerticalPolicy()
    rows = [tel("ls", req=0.3, lim=0.7), tel("tr", "training", req=0.3, lim=0.6),
            tel("ls", req=0.9, lim=0.95)]
    policy.on_telemetry(GPU, 0.0, rows)
    q = policy.quotas(GPU)
    assert q["tr"] >= 0.3 - 1e-9 and q["ls"] >= 0.3 - 1e-9
    assert sum(q.values()) <= 1.0 + 1e-9
    assert policy.duplicate_rows == 1


@st.composite
def gpus(draw):
    n = draw(st.integers(1, 5))
    reqs = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    scale = draw(st.floats(0.1, 0.9)) / max(sum(reqs), 1.0)
    specs = {}
    for k, r in enumerate(reqs):
        req = round(r * scale, 4)
        lim = max(0.01, min(1.0, req + draw(st.floats(0.0, 0.6))))
        specs[f"i{k}"] = dict(prio=draw(st.sampled_from(PRIOS)), req=req, lim=lim)
    return specs


# One row per instance: (omitted, listed twice, busy fraction of its quota, waiting, stretch)
row = st.tuples(st.booleans(), st.booleans(), st.floats(0, 1), st.booleans(), st.booleans())
window = st.tuples(st.floats(1, 600), st.lists(row, min_size=5, max_size=5), st.randoms())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=gpus(), windows=st.lists(window, min_size=1, max_size=25),
       hysteresis=st.sampled_from([0.0, 0.02, 0.1]))
def test_no_window_breaks_the_sum_or_a_floor(specs, windows, hysteresis):
    cfg = VerticalConfig(hysteresis=hysteresis, forget_after_ms=1500.0)
    policy = VerticalPolicy(cfg)
    node = Node(policy, specs)  # checks Σ ≤ 1 over every running instance after each grant
    missing_since: dict[str, float] = {}
    now = 0.0
    node.report(now)
    for dt, rows, rnd in windows:
        now += dt
        listed = []
        for (iid, s), (omit, twice, frac, waiting, stretch) in zip(list(node.specs.items()), rows):
            if omit:
                missing_since.setdefault(iid, now)
                if now - missing_since[iid] >= cfg.forget_after_ms:  # the policy takes it for retired:
                    del node.specs[iid], node.quota[iid]  # in this model it is (it never comes back)
                continue
            missing_since.pop(iid, None)
            r = tel(iid, s["prio"], s["req"], s["lim"], quota=node.quota[iid], used=frac * node.quota[iid],
                    wait_us=1000 if waiting else 0)
            listed += [r, tel(iid, s["prio"], s["req"], s["lim"], quota=node.quota[iid],
                              used=rnd.random() * node.quota[iid])] if twice else [r]
            if stretch:
                node.stretch(now, iid)
        rnd.shuffle(listed)
        node.apply(policy.on_telemetry(GPU, now, listed))
        assert sum(node.quota.values()) <= 1.0 + 1e-6
        for iid, s in node.specs.items():
            q = node.quota[iid]
            assert 0 < q <= s["lim"] + 1e-6
            if s["prio"] != "best-effort":
                assert q >= s["req"] - 1e-6


def test_a_retired_instance_gives_its_share_back_at_once():
    """Rule 6 kept a retired instance's grant for forget_after_ms (2 s); the node agent's
    InstanceRetired says the process is gone, so its neighbour gets the share on that event."""
    specs = {"ls": dict(prio="latency-sensitive", req=0.3, lim=0.9),
             "tr": dict(prio="training", req=0.5, lim=0.7)}
    node = Node(VerticalPolicy(), specs)
    node.report(0.0, tr=busy(0.5), ls=busy(0.3))
    assert node.quota["ls"] < 0.6  # training holds at least its request
    assert node.apply(node.policy.on_retired(GPU, 10.0, "nope")) == {}  # unknown: nothing changes
    del node.specs["tr"]
    grants = node.policy.on_retired(GPU, 10.0, "tr")
    assert "tr" not in node.policy.quotas(GPU)
    node.quota.pop("tr")
    node.apply(grants)
    assert node.quota["ls"] >= 0.9 - 1e-9  # its limit, at the retirement, not 2 s later
    assert node.policy.on_retired(7, 10.0, "ls") == []  # another GPU: nothing known there
