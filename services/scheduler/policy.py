"""Placement policy: 2-D bin packing of request quota and memory under a limit cap (DESIGN.md section 4.5).

Pure: the cluster state is a plain object, decisions are returned, nothing here does I/O or reads
a clock. The same object drives the live scheduler service and the workload replay.

The cluster is what the node agents' inventories say (section 4.0): nodes join and leave at run
time (:meth:`Cluster.add_node`, :meth:`Cluster.update_node`, :meth:`Cluster.remove_node`) and
their GPUs differ (memory, MPS client limit, health). Each GPU has its own :class:`GpuCapacity`.

Feasibility of a GPU for one more instance slot (compared with tolerance ``EPS`` = 1e-6, because
quotas in the data carry float artefacts such as 0.5900000000000001):

- the GPU is healthy (an unhealthy GPU keeps its residents but takes nothing new),
- Σ request quotas ≤ 1 (requests are guaranteed),
- Σ limit quotas ≤ γ (default 1.5, the oversubscription cap on bursts), a training instance
  counting its request there (:attr:`Demand.burst_quota`),
- Σ memory ≤ that GPU's memory, counting what parked instances' processes keep there (their
  CUDA context, ``models.PARKED_BYTES``: :meth:`Cluster.park`; their quotas are freed),
- its number of instances < its ``max_instances`` (the MPS client limit, 48 on Volta and later;
  0: no limit), parked processes included: each is still an MPS client,
- for a *rigid* instance (inference whose limit is its request: the profiler found no latency
  gain above it, e.g. BERT-base), and for any instance beside a rigid resident, Σ limits ≤ 1
  (:func:`rigid_fits`): the widths busy at once on a GPU slow each instance by their sum when it
  exceeds 1 (DESIGN.md section 7), a slowdown a wider grant makes up for an elastic instance but
  not for a rigid one. This rule yields to the cost of a GPU: when no active GPU keeps it,
  :meth:`Cluster.choose` takes an active GPU that breaks it (best fit among them) before it
  opens an empty one (for a one-GPU instance; a multi-GPU one, training spread over a node's
  GPUs, keeps it), since a GPU held for a whole keep-alive costs more than a slowdown that
  lasts only while the widths are busy at once, each paced to its grant. A defragmentation move
  never breaks it: a move is a choice, and one that fills GPUs tighter also turns more resumes
  into cold starts (seed 1's 4-hour 200-function run without training jobs: 847 cold-start
  requests at commit aa25d0c against 687, for 4.4 % fewer GPU·s). So it is not a cap:
  :meth:`Cluster.assign` checks the caps above without it. A parked instance resuming on the GPU it left is exempt:
  its resume, a weight copy, slowed by its neighbours' widths still beats a cold start elsewhere,
- for a training instance, no other training instance on it: a training job is always busy, so
  two on one GPU contend all the time, which no grant resolves (a kernel-cycle stretch cannot
  tell which of them to squeeze); "training on 10 % of the GPUs" (``dilu sim --training-jobs``,
  ``dilu demo --training-jobs``: at most one per GPU) means one job on each of them, whatever
  the allocation policy.

Placement: among feasible GPUs that already host instances, best fit (least request quota and
memory left over, memory relative to that GPU's size), with small preferences for complementary
collocation (training beside inference; functions whose load peaks at different hours) and
affinity, and against two replicas of one function on a GPU (their bursts coincide). A new GPU is
opened only when nothing fits; it is taken on the node with the fewest empty GPUs (of enough
memory) left, so whole nodes stay free for multi-GPU training, and among that node's empty GPUs
the smallest that holds the instance, so large GPUs stay free for what only they can take. A
multi-GPU instance (training) gets its slots on distinct GPUs of one node.

Speed: active GPUs are indexed in buckets of free request quota (1 % wide), one set of buckets per
memory class (one class per distinct GPU memory size); a placement scans the buckets upward from
the one that can hold the request, in the classes large enough for it, and scores at most
``max_candidates`` feasible GPUs, so its cost does not grow with the cluster. GPUs that cannot
take anything (dead, unhealthy, at their instance limit) are kept out of the buckets. Empty GPUs
are indexed per node and per memory class, so opening one is a lookup too.
GPU ids (indexes into ``gpus``) are never reused: a removed node's GPUs stay in the list, dead.
"""
from __future__ import annotations

import bisect
import copy
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dilu.services.common.models import PARKED_BYTES

EPS = 1e-6
BUCKETS = 100  # free request quota buckets: bucket k holds GPUs with free in [k/100, (k+1)/100)
UNLIMITED = 1 << 62  # instance limit of a GPU with no MPS client limit


class NoCapacity(RuntimeError):
    """No GPU (nor set of GPUs on one node) can take the instance, even an empty one."""


class UnknownInstance(KeyError):
    """The instance id is not in the cluster state."""


@dataclass(frozen=True)
class Demand:
    """What one instance needs on each of its GPUs.

    ``request_quota``/``limit_quota``: fractions 0..1 of one GPU's SM-time (limit ≥ request);
    ``memory_bytes`` per GPU; ``gpus``: GPUs it spans, all on one node (training only);
    ``kind``: inference | training (complementary collocation); ``peak_hour``: hour of day (0..23)
    of the function's load peak when known; ``affinity``: functions it prefers to share a GPU with.
    Raises ValueError for quotas outside (0, 1], limit < request, negative memory or gpus < 1.
    """

    function: str
    request_quota: float
    limit_quota: float
    memory_bytes: int
    kind: str = "inference"
    gpus: int = 1
    peak_hour: int | None = None
    affinity: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not (0 < self.request_quota <= 1 + EPS and self.request_quota <= self.limit_quota + EPS
                and self.limit_quota <= 1 + EPS):
            raise ValueError(
                f"{self.function}: need 0 < request ≤ limit ≤ 1, got {self.request_quota}, {self.limit_quota}")
        if self.memory_bytes < 0 or self.gpus < 1:
            raise ValueError(f"{self.function}: bad memory {self.memory_bytes} or gpus {self.gpus}")

    @property
    def burst_quota(self) -> float:
        """The share (0..1) it counts against γ: what it may claim back in a burst. Inference bursts
        to its limit; training gives up all above its request whenever a neighbour is pressed (the
        vertical policy takes from it first, ``functions.reclaimable_share``), so it claims only
        its request: the rest of its limit is idle share lent to it, not room kept for it."""
        return self.request_quota if self.kind == "training" else self.limit_quota

    @property
    def rigid(self) -> bool:
        """Inference that cannot use width above its request (limit = request): neighbours'
        widths above a GPU's SMs slow it and no grant makes up for it (see the module's feasibility list)."""
        return self.kind != "training" and self.limit_quota <= self.request_quota + EPS


def rigid_fits(rigid_residents: int, d: Demand, limits: float) -> bool:
    """Whether ``d`` may join a GPU with ``rigid_residents`` rigid instances whose Σ burst quotas
    would then be ``limits`` (0..γ): a rigid instance runs only where they stay ≤ 1, so no
    neighbour's width slows it (see the module's feasibility list)."""
    return limits <= 1 + EPS or not (d.rigid or rigid_residents)


def _clients(s: _Gpu) -> int:
    """The MPS clients on a GPU: its residents and the parked processes it keeps."""
    return len(s.residents) + len(s.parked)


def parked_bytes(d: Demand) -> int:
    """GPU memory (bytes) an instance of ``d`` keeps while parked: ``models.PARKED_BYTES`` (its
    process's CUDA context), never more than it was placed with."""
    return min(PARKED_BYTES, d.memory_bytes)


ALLOCATIONS = ("dilu", "static-mps", "exclusive")


def allocation_quotas(allocation: str, request_quota: float, limit_quota: float) -> tuple[float, float]:
    """(request, limit) quotas an instance is placed with under an allocation policy.

    ``dilu``: the profile's request and limit (limit >= request; the instance bursts between them
    through tokens). ``static-mps``: a fixed slice at the request quota, no burst (FaST-GShare-like
    static MPS partitions). ``exclusive``: a whole GPU per instance (request = limit = 1).
    Raises ValueError for an unknown allocation.
    """
    if allocation == "dilu":
        return request_quota, max(limit_quota, request_quota)
    if allocation == "static-mps":
        return request_quota, request_quota
    if allocation == "exclusive":
        return 1.0, 1.0
    raise ValueError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")


def allocation_batch(allocation: str, batch: int, burst_batch: int) -> int:
    """The largest batch an instance pulls under an allocation policy: with ``dilu`` its burst
    batch (a backlog is served in bigger batches while the vertical scaler raises the quota
    toward the limit the profile sized that batch for); with fixed quotas the profiled batch,
    which is what meets the SLO at that quota. Raises ValueError for an unknown allocation."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; choose from {', '.join(ALLOCATIONS)}")
    return max(1, batch, burst_batch) if allocation == "dilu" else max(1, batch)


@dataclass(frozen=True)
class Slot:
    """One GPU: ``node`` name and ``gpu`` index on that node."""

    node: str
    gpu: int


@dataclass(frozen=True)
class Migration:
    """Move ``instance_id`` from ``source`` to ``target`` (drain, then relaunch there)."""

    instance_id: str
    source: Slot
    target: Slot


MIGRATION_DISRUPTION_S = 5.0  # allowance for the drain and warm-up of a moved instance, in s at its quota
DEFRAG_GAIN_PER_GPU_S = 300.0  # a freed GPU is assumed to stay free this long (s)


def migration_cost_gpu_s(cold_start_ms: float, request_quota: float) -> float:
    """GPU-seconds one migration costs: while the replacement starts (``cold_start_ms``, ms) the
    instance's ``request_quota`` (0..1) is held twice, plus ``MIGRATION_DISRUPTION_S`` at it for
    the drain and warm-up. The live scheduler and the simulator price a move with it."""
    return (cold_start_ms / 1000 + MIGRATION_DISRUPTION_S) * request_quota


def migration_price_gpu_s(*, ready: bool, leaving: bool, training: bool, cold_start_ms: float,
                          request_quota: float) -> float:
    """What :meth:`Cluster.plan_defrag` is told moving one placed instance costs (GPU-seconds):
    :func:`migration_cost_gpu_s` for a ready inference instance that is staying; ``inf`` (never
    moved) for one still starting (it holds no warm state to move yet), ``leaving`` (draining, or
    already being replaced by a migration in flight) or ``training`` (its progress would be lost).
    The live scheduler and the simulator both price a round with it."""
    if not ready or leaving or training:
        return math.inf
    return migration_cost_gpu_s(cold_start_ms, request_quota)


PLACED_STATES = ("starting", "ready", "draining", "parked")


@dataclass(frozen=True)
class Placed:
    """One placed instance as a defragmentation round sees it. ``state``: one of
    :data:`PLACED_STATES` (starting: launched or resuming, not ready yet; parked: off the GPU,
    holding no quota); ``replaces``: the instance a migration's replacement takes over from
    ("" for any other); ``cold_start_ms`` (ms) and ``request_quota`` (0..1) price its move.
    Raises ValueError for a state not in :data:`PLACED_STATES`."""

    state: str
    replaces: str = ""
    training: bool = False
    cold_start_ms: float = 0.0
    request_quota: float = 0.0

    def __post_init__(self) -> None:
        if self.state not in PLACED_STATES:
            raise ValueError(f"placed state must be one of {', '.join(PLACED_STATES)}, got {self.state!r}")


@dataclass(frozen=True)
class DefragInputs:
    """What :meth:`Cluster.plan_defrag` is given for one round: ``cost_gpu_s`` per instance
    (:func:`migration_price_gpu_s`), and the ``leaving`` and ``starting`` instance ids."""

    cost_gpu_s: dict[str, float]
    leaving: frozenset[str]
    starting: frozenset[str]


def defrag_inputs(placed: Mapping[str, Placed]) -> DefragInputs:
    """One defragmentation round's view of ``placed`` (instance id -> :class:`Placed`): an
    instance is *leaving* when it drains or a live (not draining) replacement replaces it,
    *starting* when it is neither ready nor parked nor leaving, and only a ready one that stays
    has a finite price. The live scheduler and the simulator both build their round with it."""
    moving = {p.replaces for p in placed.values() if p.replaces and p.state != "draining"}
    leaving = frozenset(i for i, p in placed.items() if p.state == "draining" or i in moving)
    starting = frozenset(i for i, p in placed.items() if p.state == "starting" and i not in leaving)
    costs = {i: migration_price_gpu_s(ready=p.state == "ready", leaving=i in leaving, training=p.training,
                                      cold_start_ms=p.cold_start_ms, request_quota=p.request_quota)
             for i, p in placed.items()}
    return DefragInputs(costs, leaving, starting)


@dataclass
class DefragPlan:
    """Migrations that empty ``freed`` GPUs; ``gain_gpu_s`` vs ``cost_gpu_s`` (GPU-seconds)."""

    migrations: list[Migration] = field(default_factory=list)
    freed: list[Slot] = field(default_factory=list)
    gain_gpu_s: float = 0.0
    cost_gpu_s: float = 0.0


@dataclass(frozen=True)
class GpuCapacity:
    """What one GPU offers: ``memory_bytes`` of device memory; ``max_instances`` instances at once
    (its MPS client limit; 0: no limit); ``healthy`` (False: it keeps its residents but takes
    nothing new; ``reason`` says why); ``index``: its index on the node (what placements name;
    None: its position in the list given to :meth:`Cluster.add_node`).
    Raises ValueError for negative memory or a negative instance limit."""

    memory_bytes: int
    max_instances: int = 0
    healthy: bool = True
    reason: str = ""
    index: int | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.max_instances < 0:
            raise ValueError(f"bad GPU capacity: memory {self.memory_bytes}, max instances {self.max_instances}")


class _Gpu:
    __slots__ = ("req", "lim", "mem", "residents", "training", "rigid", "fns", "peaks", "bucket", "multi",
                 "node", "index", "cap", "max", "healthy", "reason", "alive", "open", "ok", "limit", "parked")

    def __init__(self, node: int, index: int, c: GpuCapacity) -> None:
        self.req = 0.0
        self.lim = 0.0
        self.mem = 0  # bytes: residents' memory and what parked processes keep here
        self.residents: dict[str, Demand] = {}
        self.parked: dict[str, int] = {}  # parked instance -> the bytes its process keeps (Cluster.park)
        self.training = 0
        self.rigid = 0  # residents that are Demand.rigid
        self.fns: dict[str, int] = {}
        self.peaks: dict[int, int] = {}
        self.bucket = -1  # -1: not in the active buckets (empty, or cannot take anything)
        self.multi = 0  # residents spanning several GPUs (never migrated)
        self.node = node  # index into Cluster._nodes
        self.index = index  # the GPU's index on its node
        self.cap = c.memory_bytes
        self.max = c.max_instances
        self.healthy = c.healthy
        self.reason = c.reason
        self.alive = True  # False once its node left (or it vanished from the node's inventory)
        self.open = False  # empty and placeable: in its node's ``open`` set and the class indexes
        self.ok = True  # alive and healthy (kept in step by ``Cluster._reindex``)
        self.limit = self.max or UNLIMITED


class _Node:
    __slots__ = ("name", "gpus", "by_index", "open", "counts", "alive")

    def __init__(self, name: str) -> None:
        self.name = name
        self.gpus: list[int] = []  # global GPU ids, by index on the node
        self.by_index: dict[int, int] = {}
        self.open: dict[int, None] = {}  # empty placeable GPUs (ordered set)
        self.counts: dict[int, int] = {}  # memory class -> open GPUs with at least that memory
        self.alive = True


def _resolve(gpus: Sequence[GpuCapacity]) -> dict[int, GpuCapacity]:
    """GPU index -> capacity; raises ValueError for an index given twice or negative."""
    out: dict[int, GpuCapacity] = {}
    for pos, c in enumerate(gpus):
        idx = pos if c.index is None else c.index
        if idx < 0 or idx in out:
            raise ValueError(f"GPU index {idx} negative or given twice")
        out[idx] = c
    return dict(sorted(out.items()))


class Cluster:
    """GPUs of the nodes that joined, each with its own :class:`GpuCapacity`, and what runs on them.

    ``Cluster(nodes, gpus_per_node, gpu_memory_bytes, max_gpu_instances=0)`` adds each of
    ``nodes`` with ``gpus_per_node`` identical GPUs (benchmarks, the workload replay); with no
    nodes (or :meth:`empty`) the cluster starts empty and nodes join through :meth:`add_node`.
    ``gamma``: the Σ-limit cap; ``max_candidates``: feasible GPUs scored per placement.
    Raises ValueError for gamma < 1, repeated node names, or nodes without GPUs or memory.
    """

    def __init__(
        self,
        nodes: Sequence[str] = (),
        gpus_per_node: int = 0,
        gpu_memory_bytes: int = 0,
        *,
        gamma: float = 1.5,
        max_candidates: int = 16,
        max_gpu_instances: int = 0,
    ) -> None:
        if gamma < 1:
            raise ValueError("need gamma ≥ 1")
        if nodes and (gpus_per_node < 1 or gpu_memory_bytes <= 0):
            raise ValueError("need ≥ 1 GPU per node and positive memory")
        if len(set(nodes)) != len(nodes):
            raise ValueError("node names must be unique")
        self.gamma = gamma
        self.max_candidates = max_candidates
        self.gpus: list[_Gpu] = []
        self._nodes: list[_Node] = []
        self.node_index: dict[str, int] = {}  # live nodes only
        # memory class -> free-request bucket -> active GPUs of that memory size (ordered sets)
        self.buckets: dict[int, list[dict[int, None]]] = {}
        self._tables: list[list[dict[int, None]]] = []  # self.buckets[m] for m in self.classes
        self.classes: list[int] = []  # distinct memory sizes of live GPUs, ascending
        self._class_refs: dict[int, int] = {}
        # memory class M -> [count -> nodes with `count` open GPUs of ≥ M bytes] (ordered sets)
        self._open: dict[int, list[dict[int, None]]] = {}
        self._sizes: dict[int, int] = {}  # GPUs per node -> live nodes of that size
        self.instances: dict[str, tuple[Demand, tuple[int, ...]]] = {}
        self.parked: dict[str, int] = {}  # parked instance -> the GPU whose memory its process holds
        self.active = 0
        same = [GpuCapacity(gpu_memory_bytes, max_gpu_instances)] * gpus_per_node
        for n in nodes:
            self.add_node(n, same)

    @classmethod
    def empty(cls, *, gamma: float = 1.5, max_candidates: int = 16) -> "Cluster":
        """A cluster with no node yet."""
        return cls((), gamma=gamma, max_candidates=max_candidates)

    # ------------------------------------------------------------------ membership

    @property
    def nodes(self) -> list[str]:
        """Names of the live nodes, in the order they joined."""
        return list(self.node_index)

    def add_node(self, name: str, gpus: Sequence[GpuCapacity]) -> None:
        """A node joins with ``gpus``. Raises ValueError for a node already in the cluster or an
        index given twice."""
        if name in self.node_index:
            raise ValueError(f"node {name!r} is already in the cluster")
        caps = _resolve(gpus)
        nid = len(self._nodes)
        self._nodes.append(_Node(name))
        self.node_index[name] = nid
        for idx, c in caps.items():
            self._add_gpu(nid, idx, c)
        self._resize(nid, +1)

    def update_node(self, name: str, gpus: Sequence[GpuCapacity]) -> list[str]:
        """A node's GPUs changed (health, limits, memory, GPUs added or gone). A GPU that became
        unhealthy keeps its residents and takes nothing new; one whose memory or instance limit
        shrank below what it hosts keeps them too (:meth:`violations` reports the over-commit).
        Returns the ids of the instances that were on GPUs no longer listed: they are taken out
        (displaced; their capacity is freed). Raises KeyError for an unknown node, ValueError for
        an index given twice."""
        nid = self.node_index[name]
        caps = _resolve(gpus)
        node = self._nodes[nid]
        self._resize(nid, -1)
        displaced = self._kill([g for idx, g in node.by_index.items() if idx not in caps])
        for idx, c in caps.items():
            g = node.by_index.get(idx)
            if g is None:
                self._add_gpu(nid, idx, c)
                continue
            s = self.gpus[g]
            if (s.cap, s.max, s.healthy, s.reason) == (c.memory_bytes, c.max_instances, c.healthy, c.reason):
                continue
            if s.open:
                self._set_open(g, False)
            if s.bucket >= 0:  # out of its class's buckets while its class may change
                del self.buckets[s.cap][s.bucket][g]
                s.bucket = -1
            if s.cap != c.memory_bytes:
                self._class_drop(s.cap)
                self._class_add(c.memory_bytes)
            s.cap, s.max, s.healthy, s.reason = c.memory_bytes, c.max_instances, c.healthy, c.reason
            s.limit = s.max or UNLIMITED
            self._reindex(g)
        self._resize(nid, +1)
        return displaced

    def remove_node(self, name: str) -> list[str]:
        """A node left: returns the ids of the instances that were on it, now taken out of the
        cluster (displaced; place them again elsewhere). Raises KeyError for an unknown node."""
        nid = self.node_index.pop(name)
        node = self._nodes[nid]
        self._resize(nid, -1)
        node.alive = False
        return self._kill(list(node.gpus))

    def _add_gpu(self, nid: int, idx: int, c: GpuCapacity) -> None:
        g = len(self.gpus)
        self.gpus.append(_Gpu(nid, idx, c))
        node = self._nodes[nid]
        node.by_index[idx] = g
        node.gpus = [node.by_index[i] for i in sorted(node.by_index)]
        self._class_add(c.memory_bytes)
        self._reindex(g)

    def _kill(self, gpus: list[int]) -> list[str]:
        """Mark ``gpus`` dead and take out every instance on them; returns those instances' ids."""
        ids: dict[str, None] = {}
        for g in gpus:
            s = self.gpus[g]
            s.alive = False
            self._reindex(g)
            ids.update(dict.fromkeys(s.residents))
        for i in ids:
            self.remove(i)
        for g in gpus:
            s = self.gpus[g]
            for i in s.parked:  # the process went with its GPU: nothing left to resume there
                del self.parked[i]
            s.parked.clear()
            s.mem = 0
            self._class_drop(s.cap)
            node = self._nodes[s.node]
            del node.by_index[s.index]
        for nid in {self.gpus[g].node for g in gpus}:
            node = self._nodes[nid]
            node.gpus = [node.by_index[i] for i in sorted(node.by_index)]
        return list(ids)

    def _resize(self, nid: int, sign: int) -> None:
        n = len(self._nodes[nid].gpus)
        self._sizes[n] = self._sizes.get(n, 0) + sign
        if not self._sizes[n]:
            del self._sizes[n]

    def _class_add(self, m: int) -> None:
        self._class_refs[m] = self._class_refs.get(m, 0) + 1
        if self._class_refs[m] > 1:
            return
        bisect.insort(self.classes, m)
        self.buckets[m] = [{} for _ in range(BUCKETS + 1)]
        self._tables = [self.buckets[c] for c in self.classes]
        index: list[dict[int, None]] = [{}]
        for nid in self.node_index.values():  # a new memory size: count each node's open GPUs once
            node = self._nodes[nid]
            count = sum(1 for h in node.open if self.gpus[h].cap >= m)
            node.counts[m] = count
            if count:
                while len(index) <= count:
                    index.append({})
                index[count][nid] = None
        self._open[m] = index

    def _class_drop(self, m: int) -> None:
        self._class_refs[m] -= 1
        if not self._class_refs[m]:
            del self._class_refs[m]
            self.classes.remove(m)
            del self._open[m]  # nodes' stale counts for m are reset if the size comes back
            del self.buckets[m]  # empty: its GPUs are dead or changed size, out of the buckets
            self._tables = [self.buckets[c] for c in self.classes]

    # ------------------------------------------------------------------ addressing

    def slot(self, g: int) -> Slot:
        s = self.gpus[g]
        return Slot(self._nodes[s.node].name, s.index)

    def gpu_id(self, slot: Slot) -> int:
        """Raises KeyError for an unknown node, IndexError for a GPU the node does not have."""
        node = self._nodes[self.node_index[slot.node]]
        try:
            return node.by_index[slot.gpu]
        except KeyError:
            raise IndexError(f"node {slot.node} has no GPU {slot.gpu} (it has {sorted(node.by_index)})") from None

    def node_slots(self, name: str) -> list[Slot]:
        """The GPUs of a live node. Raises KeyError for an unknown node."""
        return [Slot(name, i) for i in self._nodes[self.node_index[name]].by_index]

    def capacity(self, slot: Slot) -> GpuCapacity:
        """What the GPU at ``slot`` offers now. Raises KeyError/IndexError like :meth:`gpu_id`."""
        s = self.gpus[self.gpu_id(slot)]
        return GpuCapacity(s.cap, s.max, s.healthy, s.reason, s.index)

    def max_gpus_per_node(self) -> int:
        return max(self._sizes, default=0)

    # ------------------------------------------------------------------ feasibility and scoring

    def fits(self, g: int, d: Demand, parked_id: str | None = None, rigid: bool = True) -> bool:
        """Whether GPU ``g`` can take one more slot of ``d``: alive and healthy, under its instance
        limit, Σ request ≤ 1, Σ limit ≤ γ, memory, no training beside training, and (unless
        ``rigid`` is False: the caps alone) Σ limits ≤ 1 where a rigid instance is
        (:func:`rigid_fits`). Parked processes count against the memory
        and the instance limit (each is still an MPS client), but ``parked_id``'s, when it is
        parked here: that is the instance coming back, and it comes back beside whatever widths
        are there (a resume slowed by them still beats a cold start elsewhere)."""
        s = self.gpus[g]
        own = s.parked.get(parked_id, -1) if parked_id is not None else -1
        return (s.ok and _clients(s) - (own >= 0) < s.limit
                and s.req + d.request_quota <= 1 + EPS and s.lim + d.burst_quota <= self.gamma + EPS
                and s.mem - max(own, 0) + d.memory_bytes <= s.cap and not (s.training and d.kind == "training")
                and (own >= 0 or not rigid or rigid_fits(s.rigid, d, s.lim + d.burst_quota)))

    def score(self, g: int, d: Demand) -> float:
        """Lower is better: request and memory left over (best fit), adjusted by collocation
        preferences (see the module's Placement)."""
        s = self.gpus[g]
        score = (1 - s.req - d.request_quota) + 0.5 * (s.cap - s.mem - d.memory_bytes) / (s.cap or 1)
        if s.residents:
            has_inference = s.training < len(s.residents)
            if (has_inference and d.kind == "training") or (s.training and d.kind != "training"):
                score -= 0.05  # training beside inference: it soaks up what inference leaves idle
            if d.function in s.fns:
                score += 0.05  # replicas of one function burst together
            if d.peak_hour is not None and s.peaks:
                same = s.peaks.get(d.peak_hour, 0)
                score += 0.03 if same else -0.03
            if d.affinity and any(f in s.fns for f in d.affinity):
                score -= 0.05
        return score

    def _bucket_of(self, s: _Gpu) -> int:
        return min(BUCKETS, max(0, int((1 - s.req + EPS) * BUCKETS)))

    def _candidates(self, d: Demand, exclude: set[int] | None = None, rigid: bool = True) -> Iterable[int]:
        """Feasible active GPUs in best-fit order of buckets (at most max_candidates of them).
        A GPU in the buckets is alive, healthy and under its instance limit, so only the sums are
        checked here: :meth:`fits` for those GPUs (with its ``rigid``), inlined (this is the hot loop)."""
        found = 0
        start = max(0, int((d.request_quota - EPS) * BUCKETS))
        req, lim, mem = d.request_quota, d.burst_quota, d.memory_bytes
        one, cap_lim = 1 + EPS, self.gamma + EPS
        training, own_rigid = d.kind == "training", d.rigid
        keep_rule = one if rigid else cap_lim  # Σ limits beside a rigid instance (the caps alone: γ)
        gpus = self.gpus
        tables = self._tables[bisect.bisect_left(self.classes, mem):]  # memory classes large enough
        for k in range(start, BUCKETS + 1):
            for buckets in tables:
                for g in buckets[k]:
                    s = gpus[g]
                    if (s.req + req <= one and s.lim + lim <= cap_lim and s.mem + mem <= s.cap
                            and not (training and s.training) and (s.lim + lim <= keep_rule or not (own_rigid or s.rigid))
                            and (exclude is None or g not in exclude)):
                        yield g
                        found += 1
                        if found >= self.max_candidates:
                            return

    # ------------------------------------------------------------------ decisions

    def choose(self, d: Demand, exclude: set[int] | None = None, allow_new: bool = True) -> tuple[int, ...]:
        """The GPUs (global ids) for one instance of ``d``, without applying it: an active GPU that
        keeps the rigid rule; with ``allow_new``, else one that breaks it, else an empty one (see
        the module's feasibility list). Raises NoCapacity."""
        if d.gpus == 1:
            best = min(self._candidates(d, exclude), key=lambda g: self.score(g, d), default=None)
            if best is None and allow_new:
                best = min(self._candidates(d, exclude, rigid=False), key=lambda g: self.score(g, d), default=None)
            if best is not None:
                return (best,)
        else:
            multi = self._choose_multi(d, exclude)
            if multi:
                return multi
        if allow_new:
            fresh = self._open_gpus(d.gpus, d, exclude)
            if fresh:
                return fresh
        if not self.node_index:
            raise NoCapacity(f"no GPU can take {d.function}: the cluster has no node")
        if d.gpus > self.max_gpus_per_node():
            raise NoCapacity(f"{d.function} needs {d.gpus} GPUs on one node; "
                             f"nodes have {self.max_gpus_per_node()} GPUs at most")
        raise NoCapacity(f"no GPU can take {d.function} (request {d.request_quota:.3f}, "
                         f"limit {d.limit_quota:.3f}, memory {d.memory_bytes} B × {d.gpus} GPUs)")

    def _choose_multi(self, d: Demand, exclude: set[int] | None) -> tuple[int, ...] | None:
        """``d.gpus`` feasible GPUs on one node, preferring nodes with active GPUs that fit."""
        best: tuple[float, tuple[int, ...]] | None = None
        seen: set[int] = set()
        for g in self._candidates(d, exclude):
            nid = self.gpus[g].node
            if nid in seen:
                continue
            seen.add(nid)
            node = self._nodes[nid]
            ok = [h for h in node.gpus
                  if self.gpus[h].residents and (exclude is None or h not in exclude) and self.fits(h, d)]
            ok.sort(key=lambda h: self.score(h, d))
            empties = sorted((h for h in node.open if self.fits(h, d)), key=lambda h: self.gpus[h].cap)
            pick = (ok + empties)[: d.gpus]
            if len(pick) == d.gpus:
                total = sum(self.score(h, d) for h in pick)
                if best is None or total < best[0]:
                    best = (total, tuple(pick))
        return best[1] if best else None

    def _open_gpus(self, n: int, d: Demand, exclude: set[int] | None = None) -> tuple[int, ...] | None:
        """``n`` empty GPUs with room for ``d`` on the node with the fewest such GPUs that still
        has ``n``; on that node the smallest that fit (none of ``exclude``)."""
        if d.limit_quota > self.gamma + EPS:
            return None
        k = bisect.bisect_left(self.classes, d.memory_bytes)
        if k == len(self.classes):
            return None
        index = self._open[self.classes[k]]
        for count in range(n, len(index)):
            for nid in index[count]:
                fit = [h for h in self._nodes[nid].open
                       if self.fits(h, d) and (exclude is None or h not in exclude)]
                if len(fit) < n:  # only with exclude: this node's open GPUs are ruled out
                    continue
                if len(fit) > n:
                    fit.sort(key=lambda h: self.gpus[h].cap)  # stable: join order among equals
                return tuple(fit[:n])
        return None

    def resume_target(self, d: Demand, left: Slot, instance_id: str | None = None) -> Slot | None:
        """Where a parked instance of ``d`` resumes: the GPU it ``left``, when that can still take
        it (what parked ``instance_id`` keeps there, memory and MPS client, counts as its own); None when it cannot
        (the instance is retired and a new one launched wherever :meth:`place` finds room, a cold
        start). Only there: an instance's process is bound to its GPU at launch
        (``CUDA_VISIBLE_DEVICES``, its MPS client, its control block), so resuming on another
        would be a relaunch anyway. Raises KeyError for a dead node."""
        return left if self.fits(self.gpu_id(left), d, parked_id=instance_id) else None

    def park(self, instance_id: str) -> Slot:
        """Take a parked instance off its GPU: its quotas and memory are freed there, except
        :func:`parked_bytes`, which its process keeps until it resumes or ends (:meth:`unpark`).
        A GPU holding only parked processes is not active: it takes new instances in the memory
        left. Returns its slot. Raises UnknownInstance; ValueError for a multi-GPU instance."""
        if instance_id not in self.instances:
            raise UnknownInstance(instance_id)
        d, gpus = self.instances[instance_id]
        if len(gpus) != 1:
            raise ValueError(f"{instance_id}: a multi-GPU instance does not park")
        self.remove(instance_id)
        slot = self.slot(gpus[0])
        self.hold(instance_id, slot, parked_bytes(d))
        return slot

    def hold(self, instance_id: str, slot: Slot, held_bytes: int) -> None:
        """Count ``held_bytes`` of parked ``instance_id``'s process on the GPU at ``slot`` (rebuilding
        state from a parked placement; :meth:`park` calls it). Raises KeyError for an unknown
        node, IndexError for a GPU the node does not have, ValueError for an id placed or parked
        already or negative bytes."""
        g = self.gpu_id(slot)
        if instance_id in self.instances or instance_id in self.parked or held_bytes < 0:
            raise ValueError(f"{instance_id}: placed or parked already, or bad bytes {held_bytes}")
        s = self.gpus[g]
        s.parked[instance_id] = held_bytes
        s.mem += held_bytes
        self.parked[instance_id] = g
        self._reindex(g)  # one more MPS client: it may now be at its instance limit

    def unpark(self, instance_id: str) -> Slot | None:
        """Release the memory parked ``instance_id`` holds (it resumes, or its process ended);
        returns that GPU's slot, None when it held nothing (never parked here, or its GPU is gone)."""
        g = self.parked.pop(instance_id, None)
        if g is None:
            return None
        s = self.gpus[g]
        s.mem -= s.parked.pop(instance_id)
        if s.alive:
            self._reindex(g)
        return self.slot(g)

    def place(self, instance_id: str, d: Demand, allow_new: bool = True) -> list[Slot]:
        """Choose GPUs for a new instance and apply it; returns its slots.

        Raises ValueError for an instance id already placed, NoCapacity when nothing can take it.
        """
        if instance_id in self.instances or instance_id in self.parked:
            raise ValueError(f"instance {instance_id} is already placed (or parked)")
        gpus = self.choose(d, allow_new=allow_new)
        self._apply(instance_id, d, gpus)
        return [self.slot(g) for g in gpus]

    def assign(self, instance_id: str, d: Demand, slots: Sequence[Slot], *, check: bool = True) -> None:
        """Apply a decision taken elsewhere (rebuilding state from the placement table).

        With ``check``, raises ValueError when a slot would break a cap (including an unhealthy
        GPU or one at its instance limit; not the rigid rule, which :meth:`choose` too breaks
        before opening a GPU) or the id exists. Raises KeyError for an
        unknown node, IndexError for a GPU the node does not have.
        """
        if instance_id in self.instances or instance_id in self.parked:
            raise ValueError(f"instance {instance_id} is already placed (or parked: unpark it first)")
        gpus = tuple(self.gpu_id(s) for s in slots)
        if len(set(gpus)) != len(gpus) or len(gpus) != d.gpus:
            raise ValueError(f"{instance_id}: needs {d.gpus} distinct GPUs, got {slots}")
        if check and not all(self.fits(g, d, rigid=False) for g in gpus):
            raise ValueError(f"{instance_id}: placing it on {slots} would break a GPU's limits")
        self._apply(instance_id, d, gpus)

    def _apply(self, instance_id: str, d: Demand, gpus: tuple[int, ...]) -> None:
        for g in gpus:
            s = self.gpus[g]
            if not s.residents:
                self.active += 1
            s.req += d.request_quota
            s.lim += d.burst_quota
            s.mem += d.memory_bytes
            s.residents[instance_id] = d
            s.training += d.kind == "training"
            s.rigid += d.rigid
            s.multi += d.gpus > 1
            s.fns[d.function] = s.fns.get(d.function, 0) + 1
            if d.peak_hour is not None:
                s.peaks[d.peak_hour] = s.peaks.get(d.peak_hour, 0) + 1
            self._reindex(g)
        self.instances[instance_id] = (d, gpus)

    def remove(self, instance_id: str) -> tuple[Demand, list[Slot]]:
        """Take an instance out; returns what it was and where. Raises UnknownInstance."""
        try:
            d, gpus = self.instances.pop(instance_id)
        except KeyError:
            raise UnknownInstance(instance_id) from None
        for g in gpus:
            s = self.gpus[g]
            del s.residents[instance_id]
            s.training -= d.kind == "training"
            s.rigid -= d.rigid
            s.multi -= d.gpus > 1
            s.fns[d.function] -= 1
            if not s.fns[d.function]:
                del s.fns[d.function]
            if d.peak_hour is not None:
                s.peaks[d.peak_hour] -= 1
                if not s.peaks[d.peak_hour]:
                    del s.peaks[d.peak_hour]
            if s.residents:
                s.req -= d.request_quota
                s.lim -= d.burst_quota
                s.mem -= d.memory_bytes
            else:  # reset exactly: no float residue on an empty GPU
                s.req = s.lim = 0.0
                s.mem = sum(s.parked.values())
                self.active -= 1
            self._reindex(g)
        return d, [self.slot(g) for g in gpus]

    def _takes_more(self, s: _Gpu) -> bool:
        """Whether an active GPU belongs in the buckets (it may take another instance)."""
        return s.ok and bool(s.residents) and _clients(s) < s.limit

    def _reindex(self, g: int) -> None:
        """Bring ``g``'s bucket and open-GPU entries in line with its state."""
        s = self.gpus[g]
        s.ok = s.alive and s.healthy
        if s.bucket >= 0:
            del self.buckets[s.cap][s.bucket][g]
            s.bucket = -1
        if s.ok and s.residents and _clients(s) < s.limit:  # it may take more
            s.bucket = self._bucket_of(s)
            self.buckets[s.cap][s.bucket][g] = None
        want_open = s.ok and not s.residents
        if want_open != s.open:
            self._set_open(g, want_open)

    def _set_open(self, g: int, is_open: bool) -> None:
        s = self.gpus[g]
        node = self._nodes[s.node]
        if is_open:
            node.open[g] = None
        else:
            del node.open[g]
        s.open = is_open
        step = 1 if is_open else -1
        for m in self.classes:
            if m > s.cap:
                break
            index = self._open[m]
            count = node.counts.get(m, 0)
            if count:
                del index[count][s.node]
            count += step
            node.counts[m] = count
            if count:
                while len(index) <= count:
                    index.append({})
                index[count][s.node] = None

    # ------------------------------------------------------------------ retirement and defragmentation

    def frees_room(self, instance_id: str, d: Demand) -> bool:
        """Whether removing ``instance_id`` would let one slot of ``d`` fit on one of its GPUs
        (:meth:`fits` as if it were gone). Raises UnknownInstance for an id not placed."""
        if instance_id not in self.instances:
            raise UnknownInstance(instance_id)
        gone, gpus = self.instances[instance_id]
        for g in gpus:
            s = self.gpus[g]
            trained = s.training - (gone.kind == "training")
            if (s.ok and _clients(s) - 1 < s.limit
                    and s.req - gone.request_quota + d.request_quota <= 1 + EPS
                    and s.lim - gone.burst_quota + d.burst_quota <= self.gamma + EPS
                    and s.mem - gone.memory_bytes + d.memory_bytes <= s.cap
                    and not (trained and d.kind == "training")
                    and rigid_fits(s.rigid - gone.rigid, d, s.lim - gone.burst_quota + d.burst_quota)):
                return True
        return False

    def choose_victim(self, candidates: Sequence[str], warm: Iterable[str] = ()) -> str:
        """Which of ``candidates`` (instance ids of one function) to retire.

        Instances still starting go first (cancelling a launch loses no warm capacity); then the
        one whose removal leaves the least fragmentation: one that empties its GPU, else the one on
        the least-loaded GPU (closest to being emptied). Ties: the last id in order. Raises
        ValueError for no candidates, UnknownInstance for an id not placed.
        """
        if not candidates:
            raise ValueError("no instance to retire")
        warm = set(warm)

        def key(i: str) -> tuple:
            if i not in self.instances:
                raise UnknownInstance(i)
            d, gpus = self.instances[i]
            empties = all(len(self.gpus[g].residents) == 1 for g in gpus)
            load = max(self.gpus[g].req for g in gpus)
            return (i in warm, not empties, load)

        return min(reversed(list(candidates)), key=key)

    def plan_round(self, placed: Mapping[str, Placed], gain_per_gpu_s: float = DEFRAG_GAIN_PER_GPU_S) -> DefragPlan:
        """One defragmentation round as the live scheduler and the simulator run it:
        :meth:`plan_defrag` over :func:`defrag_inputs` of ``placed`` (every placed instance,
        parked ones included). Pure, as :meth:`plan_defrag`."""
        inputs = defrag_inputs(placed)
        return self.plan_defrag(inputs.cost_gpu_s, gain_per_gpu_s=gain_per_gpu_s, leaving=inputs.leaving,
                                starting=inputs.starting)

    def plan_defrag(
        self, cost_gpu_s: dict[str, float] | None = None, *, gain_per_gpu_s: float = 300.0,
        default_cost_gpu_s: float = 10.0, max_sources: int = 64, leaving: Collection[str] = (),
        starting: Collection[str] = (),
    ) -> DefragPlan:
        """Migrations that free whole GPUs, kept only when the gain outweighs the cost.

        Sources are tried from the least loaded GPU up; every instance on a source must fit on
        another active GPU (never an empty one, never another source, never an unsettled one);
        multi-GPU instances are never moved. ``gain_per_gpu_s``: GPU-seconds saved per freed GPU
        (how long it is expected to stay free, default 300 s). ``cost_gpu_s[instance]``:
        GPU-seconds a migration costs (:func:`migration_price_gpu_s`), default
        ``default_cost_gpu_s``. A GPU is *unsettled* when every instance on it is ``leaving`` (on
        its way out, draining or replaced by a migration in flight, but holding its share until
        it is gone) or ``starting`` (launched or resuming, not ready yet), and it takes no one:
        one being vacated would be refilled, undoing the round that empties it; one opened by a
        scale-out or a relaunch since the last round would take a lighter GPU's every instance,
        where its newcomer, once ready, may move with one launch. Either way the next round
        would move the newcomers again; waiting costs at most a round. A source is accepted only
        if its own gain exceeds its migrations' cost. Pure: the cluster itself is not changed;
        apply the plan by retiring and placing.
        """
        costs = cost_gpu_s or {}
        plan = DefragPlan()
        unsettled = set(leaving) | set(starting)
        unsettled_gpus = {g for g, s in enumerate(self.gpus) if s.residents and unsettled.issuperset(s.residents)}

        def cost_of(g: int) -> float:
            return sum(costs.get(i, default_cost_gpu_s) for i in self.gpus[g].residents)

        order = [g for k in range(BUCKETS, -1, -1) for m in self.classes for g in self.buckets[m][k]]
        order = [g for g in order[:max_sources]
                 if self.gpus[g].residents and not self.gpus[g].multi and cost_of(g) < gain_per_gpu_s]
        if not order:  # e.g. every active GPU holds a training job: nothing to copy the cluster for
            return plan
        shadow = copy.deepcopy(self)
        sources: set[int] = set()
        targets: set[int] = set()
        for g in order:
            s = shadow.gpus[g]
            if not s.residents or s.multi or g in targets:  # never empty a GPU we just filled
                continue
            moved = list(s.residents.items())
            cost = sum(costs.get(i, default_cost_gpu_s) for i, _ in moved)
            if cost >= gain_per_gpu_s:
                continue
            moved_to = self._try_move(shadow, g, moved, sources | unsettled_gpus | {g})
            if moved_to is None:
                continue
            sources.add(g)
            targets.update(t for _, t in moved_to)
            plan.freed.append(self.slot(g))
            plan.gain_gpu_s += gain_per_gpu_s
            plan.cost_gpu_s += cost
            plan.migrations += [Migration(i, self.slot(g), self.slot(t)) for i, t in moved_to]
        return plan

    @staticmethod
    def _try_move(shadow: "Cluster", g: int, moved: list[tuple[str, Demand]], exclude: set[int]):
        """Move every resident of ``g`` onto other active GPUs of ``shadow``; undo and None if one fails."""
        for i, _ in moved:
            shadow.remove(i)
        done: list[tuple[str, int]] = []
        for i, d in sorted(moved, key=lambda x: -x[1].request_quota):
            try:
                (t,) = shadow.choose(d, exclude=exclude, allow_new=False)
            except NoCapacity:
                for j, _ in done:
                    shadow.remove(j)
                for j, dj in moved:
                    shadow._apply(j, dj, (g,))
                return None
            shadow._apply(i, d, (t,))
            done.append((i, t))
        return done

    # ------------------------------------------------------------------ observation

    def violations(self) -> list[str]:
        """Broken invariants (empty when all hold): per-GPU caps (Σ request, Σ limit, memory,
        instance count), sums equal to residents', indexes; dead GPUs hold nothing."""
        out = []
        for g, s in enumerate(self.gpus):
            if not s.alive:
                if s.residents or s.parked or s.bucket >= 0 or s.open:
                    out.append(f"GPU {g}: dead but occupied or indexed")
                continue
            req = sum(d.request_quota for d in s.residents.values())
            lim = sum(d.burst_quota for d in s.residents.values())
            mem = sum(d.memory_bytes for d in s.residents.values()) + sum(s.parked.values())
            if any(self.parked.get(i) != g for i in s.parked):
                out.append(f"GPU {g}: parked processes' memory drifted")
            if req > 1 + EPS or lim > self.gamma + EPS or mem > s.cap or (s.max and _clients(s) > s.max):
                out.append(f"GPU {g}: Σreq {req:.4f} Σlim {lim:.4f} mem {mem}/{s.cap} "
                           f"instances {len(s.residents)} + {len(s.parked)} parked/{s.max or '∞'}")
            if sum(d.kind == "training" for d in s.residents.values()) > 1:
                out.append(f"GPU {g}: two training instances")
            if abs(req - s.req) > 1e-6 or abs(lim - s.lim) > 1e-6 or mem != s.mem:
                out.append(f"GPU {g}: running sums drifted")
            in_bucket = s.bucket >= 0 and g in self.buckets[s.cap][s.bucket] and s.bucket == self._bucket_of(s)
            want_open = s.healthy and not s.residents
            if (in_bucket != self._takes_more(s) or want_open != s.open or s.open != (g in self._nodes[s.node].open)
                    or s.ok != s.healthy or s.limit != (s.max or UNLIMITED)):
                out.append(f"GPU {g}: index out of date")
        for m in self.classes:
            indexed = 0
            for name, nid in self.node_index.items():
                node = self._nodes[nid]
                count = sum(1 for h in node.open if self.gpus[h].cap >= m)
                listed = node.counts.get(m, 0)
                indexed += count > 0
                if listed != count or (count and nid not in self._open[m][count]):
                    out.append(f"node {name}: open-GPU index of memory class {m} out of date")
            if sum(len(nodes) for nodes in self._open[m]) != indexed:
                out.append(f"memory class {m}: index lists nodes that have no open GPU")
        if sorted(self.classes) != sorted({self.gpus[g].cap for n in self.node_index.values() for g in self._nodes[n].gpus}):
            out.append("memory classes out of date")
        if (sorted(self.buckets) != self.classes
                or sum(len(b) for m in self.buckets for b in self.buckets[m]) != sum(s.bucket >= 0 for s in self.gpus)):
            out.append("buckets list GPUs they should not")
        if self.active != sum(1 for s in self.gpus if s.residents):
            out.append("active GPU count drifted")
        if len(self.parked) != sum(len(s.parked) for s in self.gpus):
            out.append("parked instances listed on no GPU")
        return out

    def request_sum(self, slot: Slot) -> float:
        return self.gpus[self.gpu_id(slot)].req

    def limit_sum(self, slot: Slot) -> float:
        """Σ of what the GPU's residents count against γ (:attr:`Demand.burst_quota`: limits,
        training at its request)."""
        return self.gpus[self.gpu_id(slot)].lim

    def residents(self, slot: Slot) -> list[str]:
        return list(self.gpus[self.gpu_id(slot)].residents)
