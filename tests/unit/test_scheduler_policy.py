"""Placement policy: feasibility, best fit, collocation, multi-GPU, retirement, defragmentation,
invariants under any sequence of operations (hypothesis), and the benchmark's figures."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dilu.services.scheduler.bench import WORKLOADS_DIR, WorkloadError, bench_scheduler, parse_workload, replay, synthetic
from dilu.services.common.models import PARKED_BYTES
from dilu.services.scheduler.policy import Cluster, Demand, NoCapacity, Slot, UnknownInstance, parked_bytes

GiB = 2**30


def cluster(nodes=2, gpus=4, mem_gib=40, **kw) -> Cluster:
    return Cluster([f"n{i}" for i in range(nodes)], gpus, mem_gib * GiB, **kw)


def inf(fn="f", r=0.3, lim=None, mem_gib=4, **kw) -> Demand:
    return Demand(function=fn, request_quota=r, limit_quota=lim if lim is not None else r, memory_bytes=int(mem_gib * GiB), **kw)


def test_float_artefacts_are_tolerated():
    c = cluster(1, 1)
    c.place("a", inf(r=0.41, lim=0.5900000000000001))
    c.place("b", inf(r=0.59, lim=0.9100000000000001))  # Σlim = 1.5000000000000002 ≤ γ within tolerance
    assert c.residents(Slot("n0", 0)) == ["a", "b"]
    with pytest.raises(NoCapacity):
        c.place("c", inf(r=0.01))


@pytest.mark.parametrize(("field", "demand"), [
    ("request", inf(r=0.6)), ("limit", inf(r=0.1, lim=1.0)), ("memory", inf(r=0.1, mem_gib=30)),
])
def test_each_cap_blocks_collocation(field, demand):
    c = cluster(1, 2)
    first = c.place("a", inf(r=0.5, lim=0.9, mem_gib=20))
    second = c.place("b", demand)
    assert second != first, f"the {field} cap must force a second GPU"
    assert c.violations() == []


def test_best_fit_and_new_gpu_only_when_nothing_fits():
    c = cluster(1, 4)
    a = c.place("a", inf("a", r=0.6))
    b = c.place("b", inf("b", r=0.5))  # does not fit beside a: second GPU
    assert a != b and c.active == 2
    d = c.place("d", inf("d", r=0.35))  # fits both; best fit is beside a (0.05 left vs 0.15)
    assert d == a and c.active == 2
    c.place("e", inf("e", r=0.5))  # fits beside b exactly
    assert c.active == 2


def test_complementary_collocation_prefers_training_beside_inference():
    c = cluster(1, 4)
    i = c.place("i", inf("serve", r=0.4))
    t = c.place("t", inf("train0", r=0.4, kind="training"))
    assert t != i or c.active == 1
    # two GPUs equally loaded, one with inference, one with training: a training job goes beside inference
    c2 = cluster(1, 4)
    gi = c2.place("i", inf("serve", r=0.4))
    c2.assign("t", inf("train0", r=0.4, kind="training"), [Slot("n0", 1)])
    assert c2.place("t2", inf("train1", r=0.3, kind="training")) == gi


def test_replicas_of_one_function_spread_and_peaks_complement():
    c = cluster(1, 4)
    c.assign("a", inf("x", r=0.3, peak_hour=9), [Slot("n0", 0)])
    c.assign("b", inf("y", r=0.3, peak_hour=20), [Slot("n0", 1)])
    # same load: an instance of x peaking at 9 goes beside y (peaks differ, different function)
    assert c.place("c", inf("x", r=0.3, peak_hour=9)) == [Slot("n0", 1)]


def test_a_rigid_instance_keeps_clear_of_oversubscribed_widths_until_that_would_open_a_gpu():
    """An instance whose limit is its request (no gain from width, e.g. BERT-base) is slowed by
    neighbours' widths above 1 and no grant makes up for it: it takes a GPU where Σ limits stays
    ≤ 1 over the better fit at 1.4, and no instance pushes a rigid resident's GPU above 1 while
    another active GPU takes it; elastic beside elastic stays best fit up to γ. When no active GPU
    keeps the rule, one that breaks it is taken before an empty GPU is opened (not by a move,
    which opens none), and the caps (what assign checks) still hold."""
    c = cluster(1, 4)
    crowded, calm, loose = [Slot("n0", 0)], [Slot("n0", 1)], [Slot("n0", 2)]
    c.assign("e1", inf("e1", r=0.3, lim=0.65), crowded)
    c.assign("e2", inf("e2", r=0.3, lim=0.65), crowded)  # Σ request 0.6, Σ limits 1.3
    c.assign("r1", inf("r1", r=0.3), calm)  # Σ request 0.3, Σ limits 0.3
    bert = inf("bert", r=0.1)
    assert not c.fits(0, bert) and c.fits(0, bert, rigid=False) and c.fits(0, inf("resnet", r=0.1, lim=0.2))
    assert c.place("rigid", bert) == calm
    assert c.place("elastic", inf("resnet", r=0.1, lim=0.2)) == crowded  # best fit: no rigid one there
    c.assign("e3", inf("e3", r=0.1, lim=0.2), loose)
    assert c.place("wide", inf("gpt", r=0.1, lim=0.7)) == loose  # calm fits better, at Σ limits 1.1
    assert c.place("rigid2", inf("bert", r=0.6)) == calm  # Σ limits 0.4 + 0.6 = 1: still calm
    c2 = cluster(1, 2)
    c2.assign("r", inf("bert", r=0.5), [Slot("n0", 0)])
    c2.assign("e", inf("e", r=0.2, lim=0.5), [Slot("n0", 0)])  # Σ request 0.7, Σ limits 1.0
    assert c2.frees_room("r", inf("x", r=0.4, lim=0.9))  # with the rigid one gone: Σ limits 1.4 ≤ γ
    assert not c2.frees_room("e", inf("y", r=0.2, lim=0.6))  # Σ limits 1.1 beside the rigid one
    assert c2.frees_room("e", inf("y", r=0.2, lim=0.5))
    assert c2.place("new", inf("gpt", r=0.2, lim=0.4)) == [Slot("n0", 0)]  # Σ limits 1.4, not a second GPU
    with pytest.raises(NoCapacity):  # a defragmentation move (no GPU to open) never breaks it
        c2.place("moved", inf("bert", r=0.1), allow_new=False)
    assert c2.place("third", inf("bert", r=0.1)) == [Slot("n0", 0)]  # Σ limits 1.5 = γ
    assert c2.place("fourth", inf("bert", r=0.1)) == [Slot("n0", 1)]  # Σ request would pass 1: a GPU opens
    with pytest.raises(ValueError, match="break a GPU's limits"):
        c2.assign("over", inf("z", r=0.1, lim=0.1), [Slot("n0", 0)])  # the caps: Σ request 1.1
    assert not c2.violations() and c2.active == 2


def test_a_parked_rigid_instance_resumes_beside_widths_a_new_one_may_not_join():
    """A resume (a weight copy) slowed by its neighbours' widths beats a cold start elsewhere, so
    the instance coming back is exempt from the rigid rule; a new instance is not."""
    c = cluster(1, 2)
    bert, left = inf("bert", r=0.1), Slot("n0", 0)
    c.assign("b1", bert, [left])
    c.park("b1")
    c.assign("e", inf("e", r=0.3, lim=1.0), [left])  # placed while b1 is parked: Σ limits 1.0
    assert not c.fits(0, bert) and c.fits(0, bert, parked_id="b1")
    assert c.resume_target(bert, left, "b1") == left and c.resume_target(bert, left) is None


def test_multi_gpu_training_takes_distinct_gpus_of_one_node():
    c = cluster(3, 4)
    c.place("small", inf(r=0.2))
    slots = c.place("t", inf("train", r=0.5, mem_gib=30, kind="training", gpus=4))
    assert len({s.node for s in slots}) == 1 and len({s.gpu for s in slots}) == 4
    with pytest.raises(NoCapacity, match="nodes have 4"):
        c.place("t8", inf("train", r=0.5, kind="training", gpus=8))
    assert c.violations() == []


def test_no_capacity_and_bad_input_are_clear_errors():
    c = cluster(1, 1)
    with pytest.raises(NoCapacity, match="memory"):
        c.place("big", inf(r=0.1, mem_gib=41))
    with pytest.raises(ValueError):
        inf(r=0.5, lim=0.4)
    with pytest.raises(ValueError):
        inf(r=0.0)
    c.place("a", inf())
    with pytest.raises(ValueError, match="already"):
        c.place("a", inf())
    with pytest.raises(UnknownInstance):
        c.remove("zzz")
    with pytest.raises(ValueError, match="break"):
        c.assign("b", inf(r=0.9), [Slot("n0", 0)])
    with pytest.raises(KeyError):
        c.assign("b", inf(), [Slot("nope", 0)])


def test_victim_prefers_starting_then_the_one_that_empties_a_gpu():
    c = cluster(1, 4)
    c.assign("w1", inf(r=0.3), [Slot("n0", 0)])
    c.assign("other", inf("g", r=0.5), [Slot("n0", 0)])
    c.assign("w2", inf(r=0.3), [Slot("n0", 1)])  # alone: retiring it frees GPU 1
    c.assign("s1", inf(r=0.3), [Slot("n0", 2)])
    c.assign("s2", inf(r=0.3), [Slot("n0", 3)])
    warm = {"w1", "w2"}
    assert c.choose_victim(["w1", "w2", "s1", "s2"], warm) in {"s1", "s2"}
    assert c.choose_victim(["w1", "w2"], warm) == "w2"
    with pytest.raises(ValueError):
        c.choose_victim([], warm)


def test_defrag_frees_a_gpu_only_when_gain_outweighs_cost():
    c = cluster(1, 4)
    c.assign("a", inf("a", r=0.3), [Slot("n0", 0)])
    c.assign("b", inf("b", r=0.3), [Slot("n0", 1)])
    c.assign("c", inf("c", r=0.3), [Slot("n0", 2)])
    plan = c.plan_defrag(gain_per_gpu_s=300, default_cost_gpu_s=10)
    assert len(plan.freed) >= 1 and plan.gain_gpu_s > plan.cost_gpu_s
    assert c.active == 3, "planning does not change the cluster"
    # apply: drain and relaunch; every migrated instance lands on a GPU that was active, none on a freed one
    for m in plan.migrations:
        d, _ = c.remove(m.instance_id)
        c.assign(m.instance_id, d, [m.target])
        assert m.target not in plan.freed
    assert c.active == 3 - len(plan.freed) and c.violations() == []
    # too expensive: nothing proposed
    c2 = cluster(1, 4)
    c2.assign("a", inf("a", r=0.3), [Slot("n0", 0)])
    c2.assign("b", inf("b", r=0.3), [Slot("n0", 1)])
    assert c2.plan_defrag({"a": 400, "b": 400}, gain_per_gpu_s=300).migrations == []


def test_concurrent_half_gpu_requests_pack_two_per_gpu():
    """Issue 6 case 3 at the policy level: 16 × 0.5 on 8 GPUs -> exactly two per GPU."""
    c = cluster(2, 4)
    for k in range(16):
        c.place(f"i{k}", inf(f"f{k}", r=0.5, lim=0.5))
    counts = [len(s.residents) for s in c.gpus]
    assert counts == [2] * 8 and max(s.req for s in c.gpus) <= 1.0 + 1e-9
    with pytest.raises(NoCapacity):
        c.place("i16", inf(r=0.5))


# ----------------------------------------------------------------------------- invariants, any sequence

demands = st.builds(
    lambda fn, r, extra, mem, kind, gpus, peak: Demand(
        function=fn, request_quota=r, limit_quota=min(1.0, r + extra), memory_bytes=mem * GiB, kind=kind,
        gpus=gpus if kind == "training" else 1, peak_hour=peak),
    fn=st.sampled_from(["a", "b", "c", "d", "e"]),
    r=st.floats(0.01, 1.0), extra=st.floats(0.0, 0.8), mem=st.integers(0, 40),
    kind=st.sampled_from(["inference", "training"]), gpus=st.sampled_from([1, 1, 2, 4]),
    peak=st.one_of(st.none(), st.integers(0, 23)),
)


class PlacementMachine(RuleBasedStateMachine):
    """Deploys, scale-outs, retirements and defragmentation in any order never break an invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.c = cluster(3, 4, gamma=1.5, max_candidates=4)
        self.n = 0

    @rule(d=demands)
    def scale_out(self, d):
        before = self.c.active
        fit_active = any(self.c.fits(g, d) for g in range(12) if self.c.gpus[g].residents)
        self.n += 1
        try:
            self.c.place(f"i{self.n}", d)
        except NoCapacity:
            assert d.gpus > 1 or not fit_active, "refused although an active GPU fit"
            return
        if d.gpus == 1 and self.c.active > before:
            assert not fit_active, "a new GPU was opened although an active one fit"

    @precondition(lambda self: self.c.instances)
    @rule(data=st.data())
    def retire(self, data):
        ids = sorted(self.c.instances)
        fn = self.c.instances[data.draw(st.sampled_from(ids))][0].function
        same = [i for i in ids if self.c.instances[i][0].function == fn]
        self.c.remove(self.c.choose_victim(same, warm=same[::2]))

    @precondition(lambda self: self.c.instances)
    @rule()
    def defragment(self):
        plan = self.c.plan_defrag(gain_per_gpu_s=100, default_cost_gpu_s=1)
        active = self.c.active
        for m in plan.migrations:
            d, _ = self.c.remove(m.instance_id)
            self.c.assign(m.instance_id, d, [m.target])  # check=True: raises if the plan over-packs
        assert self.c.active == active - len(plan.freed)

    @invariant()
    def caps_hold(self):
        assert self.c.violations() == []


TestPlacementMachine = PlacementMachine.TestCase
TestPlacementMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# ----------------------------------------------------------------------------- benchmark


def test_workload_replay_is_deterministic_and_near_the_bound():
    path = WORKLOADS_DIR / "instances-200.txt"
    a = replay(path)
    b = replay(path)
    a.pop("placement_latency_ms_p99"), b.pop("placement_latency_ms_p99")
    assert a == b
    assert a["lower_bound_peak"] <= a["peak_active_gpus"] <= 1.03 * a["lower_bound_peak"]
    assert a["max_limit_sum"] <= 1.5 + 1e-9
    assert a["unplaced"] == 0 and a["violations"] == 0
    assert 0 <= a["allocation_fragmentation"] < 1
    assert a["mean_active_gpus"] <= a["peak_active_gpus"]


def test_workload_parse_error_names_the_line(tmp_path):
    bad = tmp_path / "w.txt"
    good = (WORKLOADS_DIR / "instances-100.txt").read_text().splitlines()[0]
    bad.write_text(good + "\n__import__('os').system('true')\n")
    with pytest.raises(WorkloadError, match=":2:"):
        parse_workload(bad)


def _line(t: str, action: str, name: str, **inst) -> str:
    fields = {"service_name": name, "type": "inference", "gpu_num": 1, "sm_requests": 0.2, "sm_limits": 0.4,
              "memory": [3], **inst}
    return repr({"Time": f"2024-06-19 15:44:{t}", "Action": action, "Instance": fields})


@pytest.mark.parametrize("second, says", [
    (_line("31", "start", "b", type="gpu"), r":2: unknown type 'gpu' \(inference, training, llm-inference\)"),
    (_line("31", "start", "b", sm_requests="0.2"), r":2: sm_requests must be a number .*got '0.2'"),
    (_line("31", "start", "b", sm_limits=True), r":2: sm_limits must be a number"),
    (_line("29", "start", "b"), r":2: its Time goes back 1 s: events must be in time order"),
    (_line("31", "delete", "b"), r":2: instance 'b' is deleted but not running"),
    (_line("31", "start", "a"), r":2: instance 'a' is started again while running"),
    (_line("31", "start", "b", gpu_num=8), r":2: gpu_num 8 for an instance of type 'inference': only training spans"),
    (_line("31", "start", 5), r":2: service_name must be a non-empty string, got 5"),
    (_line("31", "start", " "), r":2: service_name must be a non-empty string"),
    (_line("31", "start", "b").replace("2024-06-19 15:44:31", "yesterday"),
     r":2: Time must be like '2024-06-19 15:44:30', got 'yesterday'"),
])
def test_a_workload_line_out_of_place_is_refused_by_line(tmp_path, second, says):
    """Each line must be a known kind with numeric quotas, in time order, and start only what is
    not running and delete only what is: else the replay would place or ignore what the file
    does not mean."""
    path = tmp_path / "w.txt"
    path.write_text(_line("30", "start", "a") + "\n" + second + "\n")
    with pytest.raises(WorkloadError, match=says):
        parse_workload(path)
    path.write_text("\n".join([_line("30", "start", "a"), _line("30", "start", "b", type="llm-inference"),
                               _line("31", "delete", "a"), _line("31", "start", "a", type="training")]))
    assert [(e[1], e[2], e[3].kind) for e in parse_workload(path)] == [
        ("start", "a", "inference"), ("start", "b", "inference"), ("delete", "a", "inference"),
        ("start", "a", "training")]


def test_the_lower_bound_counts_the_gpus_of_a_job_spanning_several(tmp_path):
    path = tmp_path / "w.txt"
    path.write_text(_line("30", "start", "t", type="training", gpu_num=4, sm_requests=0.1, sm_limits=0.2,
                          memory=[1, 1, 1, 1]) + "\n")
    out = replay(path, nodes=2, gpus_per_node=4)
    assert out["peak_active_gpus"] == out["lower_bound_peak"] == 4  # Σ requests 0.4 alone said 1


def test_synthetic_bench_and_cli_write_figures(tmp_path):
    out = synthetic(nodes=100, gpus_per_node=4, instances=600, churn=100, seed=3)
    assert out["placements"] == 700 and out["violations"] == 0 and out["placements_per_second"] > 0
    path = tmp_path / "b.json"
    r = CliRunner().invoke(bench_scheduler, ["--nodes", "50", "--instances", "200", "--churn", "20", "--json", str(path)])
    assert r.exit_code == 0, r.output
    data = json.loads(path.read_text())
    assert {"placements_per_second", "placement_latency_ms_p99"} <= set(data)
    r = CliRunner().invoke(bench_scheduler, ["--nodes", "5", "--gpus-per-node", "2", "--gpu-memory-gib", "80",
                                             "--max-gpu-instances", "3", "--instances", "40", "--churn", "0"])
    capped = json.loads(r.output)
    assert r.exit_code == 0 and capped["violations"] == 0 and capped["placements"] <= 5 * 2 * 3


def test_a_parked_instance_resumes_where_it_left_or_nowhere():
    """Its process is bound to its GPU: back there when the GPU can take it, else a relaunch
    (None), even when another GPU of its node has room."""
    c = cluster(2, 2)
    d = inf("p", r=0.4)
    (left,) = c.place("p1", d)
    assert c.park("p1") == left  # parked: its quotas freed
    assert c.resume_target(d, left, "p1") == left  # its GPU still has room
    c.assign("x", inf("x", r=0.7), [left])  # its room taken while it was parked
    assert c.resume_target(d, left, "p1") is None  # though the node's other GPU is empty
    assert c.choose(d)  # a new instance is placed elsewhere
    assert c.unpark("p1") == left and c.unpark("p1") is None  # its process ended: a relaunch


def test_a_parked_process_keeps_its_cuda_context_on_its_gpu():
    """Parking frees an instance's quotas and weights but not its process's CUDA context
    (models.PARKED_BYTES): that memory is not offered to others until the process resumes or
    ends, a resume counts it as its own, and a GPU holding only parked processes is not active."""
    c = cluster(1, 1, mem_gib=40)
    d = inf("p", r=0.4, mem_gib=8)
    (left,) = c.place("p1", d)
    assert c.park("p1") == left and c.active == 0 and c.request_sum(left) == 0
    assert c.gpus[0].mem == PARKED_BYTES == parked_bytes(d)
    fills = inf("big", r=0.5, mem_gib=40 - PARKED_BYTES / GiB)  # the memory that is left, exactly
    assert c.fits(0, fills) and not c.fits(0, inf("big", r=0.5, mem_gib=40 - PARKED_BYTES / GiB + 0.01))
    c.place("big", fills)
    assert c.resume_target(d, left, "p1") is None  # 8 GiB do not fit beside it
    c.remove("big")
    c.place("mid", inf("mid", r=0.5, mem_gib=32))  # 32 + 8 = 40 GiB: fits only with its own context counted
    assert c.resume_target(d, left, "p1") == left and c.resume_target(d, left) is None
    with pytest.raises(ValueError, match="parked"):
        c.assign("p1", d, [left])  # unpark first
    c.unpark("p1")
    c.assign("p1", d, [left])
    assert c.gpus[0].mem == 40 * GiB and not c.violations()
    c = cluster(1, 1)
    tiny = inf("t", r=0.1, mem_gib=0.25)
    c.place("t1", tiny)
    c.park("t1")
    assert c.parked == {"t1": 0} and c.gpus[0].mem == tiny.memory_bytes  # never more than it was placed with


def test_a_parked_process_is_still_an_mps_client():
    """A GPU at its MPS client limit with one client parked takes nothing new, but the parked
    one may come back; once its process ends there is room again."""
    c = cluster(1, 1, max_gpu_instances=2)
    (slot,) = c.place("p1", inf("p", r=0.2))
    c.place("q1", inf("q", r=0.2))
    c.park("p1")
    assert not c.fits(0, inf("x", r=0.1)) and c.resume_target(inf("p", r=0.2), slot, "p1") == slot
    with pytest.raises(NoCapacity):
        c.place("x1", inf("x", r=0.1))
    c.remove("q1")  # only the parked client left: the GPU is empty but keeps it
    c.place("x1", inf("x", r=0.1))
    assert not c.fits(0, inf("y", r=0.1)) and not c.violations()
    c.unpark("p1")  # its process ended
    assert c.fits(0, inf("y", r=0.1)) and not c.violations()


def test_a_parked_process_goes_with_its_node():
    c = cluster(2, 1)
    (slot,) = c.place("p1", inf("p"))
    c.park("p1")
    assert c.remove_node(slot.node) == [] and c.parked == {}  # not displaced: no process to place again
    assert c.unpark("p1") is None and not c.violations()


def test_training_jobs_go_one_per_gpu_whatever_their_quota():
    """Four small training jobs (request = limit = 0.1, as horizontal-only places them) fit on
    one GPU by every sum, yet each gets its own: always busy, they would only contend."""
    c = cluster(1, 4)
    slots = [c.place(f"t{k}", inf(f"train{k}", r=0.1, kind="training"))[0] for k in range(4)]
    assert len(set(slots)) == 4
    with pytest.raises(NoCapacity):
        c.place("t4", inf("train4", r=0.1, kind="training"))
    with pytest.raises(ValueError):
        c.assign("t5", inf("train5", r=0.1, kind="training"), [slots[0]])
    assert c.place("i", inf("serve", r=0.1))  # inference still joins them
    assert not c.violations()


def test_a_training_job_counts_its_request_not_its_limit_against_gamma():
    """Training gives back all above its request when a neighbour is pressed, so beside a job at
    request 0.1 / limit 0.8 inference may hold limits up to γ − 0.1, not γ − 0.8."""
    c = cluster(1, 1)
    c.place("t", inf("train", r=0.1, lim=0.8, kind="training"))
    c.place("a", inf("a", r=0.3, lim=0.7))
    c.place("b", inf("b", r=0.3, lim=0.7))  # Σ limits of inference 1.4: fits beside the job's 0.1
    assert c.limit_sum(Slot("n0", 0)) == pytest.approx(1.5)
    with pytest.raises(NoCapacity):
        c.place("c", inf("c", r=0.1, lim=0.1))  # γ is full
    assert not c.violations()


def test_frees_room_says_whose_removal_lets_a_demand_in():
    c = cluster(1, 1)
    c.place("big", inf("big", r=0.6))
    c.place("small", inf("small", r=0.2))
    want = inf("new", r=0.5)
    with pytest.raises(NoCapacity):
        c.place("new", want)
    assert c.frees_room("big", want) and not c.frees_room("small", want)
    t = cluster(1, 1)
    t.place("job", inf("train", r=0.1, kind="training"))
    assert t.frees_room("job", inf("x", r=0.95)) and not t.fits(0, inf("x", r=0.95))  # only with the job gone
    t.place("i", inf("serve", r=0.8))
    assert t.frees_room("job", inf("train2", r=0.1, kind="training"))  # one training job per GPU
    assert not t.frees_room("i", inf("train2", r=0.1, kind="training"))
    with pytest.raises(UnknownInstance):
        t.frees_room("nope", want)


def test_defrag_never_fills_a_gpu_that_is_being_vacated():
    """Live, a migration's old instance keeps its share until its drain ends, seconds after the
    next round can start: its GPU, with nothing else on it, looks like the least loaded active
    GPU. Filling it would undo the round that is emptying it and move the newcomers again."""
    c = cluster(1, 4)
    c.assign("old", inf("a", r=0.1), [Slot("n0", 0)])  # draining: its replacement is ready elsewhere
    c.assign("b", inf("b", r=0.2), [Slot("n0", 1)])
    c.assign("c", inf("c", r=0.9), [Slot("n0", 2)])  # full: b fits only beside the old one
    costs = {"old": float("inf"), "b": 1.0, "c": 1.0}
    ping = c.plan_defrag(costs, gain_per_gpu_s=300)
    assert [(m.instance_id, m.target) for m in ping.migrations] == [("b", Slot("n0", 0))], \
        "without the leaving set, the vacated GPU takes b"
    plan = c.plan_defrag(costs, gain_per_gpu_s=300, leaving={"old"})
    assert plan.migrations == [] and plan.freed == []
    # a GPU with a staying instance beside the leaving one is an ordinary target
    c.assign("d", inf("d", r=0.3), [Slot("n0", 0)])
    costs["d"] = float("inf")
    plan = c.plan_defrag(costs, gain_per_gpu_s=300, leaving={"old"})
    assert [(m.instance_id, m.target) for m in plan.migrations] == [("b", Slot("n0", 0))]


def test_defrag_does_not_empty_a_busy_gpu_onto_one_a_newcomer_just_opened():
    """A scale-out that found no room opened GPU 0; while its instance starts it cannot move, and
    GPU 1's eight instances fit beside it. Moving eight to free GPU 1 now costs eight launches
    where the newcomer, once ready, may move with one: the round waits (at most one round)."""
    c = cluster(1, 3)
    c.assign("new", inf("new", r=0.1), [Slot("n0", 0)])
    for k in range(8):
        c.assign(f"i{k}", inf(f"f{k}", r=0.1, mem_gib=2), [Slot("n0", 1)])
    c.assign("full", inf("full", r=1.0), [Slot("n0", 2)])
    costs = {"new": float("inf"), "full": 1.0, **{f"i{k}": 1.0 for k in range(8)}}
    swap = c.plan_defrag(costs, gain_per_gpu_s=300)
    assert len(swap.migrations) == 8 and {m.target for m in swap.migrations} == {Slot("n0", 0)}
    assert c.plan_defrag(costs, gain_per_gpu_s=300, starting={"new"}).migrations == []
    # once it is ready it is the cheap source: one move onto GPU 1
    costs["new"] = 1.0
    plan = c.plan_defrag(costs, gain_per_gpu_s=300)
    assert [(m.instance_id, m.target) for m in plan.migrations] == [("new", Slot("n0", 1))]


@pytest.mark.parametrize(("state", "price"), [
    (dict(ready=True, leaving=False, training=False), (2000 / 1000 + 5.0) * 0.5),
    (dict(ready=False, leaving=False, training=False), float("inf")),
    (dict(ready=True, leaving=True, training=False), float("inf")),
    (dict(ready=True, leaving=False, training=True), float("inf")),
])
def test_only_a_ready_staying_inference_instance_has_a_finite_migration_price(state, price):
    from dilu.services.scheduler.policy import MIGRATION_DISRUPTION_S, migration_price_gpu_s
    assert MIGRATION_DISRUPTION_S == 5.0
    assert migration_price_gpu_s(cold_start_ms=2000, request_quota=0.5, **state) == price


def test_a_defragmentation_rounds_view_of_the_placed_instances():
    """The one rule the live scheduler and the simulator build a round with: a draining instance
    and one a live replacement takes over from are leaving; the replacement, not ready yet, is
    starting; a replacement itself draining (cancelled) leaves its old instance staying; a
    parked one is neither; only a ready staying inference instance gets a finite price."""
    from dilu.services.scheduler.policy import Placed, defrag_inputs
    placed = {
        "old": Placed("ready", cold_start_ms=2000, request_quota=0.5),
        "new": Placed("starting", replaces="old", cold_start_ms=2000, request_quota=0.5),
        "kept": Placed("ready", cold_start_ms=1000, request_quota=0.2),
        "cancelled": Placed("draining", replaces="kept"),
        "gone": Placed("draining"),
        "idle": Placed("parked"),
        "job": Placed("ready", training=True, request_quota=0.3),
        "launching": Placed("starting"),
    }
    view = defrag_inputs(placed)
    assert view.leaving == {"old", "cancelled", "gone"}
    assert view.starting == {"new", "launching"}
    finite = {i: c for i, c in view.cost_gpu_s.items() if c != float("inf")}
    assert finite == {"kept": (1000 / 1000 + 5.0) * 0.2}
    assert set(view.cost_gpu_s) == set(placed)
    with pytest.raises(ValueError, match="got 'gone'"):
        Placed("gone")


def test_a_round_planned_from_the_placed_view_waits_for_a_starting_newcomer():
    """:meth:`Cluster.plan_round` is :meth:`Cluster.plan_defrag` over that view: the same case as
    above, where a newcomer still starting keeps GPU 1's eight instances where they are."""
    from dilu.services.scheduler.policy import Placed
    c = cluster(1, 3)
    c.assign("new", inf("new", r=0.1), [Slot("n0", 0)])
    for k in range(8):
        c.assign(f"i{k}", inf(f"f{k}", r=0.1, mem_gib=2), [Slot("n0", 1)])
    c.assign("full", inf("full", r=1.0), [Slot("n0", 2)])
    placed = {i: Placed("ready", request_quota=0.1, cold_start_ms=500) for i in c.instances}
    placed["new"] = Placed("starting")
    assert c.plan_round(placed).migrations == []
    placed["new"] = Placed("ready", request_quota=0.1, cold_start_ms=500)
    assert [(m.instance_id, m.target) for m in c.plan_round(placed).migrations] == [("new", Slot("n0", 1))]
