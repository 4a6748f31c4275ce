"""What a training job adds to its GPU's busy widths in dilu sim: its grant while paced below its
width (the fake driver counts a process's width only while its kernels run), kept exact as
grants move."""
from __future__ import annotations

import pytest

from dilu.loadgen.sim.node import Instance, train_load
from dilu.loadgen.sim.run import SimConfig, Simulation, prepare


def _training(grant: float, width: float = 0.8) -> Instance:
    return Instance("t", None, None, 0.1, width, grant, 32, 0.0, 0.0, True, "training")


@pytest.mark.parametrize("grant, load", [(0.1, 0.1), (0.5, 0.5), (0.8, 0.8), (1.0, 0.8), (0.0, 0.8)])
def test_a_paced_job_holds_its_grant_an_unpaced_one_its_width(grant, load):
    assert train_load(_training(grant)) == pytest.approx(load)


class _Checked(Simulation):
    """Checks at every telemetry tick that each GPU's busy widths are its busy inference
    instances' widths plus its ready training jobs' loads."""

    checked = 0

    def _vertical_tick(self, _=None) -> None:
        for gpu in self.gpus.values():
            want = sum(train_load(i) if i.training else i.width for i in gpu.instances.values()
                       if (i.training and i.state == "ready") or (not i.training and i.busy))
            assert gpu.busy_width == pytest.approx(want, abs=1e-9), gpu.gid
            self.checked += any(i.training for i in gpu.instances.values())
        super()._vertical_tick(_)


def test_busy_widths_follow_the_training_grants_as_they_move():
    cfg = SimConfig(functions=8, hours=0.05, nodes=1, gpus_per_node=4, seed=2, training_jobs=0.5)
    sim = _Checked(cfg, "dilu", prepare(cfg))
    rep, _ = sim.run()
    assert sim.checked > 100  # GPUs with training jobs were checked, while their grants moved
    assert rep.mechanism.grant_changes > 0
    assert all(t.iterations > 0 for t in rep.training)
