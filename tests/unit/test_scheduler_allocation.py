"""Allocation policies of the baselines: what quotas an instance is placed with."""
import pytest

from dilu.services.scheduler.policy import allocation_batch, allocation_quotas


def test_dilu_keeps_the_profiles_request_and_limit():
    assert allocation_quotas("dilu", 0.3, 0.7) == (0.3, 0.7)
    assert allocation_quotas("dilu", 0.4, 0.2) == (0.4, 0.4)  # limit never below request


def test_static_mps_is_a_fixed_slice_at_the_request():
    assert allocation_quotas("static-mps", 0.3, 0.7) == (0.3, 0.3)


def test_exclusive_takes_whole_gpus():
    assert allocation_quotas("exclusive", 0.3, 0.7) == (1.0, 1.0)


def test_unknown_allocation_is_an_error():
    with pytest.raises(ValueError, match="static-mps"):
        allocation_quotas("fractional", 0.3, 0.7)


def test_only_dilu_instances_pull_up_to_their_burst_batch():
    assert allocation_batch("dilu", 2, 8) == 8
    assert allocation_batch("dilu", 4, 0) == 4  # no burst batch profiled: the batch
    assert allocation_batch("static-mps", 2, 8) == 2  # a fixed quota meets the SLO only at its batch
    assert allocation_batch("exclusive", 2, 8) == 2
    with pytest.raises(ValueError, match="unknown allocation"):
        allocation_batch("elastic", 2, 8)
