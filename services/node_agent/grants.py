"""Pure rule of the quotas the node agent writes into the control blocks of one GPU: the sum of
the quotas in force never exceeds 1, at any instant. No I/O, no clock: state in, quotas out.

Grants arrive one instance at a time (the vertical scaler's TokenGrant) and a new instance
starts at its initial grant while its neighbours hold what they were granted, so an incoming
quota is fitted into what the others leave (:func:`fit_quota`). An instance is entitled to its
request quota: when what the others leave is less than that, the excess the neighbours hold
above their requests is taken back from them first (their quotas are lowered, and must be
written before the incoming one is raised). When the requests of the GPU's instances alone sum
above 1 (a placement the scheduler should never make), each one's entitlement is its request
scaled down by that sum.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

QUOTA_SUM_MAX = 1.0  # the quotas in force on one GPU sum to at most this (fraction of its SM-time)


def entitlements(requests: Mapping[str, float]) -> dict[str, float]:
    """Each instance's floor (fraction 0..1): its request quota, or, when the requests sum above
    ``QUOTA_SUM_MAX``, its request scaled so the floors sum to ``QUOTA_SUM_MAX``."""
    total = math.fsum(max(0.0, r) for r in requests.values())
    scale = QUOTA_SUM_MAX / total if total > QUOTA_SUM_MAX else 1.0
    return {i: max(0.0, r) * scale for i, r in requests.items()}


def fit_quota(
    in_force: Mapping[str, float], requests: Mapping[str, float], instance_id: str, wanted: float,
) -> list[tuple[str, float]]:
    """The quotas to write on one GPU so that ``instance_id`` gets as much of ``wanted`` as fits.

    ``in_force``: instance -> quota in force now on this GPU (the incoming instance may be absent:
    a new one); ``requests``: instance -> request quota, for every instance of ``in_force`` and
    ``instance_id``; ``wanted``: the incoming quota (fraction 0..1). Returns ``(instance,
    quota)`` pairs in the order to write them: neighbours lowered first, ``instance_id`` last
    (always present). After writing them the quotas in force sum to at most ``QUOTA_SUM_MAX``
    (up to float rounding), no neighbour is raised, no neighbour is lowered below its request
    (its entitlement, see :func:`entitlements`), and ``instance_id`` gets at least
    min(``wanted``, its entitlement). Raises ValueError for ``wanted`` outside [0, 1] or an
    instance without a request."""
    if not 0.0 <= wanted <= 1.0:
        raise ValueError(f"wanted quota {wanted} outside [0, 1]")
    missing = (set(in_force) | {instance_id}) - set(requests)
    if missing:
        raise ValueError(f"no request quota for {sorted(missing)}")
    floors = entitlements({i: requests[i] for i in set(in_force) | {instance_id}})
    others = {i: max(0.0, q) for i, q in in_force.items() if i != instance_id}
    left = QUOTA_SUM_MAX - math.fsum(others.values())
    need = min(wanted, floors[instance_id]) - left  # what must come back from the neighbours
    lowered: list[tuple[str, float]] = []
    if need > 0:
        excess = {i: q - floors[i] for i, q in others.items() if q > floors[i]}
        total = math.fsum(excess.values())
        take = min(1.0, need / total) if total > 0 else 0.0
        for i in sorted(excess):
            q = others[i] = max(floors[i], others[i] - excess[i] * take) if take < 1.0 else floors[i]
            lowered.append((i, q))
        left = QUOTA_SUM_MAX - math.fsum(others.values())
    return lowered + [(instance_id, max(0.0, min(wanted, left)))]


def quota_sum(quotas: Mapping[str, float]) -> float:
    """Σ of the quotas (fractions 0..1), summed exactly (math.fsum)."""
    return math.fsum(quotas.values())
