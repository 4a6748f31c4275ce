"""The node agent's rule for the quotas in force on one GPU (services/node_agent/grants.py):
whatever arrives, the quotas written sum to at most 1, neighbours are lowered (never below their
requests) before the incoming quota is raised."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu.services.node_agent.grants import QUOTA_SUM_MAX, entitlements, fit_quota

EPS = 1e-9


def apply(in_force, writes):
    out = dict(in_force)
    for i, q in writes:
        out[i] = q
    return out


def test_a_grant_that_fits_is_written_as_is():
    assert fit_quota({"a": 0.3, "b": 0.3}, {"a": 0.3, "b": 0.3}, "a", 0.6) == [("a", 0.6)]


def test_a_grant_is_clamped_to_what_the_others_leave():
    writes = fit_quota({"a": 0.3, "b": 0.6}, {"a": 0.3, "b": 0.3}, "a", 0.9)
    assert writes == [("a", pytest.approx(0.4))]


def test_a_new_instance_takes_its_request_back_from_neighbours_above_theirs_lowering_first():
    in_force = {"a": 0.7, "b": 0.3}  # a was raised by the vertical scaler
    writes = fit_quota(in_force, {"a": 0.3, "b": 0.3, "c": 0.4}, "c", 0.4)
    assert [i for i, _ in writes] == ["a", "c"]  # the lowering is written first
    after = apply(in_force, writes)
    assert after == {"a": pytest.approx(0.3), "b": 0.3, "c": pytest.approx(0.4)}


def test_requests_summing_above_one_are_scaled_down():
    assert entitlements({"a": 0.6, "b": 0.9}) == {"a": pytest.approx(0.4), "b": pytest.approx(0.6)}
    after = apply({"a": 0.6}, fit_quota({"a": 0.6}, {"a": 0.6, "b": 0.9}, "b", 0.9))
    assert math.fsum(after.values()) <= QUOTA_SUM_MAX + EPS
    assert after["b"] == pytest.approx(0.6)


@pytest.mark.parametrize("wanted", [-0.1, 1.5])
def test_bad_input_is_refused(wanted):
    with pytest.raises(ValueError, match="outside"):
        fit_quota({}, {"a": 0.3}, "a", wanted)
    with pytest.raises(ValueError, match="no request quota"):
        fit_quota({"b": 0.1}, {"a": 0.3}, "a", 0.3)


quota = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def gpu_states(draw):
    """In-force quotas already within the rule (Σ ≤ 1) with requests, and one incoming grant."""
    n = draw(st.integers(0, 6))
    ids = [f"i{k}" for k in range(n)]
    requests = {i: draw(st.floats(0.01, 1.0)) for i in ids}
    raw = {i: draw(quota) for i in ids}
    s = math.fsum(raw.values())
    in_force = {i: q / s for i, q in raw.items()} if s > 1 else raw
    incoming = draw(st.sampled_from(ids + ["new"]))
    requests.setdefault(incoming, draw(st.floats(0.01, 1.0)))
    return in_force, requests, incoming, draw(quota)


@settings(max_examples=400, deadline=None)
@given(gpu_states())
def test_the_quotas_written_never_sum_above_one_and_respect_requests(state):
    in_force, requests, incoming, wanted = state
    writes = fit_quota(in_force, requests, incoming, wanted)
    assert writes[-1][0] == incoming and all(i != incoming for i, _ in writes[:-1])
    # every prefix of the writes (each instant while they are applied) keeps the sum within 1
    cur = dict(in_force)
    for i, q in writes:
        cur[i] = q
        assert math.fsum(cur.values()) <= QUOTA_SUM_MAX + EPS
    floors = entitlements({i: requests[i] for i in cur})
    for i, q in writes[:-1]:
        assert q <= in_force[i] + EPS  # neighbours are only lowered
        assert q >= min(in_force[i], floors[i]) - EPS  # ... never below their request
    if math.fsum(requests[i] for i in cur) <= 1:
        assert floors == pytest.approx({i: requests[i] for i in cur})
    assert 0 <= writes[-1][1] <= wanted + EPS
    assert writes[-1][1] >= min(wanted, floors[incoming]) - EPS
