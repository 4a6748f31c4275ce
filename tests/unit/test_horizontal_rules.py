"""The horizontal scaler's rules moved out of its service: profile -> parameters, initial-scale
gating, placement back-off (pure, clock injected)."""
from __future__ import annotations

import pytest

from dilu.contracts.events import FunctionSpec, Profile
from dilu.services.horizontal_scaler.policy import (
    FunctionParams,
    InitialScaleGate,
    PlacementBackoff,
    function_params,
)


def prof(**kw) -> Profile:
    base = dict(function="f", request_quota=0.3, limit_quota=0.6, batch_size=4, burst_batch=8,
                throughput_rps=200.0, latency_ms=20.0)
    return Profile(**{**base, **kw})


def test_defaults_without_spec_or_profile():
    p = function_params(None, None, None)
    assert (p.target, p.min_instances, p.max_instances, p.initial_scale, p.burst_target) == (1.0, 0, 8, -1, 0.0)


def test_profile_sets_targets_from_batch_latency_and_slo():
    p = function_params(None, prof(limit_latency_ms=25.0, limit_throughput_rps=320.0), None, slo_ms=100.0)
    assert p.target == 4 * 5  # batch 4, five 20 ms batches back to back within 100 ms
    assert p.instance_rps == 200.0
    assert p.burst_target == 8 * 4 and p.burst_rps == 320.0  # burst batch 8, four 25 ms batches
    assert p.sizing("lazy") == (32, 320.0) and p.sizing("eager") == (20, 200.0)


def test_old_profile_without_limit_measurement_has_no_burst_sizing_and_no_slo_means_batch():
    p = function_params(None, prof(), None, slo_ms=0.0)
    assert p.target == 4 and p.burst_target == 0 and p.burst_rps == 0


def test_spec_sets_bounds_and_keeps_profile_sizing():
    old = function_params(None, prof(), None, slo_ms=100.0)
    spec = FunctionSpec(name="f", min_instances=3, max_instances=2, initial_scale=2, keep_alive_s=-5)
    p = function_params(spec, None, old)
    assert (p.min_instances, p.max_instances) == (3, 3)  # max raised to min
    assert (p.initial_scale, p.keep_alive_s) == (2, 0.0)
    assert p.target == old.target and p.instance_rps == old.instance_rps


def test_a_training_job_is_held_at_its_min_instances_and_says_so():
    """A training job has no request backlog: its decision names it a training job, not a backlog
    that could not be read (what ``dilu status`` shows as its last decision)."""
    from dilu.services.horizontal_scaler.policy import HorizontalConfig, HorizontalPolicy

    spec = FunctionSpec(name="t", kind="training", min_instances=1, max_instances=1)
    params = function_params(spec, None, None)
    assert params.training and function_params(None, prof(), params).training  # kept without a spec
    pol = HorizontalPolicy(HorizontalConfig(mode="lazy"))
    pol.add_function("t", params)
    pol.record("t", 1.0, None)
    d = pol.decide("t", 1.0)
    assert d.place == 1 and d.reason == "training job (it takes no requests): its min_instances, 1"
    inference = FunctionParams(min_instances=1)
    pol.add_function("i", inference)
    pol.instance_starting("i", "i0", 1.0)
    pol.record("i", 1.5, None)
    assert pol.decide("i", 1.5).reason.startswith("backlog unknown")


def test_fixed_target_overrides_every_target():
    p = function_params(None, prof(limit_latency_ms=25.0, limit_throughput_rps=320.0), None, slo_ms=100.0,
                        fixed_target=3.0)
    assert p.target == 3.0 and p.burst_target == 0.0


def test_inconsistent_bounds_raise():
    with pytest.raises(ValueError):
        function_params(None, None, FunctionParams(), fixed_target=-1.0)


@pytest.mark.parametrize("order", [("deployed", "profiled"), ("profiled", "deployed")])
def test_gate_opens_once_when_deployed_and_profiled_in_either_order(order):
    g = InitialScaleGate()
    first, second = (getattr(g, name) for name in order)
    assert first("f") is False
    assert second("f") is True
    assert g.profiled("f") is False and g.deployed("f") is False  # once per deployment
    g.forget("f")
    assert g.deployed("f") is False and g.profiled("f") is True  # a redeploy after undeploy opens again


def test_gate_never_opens_for_training_or_restored_functions():
    g = InitialScaleGate()
    g.training("t", True)
    assert g.deployed("t") is False and g.profiled("t") is False and g.is_training("t")
    assert g.profiled("r") is False  # restored profile, never deployed live: no initial scale
    g.training("t", False)  # redeployed as inference
    assert g.deployed("t") is True


def test_backoff_doubles_from_the_tick_up_to_the_maximum_and_clears():
    b = PlacementBackoff(0.5, 3.0)
    assert not b.blocked("f", 0.0)
    delays = [b.failed("f", 10.0) for _ in range(5)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.blocked("f", 12.9) and not b.blocked("f", 13.0)
    assert not b.blocked("g", 10.0)  # per function
    b.clear("f")
    assert b.delay("f") == 0.0 and not b.blocked("f", 10.0)
    assert b.failed("f", 20.0) == 0.5
    with pytest.raises(ValueError):
        PlacementBackoff(0.0, 1.0)


def test_shared_constants_have_one_truth():
    """The stretch threshold, priority classes and memory units come from services/common/functions."""
    from typing import get_args

    from dilu.contracts.events import PriorityClass
    from dilu.services.common import functions as fx
    from dilu.services.node_agent import accounting
    from dilu.services.vertical_scaler.policy import VerticalConfig

    assert VerticalConfig().stretch_ratio == accounting.STRETCH_RATIO == fx.STRETCH_RATIO
    assert set(fx.PRIORITY_RANK) == set(get_args(PriorityClass))
    assert [fx.yields_share(p) for p in (fx.LATENCY_SENSITIVE, fx.TRAINING, fx.BEST_EFFORT)] == [False, True, True]
    assert fx.reclaimable_share(fx.BEST_EFFORT, 0.3, 0.2) == 0.3
    assert fx.reclaimable_share(fx.TRAINING, 0.3, 0.2) == pytest.approx(0.1)
    assert fx.reclaimable_share(fx.LATENCY_SENSITIVE, 0.9, 0.2) == 0.0
    assert (fx.MIB, fx.GIB) == (1 << 20, 1 << 30)
