"""The scheduler's defragmentation in the simulator (dilu's default, ``--defrag-interval-s``):
instances move off lightly used GPUs make before break, freeing active GPU·s at no cold start,
with the placement table whole and the horizontal policy's view of every instance in step."""
from __future__ import annotations

import json

from click.testing import CliRunner

from dilu.cli.main import main
from dilu.loadgen.sim.run import SimConfig, Simulation, prepare
from dilu.services.common.policies import DEFRAG_INTERVAL_S

# parking off: defragmentation's own effect (a parked instance resumes only on the GPU it left,
# and a fuller GPU refuses more resumes: with both, cold starts are parking's trade)
CFG = dict(functions=200, hours=0.5, nodes=4, gpus_per_node=4, seed=1, training_jobs=0.2, park_after_s=0.0)


class _Checked(Simulation):
    """After every horizontal tick and defragmentation round: no placement rule broken; a
    replacement moving in is placed and so is the instance it replaces (which serves on until the
    replacement is ready); and the horizontal policy knows exactly the simulator's instances,
    a replacement as ``moving``."""

    def _check(self) -> None:
        assert not self.cluster.violations()
        for f in self.fns.values():
            if f.training or f.demand is None:
                continue
            seen = self.horizontal.instances(f.name)
            assert set(seen) == set(f.instances), (f.name, seen, list(f.instances))
            for iid, inst in f.instances.items():
                if inst.replaces:
                    assert inst.state == "starting" and seen[iid] == "moving", (iid, inst.state, seen[iid])
                    old = f.instances[inst.replaces]
                    assert old.iid in self.cluster.instances and old.state in ("ready", "draining")

    def _horizontal_tick(self, _=None) -> None:
        super()._horizontal_tick(_)
        self._check()

    def _defrag_tick(self, _=None) -> None:
        super()._defrag_tick(_)
        self._check()


def _run(defrag_interval_s: float | None):
    cfg = SimConfig(**CFG, defrag_interval_s=defrag_interval_s)
    return _Checked(cfg, "dilu", prepare(cfg)).run()


def test_defragmentation_frees_gpu_seconds_without_cold_starts():
    kept, kept_facts = _run(0.0)
    moved, facts = _run(None)  # dilu's own interval
    assert kept_facts.migrations == 0 and facts.migrations > 0
    assert (kept_facts.defrag_interval_s, facts.defrag_interval_s) == (0.0, DEFRAG_INTERVAL_S)
    assert moved.totals.active_gpu_seconds < 0.95 * kept.totals.active_gpu_seconds
    # make before break: no request waits for a moved instance's launch
    assert moved.totals.cold_start_requests <= kept.totals.cold_start_requests
    assert moved.totals.offered == moved.totals.completed == kept.totals.completed
    assert moved.totals.instance_launches > kept.totals.instance_launches  # each move is a launch
    # ... counted as a launch, not as a scale-out (the scheduler's, not the horizontal scaler's)
    for rep, f in ((kept, kept_facts), (moved, facts)):
        assert rep.totals.instance_launches == rep.mechanism.scale_outs + f.migrations + len(rep.training)
        assert rep.mechanism.migrations == f.migrations  # the report's row, as a live run scrapes it


def test_with_parking_a_migrating_instance_is_never_parked_and_the_state_stays_whole():
    cfg = SimConfig(**{**CFG, "park_after_s": None})  # dilu as it runs: defragmentation and parking
    rep, facts = _Checked(cfg, "dilu", prepare(cfg)).run()
    assert facts.migrations > 0 and facts.parks > 0 and facts.park_after_s > 0
    assert rep.totals.offered == rep.totals.completed


def test_the_baselines_do_not_defragment_whatever_the_interval():
    cfg = SimConfig(**CFG, defrag_interval_s=10.0)  # sets dilu's policies' interval, not the baselines'
    _, facts = _Checked(cfg, "static-mps", prepare(cfg)).run()
    assert facts.migrations == 0 and facts.defrag_interval_s == 0.0


def test_defrag_interval_is_in_the_json_and_a_bad_one_is_one_line(tmp_path):
    from cli_errors import one_line_error

    path = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["sim", "--functions", "12", "--hours", "0.2", "--policies", "dilu",
                                  "--defrag-interval-s", "0", "--json", str(path)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(path.read_text())
    assert data["sim"]["config"]["defrag_interval_s"] == 0.0
    assert data["sim"]["policies"]["dilu"]["migrations"] == 0
    assert data["sim"]["policies"]["dilu"]["defrag_interval_s"] == 0.0
    assert data["policies"]["dilu"]["run"]["defrag_interval_s"] == 0.0
    r = CliRunner().invoke(main, ["sim", "--functions", "200", "--hours", "0.5", "--nodes", "4", "--policies", "dilu",
                                  "--training-jobs", "0.2"], catch_exceptions=False)
    assert r.exit_code == 0 and f"instances moved by defragmentation, every {DEFRAG_INTERVAL_S:g} trace s" in r.output
    for bad in ("-1", "nan", "1e9", "1e-20"):  # 1e-20: a clock stepped by it would stop moving
        r = CliRunner().invoke(main, ["sim", "--defrag-interval-s", bad])
        assert "--defrag-interval-s" in one_line_error(r, 2)
