"""The cluster built from node inventories: nodes join and leave, GPUs differ (memory, MPS client
limit, health), liveness on a fake clock, and the policy's invariants under any sequence of
joins, leaves, placements and removals (hypothesis)."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dilu.contracts.events import GpuInfo, NodeInventory
from dilu.services.scheduler.inventory import (
    Roster,
    gpu_capacities,
    inventory_age_s,
    orphans_due,
    stale_nodes,
)
from dilu.services.scheduler.policy import EPS, Cluster, Demand, GpuCapacity, NoCapacity, Slot, parked_bytes

GiB = 2**30


def inf(fn="f", r=0.3, lim=None, mem_gib=4.0, **kw) -> Demand:
    return Demand(function=fn, request_quota=r, limit_quota=lim if lim is not None else r,
                  memory_bytes=int(mem_gib * GiB), **kw)


def gpus(n=4, mem_gib=40, limit=0) -> list[GpuCapacity]:
    return [GpuCapacity(mem_gib * GiB, limit)] * n


def gpu_info(i, mem_gib=40, **kw) -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA A100-SXM4-40GB", memory_bytes=mem_gib * GiB, sms=108, **kw)


def inventory(node="n0", count=2, agent="a1", **kw) -> NodeInventory:
    return NodeInventory(node=node, agent_id=agent, gpus=[gpu_info(i, **kw) for i in range(count)])


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ----------------------------------------------------------------------------- membership


def test_an_empty_cluster_refuses_clearly_and_nodes_join_at_run_time():
    c = Cluster.empty()
    assert Cluster([]).nodes == [] and c.nodes == []
    with pytest.raises(NoCapacity, match="no node"):
        c.place("a", inf())
    c.add_node("gpu-node-7.dc1", gpus(2))
    assert c.place("a", inf()) == [Slot("gpu-node-7.dc1", 0)]
    with pytest.raises(ValueError, match="already"):
        c.add_node("gpu-node-7.dc1", gpus(1))
    with pytest.raises(ValueError, match="twice"):
        c.add_node("x", [GpuCapacity(GiB, index=1), GpuCapacity(GiB, index=1)])
    assert c.violations() == []


def test_the_old_constructor_is_add_node_for_each():
    c = Cluster(["a", "b"], 2, 40 * GiB, gamma=1.5, max_gpu_instances=48)
    assert c.nodes == ["a", "b"] and len(c.gpus) == 4
    assert c.capacity(Slot("b", 1)) == GpuCapacity(40 * GiB, 48, index=1)
    with pytest.raises(ValueError):
        Cluster(["a"], 0, 40 * GiB)


def test_leave_displaces_its_instances_and_they_fit_on_the_remaining_nodes():
    c = Cluster.empty()
    c.add_node("a", gpus(2))
    c.add_node("b", gpus(2))
    for k in range(4):
        c.assign(f"i{k}", inf(r=0.3), [Slot("a", k % 2)])
    c.assign("j", inf(r=0.3), [Slot("b", 0)])
    displaced = c.remove_node("a")
    assert sorted(displaced) == ["i0", "i1", "i2", "i3"]
    assert c.nodes == ["b"] and c.active == 1 and "i0" not in c.instances
    for i in displaced:  # the service places each again, as a new instance of the same function
        assert c.place(f"{i}-again", inf(r=0.3))[0].node == "b"
    assert c.active == 2 and c.violations() == []
    with pytest.raises(NoCapacity):
        c.place("one-too-many", inf(r=0.5))
    with pytest.raises(KeyError):
        c.assign("z", inf(), [Slot("a", 0)])  # its GPUs are gone
    with pytest.raises(KeyError):
        c.remove_node("a")
    # the same name may join again: fresh GPUs
    c.add_node("a", gpus(1))
    assert c.place("back", inf(r=0.9)) == [Slot("a", 0)] and c.violations() == []


def test_multi_gpu_instances_leave_with_their_node():
    c = Cluster.empty()
    c.add_node("a", gpus(4))
    c.place("t", inf("train", r=0.5, kind="training", gpus=4))
    c.place("s", inf(r=0.2))
    assert sorted(c.remove_node("a")) == ["s", "t"]
    assert c.active == 0 and c.instances == {} and c.violations() == []


def test_an_unhealthy_gpu_keeps_its_residents_but_takes_nothing_new():
    c = Cluster.empty()
    c.add_node("a", gpus(2))
    c.assign("x", inf(r=0.2), [Slot("a", 0)])
    sick = [GpuCapacity(40 * GiB, healthy=False, reason="Xid 79"), GpuCapacity(40 * GiB)]
    assert c.update_node("a", sick) == []
    assert c.residents(Slot("a", 0)) == ["x"] and c.violations() == []
    assert c.place("y", inf(r=0.2)) == [Slot("a", 1)], "the best fit would be beside x, but GPU 0 is unhealthy"
    with pytest.raises(ValueError, match="break"):
        c.assign("z", inf(r=0.1), [Slot("a", 0)])
    c.update_node("a", [GpuCapacity(40 * GiB, healthy=False), GpuCapacity(40 * GiB, healthy=False)])
    with pytest.raises(NoCapacity):
        c.place("w", inf(r=0.1))
    c.remove("x")
    with pytest.raises(NoCapacity):  # an empty unhealthy GPU is not opened either
        c.place("w", inf(r=0.1))
    c.update_node("a", gpus(2))  # healthy again
    assert c.place("w", inf(r=0.1))[0].node == "a" and c.violations() == []


def test_a_gpu_gone_from_the_inventory_displaces_its_residents():
    c = Cluster.empty()
    c.add_node("a", gpus(2))
    c.assign("x", inf(), [Slot("a", 1)])
    c.assign("y", inf(), [Slot("a", 0)])
    assert c.update_node("a", [GpuCapacity(40 * GiB, index=0), GpuCapacity(80 * GiB, index=2)]) == ["x"]
    assert [s.gpu for s in c.node_slots("a")] == [0, 2] and c.violations() == []
    with pytest.raises(IndexError):
        c.gpu_id(Slot("a", 1))


def test_mps_client_limit_48_sends_86_tiny_instances_to_two_gpus():
    c = Cluster.empty()
    c.add_node("a", gpus(4, limit=48))
    for k in range(86):
        c.place(f"i{k}", inf(f"f{k}", r=0.01, mem_gib=0.1))
    counts = sorted(len(s.residents) for s in c.gpus if s.residents)
    assert counts == [38, 48] and c.active == 2 and c.violations() == []
    # without the limit they would all share one GPU
    free = Cluster.empty()
    free.add_node("a", gpus(4))
    for k in range(86):
        free.place(f"i{k}", inf(f"f{k}", r=0.01, mem_gib=0.1))
    assert free.active == 1


def test_heterogeneous_memory_an_80_gb_gpu_takes_what_a_40_gb_one_cannot():
    c = Cluster.empty()
    c.add_node("small", gpus(2, mem_gib=40))
    c.add_node("big", gpus(1, mem_gib=80))
    assert c.place("huge", inf(r=0.3, mem_gib=60)) == [Slot("big", 0)]
    assert c.place("tiny", inf("g", r=0.3, mem_gib=4)) == [Slot("big", 0)], "best fit beside huge"
    # a fresh GPU for a small instance: the smallest empty GPU that holds it
    c2 = Cluster.empty()
    c2.add_node("mixed", [GpuCapacity(80 * GiB), GpuCapacity(40 * GiB)])
    assert c2.place("s", inf(r=0.5, mem_gib=10)) == [Slot("mixed", 1)]
    assert c2.place("l", inf(r=0.9, mem_gib=50)) == [Slot("mixed", 0)]
    with pytest.raises(NoCapacity):
        c2.place("xl", inf(r=0.1, mem_gib=90))
    # multi-GPU training on a node whose GPUs are big enough only
    c3 = Cluster.empty()
    c3.add_node("small", gpus(4, mem_gib=40))
    c3.add_node("big", gpus(2, mem_gib=80))
    slots = c3.place("t", inf("train", r=0.5, mem_gib=60, kind="training", gpus=2))
    assert {s.node for s in slots} == {"big"}
    with pytest.raises(NoCapacity, match="nodes have 4 GPUs at most"):
        c3.place("t8", inf("train", r=0.5, kind="training", gpus=8))
    assert c.violations() == c2.violations() == c3.violations() == []


def test_defrag_and_victims_work_across_heterogeneous_nodes():
    c = Cluster.empty()
    c.add_node("a", gpus(2, mem_gib=40))
    c.add_node("b", gpus(2, mem_gib=80))
    c.assign("x", inf("x", r=0.3), [Slot("a", 0)])
    c.assign("y", inf("y", r=0.3), [Slot("b", 1)])
    plan = c.plan_defrag(gain_per_gpu_s=300, default_cost_gpu_s=1)
    assert len(plan.freed) == 1 and len(plan.migrations) == 1
    assert c.choose_victim(["x", "y"], warm={"x", "y"}) in {"x", "y"}
    c.remove_node("a")
    assert c.plan_defrag().migrations == [] and c.violations() == []


# ----------------------------------------------------------------------------- inventory and liveness


def test_capacities_from_an_inventory():
    inv = NodeInventory(node="n", mps="on", gpus=[
        gpu_info(0, mps_client_limit=48),
        gpu_info(1, mem_gib=80),
        gpu_info(2, healthy=False, health_reason="Xid 79: fell off the bus"),
        gpu_info(3, mig=True),
        gpu_info(4, compute_mode="prohibited"),
        gpu_info(5, compute_mode="exclusive-process"),
        gpu_info(0, mem_gib=1),  # a repeated index: the first is kept
    ])
    caps = gpu_capacities(inv)
    assert [c.index for c in caps] == [0, 1, 2, 3, 4, 5]
    assert caps[0] == GpuCapacity(40 * GiB, 48, index=0)
    assert caps[1].memory_bytes == 80 * GiB and caps[1].max_instances == 0 and caps[1].healthy
    assert not caps[2].healthy and "Xid 79" in caps[2].reason
    assert not caps[3].healthy and "MIG" in caps[3].reason
    assert not caps[4].healthy and "prohibited" in caps[4].reason
    assert caps[5].healthy and caps[5].max_instances == 0, "under MPS exclusive-process is shared"
    solo = gpu_capacities(NodeInventory(node="n", mps="off", gpus=[gpu_info(0, compute_mode="exclusive-process")]))
    assert solo[0].max_instances == 1
    assert gpu_capacities(NodeInventory(node="n", device="emulated")) == [], "a GPU node with no GPU offers nothing"
    (cpu,) = gpu_capacities(NodeInventory(node="n", device="cpu"))
    assert cpu.index == 0 and cpu.healthy and cpu.memory_bytes >= 2**40, "a CPU node is one shared slot"


def test_stale_nodes_and_ages():
    seen = {"a": 100.0, "b": 110.0, "c": 115.5}
    assert stale_nodes(seen, 130.0, 15.0) == ["a", "b"]
    assert stale_nodes(seen, 115.0, 15.0) == []
    assert inventory_age_s(1000.0, None) == 0.0
    assert inventory_age_s(1000.0, 990.0, ts_ns=int(900e9)) == pytest.approx(10.0), "the store's time first"
    assert inventory_age_s(1000.0, None, ts_ns=int(990e9)) == pytest.approx(10.0)
    assert inventory_age_s(1000.0, 1010.0) == 0.0, "a clock ahead of ours is no age"
    assert not orphans_due(100.0, 114.0, 15.0) and orphans_due(100.0, 115.0, 15.0)


def test_roster_join_update_leave_once_each_on_a_fake_clock():
    clock = FakeClock()
    r = Roster(ttl_s=15.0)
    join = r.observe(inventory("n0"), clock())
    assert join.action == "join" and len(join.gpus) == 2 and "n0" in r
    clock.advance(5)
    assert r.observe(inventory("n0"), clock()) is None, "a heartbeat with nothing new is no change"
    sick = NodeInventory(node="n0", agent_id="a1",
                         gpus=[gpu_info(0), gpu_info(1, healthy=False, health_reason="ECC uncorrectable")])
    change = r.observe(sick, clock())
    assert change.action == "update" and change.reasons == ("GPU 1 unhealthy: ECC uncorrectable",)
    assert r.observe(sick, clock()) is None, "logged once"
    restarted = r.observe(NodeInventory(node="n0", agent_id="a2", gpus=sick.gpus), clock())
    assert restarted.action == "update" and "agent restarted" in restarted.reasons[0]
    r.observe(inventory("n1"), clock())
    clock.advance(14)
    r.observe(inventory("n1"), clock())
    assert r.expire(clock()) == []
    clock.advance(2)  # n0 last seen 16 s ago, n1 2 s ago
    (gone,) = r.expire(clock())
    assert gone.action == "leave" and gone.node == "n0" and "16.0 s" in gone.reasons[0]
    assert r.expire(clock()) == [] and "n0" not in r
    assert r.forget("n0", "deleted") is None
    assert r.forget("n1", "inventory deleted").action == "leave" and len(r) == 0
    # an entry read at start counts from its age: last seen 20 s ago is already stale
    r.observe(inventory("old"), clock() - 20)
    assert [c.node for c in r.expire(clock())] == ["old"]


def test_last_seen_never_goes_backwards():
    r = Roster(ttl_s=10.0)
    r.observe(inventory("n"), 100.0)
    r.observe(inventory("n"), 90.0)
    assert r.last_seen["n"] == 100.0
    with pytest.raises(ValueError):
        Roster(0)


# ----------------------------------------------------------------------------- invariants, any sequence

demands = st.builds(
    lambda fn, r, extra, mem, kind, n: Demand(
        function=fn, request_quota=r, limit_quota=min(1.0, r + extra), memory_bytes=mem * GiB, kind=kind,
        gpus=n if kind == "training" else 1),
    fn=st.sampled_from(["a", "b", "c"]), r=st.floats(0.01, 1.0), extra=st.floats(0.0, 0.8),
    mem=st.integers(0, 90), kind=st.sampled_from(["inference", "training"]), n=st.sampled_from([1, 1, 2, 3]),
)
capacities = st.lists(
    st.builds(GpuCapacity, memory_bytes=st.sampled_from([16 * GiB, 40 * GiB, 80 * GiB]),
              max_instances=st.sampled_from([0, 0, 2, 3, 48]), healthy=st.sampled_from([True, True, True, False])),
    min_size=0, max_size=4)


class MembershipMachine(RuleBasedStateMachine):
    """Joins, leaves, health changes, placements, removals, parks, resumes and defragmentation in
    any order keep Σ requests ≤ 1, Σ limits ≤ γ, memory (parked processes' included) and instance
    counts within each GPU, and the indexes."""

    def __init__(self) -> None:
        super().__init__()
        self.c = Cluster.empty(gamma=1.5, max_candidates=4)
        self.demands: dict[str, Demand] = {}  # parked instance -> its demand
        self.n = 0
        self.names = 0

    @rule(caps=capacities)
    def join(self, caps):
        self.names += 1
        self.c.add_node(f"node-{self.names}.dc1", caps)

    @precondition(lambda self: self.c.nodes)
    @rule(data=st.data())
    def leave(self, data):
        name = data.draw(st.sampled_from(self.c.nodes))
        on_it = {i for i, (_, gs) in self.c.instances.items() if self.c.slot(gs[0]).node == name}
        assert set(self.c.remove_node(name)) == on_it
        assert not on_it & set(self.c.instances)

    @precondition(lambda self: self.c.nodes)
    @rule(data=st.data())
    def health(self, data):
        """Only health flips: shrinking memory or limits under residents is an over-commit the
        inventory may report, which violations() rightly flags."""
        name = data.draw(st.sampled_from(self.c.nodes))
        caps = [self.c.capacity(s) for s in self.c.node_slots(name)]
        flips = data.draw(st.lists(st.booleans(), min_size=len(caps), max_size=len(caps)))
        new = [GpuCapacity(c.memory_bytes, c.max_instances, c.healthy != f, "flip", c.index) for c, f in zip(caps, flips)]
        assert self.c.update_node(name, new) == []

    @precondition(lambda self: self.c.nodes)
    @rule(data=st.data(), added=capacities)
    def reshape(self, data, added):
        """GPUs vanish from a node's inventory (their residents are displaced) and others appear."""
        name = data.draw(st.sampled_from(self.c.nodes))
        slots = self.c.node_slots(name)
        keep = data.draw(st.lists(st.sampled_from(slots), unique=True)) if slots else []
        gone = {s for s in slots if s not in keep}
        on_gone = {i for i, (_, gs) in self.c.instances.items() if any(self.c.slot(g) in gone for g in gs)}
        top = max((s.gpu for s in slots), default=-1)
        new = [self.c.capacity(s) for s in keep] + [
            GpuCapacity(c.memory_bytes, c.max_instances, c.healthy, index=top + 1 + k) for k, c in enumerate(added)]
        assert set(self.c.update_node(name, new)) == on_gone
        assert sorted(s.gpu for s in self.c.node_slots(name)) == sorted(c.index for c in new)

    @rule(d=demands)
    def place(self, d):
        fit_active = any(self.c.fits(g, d) for g, s in enumerate(self.c.gpus) if s.residents)
        before = self.c.active
        self.n += 1
        try:
            slots = self.c.place(f"i{self.n}", d)
        except NoCapacity:
            assert d.gpus > 1 or not fit_active, "refused although an active GPU fit"
            return
        assert len({s.node for s in slots}) == 1 and len(set(slots)) == d.gpus
        assert all(self.c.capacity(s).healthy for s in slots), "placed on an unhealthy GPU"
        if d.gpus == 1 and self.c.active > before:
            assert not fit_active, "a new GPU was opened although an active one fit"

    @precondition(lambda self: self.c.instances)
    @rule(data=st.data())
    def remove(self, data):
        self.c.remove(data.draw(st.sampled_from(sorted(self.c.instances))))

    @precondition(lambda self: any(d.gpus == 1 for d, _ in self.c.instances.values()))
    @rule(data=st.data())
    def park(self, data):
        iid = data.draw(st.sampled_from(sorted(i for i, (d, _) in self.c.instances.items() if d.gpus == 1)))
        d, (g,) = self.c.instances[iid]
        self.demands[iid] = d
        before = self.c.gpus[g].mem
        assert self.c.park(iid) == self.c.slot(g)
        assert self.c.gpus[g].mem == before - d.memory_bytes + parked_bytes(d)  # its context stays

    @precondition(lambda self: self.c.parked)
    @rule(data=st.data())
    def resume(self, data):
        """Back on its own GPU when it fits there (its own context counted once, and exempt from
        the rigid rule: Cluster.fits), else its process ends (a relaunch elsewhere is an ordinary
        placement)."""
        iid = data.draw(st.sampled_from(sorted(self.c.parked)))
        d, g = self.demands.pop(iid), self.c.parked[iid]
        slot = self.c.resume_target(d, self.c.slot(g), iid)
        assert self.c.unpark(iid) == self.c.slot(g) and iid not in self.c.parked
        if slot is not None:
            # check=False as the scheduler's _resume does (resume_target has checked it); caps_hold
            # checks that resume_target let nothing over-pack (Σ request, Σ limit ≤ γ, memory, clients)
            self.c.assign(iid, d, [slot], check=False)

    @precondition(lambda self: self.c.instances)
    @rule()
    def defragment(self):
        plan = self.c.plan_defrag(gain_per_gpu_s=100, default_cost_gpu_s=1)
        for m in plan.migrations:
            d, _ = self.c.remove(m.instance_id)
            self.c.assign(m.instance_id, d, [m.target])  # check=True: raises if the plan over-packs

    @invariant()
    def caps_hold(self):
        assert self.c.violations() == []
        for s in self.c.gpus:
            if not s.alive:
                assert not s.residents
                continue
            assert sum(d.request_quota for d in s.residents.values()) <= 1 + EPS
            assert sum(d.burst_quota for d in s.residents.values()) <= self.c.gamma + EPS  # training at its request
            assert sum(d.memory_bytes for d in s.residents.values()) + sum(s.parked.values()) <= s.cap
            assert not s.max or len(s.residents) + len(s.parked) <= s.max  # a parked process is an MPS client
        assert set(self.c.parked) <= set(self.demands)  # a parked process gone with its GPU is dropped


TestMembershipMachine = MembershipMachine.TestCase
TestMembershipMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class _Draws:
    """Stands in for hypothesis' ``st.data()``: hands out the given values in order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


def test_the_machine_resumes_a_rigid_instance_beside_widths_a_new_one_may_not_join():
    """Steps the machine once found (rarely): a rigid instance parked, a wider one placed on the
    GPU it left, then its resume there, exempt from the rigid rule (Σ limits 1.5 > 1) as the
    scheduler's _resume and the simulator let it be; the machine's own resume rule refused it."""
    m = MembershipMachine()
    m.join(caps=[GpuCapacity(memory_bytes=16 * GiB, max_instances=0, healthy=True)])
    m.place(d=Demand(function="a", request_quota=0.5, limit_quota=0.5, memory_bytes=0))  # i1, rigid
    m.park(data=_Draws("i1"))  # its GPU holds only i1's parked process: empty, open
    m.place(d=Demand(function="a", request_quota=0.5, limit_quota=1.0, memory_bytes=0))  # i2 takes it
    m.resume(data=_Draws("i1"))
    m.caps_hold()
    assert set(m.c.instances) == {"i1", "i2"}
    m.teardown()
