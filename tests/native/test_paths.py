"""Every path into the driver is metered: linked directly (plain and _ptsz), dlopen + dlsym,
cuGetProcAddress_v2 with flags 0 and 2, 4-argument cuGetProcAddress, cuGetProcAddress at CUDA 13
(whose cuCtxSynchronize takes the context), cuLaunchKernelEx,
cooperative launches, graph launches and Python ctypes. The launch counter in the control block
must equal the launches made, and the timeline must hold every kernel."""
from __future__ import annotations

import subprocess

import pytest

from native_helpers import PYTHON, finish, launch_env, spawn
from dilu.interceptor import timeline

pytestmark = pytest.mark.native

N = 60


@pytest.mark.parametrize("mode", ["direct", "ptsz", "dlsym", "gpa0", "gpa2", "gpa4", "gpa13", "ex", "coop"])
def test_every_kernel_launch_path_is_metered(agent, gpu, mode):
    cb = agent.block(request_quota=1.0)
    out = finish(spawn(launch_env(cb.path, gpu), "-m", mode, "-k", "k_20", "-n", str(N)))
    snap = cb.snapshot()
    assert out["launches"] == N
    assert snap.launches == N
    assert snap.pid == out["pid"]
    recs = timeline.read_array(gpu)
    assert int((recs["pid"] == out["pid"]).sum()) == N


def test_graph_launch_is_metered_once_per_graph(agent, gpu):
    cb = agent.block(request_quota=1.0)
    out = finish(spawn(launch_env(cb.path, gpu), "-m", "graph", "-k", "k_20", "-g", "5", "-n", "12"))
    # capture launches run nothing and are not charged; each graph launch is one metered launch
    assert cb.snapshot().launches == 12
    recs = timeline.read_array(gpu)
    assert int((recs["pid"] == out["pid"]).sum()) == 12 * 5


def test_python_ctypes_path_is_metered(agent, gpu):
    cb = agent.block(request_quota=1.0)
    code = (
        "from dilu.interceptor.cuda import Driver\n"
        "d = Driver.load(); f = d.function('conv'); g = d.function('gemm')\n"
        f"for i in range({N}): d.launch(f if i % 2 else g, 30.0)\n"
        "d.synchronize()\n"
    )
    proc = subprocess.run([PYTHON, "-c", code], env=launch_env(cb.path, gpu), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    snap = cb.snapshot()
    assert snap.launches == N
    recs = timeline.read_array(gpu)
    mine = recs[recs["pid"] == snap.pid]
    assert len(mine) == N
    # the per-launch duration parameter reached the device: 30 µs each
    assert ((mine["end_ns"] - mine["start_ns"]) // 1000 == 30).all()


def test_without_interceptor_nothing_is_metered(agent, gpu):
    cb = agent.block(request_quota=1.0)
    env = launch_env(cb.path, gpu)
    env.pop("LD_PRELOAD")
    out = finish(spawn(env, "-k", "k_20", "-n", "10"))
    assert out["launches"] == 10
    assert cb.snapshot().launches == 0
