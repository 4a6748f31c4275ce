"""Shared-memory segment names carry their creating agent's pid; the sweep removes only those of
dead agents (a node agent killed with SIGKILL leaves its segments behind)."""
import os
import subprocess

import pytest

from dilu.services.node_agent import segments


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_names_carry_the_pid_after_their_prefix():
    cb = os.path.basename(segments.control_block_path("node-7", "fn-a-1", pid=4242))
    gpu = "dilu-gpu-" + segments.timeline_name("node-7", "abcd", 3, pid=4242)
    trial = os.path.basename(segments.trial_block_path("node-7", pid=4242))
    assert [segments.owner(n) for n in (cb, gpu, trial)] == [4242, 4242, 4242]
    assert cb.startswith("dilu-cb-4242-node-7-") and gpu.endswith("-g3")
    assert segments.owner("dilu-cb-node0-fn-1") is None and segments.owner("other") is None


def test_sweep_removes_dead_agents_segments_only(tmp_path):
    dead, live = dead_pid(), os.getppid()
    names = {
        os.path.basename(segments.control_block_path("n", "i1", pid=dead)): False,
        "dilu-gpu-" + segments.timeline_name("n", "r", 0, pid=dead): False,
        os.path.basename(segments.control_block_path("n", "i2", pid=live)): True,
        "dilu-gpu-" + segments.timeline_name("n", "r", 0, pid=live): True,
        "dilu-cb-node0-legacy": True,  # not a name it knows: left alone
        "unrelated": True,
    }
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = segments.sweep_dead(tmp_path)
    assert sorted(removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in names.items() if keep)


@pytest.mark.native
def test_the_interceptor_bench_names_its_segments_for_the_sweep():
    """A bench killed midway (SIGKILL, a timeout) leaves its control blocks and emulated GPUs:
    their names carry its pid, so the next node agent removes them."""
    from dilu.interceptor import bench

    cb = bench._block(0.5)
    try:
        assert segments.owner(os.path.basename(cb.path)) == os.getpid()
    finally:
        cb.close()
        cb.unlink()
    assert segments.owner("dilu-gpu-" + bench._gpu("oh")) == os.getpid()
