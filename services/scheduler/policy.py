"""Placement policy: 2-D bin packing of request quota and memory under a limit cap (DESIGN.md section 4.5).

Pure: the cluster state is a plain object, decisions are returned, nothing here does I/O or reads
a clock. The same object drives the live scheduler service and the workload replay.

Feasibility of a GPU for one more instance slot (compared with tolerance ``EPS`` = 1e-6, because
quotas in the data carry float artefacts such as 0.5900000000000001):

- Σ request quotas ≤ 1 (requests are guaranteed),
- Σ limit quotas ≤ γ (default 1.5, the oversubscription cap on bursts),
- Σ memory ≤ the GPU's memory.

Placement: among feasible GPUs that already host instances, best fit (least request quota and
memory left over), with small preferences for complementary collocation (training beside
inference; functions whose load peaks at different hours) and affinity, and against two replicas of
one function on a GPU (their bursts coincide). A new GPU is opened only when nothing fits; it is
taken on the node with the fewest empty GPUs left, so whole nodes stay free for multi-GPU training.
A multi-GPU instance (training) gets its slots on distinct GPUs of one node.

Speed: active GPUs are indexed in buckets of free request quota (1 % wide); a placement scans the
buckets upward from the one that can hold the request and scores at most ``max_candidates``
feasible GPUs, so its cost does not grow with the cluster.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

EPS = 1e-6
BUCKETS = 100  # free request quota buckets: bucket k holds GPUs with free in [k/100, (k+1)/100)


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


@dataclass
class DefragPlan:
    """Migrations that empty ``freed`` GPUs; ``gain_gpu_s`` vs ``cost_gpu_s`` (GPU-seconds)."""

    migrations: list[Migration] = field(default_factory=list)
    freed: list[Slot] = field(default_factory=list)
    gain_gpu_s: float = 0.0
    cost_gpu_s: float = 0.0


class _Gpu:
    __slots__ = ("req", "lim", "mem", "residents", "training", "fns", "peaks", "bucket", "multi")

    def __init__(self) -> None:
        self.req = 0.0
        self.lim = 0.0
        self.mem = 0
        self.residents: dict[str, Demand] = {}
        self.training = 0
        self.fns: dict[str, int] = {}
        self.peaks: dict[int, int] = {}
        self.bucket = -1  # -1: empty (not in the active buckets)
        self.multi = 0  # residents spanning several GPUs (never migrated)


class Cluster:
    """GPUs of ``nodes`` × ``gpus_per_node``, each with ``gpu_memory_bytes``, and what runs on them.

    ``gamma``: the Σ-limit cap; ``max_candidates``: feasible GPUs scored per placement.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        gpus_per_node: int,
        gpu_memory_bytes: int,
        *,
        gamma: float = 1.5,
        max_candidates: int = 16,
    ) -> None:
        if not nodes or gpus_per_node < 1 or gpu_memory_bytes <= 0 or gamma < 1:
            raise ValueError("need ≥ 1 node, ≥ 1 GPU per node, positive memory and gamma ≥ 1")
        if len(set(nodes)) != len(nodes):
            raise ValueError("node names must be unique")
        self.nodes = list(nodes)
        self.node_index = {n: i for i, n in enumerate(self.nodes)}
        self.gpus_per_node = gpus_per_node
        self.capacity = gpu_memory_bytes
        self.gamma = gamma
        self.max_candidates = max_candidates
        self.gpus = [_Gpu() for _ in range(len(nodes) * gpus_per_node)]
        self.buckets: list[dict[int, None]] = [{} for _ in range(BUCKETS + 1)]  # ordered sets
        # empty GPUs per node, and nodes indexed by their number of empty GPUs
        self.empty: list[dict[int, None]] = [
            {n * gpus_per_node + g: None for g in range(gpus_per_node)} for n in range(len(nodes))]
        self.nodes_by_empty: list[dict[int, None]] = [{} for _ in range(gpus_per_node + 1)]
        self.nodes_by_empty[gpus_per_node] = {n: None for n in range(len(nodes))}
        self.instances: dict[str, tuple[Demand, tuple[int, ...]]] = {}
        self.active = 0

    # ------------------------------------------------------------------ addressing

    def slot(self, g: int) -> Slot:
        return Slot(self.nodes[g // self.gpus_per_node], g % self.gpus_per_node)

    def gpu_id(self, slot: Slot) -> int:
        """Raises KeyError for an unknown node, IndexError for a GPU index out of range."""
        if not 0 <= slot.gpu < self.gpus_per_node:
            raise IndexError(f"GPU {slot.gpu} out of range 0..{self.gpus_per_node - 1}")
        return self.node_index[slot.node] * self.gpus_per_node + slot.gpu

    # ------------------------------------------------------------------ feasibility and scoring

    def fits(self, g: int, d: Demand) -> bool:
        """Whether GPU ``g`` can take one more slot of ``d`` (Σ request ≤ 1, Σ limit ≤ γ, memory)."""
        s = self.gpus[g]
        return (s.req + d.request_quota <= 1 + EPS and s.lim + d.limit_quota <= self.gamma + EPS
                and s.mem + d.memory_bytes <= self.capacity)

    def score(self, g: int, d: Demand) -> float:
        """Lower is better: request and memory left over (best fit), adjusted by collocation preferences."""
        s = self.gpus[g]
        score = (1 - s.req - d.request_quota) + 0.5 * (self.capacity - s.mem - d.memory_bytes) / self.capacity
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

    def _candidates(self, d: Demand, exclude: set[int] | None = None) -> Iterable[int]:
        """Feasible active GPUs in best-fit order of buckets (at most max_candidates of them)."""
        found = 0
        start = max(0, int((d.request_quota - EPS) * BUCKETS))
        for k in range(start, BUCKETS + 1):
            for g in self.buckets[k]:
                if (exclude is None or g not in exclude) and self.fits(g, d):
                    yield g
                    found += 1
                    if found >= self.max_candidates:
                        return

    # ------------------------------------------------------------------ decisions

    def choose(self, d: Demand, exclude: set[int] | None = None, allow_new: bool = True) -> tuple[int, ...]:
        """The GPUs (global ids) for one instance of ``d``, without applying it. Raises NoCapacity."""
        if d.gpus > self.gpus_per_node:
            raise NoCapacity(f"{d.function} needs {d.gpus} GPUs on one node; nodes have {self.gpus_per_node}")
        if d.gpus == 1:
            best = min(self._candidates(d, exclude), key=lambda g: self.score(g, d), default=None)
            if best is not None:
                return (best,)
        else:
            multi = self._choose_multi(d, exclude)
            if multi:
                return multi
        if allow_new:
            fresh = self._open(d.gpus, d)
            if fresh:
                return fresh
        raise NoCapacity(f"no GPU can take {d.function} (request {d.request_quota:.3f}, "
                         f"limit {d.limit_quota:.3f}, memory {d.memory_bytes} B × {d.gpus} GPUs)")

    def _choose_multi(self, d: Demand, exclude: set[int] | None) -> tuple[int, ...] | None:
        """``d.gpus`` feasible GPUs on one node, preferring nodes with active GPUs that fit."""
        best: tuple[float, tuple[int, ...]] | None = None
        seen: set[int] = set()
        for g in self._candidates(d, exclude):
            node = g // self.gpus_per_node
            if node in seen:
                continue
            seen.add(node)
            base = node * self.gpus_per_node
            ok = [h for h in range(base, base + self.gpus_per_node)
                  if self.gpus[h].residents and (exclude is None or h not in exclude) and self.fits(h, d)]
            ok.sort(key=lambda h: self.score(h, d))
            empties = list(self.empty[node])
            pick = (ok + empties)[: d.gpus]
            if len(pick) == d.gpus:
                total = sum(self.score(h, d) for h in pick)
                if best is None or total < best[0]:
                    best = (total, tuple(pick))
        return best[1] if best else None

    def _open(self, n: int, d: Demand) -> tuple[int, ...] | None:
        """``n`` empty GPUs on the node with the fewest empty GPUs that still has ``n``."""
        if d.memory_bytes > self.capacity or d.limit_quota > self.gamma + EPS:
            return None
        for count in range(n, self.gpus_per_node + 1):
            for node in self.nodes_by_empty[count]:
                return tuple(list(self.empty[node])[:n])
        return None

    def place(self, instance_id: str, d: Demand, allow_new: bool = True) -> list[Slot]:
        """Choose GPUs for a new instance and apply it; returns its slots.

        Raises ValueError for an instance id already placed, NoCapacity when nothing can take it.
        """
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id} is already placed")
        gpus = self.choose(d, allow_new=allow_new)
        self._apply(instance_id, d, gpus)
        return [self.slot(g) for g in gpus]

    def assign(self, instance_id: str, d: Demand, slots: Sequence[Slot], *, check: bool = True) -> None:
        """Apply a decision taken elsewhere (rebuilding state from the placement table).

        With ``check``, raises ValueError when a slot would break feasibility or the id exists.
        """
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id} is already placed")
        gpus = tuple(self.gpu_id(s) for s in slots)
        if len(set(gpus)) != len(gpus) or len(gpus) != d.gpus:
            raise ValueError(f"{instance_id}: needs {d.gpus} distinct GPUs, got {slots}")
        if check and not all(self.fits(g, d) for g in gpus):
            raise ValueError(f"{instance_id}: placing it on {slots} would break a GPU's limits")
        self._apply(instance_id, d, gpus)

    def _apply(self, instance_id: str, d: Demand, gpus: tuple[int, ...]) -> None:
        for g in gpus:
            s = self.gpus[g]
            if not s.residents:
                self._set_empty(g, False)
            s.req += d.request_quota
            s.lim += d.limit_quota
            s.mem += d.memory_bytes
            s.residents[instance_id] = d
            s.training += d.kind == "training"
            s.multi += d.gpus > 1
            s.fns[d.function] = s.fns.get(d.function, 0) + 1
            if d.peak_hour is not None:
                s.peaks[d.peak_hour] = s.peaks.get(d.peak_hour, 0) + 1
            self._rebucket(g)
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
                s.lim -= d.limit_quota
                s.mem -= d.memory_bytes
            else:  # reset exactly: no float residue on an empty GPU
                s.req = s.lim = 0.0
                s.mem = 0
            self._rebucket(g)
        return d, [self.slot(g) for g in gpus]

    def _rebucket(self, g: int) -> None:
        s = self.gpus[g]
        if s.bucket >= 0:
            del self.buckets[s.bucket][g]
        if s.residents:
            s.bucket = self._bucket_of(s)
            self.buckets[s.bucket][g] = None
        else:
            s.bucket = -1
            self._set_empty(g, True)

    def _set_empty(self, g: int, empty: bool) -> None:
        node = g // self.gpus_per_node
        before = len(self.empty[node])
        if empty:
            self.empty[node][g] = None
            self.active -= 1
        else:
            del self.empty[node][g]
            self.active += 1
        del self.nodes_by_empty[before][node]
        self.nodes_by_empty[len(self.empty[node])][node] = None

    # ------------------------------------------------------------------ retirement and defragmentation

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

    def plan_defrag(
        self, cost_gpu_s: dict[str, float] | None = None, *, gain_per_gpu_s: float = 300.0,
        default_cost_gpu_s: float = 10.0, max_sources: int = 64,
    ) -> DefragPlan:
        """Migrations that free whole GPUs, kept only when the gain outweighs the cost.

        Sources are tried from the least loaded GPU up; every instance on a source must fit on
        another active GPU (never an empty one, never another source); multi-GPU instances are
        never moved. ``gain_per_gpu_s``: GPU-seconds saved per freed GPU (how long it is expected to
        stay free, default 300 s). ``cost_gpu_s[instance]``: GPU-seconds a migration costs (e.g. cold
        start in s × its request quota + a disruption allowance), default ``default_cost_gpu_s``.
        A source is accepted only if its own gain exceeds its migrations' cost. Pure: the cluster
        itself is not changed; apply the plan by retiring and placing.
        """
        costs = cost_gpu_s or {}
        shadow = copy.deepcopy(self)
        plan = DefragPlan()
        sources: set[int] = set()
        targets: set[int] = set()
        order = [g for k in range(BUCKETS, -1, -1) for g in self.buckets[k]]
        for g in order[:max_sources]:
            s = shadow.gpus[g]
            if not s.residents or s.multi or g in targets:  # never empty a GPU we just filled
                continue
            moved = list(s.residents.items())
            cost = sum(costs.get(i, default_cost_gpu_s) for i, _ in moved)
            if cost >= gain_per_gpu_s:
                continue
            moved_to = self._try_move(shadow, g, moved, sources | {g})
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
        """Broken invariants (empty when all hold): per-GPU caps, sums equal to residents', indexes."""
        out = []
        for g, s in enumerate(self.gpus):
            req = sum(d.request_quota for d in s.residents.values())
            lim = sum(d.limit_quota for d in s.residents.values())
            mem = sum(d.memory_bytes for d in s.residents.values())
            if req > 1 + EPS or lim > self.gamma + EPS or mem > self.capacity:
                out.append(f"GPU {g}: Σreq {req:.4f} Σlim {lim:.4f} mem {mem}")
            if abs(req - s.req) > 1e-6 or abs(lim - s.lim) > 1e-6 or mem != s.mem:
                out.append(f"GPU {g}: running sums drifted")
            in_empty = g in self.empty[g // self.gpus_per_node]
            if in_empty == bool(s.residents) or (s.residents and g not in self.buckets[s.bucket]):
                out.append(f"GPU {g}: index out of date")
        if self.active != sum(1 for s in self.gpus if s.residents):
            out.append("active GPU count drifted")
        return out

    def request_sum(self, slot: Slot) -> float:
        return self.gpus[self.gpu_id(slot)].req

    def limit_sum(self, slot: Slot) -> float:
        return self.gpus[self.gpu_id(slot)].lim

    def residents(self, slot: Slot) -> list[str]:
        return list(self.gpus[self.gpu_id(slot)].residents)
