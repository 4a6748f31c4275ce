"""dilu sim --park-after-s: idle instances parked off their GPUs free active GPU·s (with
defragmentation), come back on the next request without a launch, and leave the placement table
whole."""
from __future__ import annotations

import copy
import json

from click.testing import CliRunner

from dilu.cli.main import main
from dilu.loadgen.sim.run import SimConfig, Simulation, prepare

CFG = dict(functions=40, hours=0.5, nodes=2, gpus_per_node=4, seed=3, defrag_interval_s=0.0)  # parking alone


class _Checked(Simulation):
    """Checks the placement table and the GPUs after every horizontal tick: parked instances hold
    no placement and sit on no GPU; every other live instance has both."""

    def _horizontal_tick(self, _=None) -> None:
        super()._horizontal_tick(_)
        assert not self.cluster.violations()
        for inst in self.instances.values():
            if inst.training:
                continue
            placed = inst.iid in self.cluster.instances
            on_gpu = inst.iid in inst.gpu.instances and self.gpus.get(inst.gpu.gid) is inst.gpu
            assert placed == on_gpu == (inst.state != "parked"), (inst.iid, inst.state)


def _run(park_after_s: float, **kw):
    cfg = SimConfig(**{**CFG, **kw}, park_after_s=park_after_s)
    return _Checked(cfg, "dilu", prepare(cfg)).run()


def test_parking_frees_gpu_seconds_and_resumes_without_launches():
    kept, kept_facts = _run(0.0)
    parked, facts = _run(60.0)
    assert kept_facts.parks == 0 and facts.parks > 0 and facts.resumes > 0
    assert facts.resume_waits > 0  # requests that waited for a resume...
    # a resume is no launch: launches grow by what could not resume on its GPU, not by the resumes
    assert parked.totals.instance_launches - kept.totals.instance_launches < facts.resumes / 10
    assert parked.totals.offered == parked.totals.completed == kept.totals.completed  # ...and every request ended
    # a GPU is freed once all its residents are parked at once; busy and idle functions share
    # GPUs (placed largest first), so it takes defragmentation to gather the busy ones
    defragmented, _ = _run(0.0, defrag_interval_s=None)
    both, _ = _run(60.0, defrag_interval_s=None)
    assert both.totals.active_gpu_seconds < 0.95 * min(defragmented.totals.active_gpu_seconds,
                                                      parked.totals.active_gpu_seconds)
    # the report counts them up to the replay's end, the simulator's facts to the end of the drain
    assert 0 < parked.mechanism.parks <= facts.parks and 0 < parked.mechanism.resumes <= facts.resumes
    assert kept.mechanism.parks == kept.mechanism.resumes == 0
    # some resumes found their GPU full and relaunched elsewhere: a scale-out, not a resume
    assert 0 < facts.relaunches <= facts.resumes_refused


def test_parking_is_deterministic_and_in_the_json(tmp_path):
    outs = []
    for name in ("a.json", "b.json"):
        path = tmp_path / name
        r = CliRunner().invoke(main, ["sim", "--functions", "12", "--hours", "0.2", "--park-after-s", "30",
                                      "--policies", "dilu", "--json", str(path)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert "instances parked" in r.output and "relaunched elsewhere" in r.output and "refused" in r.output
        data = json.loads(path.read_text())
        facts = data["sim"]["policies"]["dilu"]
        facts.pop("compute_s")
        outs.append(data)
    assert outs[0] == outs[1]
    assert outs[0]["sim"]["config"]["park_after_s"] == 30.0
    run = outs[0]["policies"]["dilu"]["run"]  # what dilu summarize compares from file to file
    assert (run["park_after_s"], run["defrag_interval_s"], run["training_jobs"], run["simulated"]) == (30.0, 30.0, 0, True)
    assert outs[0]["sim"]["policies"]["dilu"]["parks"] > 0
    mechanism = outs[0]["policies"]["dilu"]["mechanism"]
    assert 0 < mechanism["parks"] <= outs[0]["sim"]["policies"]["dilu"]["parks"] and mechanism["resumes"] >= 0


def test_the_parking_line_says_parks_resumes_relaunches_and_refusals():
    from dilu.cli.sim import _parking_line

    line = _parking_line("dilu", {"parks": 1_200, "resumes": 900, "resumes_refused": 30, "relaunches": 25,
                                  "resume_waits": 40})
    assert line.startswith("dilu: 1,200 instances parked, 900 resumed in place, 25 relaunched elsewhere")
    assert "5 refused" in line and "40 requests waited for a resume" in line
    one = _parking_line("dilu", {"parks": 1, "resumes": 0, "resumes_refused": 0, "relaunches": 0, "resume_waits": 1})
    assert one.startswith("dilu: 1 instance parked") and "1 request waited for a resume (no launch: not a cold-start request)" in one


def test_a_bad_park_after_s_is_one_line():
    from cli_errors import one_line_error

    for bad in ("-1", "nan", "1e9", "bad"):
        said = {one_line_error(CliRunner().invoke(main, [cmd, "--park-after-s", bad]), 2).split(" (see '")[0]
                for cmd in ("sim", "demo", "compare")}  # each line ends naming its own command's --help
        assert len(said) == 1 and "--park-after-s" in said.pop()  # one type, one message


class _NoRoom(_Checked):
    """Records the resumes that found no GPU with room (refused, not relaunched)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.kept: list[str] = []
        self.decided_with = None  # the back-off as a tick's decisions saw it (a failed placement may follow)

    def _horizontal_tick(self, _=None) -> None:
        self.decided_with = copy.deepcopy(self.backoff)
        try:
            super()._horizontal_tick(_)
        finally:
            self.decided_with = None

    def _resume(self, inst) -> None:
        # a refused resume backs its function off as a refused placement does: none while it lasts
        backoff = self.decided_with or self.backoff
        assert not backoff.blocked(inst.fn.name, self.loop.now / 1000.0), (inst.fn.name, self.loop.now)
        refused, relaunched = self.facts.resumes_refused, self.facts.relaunches
        super()._resume(inst)
        if self.facts.resumes_refused > refused and self.facts.relaunches == relaunched:
            assert inst.state == "parked" and inst.iid in self.instances, (inst.iid, inst.state)
            assert self.horizontal.instances(inst.fn.name)[inst.iid] == "parked"
            self.kept.append(inst.iid)


def test_a_resume_with_no_room_anywhere_leaves_the_instance_parked_as_live():
    """One GPU for 40 functions: resumes find no room on the GPU they left nor elsewhere. Live,
    the scheduler refuses such a resume and the instance stays parked for the next scale-out
    once the function's back-off is over; the simulator does the same (it used to retire it, a
    function at zero, and then retried at every tick)."""
    cfg = SimConfig(**{**CFG, "nodes": 1, "gpus_per_node": 1, "hours": 0.2}, park_after_s=60.0)
    sim = _NoRoom(cfg, "dilu", prepare(cfg))
    _, facts = sim.run()
    assert sim.kept and facts.resumes_refused - facts.relaunches == len(sim.kept)
