"""The named policies are defined once; the live cluster's service arguments come from them."""
from dilu.cli.cluster import POLICIES
from dilu.cli.demo import replay_args
from dilu.services.common import policies
from dilu.services.horizontal_scaler.policy import MODES as H_MODES
from dilu.services.scheduler.policy import ALLOCATIONS
from dilu.services.vertical_scaler.policy import MODES as V_MODES


def test_cluster_arguments_come_from_the_shared_table():
    assert list(POLICIES) == ["dilu", "horizontal-only", "static-mps", "exclusive", "dilu-published"]
    assert POLICIES["dilu"] == {"vertical_scaler": ["--mode", "dilu"],
                                "horizontal_scaler": ["--mode", "lazy", "--park-after-s", "30"],
                                "scheduler": ["--policy", "dilu", "--defrag-interval-s", "30"],
                                "node_agent": ["--initial-grant", "request"]}
    assert POLICIES["exclusive"]["node_agent"] == ["--initial-grant", "limit"]
    # the baselines leave instances where they were placed; a replay compresses the interval
    assert POLICIES["horizontal-only"]["scheduler"] == ["--policy", "static-mps", "--defrag-interval-s", "0"]
    assert replay_args(10.0, "dilu")["scheduler"] == ["--defrag-interval-s", "3"]
    assert replay_args(10.0, "static-mps")["scheduler"] == ["--defrag-interval-s", "0"]
    # --defrag-interval-s of demo/compare: trace seconds, compressed; the baselines still never
    assert replay_args(10.0, "dilu", defrag_interval_s=120.0)["scheduler"] == ["--defrag-interval-s", "12"]
    assert replay_args(10.0, "dilu-published", defrag_interval_s=0.0)["scheduler"] == ["--defrag-interval-s", "0"]
    assert replay_args(10.0, "horizontal-only", defrag_interval_s=120.0)["scheduler"] == ["--defrag-interval-s", "0"]
    # dilu parks, compressed like the keep-alive; the baselines never, unless a run asks all to
    assert replay_args(10.0, "dilu")["horizontal_scaler"][-2:] == ["--park-after-s", "3"]
    assert POLICIES["horizontal-only"]["horizontal_scaler"] == ["--mode", "kpa", "--park-after-s", "0"]
    assert replay_args(10.0, "horizontal-only", park_after_s=5.0)["horizontal_scaler"][-2:] == ["--park-after-s", "0.5"]
    assert replay_args(10.0, "dilu", park_after_s=0.0)["horizontal_scaler"][-2:] == ["--park-after-s", "0"]
    for name, m in policies.POLICIES.items():
        assert POLICIES[name] == m.service_args()


def test_every_mode_is_one_the_services_know():
    for m in policies.POLICIES.values():
        assert m.vertical in V_MODES and m.horizontal in H_MODES and m.allocation in ALLOCATIONS
        assert m.initial_grant in ("request", "limit")


def test_unknown_policy_is_one_line():
    try:
        policies.modes("nope")
    except ValueError as exc:
        assert "nope" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError("no error")
