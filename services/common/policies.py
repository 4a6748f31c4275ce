"""Named platform policies (what ``dilu demo/compare --policy`` and ``dilu sim --policies`` select),
defined once: each name maps to the mode of every service it sets. The live cluster derives the
services' command-line arguments from it (:meth:`PolicyModes.service_args`, used by
``cli/cluster.py``); the simulator builds the same policy objects from the same modes, so the two
cannot drift.

- ``dilu``: placement by request/limit, tokens resized by the vertical scaler, lazy horizontal.
- ``horizontal-only``: Knative's KPA as it ships (``kpa``: on load alone, scale to zero a stable
  window plus 30 s after the last request, no pre-warm) over quotas fixed at the request and
  placed by it alone (reserving limits an instance never bursts to would only strand GPUs).
- ``static-mps``: fixed MPS-like slices at the request quota (no bursting), horizontal on load
  with dilu's keep-alive and pre-warm (INFless keeps instances by an idle-time histogram too).
- ``exclusive``: a whole GPU per instance, no token pacing, horizontal on load, dilu's keep-alive.
- ``dilu-published``: dilu with the vertical scaling its paper describes (``PublishedVertical``:
  fixed 20/40-sample windows, stretch the only signal, AIMD on training only); placement and
  horizontal scaling as ``dilu``'s.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyModes:
    """The modes one policy sets: ``vertical`` (VerticalConfig.mode), ``horizontal``
    (HorizontalConfig.mode), ``allocation`` (the scheduler's, see scheduler.policy.ALLOCATIONS)
    and ``initial_grant`` (the node agent's first grant of an instance: ``request`` or ``limit``)."""

    vertical: str
    horizontal: str
    allocation: str
    initial_grant: str

    def service_args(self) -> dict[str, list[str]]:
        """The command-line arguments of each service (by service name) that set these modes."""
        return {
            "vertical_scaler": ["--mode", self.vertical],
            "horizontal_scaler": ["--mode", self.horizontal],
            "scheduler": ["--policy", self.allocation],
            "node_agent": ["--initial-grant", self.initial_grant],
        }


POLICIES: dict[str, PolicyModes] = {
    "dilu": PolicyModes(vertical="dilu", horizontal="lazy", allocation="dilu", initial_grant="request"),
    "horizontal-only": PolicyModes(vertical="static", horizontal="kpa", allocation="static-mps",
                                   initial_grant="request"),
    "static-mps": PolicyModes(vertical="static-limit", horizontal="eager", allocation="static-mps",
                              initial_grant="request"),
    "exclusive": PolicyModes(vertical="off", horizontal="eager", allocation="exclusive", initial_grant="limit"),
    "dilu-published": PolicyModes(vertical="published", horizontal="lazy", allocation="dilu", initial_grant="request"),
}


def modes(name: str) -> PolicyModes:
    """The modes of policy ``name``; ValueError naming the known policies for an unknown one."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
