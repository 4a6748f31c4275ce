"""``dilu sim --workload``: the Dilu authors' scheduling workloads (start/delete event lists of
instances with SM request/limit quotas and memory, services/scheduler/workloads/ATTRIBUTION.md)
replayed through the live placement policy (:class:`scheduler.policy.Cluster`), by the
scheduler bench's replay (one replay rule, not a copy). ``max_limit_sum`` is the largest Σ limit
quotas on one GPU over the run; the policy caps it at γ (1.5), and Σ requests at 1."""
from __future__ import annotations

from pathlib import Path

from dilu.services.scheduler.bench import WorkloadError, replay

__all__ = ["WorkloadError", "simulate_workload"]


def simulate_workload(path: str | Path, *, nodes: int = 1000, gpus_per_node: int = 4, gpu_memory_gib: float = 40,
                      gamma: float = 1.5) -> dict:
    """The replay's figures (``peak_active_gpus``, ``max_limit_sum``, ``lower_bound_peak``,
    ``allocation_fragmentation``, ``unplaced``, ``violations``, ...) plus ``gamma``. Raises
    WorkloadError naming a bad line, ValueError for a bad cluster size."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need at least 1 node and 1 GPU per node, got {nodes} x {gpus_per_node}")
    return replay(path, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib, gamma=gamma)
