"""The node's GPUs: discovered through NVML and the CUDA driver, real or emulated, by one code path.

``open_device(mode, ...)`` returns a :class:`Device`:

- ``nvml``: the real ``libnvidia-ml.so.1`` and ``libcuda.so.1`` of this host. Instances run on the
  real driver (``CUDA_VISIBLE_DEVICES`` = their GPU's UUID), as MPS clients when the MPS control
  daemon runs (see :mod:`.mps`).
- ``emulated``: the same calls answered by the project's fake NVML and fake driver
  (interceptor/fake_nvml.c, fake_driver.c), configured from an :class:`EmulatedGpu` model and a
  count; instances run on the fake driver with one device timeline per GPU.
- ``cpu``: no GPU; instances run torch on the CPU.
- ``auto``: ``nvml`` when NVML and a GPU are there, else ``emulated``.

The inventory (:meth:`Device.inventory`), health (:meth:`Device.health`) and the NVML half of the
telemetry (:meth:`Device.sample`) come from NVML in both the real and emulated cases; the SM count
comes from the driver's multiprocessor-count attribute. Only the environment an instance gets
differs (:meth:`Device.gpu_env`).
"""
from __future__ import annotations

import ctypes
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from dilu.contracts.events import GpuInfo, NvmlSample

from dilu.services.common import logging as dlog
from dilu.services.common import models

from . import mps as mps_mod
from . import nvml, segments

log = dlog.get("node_agent")
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16  # cuda.h
MODES = ("auto", "nvml", "emulated")
MPS_CLIENT_LIMIT = 48  # clients per GPU under MPS, Volta and later (NVIDIA MPS documentation, 2.3.5.1)


@dataclass(frozen=True)
class EmulatedGpu:
    """A GPU model the emulated node can be: NVML name, device memory (bytes) and SM count, as the
    real part reports them (SMs: NVIDIA's architecture white papers; memory: the total NVML and
    nvidia-smi report, e.g. 40960 MiB for an A100 40 GB, 143771 MiB for an H200)."""

    name: str
    memory_bytes: int
    sms: int


EMULATED_GPUS: dict[str, EmulatedGpu] = {
    "a100-40gb": EmulatedGpu("NVIDIA A100-SXM4-40GB", 40960 * 2**20, 108),
    "a100-80gb": EmulatedGpu("NVIDIA A100-SXM4-80GB", 81920 * 2**20, 108),
    "h100-80gb": EmulatedGpu("NVIDIA H100 80GB HBM3", 81559 * 2**20, 132),
    "h200": EmulatedGpu("NVIDIA H200", 143771 * 2**20, 132),
}
DEFAULT_EMULATED = "a100-40gb"  # the measured surfaces are A100 ones (DESIGN.md section 7)
EMULATED_DEFAULT_COUNT = 4  # GPUs of an emulated node when --gpus says all


class DeviceError(RuntimeError):
    """The requested device mode cannot run here; the message says why in one line."""


@dataclass
class Gpu:
    """One GPU of this node. ``timeline``: the emulated GPU's shared segment name ("" on a real
    GPU); ``healthy``/``reason``: from NVML, sticky once unhealthy."""

    index: int
    uuid: str
    name: str
    memory_bytes: int
    sms: int
    timeline: str = ""
    healthy: bool = True
    reason: str = ""


@dataclass
class Device:
    """This node's GPUs and how instances reach them (module docstring). ``kind``: nvml, emulated
    or cpu; ``mps``: the MPS state (on, off, unavailable)."""

    kind: str
    gpus: list[Gpu] = field(default_factory=list)
    driver_version: str = ""
    cuda_version: str = ""
    mps: mps_mod.Mps | None = None
    model: EmulatedGpu | None = None
    uuid_seed: str = ""
    _health: nvml.HealthWatch | None = None
    _modes: dict = field(default_factory=dict)  # index -> {"mig": bool, "compute_mode": str}

    @property
    def mps_state(self) -> str:
        return self.mps.state if self.mps is not None else "off"

    @property
    def handler_device(self) -> str:
        """What an instance's handler runs on: ``cuda``, ``emulated`` or ``cpu``."""
        return {"nvml": "cuda", "emulated": "emulated"}.get(self.kind, "cpu")

    def inventory(self) -> list[GpuInfo]:
        """The GPUs as the NodeInventory lists them (health as last polled). The MPS client
        limit holds where instances share a GPU as MPS clients: under a running MPS daemon, and on
        emulated GPUs, whose fake driver runs processes side by side as MPS slices would."""
        limit = MPS_CLIENT_LIMIT if self.mps_state == "on" or self.kind == "emulated" else 0
        return [GpuInfo(index=g.index, uuid=g.uuid, name=g.name, memory_bytes=g.memory_bytes, sms=g.sms,
                        mps_client_limit=limit, healthy=g.healthy, health_reason=g.reason, **self._modes.get(g.index, {}))
                for g in self.gpus]

    def health(self) -> list[Gpu]:
        """Polls NVML; returns the GPUs that became unhealthy since the last poll."""
        if self._health is None:
            return []
        newly = []
        for index, reason in self._health.poll().items():
            g = self.gpus[index] if 0 <= index < len(self.gpus) else None
            if g is not None and g.healthy:
                g.healthy, g.reason = False, reason
                newly.append(g)
        return newly

    def sample(self, index: int) -> NvmlSample | None:
        """NVML's view of GPU ``index`` now; None on a CPU node or when the GPU cannot be read."""
        if self.kind == "cpu" or not self.gpus[index].healthy:
            return None
        try:
            return nvml.sample(index)
        except nvml.NvmlError:
            return None

    def gpu_env(self, env: dict[str, str], gpu: Gpu, *, width: float, memory_bytes: int) -> dict[str, str]:
        """Adds what runs an instance on ``gpu`` to ``env``: the fake driver and its timeline
        (emulated), or ``CUDA_VISIBLE_DEVICES`` and the MPS client settings (real GPU).
        ``width``: SM fraction 0..1; ``memory_bytes``: the instance's reservation. An emulated
        instance's CUDA context takes ``models.CONTEXT_BYTES`` of its GPU, as a real one does."""
        if self.kind == "emulated":
            from dilu.interceptor import native

            return native.emulated_gpu_env(env, gpu_name=gpu.timeline, sms=gpu.sms, index=gpu.index,
                                           model=gpu.name, memory_bytes=gpu.memory_bytes, uuid_seed=self.uuid_seed,
                                           context_bytes=models.CONTEXT_BYTES)
        if self.kind == "nvml":
            env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            if self.mps is not None:
                env.update(self.mps.client_env(width=width, memory_bytes=memory_bytes))
        return env

    def close(self) -> None:
        """Stops what the device started (an MPS daemon this agent launched) and removes the
        emulated GPUs' shared segments."""
        if self.mps is not None:
            self.mps.stop()
        if self.kind == "emulated":
            from dilu.interceptor import timeline

            for g in self.gpus:
                timeline.unlink_gpu(g.timeline)
        nvml.shutdown()


def _driver_sms(lib: str) -> dict[str, int]:
    """UUID (``GPU-...``) -> multiprocessor count, from the CUDA driver at ``lib`` (cuInit,
    cuDeviceGetCount, cuDeviceGetUuid_v2, cuDeviceGetAttribute). Creates no context.
    Raises DeviceError when the driver cannot be loaded or initialised."""
    try:
        cu = ctypes.CDLL(lib)
    except OSError as exc:
        raise DeviceError(f"cannot load the CUDA driver {lib}: {exc}") from None
    if cu.cuInit(0) != 0:
        raise DeviceError(f"cuInit failed in {lib}")
    count = ctypes.c_int()
    cu.cuDeviceGetCount(ctypes.byref(count))
    out: dict[str, int] = {}
    for ordinal in range(count.value):
        dev, sms, raw = ctypes.c_int(), ctypes.c_int(), (ctypes.c_ubyte * 16)()
        if cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or cu.cuDeviceGetUuid_v2(raw, dev) != 0:
            continue
        cu.cuDeviceGetAttribute(ctypes.byref(sms), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        out["GPU-" + str(uuid.UUID(bytes=bytes(raw)))] = sms.value
    return out


def _from_nvml(kind: str, limit: int | None, driver_lib: str) -> Device:
    infos, driver_version, cuda_version = nvml.read_inventory(sms_by_uuid=_driver_sms(driver_lib))
    if limit is not None:
        if limit > len(infos):
            raise DeviceError(f"--gpus {limit}: this node has {len(infos)} GPU(s)")
        infos = infos[:limit]
    dev = Device(kind=kind, driver_version=driver_version, cuda_version=cuda_version)
    dev.gpus = [Gpu(g.index, g.uuid, g.name, g.memory_bytes, g.sms, healthy=g.healthy, reason=g.health_reason)
                for g in infos]
    dev._modes = {g.index: {"mig": g.mig, "compute_mode": g.compute_mode} for g in infos}
    dev._health = nvml.HealthWatch()
    return dev


def open_device(mode: str, *, node: str, gpus: int | None, emulated_model: str = DEFAULT_EMULATED,
                memory_bytes: int | None = None, sms: int | None = None, mps_dir: Path | None = None) -> Device:
    """Discover this node's GPUs (module docstring).

    ``mode``: auto | nvml | emulated; ``gpus``: how many to use (None: all; 0: a CPU node);
    ``emulated_model``: a key of :data:`EMULATED_GPUS`, with ``memory_bytes``/``sms`` overriding
    its figures; ``mps_dir``: where the MPS pipe and log directories go on a real GPU.
    Raises DeviceError (one line) when the mode cannot run here or a value is out of range.
    """
    if mode not in MODES:
        raise DeviceError(f"unknown device mode {mode!r}; choose from {', '.join(MODES)}")
    if gpus == 0:
        if mode != "auto":
            raise DeviceError(f"--gpus cpu runs no GPU, but --device {mode} asks for one: leave --device at auto")
        return Device(kind="cpu")
    if mode == "auto":
        mode = "nvml" if nvml.available() else "emulated"
        if mode == "emulated":
            log.info("no NVIDIA driver or GPU found (NVML did not start): running the emulated node")
    if mode == "nvml":
        try:
            nvml.load(None)
        except nvml.NvmlUnavailable as exc:
            raise DeviceError(f"--device nvml: {exc}") from None
        dev = _from_nvml("nvml", gpus, os.environ.get("DILU_REAL_LIBCUDA") or "libcuda.so.1")
        if not dev.gpus:
            raise DeviceError("--device nvml: NVML reports no GPU on this node")
        dev.mps = mps_mod.Mps(mps_dir or Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "dilu-mps")
        dev.mps.start()
        return dev
    return _emulated(node, EMULATED_DEFAULT_COUNT if gpus is None else gpus, emulated_model, memory_bytes, sms)


def _emulated(node: str, count: int, model_key: str, memory_bytes: int | None, sms: int | None) -> Device:
    from dilu.interceptor import native

    if model_key not in EMULATED_GPUS:
        raise DeviceError(f"unknown emulated GPU {model_key!r}; choose from {', '.join(EMULATED_GPUS)}")
    base = EMULATED_GPUS[model_key]
    model = EmulatedGpu(base.name, memory_bytes or base.memory_bytes, sms or base.sms)
    run = uuid.uuid4().hex[:8]
    timelines = [segments.timeline_name(node, run, i) for i in range(count)]
    # the fake libraries read the node's configuration from this process's environment
    os.environ.update({
        "DILU_FAKE_GPU_COUNT": str(count), "DILU_FAKE_GPU_NAME": model.name,
        "DILU_FAKE_GPU_MEMORY_BYTES": str(model.memory_bytes), "DILU_FAKE_GPU_SMS": str(model.sms),
        "DILU_FAKE_GPU_UUID_SEED": node, "DILU_FAKE_GPU_FIRST_INDEX": "0",
        "DILU_FAKE_GPU_TIMELINES": ",".join(timelines),
    })
    fake = native.fake_driver_dir()
    try:
        nvml.load(fake)
    except nvml.NvmlUnavailable as exc:
        raise DeviceError(f"emulated node: the fake NVML did not load: {exc}") from None
    dev = _from_nvml("emulated", None, str(fake / "libcuda.so.1"))
    dev.model, dev.uuid_seed = model, node
    for g, name in zip(dev.gpus, timelines):
        g.timeline = name
    return dev
