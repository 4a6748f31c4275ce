"""The node agent's NVML layer (services/node_agent/nvml.py) over the real pynvml, bound to the fake
NVML (interceptor/fake_nvml.c). NVML state is per process, so every check runs in a child Python
process with the emulated node's DILU_FAKE_* environment; faults go through the fake's fault
file (DILU_FAKE_NVML_FAULTS), never through a mocked pynvml."""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import textwrap
import time

import pytest

from native_helpers import PYTHON
from dilu.interceptor import native, timeline
from dilu.services.node_agent import nvml

pytestmark = pytest.mark.native

UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-91d1-[0-9a-f]{12}$")

PRELUDE = """
import json, os, sys, time
from pathlib import Path
import msgspec
from dilu.services.node_agent import nvml
nvml.load(Path(os.environ["DILU_TEST_FAKE_DIR"]))
out = {}
"""
EPILOGUE = "\nprint(json.dumps(msgspec.to_builtins(out)), flush=True)\n"


def _env(**config) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILU_FAKE")}
    env["DILU_TEST_FAKE_DIR"] = str(native.fake_driver_dir())
    env.update({k: str(v) for k, v in config.items()})
    return env


def _script(code: str) -> str:
    return PRELUDE + textwrap.dedent(code) + EPILOGUE


def run_nvml(code: str, timeout: float = 60, **config) -> dict:
    """Runs ``code`` after nvml.load(fake) in a child process; returns its ``out`` dict."""
    proc = subprocess.run([PYTHON, "-c", _script(code)], env=_env(**config), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_faults(path, text: str) -> None:
    """Replaces the fault file at once (the fake re-reads it when its inode or mtime changes)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fake_uuid(seed: str, index: int) -> str:
    """dilu_fake_uuid_str of dilu_fake_gpu.h, re-done in Python."""
    h = 0xCBF29CE484222325
    for b in (seed or "dilu").encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    u = [(h >> (8 * i)) & 0xFF for i in range(8)]
    u[6] = (u[6] & 0x0F) | 0x40
    u += [0x91, 0xD1] + [(index >> (8 * (5 - i))) & 0xFF for i in range(6)]
    x = "".join(f"{b:02x}" for b in u)
    return f"GPU-{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


INVENTORY = """
gpus, driver, cuda = nvml.read_inventory({"unused": 1}, mps_client_limit=48)
out = {"gpus": gpus, "driver": driver, "cuda": cuda}
"""

NODE = dict(DILU_FAKE_GPU_COUNT=3, DILU_FAKE_GPU_NAME="NVIDIA H100 80GB HBM3",
            DILU_FAKE_GPU_MEMORY_BYTES=80 << 30)


def test_inventory_matches_the_emulated_node_and_uuids_follow_the_seed():
    a = run_nvml(INVENTORY, DILU_FAKE_GPU_UUID_SEED="node-a", **NODE)
    again = run_nvml(INVENTORY, DILU_FAKE_GPU_UUID_SEED="node-a", **NODE)
    b = run_nvml(INVENTORY, DILU_FAKE_GPU_UUID_SEED="node-b", **NODE)
    assert [g["index"] for g in a["gpus"]] == [0, 1, 2]
    for g in a["gpus"]:
        assert g["name"] == "NVIDIA H100 80GB HBM3"
        assert g["memory_bytes"] == 80 << 30
        assert g["healthy"] and g["health_reason"] == ""
        assert g["mig"] is False and g["compute_mode"] == "default"
        assert g["mps_client_limit"] == 48 and g["sms"] == 0
        assert UUID_RE.match(g["uuid"]), g["uuid"]
        assert g["uuid"] == fake_uuid("node-a", g["index"])
    uuids_a = [g["uuid"] for g in a["gpus"]]
    assert len(set(uuids_a)) == 3
    assert uuids_a == [g["uuid"] for g in again["gpus"]]
    assert not set(uuids_a) & {g["uuid"] for g in b["gpus"]}
    assert a["driver"].endswith(nvml.FAKE_DRIVER_SUFFIX) and int(a["driver"].split(".")[0]) > 0
    assert a["cuda"] == "12.8"


def test_sms_come_from_the_caller_and_uuid_lookup_round_trips():
    out = run_nvml("""
        import pynvml
        uuids = [pynvml.nvmlDeviceGetUUID(h) for h in nvml.device_handles().values()]
        gpus, _, _ = nvml.read_inventory({uuids[1]: 132})
        back = [pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(u)) for u in uuids]
        out = {"sms": [g.sms for g in gpus], "back": back}
    """, DILU_FAKE_GPU_COUNT=2)
    assert out == {"sms": [0, 132], "back": [0, 1]}


def test_uuid_matches_the_fake_drivers_cuDeviceGetUuid(gpu):
    lib = ctypes.CDLL(str(native.fake_driver_dir() / "libcuda.so.1"))
    if not hasattr(lib, "cuDeviceGetUuid"):
        pytest.skip("the fake driver does not export cuDeviceGetUuid yet")
    code = f"""
import ctypes, sys
lib = ctypes.CDLL({str(native.fake_driver_dir() / "libcuda.so.1")!r})
assert lib.cuInit(0) == 0
u = (ctypes.c_ubyte * 16)()
assert lib.cuDeviceGetUuid(u, 0) == 0
x = bytes(u).hex()
print(f"GPU-{{x[:8]}}-{{x[8:12]}}-{{x[12:16]}}-{{x[16:20]}}-{{x[20:]}}")
"""
    env = _env(DILU_FAKE_GPU=gpu, DILU_FAKE_GPU_UUID_SEED="node-c", DILU_FAKE_GPU_FIRST_INDEX=2)
    driver = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert driver.returncode == 0, driver.stderr
    out = run_nvml("out = nvml.read_inventory()[0][2].uuid", DILU_FAKE_GPU_COUNT=3,
                   DILU_FAKE_GPU_UUID_SEED="node-c")
    assert driver.stdout.strip() == out == fake_uuid("node-c", 2)


HEALTH = """
w = nvml.HealthWatch()
first = w.poll(timeout_ms=300)
gpus, _, _ = nvml.read_inventory(health=first)
lost = None
try:
    nvml.sample(1)
except nvml.GpuLost as exc:
    lost = exc.index
Path(os.environ["DILU_FAKE_NVML_FAULTS"]).write_text("")  # faults gone: marks stay
out = {"first": first, "later": w.poll(0), "gpus": gpus, "lost": lost, "sample0": nvml.sample(0)}
w.close()
"""


def test_faults_mark_gpus_unhealthy_through_nvml(tmp_path):
    faults = tmp_path / "faults"
    write_faults(faults, "# index kind arg\n1 lost\n0 ecc 2\n2 xid 79\n2 xid 13\n")
    out = run_nvml(HEALTH, DILU_FAKE_GPU_COUNT=4, DILU_FAKE_NVML_FAULTS=faults)
    first = {int(k): v for k, v in out["first"].items()}
    assert sorted(first) == [0, 1, 2]
    assert "ECC" in first[0] and "2" in first[0]
    assert "lost" in first[1].lower()
    assert "Xid 79" in first[2]
    assert {int(k): v for k, v in out["later"].items()} == first  # sticky
    health = [(g["index"], g["healthy"]) for g in out["gpus"]]
    assert health == [(0, False), (1, False), (2, False), (3, True)]
    assert out["gpus"][2]["health_reason"] == first[2]
    assert out["gpus"][1]["health_reason"] and out["gpus"][1]["memory_bytes"] == 0
    assert out["lost"] == 1
    assert out["sample0"]["memory_total_bytes"] > 0  # an ECC error does not stop queries


def test_a_healthy_node_stays_healthy_and_application_xids_are_not_fatal(tmp_path):
    faults = tmp_path / "faults"
    write_faults(faults, "0 xid 13\n1 xid 43\n1 ecc 0\n")
    out = run_nvml("""
        w = nvml.HealthWatch()
        out = {"polls": [w.poll(timeout_ms=100) for _ in range(3)],
               "healthy": [g.healthy for g in nvml.read_inventory(health=w.poll())[0]]}
    """, DILU_FAKE_GPU_COUNT=2, DILU_FAKE_NVML_FAULTS=faults)
    assert out == {"polls": [{}, {}, {}], "healthy": [True, True]}


def test_an_xid_during_a_poll_wakes_it(tmp_path):
    faults = tmp_path / "faults"
    code = _script("""
        w = nvml.HealthWatch()
        assert w.poll(0) == {}
        print("ready", flush=True)
        t = time.monotonic()
        bad = w.poll(timeout_ms=5000)
        out = {"bad": bad, "waited_s": time.monotonic() - t}
    """)
    proc = subprocess.Popen([PYTHON, "-c", code], env=_env(DILU_FAKE_GPU_COUNT=3, DILU_FAKE_NVML_FAULTS=faults),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        write_faults(faults, "2 xid 79\n")
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert list(result["bad"]) == ["2"] and "Xid 79" in result["bad"]["2"]
    assert result["waited_s"] < 4.0


def test_idle_sample_is_sane_and_throttle_reasons_are_named(tmp_path):
    faults = tmp_path / "faults"
    write_faults(faults, "1 clocks 0x44\n")
    out = run_nvml("out = [nvml.sample(0), nvml.sample(1)]", DILU_FAKE_GPU_COUNT=2,
                   DILU_FAKE_GPU_MEMORY_BYTES=24 << 30, DILU_FAKE_NVML_FAULTS=faults)
    for s in out:
        assert 0.0 <= s["utilization_gpu"] <= 1.0 and 0.0 <= s["utilization_memory"] <= 1.0
        assert s["memory_total_bytes"] == 24 << 30 and s["memory_used_bytes"] == 0
        assert s["power_w"] > 0 and s["temperature_c"] > 0
        assert s["processes"] == []
    assert out[0]["throttle_reasons"] == []  # idle is not a slowdown
    assert out[1]["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert nvml.throttle_reason_names(0x1 | 0x4 | 0x8000, include_idle=True) == ["gpu_idle", "sw_power_cap", "0x8000"]


WORKER = """
import ctypes, sys, time
from dilu.interceptor.cuda import Driver
drv = Driver.load(sys.argv[1])
held = 0
if hasattr(drv._lib, "cuMemAlloc_v2"):
    ptr = ctypes.c_uint64()
    if drv._lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20)) == 0:
        held = 256 << 20
fn = drv.function("busy")
end = time.monotonic() + float(sys.argv[2])
first = True
while time.monotonic() < end:
    for _ in range(5):
        drv.launch(fn, 2000.0)
    drv.synchronize()
    if first:
        print(held, flush=True)
        first = False
"""

BUSY = """
best = None
end = time.monotonic() + 3.0
while time.monotonic() < end:
    s = nvml.sample(0)
    if best is None or s.utilization_gpu > best.utilization_gpu:
        best = s
    if s.utilization_gpu > 0.2 and (not int(os.environ["HELD"]) or s.processes):
        best = s
        break
    time.sleep(0.1)
import pynvml
idle_bit = [pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) & pynvml.nvmlClocksEventReasonGpuIdle
            for h in nvml.device_handles().values()]
out = {"busy": best, "idle": nvml.sample(1), "idle_bit": idle_bit}
"""

AFTER = """
end = time.monotonic() + 3.0
while nvml.sample(0).utilization_gpu > 0 and time.monotonic() < end:
    time.sleep(0.1)
out = nvml.sample(0)
"""


def test_utilisation_and_processes_follow_a_fake_driver_process(gpu):
    worker = subprocess.Popen([PYTHON, "-c", WORKER, str(native.fake_driver_dir() / "libcuda.so.1"), "8"],
                              env=_env(DILU_FAKE_GPU=gpu), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = worker.stdout.readline()
        assert line.strip().isdigit(), worker.stderr.read() if worker.poll() is not None else line
        held = int(line)
        assert timeline.info(gpu).kernels > 0
        out = run_nvml(BUSY, DILU_FAKE_GPU_COUNT=2, DILU_FAKE_GPU_TIMELINES=f"{gpu},", HELD=held)
    finally:
        worker.kill()
        worker.wait()
    busy, idle = out["busy"], out["idle"]
    assert 0.2 < busy["utilization_gpu"] <= 1.0
    assert busy["power_w"] > idle["power_w"] and busy["temperature_c"] > idle["temperature_c"]
    assert out["idle_bit"] == [0, 1]  # NVML's own idle reason, left out of throttle_reasons
    assert idle["utilization_gpu"] == 0.0 and idle["processes"] == []
    if held:  # the fake driver accounts device memory: NVML shows the process and its bytes
        procs = {p["pid"]: p["used_bytes"] for p in busy["processes"]}
        assert procs.get(worker.pid, 0) >= held
        assert busy["memory_used_bytes"] >= held
    # the process is gone: within about a second the device reads idle again
    after = run_nvml(AFTER, DILU_FAKE_GPU_COUNT=1, DILU_FAKE_GPU_TIMELINES=gpu)
    assert after["utilization_gpu"] == 0.0 and after["processes"] == []
    assert after["memory_used_bytes"] == 0  # a dead process holds no device memory


def test_load_and_available_report_a_missing_or_fake_library(tmp_path, monkeypatch):
    assert issubclass(nvml.NvmlUnavailable, nvml.NvmlError) and issubclass(nvml.GpuLost, nvml.NvmlError)
    with pytest.raises(nvml.NvmlUnavailable, match="no fake NVML"):
        nvml.load(tmp_path)
    # the fake NVML found first on the search path is not a real driver
    monkeypatch.setenv("LD_LIBRARY_PATH", str(native.fake_driver_dir()))
    assert nvml.available() is False
