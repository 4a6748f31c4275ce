"""The node agent's NVML layer: inventory, health and per-GPU samples, over the real ``pynvml``.

On a GPU node this reads the NVIDIA driver's ``libnvidia-ml.so.1``; on an emulated node the agent
calls ``load(fake_dir)`` first, which puts the fake NVML (interceptor/fake_nvml.c, built into
``interceptor/build/fake/``) in its place, and every call below then goes through the same
``pynvml`` code to the emulated GPUs the fake CUDA driver runs (DESIGN.md sections 4 and 6).
Nothing here mocks ``pynvml``: tests inject faults through the fake library's fault file.

NVML's state is per process: ``load`` once, then ``read_inventory``, ``HealthWatch`` and
``sample`` from any thread (NVML is thread-safe; ctypes releases the GIL during each call).

Sources: NVML API reference (docs.nvidia.com/deploy/nvml-api), the bindings in nvidia-ml-py
(``pynvml.py``), NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import pynvml

from dilu.contracts.events import GpuInfo, NvmlSample, ProcessMemory

LIBRARY = "libnvidia-ml.so.1"
FAKE_DRIVER_SUFFIX = "-dilu-emulated"  # the fake NVML's driver version ends with this

# Xids after which a GPU takes no new instance until an operator resets it. Chosen from NVIDIA's
# Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): Xids reporting
# uncorrectable memory errors or pending row remapping, NVLink failure, a GPU fallen off the bus
# or a failed GPU System Processor, whose catalog action is a GPU reset or more. Xids caused by
# applications (13, 31, 43, 45, 68, 109: the set NVIDIA's Kubernetes device plugin also skips)
# only end the faulting process and are not fatal here.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC row remapping pending",
    64: "ECC row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

# NVML's clocks-event (formerly "clocks throttle") reason bits, nvmlClocksEventReason* in nvml.h.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)

_COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: "default",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "exclusive-thread",
    pynvml.NVML_COMPUTEMODE_PROHIBITED: "prohibited",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive-process",
}
_XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
_LOST = "GPU is lost (NVML_ERROR_GPU_IS_LOST)"

_lock = threading.Lock()
_uuids: dict[int, str] = {}  # UUIDs seen by read_inventory, to name a GPU lost later


class NvmlError(RuntimeError):
    """Base of the errors this module raises (catch it to handle both below)."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used in this process; the message is a one-line reason."""


class GpuLost(NvmlError):
    """A GPU answered NVML_ERROR_GPU_IS_LOST (fell off the bus); ``index`` is its NVML index."""

    def __init__(self, index: int):
        super().__init__(f"GPU {index}: {_LOST}")
        self.index = index


def _reason(exc: pynvml.NVMLError) -> str:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return f"{LIBRARY} not found (no NVIDIA driver installed)"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "the NVIDIA kernel driver is not loaded"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return "no permission to use NVML"
    return f"NVML: {exc}"


def _addr(handle) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def load(fake_dir: Path | None = None) -> None:
    """Initialises NVML in this process (``pynvml.nvmlInit``; each call adds one reference,
    ``shutdown`` drops one).

    ``fake_dir``: folder holding the fake ``libnvidia-ml.so.1`` (an emulated node, e.g.
    ``interceptor/build/fake``). It is loaded first with ``RTLD_GLOBAL``; pynvml's later
    ``CDLL("libnvidia-ml.so.1")`` then gets that object, because the dynamic loader returns an
    already loaded library whose SONAME matches a bare name. Checked after init: if another
    ``libnvidia-ml.so.1`` was loaded in this process before, NVML is shut down again and
    NvmlUnavailable raised.
    None: the driver's own library, found through the loader's search path.

    Raises NvmlUnavailable with a one-line reason when the library or the driver is missing.
    """
    fake = None
    if fake_dir is not None:
        path = Path(fake_dir) / LIBRARY
        if not path.exists():
            raise NvmlUnavailable(f"no fake NVML at {path} (build it: python -m dilu.interceptor.build)")
        try:
            fake = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise NvmlUnavailable(f"cannot load {path}: {exc}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(_reason(exc)) from None
    if fake is not None:
        bound = getattr(pynvml, "nvmlLib", None)
        if bound is None or _addr(bound.nvmlInitWithFlags) != _addr(fake.nvmlInitWithFlags):
            pynvml.nvmlShutdown()
            raise NvmlUnavailable(f"another {LIBRARY} was loaded in this process before the fake one")


def shutdown() -> None:
    """Drops one ``load`` reference (``pynvml.nvmlShutdown``); NVML stops with the last one.
    Does nothing when NVML is not initialised."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


_PROBE = (
    "import pynvml\n"
    "pynvml.nvmlInit()\n"
    "print(pynvml.nvmlSystemGetDriverVersion())\n"
    "pynvml.nvmlShutdown()\n"
)


def available(timeout_s: float = 30.0) -> bool:
    """Whether the real NVIDIA ``libnvidia-ml.so.1`` loads and initialises (``--device auto``).

    Probed in a short-lived child process (about 0.2 s), so this process never binds a library
    or keeps NVML half-initialised when it fails, and a later ``load(fake_dir)`` still works. A
    library that says it is the fake one (driver version ending in ``-dilu-emulated``, e.g. found
    through LD_LIBRARY_PATH) does not count. False also when the probe exceeds ``timeout_s``.
    """
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout_s, env=os.environ.copy())
    except (OSError, subprocess.TimeoutExpired):
        return False
    lines = proc.stdout.strip().splitlines()
    return proc.returncode == 0 and bool(lines) and not lines[-1].endswith(FAKE_DRIVER_SUFFIX)


def device_handles() -> dict[int, object]:
    """NVML index -> device handle of every GPU NVML reports (a lost GPU's handle included when
    NVML still gives it). Raises NvmlUnavailable when NVML is not initialised."""
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(_reason(exc)) from None
    out: dict[int, object] = {}
    for i in range(count):
        try:
            out[i] = pynvml.nvmlDeviceGetHandleByIndex(i)
        except pynvml.NVMLError:
            continue
    return out


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _gpu_info(index: int, sms_by_uuid: Mapping[str, int], mps_client_limit: int) -> GpuInfo:
    uuid, name, memory, mig, mode, reason = _uuids.get(index, ""), "", 0, False, "default", ""
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        _uuids[index] = uuid
        name = pynvml.nvmlDeviceGetName(h)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        try:
            mig = pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            pass
        try:
            mode = _COMPUTE_MODES.get(pynvml.nvmlDeviceGetComputeMode(h), "default")
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            pass
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     pynvml.NVML_VOLATILE_ECC)
            if ecc > 0:
                reason = f"{ecc} uncorrected ECC errors since the driver loaded"
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            pass
    except pynvml.NVMLError_GpuIsLost:
        reason = _LOST
    except pynvml.NVMLError as exc:
        reason = f"NVML: {exc}"
    return GpuInfo(index=index, uuid=uuid, name=name, memory_bytes=memory,
                   sms=int(sms_by_uuid.get(uuid, 0)) if uuid else 0, mig=mig, compute_mode=mode,
                   mps_client_limit=mps_client_limit, healthy=not reason, health_reason=reason)


def read_inventory(sms_by_uuid: dict[str, int] | None = None, mps_client_limit: int = 0,
                   health: Mapping[int, str] | None = None) -> tuple[list[GpuInfo], str, str]:
    """The node's GPUs as NVML reports them, the driver version and the CUDA version.

    Per GPU (contracts.events.GpuInfo): NVML index; UUID ``GPU-...``; name; total device memory
    in bytes (``nvmlDeviceGetMemoryInfo``); ``sms`` from ``sms_by_uuid`` (the CUDA driver's
    multiprocessor count, which NVML does not report; 0 when not given); MIG mode enabled now;
    compute mode; ``mps_client_limit`` as given (48 under MPS, 0 when unknown); health:
    unhealthy when a query answers NVML_ERROR_GPU_IS_LOST, when the uncorrected volatile ECC
    count is above 0, when another NVML error hides the GPU, or when ``health`` (the result of
    ``HealthWatch.poll``) names it. A GPU lost before any inventory read it has an empty UUID.

    Returns (gpus, driver version string, CUDA version "major.minor" of the driver API, from
    ``nvmlSystemGetCudaDriverVersion``, e.g. "12.8"). Raises NvmlUnavailable when NVML is not
    initialised or cannot count the GPUs.
    """
    sms_by_uuid = sms_by_uuid or {}
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(_reason(exc)) from None
    gpus = []
    with _lock:
        for i in range(count):
            g = _gpu_info(i, sms_by_uuid, mps_client_limit)
            if g.healthy and health and health.get(i):
                g.healthy, g.health_reason = False, health[i]
            gpus.append(g)
    return gpus, driver, cuda


class HealthWatch:
    """Watches GPUs for what makes them unfit for new instances; unhealthiness is sticky.

    ``handles``: NVML index -> device handle (default: every GPU, ``device_handles()``). Registers
    for Xid events (``nvmlDeviceRegisterEvents`` with ``nvmlEventTypeXidCriticalError``) where the
    GPU supports them; the fake NVML delivers the Xids of its fault file once to each event set.
    Call ``close()`` (or use ``with``) to free the event set.
    """

    def __init__(self, handles: Mapping[int, object] | None = None):
        self._handles = dict(device_handles() if handles is None else handles)
        self._by_addr = {_addr(h): i for i, h in self._handles.items()}
        self._bad: dict[int, str] = {}
        self._ecc = dict.fromkeys(self._handles, True)  # uncorrected ECC count readable
        self._lock = threading.Lock()
        self._events = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError:
            return  # no events on this platform: poll() still checks ECC and loss
        for i, h in self._handles.items():
            try:
                if pynvml.nvmlDeviceGetSupportedEventTypes(h) & _XID_EVENT:
                    pynvml.nvmlDeviceRegisterEvents(h, _XID_EVENT, self._events)
            except pynvml.NVMLError_GpuIsLost:
                self._bad[i] = _LOST
            except pynvml.NVMLError:
                pass

    def __enter__(self) -> "HealthWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Frees the event set; ``poll`` afterwards only checks ECC counts and loss."""
        with self._lock:
            if self._events is not None:
                try:
                    pynvml.nvmlEventSetFree(self._events)
                except pynvml.NVMLError:
                    pass
                self._events = None

    def _mark(self, index: int, reason: str) -> None:
        if index in self._handles:
            self._bad.setdefault(index, reason)

    def _xid(self, data) -> None:
        code = int(data.eventData)
        if data.eventType != _XID_EVENT or code not in FATAL_XIDS:
            return
        reason = f"Xid {code}: {FATAL_XIDS[code]}"
        index = self._by_addr.get(_addr(data.device))
        if index is not None:
            self._mark(index, reason)
        elif not data.device:  # an event for no one device concerns them all
            for i in self._handles:
                self._mark(i, reason)

    def poll(self, timeout_ms: int = 0) -> dict[int, str]:
        """GPU index -> reason, for every watched GPU unhealthy now.

        Waits up to ``timeout_ms`` ms (``nvmlEventSetWait``) for an Xid event, then takes every
        event already queued; a fatal Xid (``FATAL_XIDS``) marks its GPU. Then queries each GPU
        not yet marked: an uncorrected volatile ECC count above 0 (``nvmlDeviceGetTotalEccErrors``)
        or NVML_ERROR_GPU_IS_LOST on the query marks it. Marks are never cleared.
        """
        with self._lock:
            wait = max(0, int(timeout_ms))
            while self._events is not None:
                try:
                    data = pynvml.nvmlEventSetWait(self._events, wait)
                except pynvml.NVMLError_Timeout:
                    break
                except pynvml.NVMLError_GpuIsLost:
                    break  # which GPU is found by the queries below
                except pynvml.NVMLError:
                    break
                self._xid(data)
                wait = 0
            for i, h in self._handles.items():
                if i in self._bad:
                    continue
                try:
                    if self._ecc[i]:
                        n = pynvml.nvmlDeviceGetTotalEccErrors(
                            h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
                        if n > 0:
                            self._bad[i] = f"{n} uncorrected ECC errors since the driver loaded"
                    else:
                        pynvml.nvmlDeviceGetMemoryInfo(h)  # still answering?
                except pynvml.NVMLError_GpuIsLost:
                    self._bad[i] = _LOST
                except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                    self._ecc[i] = False
                except pynvml.NVMLError:
                    pass  # a transient answer says nothing about the GPU's health
            return dict(self._bad)


def throttle_reason_names(mask: int, include_idle: bool = False) -> list[str]:
    """Names of the clocks-event reason bits set in ``mask`` (``THROTTLE_REASONS``, in bit order).

    ``gpu_idle`` (0x1: clocks are low because nothing runs) is left out unless ``include_idle``:
    it is no slowdown. Bits NVML may add later appear as ``"0x..."``.
    """
    names = [name for bit, name in THROTTLE_REASONS if mask & bit and (include_idle or bit != 0x1)]
    known = sum(bit for bit, _ in THROTTLE_REASONS)
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"0x{bit:x}")
            rest &= ~bit
        bit <<= 1
    return names


def _optional(call, *args):
    """``call(*args)``, or None when NVML cannot answer it; a lost GPU raises through."""
    try:
        return call(*args)
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return None


def sample(index: int) -> NvmlSample:
    """What NVML says about GPU ``index`` now (contracts.events.NvmlSample).

    ``utilization_gpu``/``utilization_memory``: ``nvmlDeviceGetUtilizationRates`` / 100, fractions
    0..1 of NVML's last sample period (1/6 s to 1 s depending on the GPU) in which a kernel ran /
    device memory was read or written; ``memory_used_bytes``/``memory_total_bytes``:
    ``nvmlDeviceGetMemoryInfo`` (bytes); ``power_w``: ``nvmlDeviceGetPowerUsage`` (mW) / 1000;
    ``temperature_c``: ``nvmlDeviceGetTemperature`` (GPU die, °C); ``throttle_reasons``:
    ``nvmlDeviceGetCurrentClocksEventReasons`` (``nvmlDeviceGetCurrentClocksThrottleReasons``
    on drivers before 535) as names, idle left out (``throttle_reason_names``); ``processes``:
    ``nvmlDeviceGetComputeRunningProcesses`` (pid, bytes held; 0 where NVML cannot say).

    A field NVML cannot answer (some GPUs have no power sensor) keeps its default.
    Raises GpuLost when the GPU answers NVML_ERROR_GPU_IS_LOST, NvmlUnavailable when NVML is
    not initialised or ``index`` names no GPU.
    """
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        out = NvmlSample()
        util = _optional(pynvml.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            out.utilization_gpu = min(1.0, max(0.0, util.gpu / 100.0))
            out.utilization_memory = min(1.0, max(0.0, util.memory / 100.0))
        mem = _optional(pynvml.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            out.memory_used_bytes, out.memory_total_bytes = int(mem.used), int(mem.total)
        mw = _optional(pynvml.nvmlDeviceGetPowerUsage, h)
        if mw is not None:
            out.power_w = mw / 1000.0
        temp = _optional(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            out.temperature_c = float(temp)
        try:
            mask = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        except pynvml.NVMLError_FunctionNotFound:
            mask = _optional(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError:
            mask = None
        if mask is not None:
            out.throttle_reasons = throttle_reason_names(mask)
        procs = _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
        if procs is not None:
            out.processes = [ProcessMemory(pid=int(p.pid), used_bytes=int(p.usedGpuMemory or 0))
                             for p in procs]
        return out
    except pynvml.NVMLError_GpuIsLost:
        raise GpuLost(index) from None
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"GPU {index}: {_reason(exc)}") from None
