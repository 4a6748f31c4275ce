"""Named platform policies (what ``dilu demo/compare --policy`` and ``dilu sim --policies`` select),
defined once: each name maps to the mode of every service it sets. The live cluster derives the
services' command-line arguments from it (:meth:`PolicyModes.service_args`, used by
``cli/cluster.py``); the simulator builds the same policy objects from the same modes, so the two
cannot drift.

- ``dilu``: placement by request/limit, tokens resized by the vertical scaler, lazy horizontal,
  the scheduler's defragmentation every ``DEFRAG_INTERVAL_S``: it empties lightly used GPUs by
  relaunching their instances on fuller ones, each drained once its replacement is ready; and
  parking after ``PARK_AFTER_S`` idle: an idle function's instances give their GPU back and keep
  their weights in host memory, so its next request waits for a weight copy, not a cold start.
- ``horizontal-only``: Knative's KPA as it ships (``kpa``: on load alone, scale to zero a stable
  window plus 30 s after the last request, no pre-warm) over quotas fixed at the request and
  placed by it alone (reserving limits an instance never bursts to would only strand GPUs).
- ``static-mps``: fixed MPS-like slices at the request quota (no bursting), horizontal on load
  with dilu's keep-alive and pre-warm (INFless keeps instances by an idle-time histogram too).
- ``exclusive``: a whole GPU per instance, no token pacing, horizontal on load, dilu's keep-alive.
- ``dilu-published``: dilu with the vertical scaling its paper describes (``PublishedVertical``:
  fixed 20/40-sample windows, stretch the only signal, AIMD on training only); placement and
  horizontal scaling (and defragmentation) as ``dilu``'s; it does not park (the paper does not).

The baselines neither defragment nor park: Knative, INFless-style slices and exclusive GPUs leave
an instance where it was placed, on its GPU until its keep-alive ends.
"""
from __future__ import annotations

from dataclasses import dataclass

# How often (trace seconds) a defragmenting policy's scheduler plans migrations. Chosen in the
# simulator, before parking (seed 1, the README's 4-hour run with training jobs): 10 s gave 97,764
# active GPU·s, 30 s 98,595, 120 s 100,396 and none 109,229, all at 182 cold-start requests; a
# round copies the placement state, so not at every tick.
DEFRAG_INTERVAL_S = 30.0
# The shortest interval accepted (s): a round under the scheduler's lock at most every 10 ms (a
# replay at --speedup 1000 compresses the 30 s to 0.03 s); below it a loop would spin.
DEFRAG_INTERVAL_MIN_S = 0.01
# How long (trace seconds) a parking policy's function is idle before its instances are parked.
# Chosen in the simulator while it still placed in deploy order (the README's 4-hour runs with
# training jobs, seeds 1-5, against Knative's KPA as it ships): 5 s gave 0.13-0.26x its
# cold-start requests, 30 s 0.18-0.24x, both at 0.95-0.996x its active GPU·s: a short delay parks
# more often, and each resume that finds its GPU full is a cold start. Knative's stable window is
# 60 s; half of it is still well inside any keep-alive.
PARK_AFTER_S = 30.0


@dataclass(frozen=True)
class PolicyModes:
    """The modes one policy sets: ``vertical`` (VerticalConfig.mode), ``horizontal``
    (HorizontalConfig.mode), ``allocation`` (the scheduler's, see scheduler.policy.ALLOCATIONS),
    ``initial_grant`` (the node agent's first grant of an instance: ``request`` or ``limit``) and
    ``defrag`` (whether the scheduler defragments, every :data:`DEFRAG_INTERVAL_S`) and ``park``
    (whether the horizontal scaler parks idle functions, after :data:`PARK_AFTER_S`)."""

    vertical: str
    horizontal: str
    allocation: str
    initial_grant: str
    defrag: bool = False
    park: bool = False

    def defrag_interval_s(self, speedup: float = 1.0, every_s: float | None = None) -> float:
        """The scheduler's defragmentation interval in seconds of a replay at ``speedup`` (trace
        time compressed, as the horizontal windows are); 0: it does not defragment.
        ``every_s``: trace seconds in place of :data:`DEFRAG_INTERVAL_S` (0: never; ``dilu sim``,
        ``demo`` and ``compare`` ``--defrag-interval-s``); a policy that does not defragment
        ignores it."""
        if not self.defrag:
            return 0.0
        return (DEFRAG_INTERVAL_S if every_s is None else every_s) / speedup

    def park_after_s(self, speedup: float = 1.0) -> float:
        """The horizontal scaler's parking delay in seconds of a replay at ``speedup``; 0: it
        never parks."""
        return PARK_AFTER_S / speedup if self.park else 0.0

    def service_args(self) -> dict[str, list[str]]:
        """The command-line arguments of each service (by service name) that set these modes."""
        return {
            "vertical_scaler": ["--mode", self.vertical],
            "horizontal_scaler": ["--mode", self.horizontal, "--park-after-s", f"{self.park_after_s():g}"],
            "scheduler": ["--policy", self.allocation, "--defrag-interval-s", f"{self.defrag_interval_s():g}"],
            "node_agent": ["--initial-grant", self.initial_grant],
        }


POLICIES: dict[str, PolicyModes] = {
    "dilu": PolicyModes(vertical="dilu", horizontal="lazy", allocation="dilu", initial_grant="request", defrag=True,
                        park=True),
    "horizontal-only": PolicyModes(vertical="static", horizontal="kpa", allocation="static-mps",
                                   initial_grant="request"),
    "static-mps": PolicyModes(vertical="static-limit", horizontal="eager", allocation="static-mps",
                              initial_grant="request"),
    "exclusive": PolicyModes(vertical="off", horizontal="eager", allocation="exclusive", initial_grant="limit"),
    "dilu-published": PolicyModes(vertical="published", horizontal="lazy", allocation="dilu", initial_grant="request",
                                  defrag=True),
}


def policy_names(text: str) -> list[str]:
    """The policies a comma-separated list names (``--policies dilu,horizontal-only``), in its
    order, spaces around names ignored. Raises ValueError for no name at all, an empty entry (a
    stray comma), an unknown name or one named twice."""
    names = [p.strip() for p in text.split(",")]
    choose = f"choose from {', '.join(POLICIES)}"
    if not any(names):
        raise ValueError(f"no policy given; {choose}")
    if not all(names):
        raise ValueError(f"an empty policy name in {text!r}: separate names by single commas")
    bad = [p for p in names if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policies {', '.join(bad)}; {choose}")
    if len(set(names)) != len(names):
        raise ValueError(f"a policy is named twice in {', '.join(names)}")
    return names


def modes(name: str) -> PolicyModes:
    """The modes of policy ``name``; ValueError naming the known policies for an unknown one."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
