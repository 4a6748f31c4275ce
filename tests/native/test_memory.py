"""Memory isolation: the interceptor counts every device allocation entry point against the
instance's reservation (the control block's mem_limit_bytes, else DILU_MEMORY_LIMIT_BYTES) and
refuses past it with CUDA_ERROR_OUT_OF_MEMORY, to that instance alone; the fake driver shares each
emulated GPU's memory between its processes and refuses past the device's total.

Allocations are made by dilu_launch's allocation mode (-A) or by Python ctypes (cuda.Driver)."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
import uuid

import pytest

from native_helpers import PYTHON, finish, launch_env, spawn
from dilu.interceptor import native, timeline
from dilu.interceptor.control_block import ControlBlock

pytestmark = pytest.mark.native

MiB = 1 << 20
GiB = 1 << 30
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def mem_block(agent, limit: int) -> ControlBlock:
    """A heartbeated block (the agent fixture closes and unlinks it) with reservation ``limit``."""
    path = f"/dev/shm/dilu-cb-test-{uuid.uuid4().hex[:12]}"
    cb = ControlBlock.create(path, os.path.basename(path), 1.0, 1.0, memory_limit_bytes=limit)
    cb.heartbeating = True
    agent.blocks.append(cb)
    return cb


def env_for(cb_path: str, gpu: str, total: int = 4 * GiB, **extra) -> dict[str, str]:
    """Under the interceptor with block ``cb_path``, on emulated GPU ``gpu`` of ``total`` bytes."""
    return launch_env(cb_path, gpu, DILU_FAKE_GPU_MEMORY_BYTES=total, **extra)


def bare_env(gpu: str, total: int) -> dict[str, str]:
    """On the fake driver alone (no interceptor)."""
    env = env_for("/nonexistent/dilu-cb", gpu, total)
    env.pop("LD_PRELOAD")
    return env


def alloc(env: dict[str, str], nbytes: int, count: int, *args: str) -> dict:
    """dilu_launch -A: ``count`` allocations of ``nbytes``; its JSON summary."""
    return finish(spawn(env, "-A", str(nbytes), "-n", str(count), *args))


class Holder:
    """A dilu_launch -A -H process: allocates, prints its summary, holds until released."""

    def __init__(self, env: dict[str, str], nbytes: int, count: int, *args: str):
        self.proc = subprocess.Popen(
            [str(native.launch_program()), "-A", str(nbytes), "-n", str(count), "-H", *args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise AssertionError(f"holder died: {self.proc.communicate()[1]}")
        self.first = json.loads(line)

    def release(self) -> dict:
        out, err = self.proc.communicate(input="", timeout=30)
        assert self.proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def holders():
    made: list[Holder] = []

    def hold(env, nbytes, count, *args):
        h = Holder(env, nbytes, count, *args)
        made.append(h)
        return h

    yield hold
    for h in made:
        h.kill()


def run_python(code: str, env: dict[str, str]) -> dict:
    """Runs ``code`` (which fills ``out``) in a child Python; returns ``out``."""
    script = "import json, os\nout = {}\n" + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run([PYTHON, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reservation_refuses_past_it_while_a_neighbour_keeps_allocating(agent, gpu, holders):
    a, b = mem_block(agent, 1 * GiB), mem_block(agent, 0)
    held = holders(env_for(a.path, gpu), 256 * MiB, 6)
    assert (held.first["ok"], held.first["oom"], held.first["last_error"]) == (4, 2, OOM)
    # cuMemGetInfo: the reservation is the total, all of it in use
    assert (held.first["total"], held.first["free"]) == (1 * GiB, 0)
    snap = a.snapshot()
    assert snap.pid == held.first["pid"]
    assert (snap.memory_limit_bytes, snap.memory_used_bytes, snap.memory_peak_bytes,
            snap.oom_refusals) == (1 * GiB, 1 * GiB, 1 * GiB, 2)
    # the neighbour (no reservation) gets the rest of the 4 GiB device while A holds its 1 GiB
    out = alloc(env_for(b.path, gpu), 256 * MiB, 12)
    assert (out["ok"], out["oom"], out["total"], out["free"]) == (12, 0, 4 * GiB, 0)
    assert b.snapshot().oom_refusals == 0
    assert a.snapshot().oom_refusals == 2  # refusals are the instance's own
    last = held.release()
    assert (last["freed"], last["free_errors"]) == (4, 0)
    snap = a.snapshot()
    assert (snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals) == (0, 1 * GiB, 2)


@pytest.mark.parametrize("entry", ["alloc", "v1", "managed", "pitch", "async", "pool", "create",
                                   "array", "array3d"])
def test_every_allocation_entry_point_is_counted_and_credited(agent, gpu, entry):
    cb = mem_block(agent, 1 * GiB)
    out = alloc(env_for(cb.path, gpu), 256 * MiB, 5, "-e", entry)
    assert (out["ok"], out["oom"], out["errors"]) == (4, 1, 0)
    assert (out["total"], out["free"]) == (1 * GiB, 0)
    assert (out["freed"], out["free_errors"]) == (4, 0)
    snap = cb.snapshot()
    assert (snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals) == (0, 1 * GiB, 1)


@pytest.mark.parametrize("entry", ["alloc", "async"])
@pytest.mark.parametrize("mode", ["dlsym", "gpa0", "gpa2", "gpa4"])
def test_allocations_reached_through_dlsym_and_cuGetProcAddress_are_counted(agent, gpu, mode, entry):
    # gpa2 asks for the per-thread default stream flavour: cuMemAllocAsync_ptsz, cuMemFreeAsync_ptsz
    cb = mem_block(agent, 1 * GiB)
    out = alloc(env_for(cb.path, gpu), 256 * MiB, 5, "-m", mode, "-e", entry)
    assert (out["ok"], out["oom"], out["errors"], out["freed"]) == (4, 1, 0, 4)
    assert out["total"] == 1 * GiB  # cuMemGetInfo reached the same way
    snap = cb.snapshot()
    assert (snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals) == (0, 1 * GiB, 1)


def test_python_ctypes_allocations_are_counted(agent, gpu):
    cb = mem_block(agent, 512 * MiB)
    out = run_python(f"""
        from dilu.interceptor.cuda import CudaError, Driver
        from dilu.interceptor.control_block import ControlBlock
        d = Driver.load()
        p = [d.mem_alloc(256 * {MiB}) for _ in range(2)]
        try:
            d.mem_alloc(256 * {MiB})
        except CudaError as exc:
            out["refused"] = exc.code
        out["info_full"] = d.mem_get_info()
        d.mem_free(p.pop())
        out["info_half"] = d.mem_get_info()
        snap = ControlBlock.open(os.environ["DILU_CB"]).snapshot()
        out["used"], out["peak"], out["refusals"] = snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals
    """, env_for(cb.path, gpu))
    assert out["refused"] == OOM
    assert out["info_full"] == [0, 512 * MiB]
    assert out["info_half"] == [256 * MiB, 512 * MiB]
    assert (out["used"], out["peak"], out["refusals"]) == (256 * MiB, 512 * MiB, 1)
    assert cb.snapshot().memory_used_bytes == 0  # the process exited: its memory went with it


def test_alloc_free_loops_do_not_leak_the_count(agent, gpu):
    cb = mem_block(agent, 1 * GiB)
    out = alloc(env_for(cb.path, gpu), 768 * MiB, 300, "-F")
    assert (out["ok"], out["oom"], out["freed"], out["free_errors"]) == (300, 0, 300, 0)
    assert (out["total"], out["free"]) == (1 * GiB, 1 * GiB)
    snap = cb.snapshot()
    assert (snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals) == (0, 768 * MiB, 0)


def test_threads_allocating_at_once_keep_the_count_exact(agent, gpu):
    cb = mem_block(agent, 64 * MiB)
    out = run_python(f"""
        import threading
        from dilu.interceptor.cuda import Driver
        from dilu.interceptor.control_block import ControlBlock
        d = Driver.load()
        errors = []
        def work():
            try:
                for _ in range(300):
                    d.mem_free(d.mem_alloc({MiB}))
            except Exception as exc:
                errors.append(repr(exc))
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        snap = ControlBlock.open(os.environ["DILU_CB"]).snapshot()
        out["errors"], out["used"], out["peak"] = errors, snap.memory_used_bytes, snap.memory_peak_bytes
        out["info"] = d.mem_get_info()
    """, env_for(cb.path, gpu))
    assert out["errors"] == []
    assert out["used"] == 0 and MiB <= out["peak"] <= 4 * MiB
    assert out["info"] == [64 * MiB, 64 * MiB]


def test_the_driver_own_refusal_is_rolled_back_and_not_counted_as_ours(agent, gpu):
    # a reservation bigger than the device: the interceptor lets 3 GiB through, the 2 GiB device
    # refuses it; nothing stays counted and it is no refusal of the interceptor's
    cb = mem_block(agent, 8 * GiB)
    out = alloc(env_for(cb.path, gpu, total=2 * GiB), 3 * GiB, 1)
    assert (out["ok"], out["oom"]) == (0, 1)
    assert (out["total"], out["free"]) == (8 * GiB, 2 * GiB)  # free: the device's, below the room left
    snap = cb.snapshot()
    assert (snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals) == (0, 0, 0)
    # past the reservation on a device with room: refused by the interceptor alone
    small = mem_block(agent, 1 * GiB)
    out = alloc(env_for(small.path, gpu, total=2 * GiB), int(1.5 * GiB), 1)
    assert (out["ok"], out["oom"]) == (0, 1)
    assert small.snapshot().oom_refusals == 1


@pytest.mark.parametrize("block_limit,env_limit,expect_total", [
    (None, 512 * MiB, 512 * MiB),     # no usable block: the environment's reservation
    (None, None, 4 * GiB),            # neither: counted only, the device's memory
    (0, 512 * MiB, 512 * MiB),        # a block without a reservation: the environment's
    (1 * GiB, 512 * MiB, 1 * GiB),    # the block's reservation wins
])
def test_where_the_reservation_comes_from(agent, gpu, block_limit, env_limit, expect_total):
    cb_path = mem_block(agent, block_limit).path if block_limit is not None else "/nonexistent/dilu-cb"
    extra = {"DILU_MEMORY_LIMIT_BYTES": env_limit} if env_limit is not None else {}
    out = alloc(env_for(cb_path, gpu, **extra), 256 * MiB, 20)
    assert out["ok"] == expect_total // (256 * MiB)
    assert out["oom"] == 20 - out["ok"]
    assert out["total"] == expect_total


def test_forked_children_draw_on_the_same_reservation(agent, gpu):
    cb = mem_block(agent, 1 * GiB)
    proc = spawn(env_for(cb.path, gpu), "-A", str(256 * MiB), "-n", "6", "-f")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(x) for x in out.strip().splitlines()]
    assert sorted(x["child"] for x in lines) == [0, 1]
    # 3 before the fork, then parent and child race for the one 256 MiB left
    assert sum(x["ok"] for x in lines) == 4
    assert sum(x["oom"] for x in lines) == 5
    assert sum(x["free_errors"] for x in lines) == 0
    snap = cb.snapshot()
    assert (snap.memory_used_bytes, snap.memory_peak_bytes, snap.oom_refusals) == (0, 1 * GiB, 5)


def test_what_a_dead_child_held_is_reclaimed(agent, gpu):
    cb = mem_block(agent, 1 * GiB)
    out = run_python(f"""
        from dilu.interceptor.cuda import Driver
        d = Driver.load()
        pid = os.fork()
        if pid == 0:  # dies holding 768 MiB of the instance's reservation (no exit handlers)
            Driver.load().mem_alloc(768 * {MiB})
            os._exit(0)
        os.waitpid(pid, 0)
        out["ptr"] = d.mem_alloc(768 * {MiB})  # fits only once the child's share is reclaimed
        out["info"] = d.mem_get_info()
    """, env_for(cb.path, gpu))
    assert out["ptr"] > 0
    assert out["info"] == [256 * MiB, 1 * GiB]


def test_fake_driver_alone_shares_the_device_between_processes(gpu, holders):
    env = bare_env(gpu, 1 * GiB)
    held = holders(env, 256 * MiB, 3)
    assert (held.first["ok"], held.first["total"], held.first["free"]) == (3, 1 * GiB, 256 * MiB)
    out = alloc(env, 256 * MiB, 2)
    assert (out["ok"], out["oom"], out["total"], out["free"]) == (1, 1, 1 * GiB, 0)
    held.release()
    out = alloc(env, 256 * MiB, 4)
    assert (out["ok"], out["oom"]) == (4, 0)


def test_fake_driver_reclaims_what_dead_processes_held(gpu, holders):
    env = bare_env(gpu, 1 * GiB)
    killed = holders(env, 256 * MiB, 4)
    assert killed.first["ok"] == 4
    killed.kill()  # SIGKILL: no exit handler runs
    out = alloc(env, 256 * MiB, 4)
    assert (out["ok"], out["oom"]) == (4, 0)
    # a process that exits without freeing gives its memory back too
    assert alloc(env, 256 * MiB, 4, "-L")["ok"] == 4
    assert alloc(env, 256 * MiB, 4)["ok"] == 4


def test_a_context_takes_device_memory_once_per_process_until_it_ends(gpu):
    """DILU_FAKE_CONTEXT_BYTES (the emulated node sets models.CONTEXT_BYTES): a process's first
    context is charged it, a second context is not, and it is given back when the process ends;
    a context that does not fit is refused with CUDA_ERROR_OUT_OF_MEMORY, as a real driver's is."""
    env = bare_env(gpu, 1 * GiB) | {"DILU_FAKE_CONTEXT_BYTES": str(256 * MiB)}
    out = run_python(f"""
        import ctypes
        from dilu.interceptor.cuda import CudaError, Driver
        d = Driver.load()
        out["after_context"] = d.mem_get_info()
        primary = ctypes.c_void_p()
        out["retain"] = ctypes.CDLL("libcuda.so.1").cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0)
        out["after_primary"] = d.mem_get_info()
        out["ptr"] = d.mem_alloc(768 * {MiB})
        try:
            d.mem_alloc(1)
        except CudaError as exc:
            out["past"] = exc.code
    """, env)
    assert out["after_context"] == [768 * MiB, 1 * GiB]
    assert (out["retain"], out["after_primary"]) == (0, [768 * MiB, 1 * GiB])
    assert out["ptr"] > 0 and out["past"] == OOM
    after = run_python("""
        from dilu.interceptor.cuda import CudaError, Driver
        out["free"] = Driver.load().mem_get_info()[0]
    """, env)
    assert after["free"] == 768 * MiB  # the first process's context went with it; this one's is held
    too_big = run_python("""
        from dilu.interceptor.cuda import CudaError, Driver
        try:
            Driver.load()
        except CudaError as exc:
            out["refused"] = [exc.call, exc.code]
    """, env | {"DILU_FAKE_CONTEXT_BYTES": str(2 * GiB)})
    assert too_big["refused"] == ["cuCtxCreate_v2", OOM]
    assert run_python("""
        from dilu.interceptor.cuda import Driver
        out["free"] = Driver.load().mem_get_info()[0]
    """, bare_env(gpu, 1 * GiB))["free"] == 1 * GiB  # not modelled unless set


def _fake_uuid(index: int, seed: str) -> bytes:
    """dilu_fake_uuid (dilu_fake_gpu.h) in Python."""
    h = 0xCBF29CE484222325
    for c in seed.encode():
        h = ((h ^ c) * 0x100000001B3) & (2**64 - 1)
    u = bytearray(h.to_bytes(8, "little")) + bytearray(8)
    u[6] = (u[6] & 0x0F) | 0x40
    u[8], u[9] = 0x91, 0xD1
    u[10:16] = index.to_bytes(6, "big")
    return bytes(u)


def test_cuinit_and_device_queries_create_no_segment(gpu):
    env = bare_env(gpu, 80 * GiB)
    env.update(DILU_FAKE_GPU_COUNT="2", DILU_FAKE_GPU_FIRST_INDEX="3", DILU_FAKE_GPU_SMS="132",
               DILU_FAKE_GPU_NAME="NVIDIA H100 80GB HBM3", DILU_FAKE_GPU_UUID_SEED="node-a")
    out = run_python(f"""
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        seg = "{timeline.gpu_path(gpu)}"
        i, n, t = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
        u, name, bus = (ctypes.c_char * 16)(), ctypes.create_string_buffer(96), ctypes.create_string_buffer(32)
        out["init"] = lib.cuInit(0)
        out["count"] = (lib.cuDeviceGetCount(ctypes.byref(n)), n.value)
        out["get"] = [lib.cuDeviceGet(ctypes.byref(i), k) for k in range(3)]
        out["name"] = (lib.cuDeviceGetName(name, 96, 1), name.value.decode())
        out["sms"] = (lib.cuDeviceGetAttribute(ctypes.byref(i), 16, 1), i.value)
        out["mem"] = (lib.cuDeviceTotalMem_v2(ctypes.byref(t), 1), t.value)
        out["uuid"] = (lib.cuDeviceGetUuid(u, 1), bytes(u).hex())
        out["uuid_v2"] = (lib.cuDeviceGetUuid_v2(u, 1), bytes(u).hex())
        out["bus"] = (lib.cuDeviceGetPCIBusId(bus, 32, 1), bus.value.decode())
        out["segment_before"] = os.path.exists(seg)
        ctx = ctypes.c_void_p()
        out["ctx"] = lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0)
        out["segment_after"] = os.path.exists(seg)
    """, env)
    assert out["init"] == 0 and out["count"] == [0, 2]
    assert out["get"] == [0, 0, 101]  # CUDA_ERROR_INVALID_DEVICE past the count
    assert out["name"] == [0, "NVIDIA H100 80GB HBM3"]
    assert out["sms"] == [0, 132]
    assert out["mem"] == [0, 80 * GiB]
    assert out["uuid"] == out["uuid_v2"] == [0, _fake_uuid(4, "node-a").hex()]
    assert out["bus"] == [0, "0000:14:00.0"]
    assert out["segment_before"] is False
    assert out["ctx"] == 0 and out["segment_after"] is True


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, True, "1024"])
def test_create_rejects_a_bad_memory_limit(tmp_path, bad):
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        ControlBlock.create(str(tmp_path / "cb"), "m", 0.5, 1.0, memory_limit_bytes=bad)


def test_memory_limit_round_trips_through_the_block(tmp_path):
    cb = ControlBlock.create(str(tmp_path / "cb"), "m", 0.5, 1.0, memory_limit_bytes=3 * GiB)
    other = ControlBlock.open(cb.path)
    snap = other.snapshot()
    assert (snap.memory_limit_bytes, snap.memory_used_bytes, snap.memory_peak_bytes,
            snap.oom_refusals) == (3 * GiB, 0, 0, 0)
    unlimited = ControlBlock.create(str(tmp_path / "cb2"), "n", 0.5, 1.0)
    assert unlimited.snapshot().memory_limit_bytes == 0
    for block in (other, cb, unlimited):
        block.close()
