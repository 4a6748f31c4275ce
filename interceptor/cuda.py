"""A thin ctypes binding of the CUDA driver API (libcuda.so.1, the fake one or a real one), enough
for a Python instance to replay a model's kernel sequence on an emulated GPU.

Loading goes through ``dlopen``/``dlsym`` like any ctypes user, so under the interceptor every
launch is metered (that is the "Python ctypes" path of DESIGN.md section 6).

Kernel durations (fake driver): ``function(name)`` asks the driver for ``p_<name>``, a kernel
whose first parameter is a pointer to a float of µs, so ``launch(fn, duration_us)`` says how long
that launch lasts at the process's width. A real driver has no such kernels: this class is for
the fake driver (a real GPU is exercised by scripts/gpu_check.sh with torch).
"""
from __future__ import annotations

import ctypes

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_READY = 600


class CudaError(RuntimeError):
    """A driver call returned an error: ``code`` is the CUresult, ``call`` the function name."""

    def __init__(self, call: str, code: int):
        super().__init__(f"{call} failed with CUresult {code}")
        self.call, self.code = call, code


class Driver:
    """One process's driver session: initialised driver, a context on device 0, one module."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._ctx = ctypes.c_void_p()
        self._mod = ctypes.c_void_p()
        self._dur = ctypes.c_float(0.0)
        self._params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(self._dur), ctypes.c_void_p))
        self._launch = lib.cuLaunchKernel
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        dev = ctypes.c_int()
        self._check("cuInit", lib.cuInit(0))
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), 0))
        self._check("cuCtxCreate_v2", lib.cuCtxCreate_v2(ctypes.byref(self._ctx), 0, dev))
        self._check("cuModuleLoadData", lib.cuModuleLoadData(ctypes.byref(self._mod), b"dilu"))

    @staticmethod
    def _check(call: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(call, code)

    @classmethod
    def load(cls, path: str = "libcuda.so.1") -> "Driver":
        """Opens the driver (found through LD_LIBRARY_PATH) and sets up a context.
        Raises OSError when the library is missing, CudaError when set-up fails."""
        return cls(ctypes.CDLL(path))

    def function(self, name: str) -> int:
        """A kernel handle whose duration is given per launch (see the module docstring)."""
        fn = ctypes.c_void_p()
        self._check("cuModuleGetFunction",
                    self._lib.cuModuleGetFunction(ctypes.byref(fn), self._mod, f"p_{name}".encode()))
        return fn.value

    def device_attribute(self, attribute: int) -> int:
        """cuDeviceGetAttribute on device 0 (16 = SM count)."""
        v = ctypes.c_int()
        self._check("cuDeviceGetAttribute", self._lib.cuDeviceGetAttribute(ctypes.byref(v), attribute, 0))
        return v.value

    def mem_alloc(self, nbytes: int) -> int:
        """cuMemAlloc_v2: a device pointer to ``nbytes`` bytes. Raises CudaError (code
        CUDA_ERROR_OUT_OF_MEMORY past the device's memory or the instance's reservation)."""
        ptr = ctypes.c_uint64()
        self._check("cuMemAlloc_v2", self._lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)))
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        """cuMemFree_v2 of a pointer from :meth:`mem_alloc`. Raises CudaError."""
        self._check("cuMemFree_v2", self._lib.cuMemFree_v2(ctypes.c_uint64(ptr)))

    def mem_get_info(self) -> tuple[int, int]:
        """cuMemGetInfo_v2: (free, total) bytes (under the interceptor, of the reservation)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check("cuMemGetInfo_v2", self._lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value

    def launch(self, fn: int, duration_us: float, stream: int | None = None, grid: int = 1) -> None:
        """Queues one launch of ``fn`` over ``grid`` blocks (gridDimX, >= 1) lasting ``duration_us``
        µs on ``stream`` (None: default). Returns at once unless the interceptor throttles it.
        The fake driver's duration is the parameter alone; the grid is what a real launch of more
        work would change, and the interceptor keys its cost estimate on it. Raises CudaError."""
        self._dur.value = duration_us  # read by the driver during the call
        code = self._launch(fn, max(1, int(grid)), 1, 1, 1, 1, 1, 0, stream, self._params, None)
        if code:
            raise CudaError("cuLaunchKernel", code)

    def synchronize(self) -> None:
        """Waits until every queued kernel of the context has finished."""
        self._check("cuCtxSynchronize", self._lib.cuCtxSynchronize())

    def stream(self) -> int:
        """A new stream handle."""
        s = ctypes.c_void_p()
        self._check("cuStreamCreate", self._lib.cuStreamCreate(ctypes.byref(s), 0))
        return s.value

    def stream_ready(self, stream: int | None = None) -> bool:
        """cuStreamQuery: True when idle, False while it still has work (CUDA_ERROR_NOT_READY)."""
        code = self._lib.cuStreamQuery(ctypes.c_void_p(stream))
        if code not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY):
            raise CudaError("cuStreamQuery", code)
        return code == CUDA_SUCCESS

    def event(self) -> int:
        """A new event handle."""
        e = ctypes.c_void_p()
        self._check("cuEventCreate", self._lib.cuEventCreate(ctypes.byref(e), 0))
        return e.value

    def record(self, event: int, stream: int | None = None) -> None:
        """cuEventRecord on ``stream``."""
        self._check("cuEventRecord", self._lib.cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)))

    def event_ready(self, event: int) -> bool:
        """cuEventQuery: True once the work before the record finished."""
        code = self._lib.cuEventQuery(ctypes.c_void_p(event))
        if code not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY):
            raise CudaError("cuEventQuery", code)
        return code == CUDA_SUCCESS

    def elapsed_ms(self, start: int, end: int) -> float:
        """cuEventElapsedTime between two completed events, in ms."""
        ms = ctypes.c_float()
        self._check("cuEventElapsedTime", self._lib.cuEventElapsedTime(
            ctypes.byref(ms), ctypes.c_void_p(start), ctypes.c_void_p(end)))
        return ms.value
