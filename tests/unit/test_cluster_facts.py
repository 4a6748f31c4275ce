"""A live run's GPU figures cover the replay only: ``cluster_facts(since=...)`` subtracts the
time integrals scraped as the replay began (profiling trials and the initial instances'
warm-up come before it), while counts of events stay the whole run's, as in ``dilu sim``."""
from __future__ import annotations

import pytest

from dilu.cli.deploy import cluster_counters, cluster_facts


class Scraped:
    """Stands in for a Cluster: ``metrics(service)`` returns the current /metrics samples."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, float]] = {}

    def set(self, *, active: float, alloc: float, idle: float, quota: float, launches: int, trials: int) -> None:
        self.samples = {
            "node_agent": {
                "dilu_active_gpu_seconds_total{node=n1,gpu=0}": active,
                "dilu_allocation_frag_gpu_seconds_total{node=n1,gpu=0}": alloc,
                "dilu_idle_frag_gpu_seconds_total{node=n1,gpu=0}": idle,
                "dilu_quota_seconds_total{function=f}": quota,
                "dilu_instance_launches_total{function=f}": launches,
                "dilu_vertical_reaction_ms{quantile=0.5}": 2.0,
                "dilu_vertical_reaction_ms{quantile=0.99}": 7.0,
            },
            "profiler": {"dilu_profiler_trials_total": trials},
            "scheduler": {"dilu_scheduler_migrations_total": 7},
            "horizontal_scaler": {
                "dilu_scale_outs_total{function=f}": 3,
                "dilu_parks_total{function=f}": 4, "dilu_parks_total{function=g}": 1,
                "dilu_resumes_total{function=f,outcome=resumed}": 1, "dilu_resumes_total{function=g,outcome=resumed}": 1,
                "dilu_resumes_total{function=f,outcome=relaunched}": 1, "dilu_resumes_total{function=g,outcome=refused}": 6,
            },
        }

    def metrics(self, service: str) -> dict[str, float]:
        return self.samples.get(service, {})


def test_time_integrals_count_from_the_replay_and_events_from_the_start():
    cluster = Scraped()
    cluster.set(active=30.0, alloc=27.0, idle=29.0, quota=3.0, launches=1, trials=40)  # profiled, warmed up
    start = cluster_counters(cluster)
    cluster.set(active=130.0, alloc=77.0, idle=69.0, quota=43.0, launches=3, trials=40)  # after the replay
    facts = cluster_facts(cluster, since=start)
    assert facts["gpu"]["active_gpu_seconds"] == pytest.approx(100.0)
    assert facts["gpu"]["allocation_fragmentation"] == pytest.approx(0.5)  # (77 - 27) / 100
    assert facts["gpu"]["idle_fragmentation"] == pytest.approx(0.4)
    assert facts["per_function"]["f"] == {"quota_seconds": pytest.approx(40.0), "instance_launches": 3}
    assert facts["mechanism"]["profiler_trials"] == 40
    assert (facts["mechanism"]["vertical_reaction_ms_p50"], facts["mechanism"]["vertical_reaction_ms_p99"]) == (2.0, 7.0)
    whole = cluster_facts(cluster)  # no start given: since the services started
    assert whole["gpu"]["active_gpu_seconds"] == pytest.approx(130.0)
    assert whole["per_function"]["f"]["quota_seconds"] == pytest.approx(43.0)


def test_parks_count_every_instance_and_resumes_only_those_back_on_their_gpu():
    """``parks``: dilu_parks over every function; ``resumes``: outcome="resumed" only, over every
    function (a relaunch is a scale-out, a refused resume brought nothing back)."""
    cluster = Scraped()
    cluster.set(active=1.0, alloc=0.0, idle=0.0, quota=0.0, launches=1, trials=0)
    mechanism = cluster_facts(cluster)["mechanism"]
    assert (mechanism["parks"], mechanism["resumes"], mechanism["scale_outs"]) == (5, 2, 3)
    assert mechanism["migrations"] == 7  # the scheduler's defragmentation moves
