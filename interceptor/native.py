"""Paths of the native build and the environment that runs a process under the interceptor.

The native parts are built at install time (``pip install`` / ``make``; see
dilu.interceptor.build); looking one up never compiles anything, it raises :class:`NativeMissing`
with what to run. ``DILU_INTERCEPTOR_LIB`` overrides the interceptor's path (operators point it
at an installed copy), ``DILU_FAKE_LIBDIR`` the folder of the fake driver and NVML.

``interceptor_env`` returns the variables that put a process under the interceptor with its
control block; ``emulated_gpu_env`` those that run it on an emulated GPU (the fake driver);
``instance_env`` is both, for tests and benches.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from dilu.interceptor import build as _build

BUILD_DIR: Path = _build.BUILD


class NativeMissing(RuntimeError):
    """A native part is not built (or not where a variable says); the message says what to run."""


def build() -> None:
    """Builds the interceptor, fake driver and NVML, test program and cffi module when out of date
    (for ``make``, tests and benches; services never call it).

    Raises dilu.interceptor.build.BuildError when the C compiler fails.
    """
    _build.build()


def _built(path: Path, what: str) -> Path:
    if not path.exists():
        raise NativeMissing(f"{what} not found at {path}: build the native parts with `make native` "
                            f"(or `python -m dilu.interceptor.build`), or reinstall the package")
    return path


def interceptor_lib() -> Path:
    """Path of ``libdilu_intercept.so`` (the LD_PRELOAD library): ``DILU_INTERCEPTOR_LIB`` when set,
    else the build folder. Raises NativeMissing when the file is not there."""
    override = os.environ.get("DILU_INTERCEPTOR_LIB")
    if override:
        return _built(Path(override), "the interceptor (DILU_INTERCEPTOR_LIB)")
    return _built(BUILD_DIR / "libdilu_intercept.so", "the interceptor")


def fake_driver_dir() -> Path:
    """Folder holding the fake ``libcuda.so.1`` and ``libnvidia-ml.so.1`` (first on an emulated
    instance's LD_LIBRARY_PATH): ``DILU_FAKE_LIBDIR`` when set, else the build folder.
    Raises NativeMissing when the fake driver is not there."""
    path = Path(os.environ.get("DILU_FAKE_LIBDIR") or BUILD_DIR / "fake")
    _built(path / "libcuda.so.1", "the fake CUDA driver")
    return path


def launch_program() -> Path:
    """Path of ``dilu_launch``, the small C driver-API program (see interceptor/tools/).
    Raises NativeMissing when it is not built."""
    return _built(BUILD_DIR / "bin" / "dilu_launch", "dilu_launch")


class LaunchFailed(RuntimeError):
    """``dilu_launch`` exited non-zero; the message carries its stderr."""


def spawn_launch(env: dict[str, str], *args: str) -> subprocess.Popen:
    """Start the ``dilu_launch`` test program (a C process calling the driver API) under ``env``;
    its last stdout line is a JSON summary (see tools/)."""
    return subprocess.Popen([str(launch_program()), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_launch(proc: subprocess.Popen, timeout: float = 120) -> dict:
    """Wait for a :func:`spawn_launch` process and return its JSON summary. Kills it and re-raises
    ``subprocess.TimeoutExpired`` past ``timeout`` s; raises LaunchFailed on a non-zero exit."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise LaunchFailed(f"dilu_launch {' '.join(map(str, proc.args[1:]))} failed ({proc.returncode}): {err.strip()}")
    return json.loads(out.strip().splitlines()[-1])


@lru_cache(maxsize=1)
def cffi_module():
    """The compiled cffi module (``ffi``, ``lib``) over dilu_cb.h; builds it if missing."""
    found = sorted(BUILD_DIR.glob("_dilu_cb*.so"))
    if not found:
        _built(BUILD_DIR / "_dilu_cb.so", "the control-block module")
    spec = importlib.util.spec_from_file_location("_dilu_cb", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interceptor_env(cb_path: str, *, width: float, request_quota: float,
                    base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment that runs a process under the interceptor with its control block.

    cb_path: the instance's control block file (created by the agent with ControlBlock.create).
    width: fraction of SMs 0..1, passed as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (percent): the MPS
    client's SM ceiling on a real GPU, the emulated GPU's width on the fake driver.
    request_quota: fraction 0..1, the rate the interceptor applies when the block is unusable.
    base: environment to extend (default: os.environ). Returns a new dict.
    Raises ValueError for a width or quota outside (0, 1], NativeMissing when not built.
    """
    if not 0.0 < width <= 1.0:
        raise ValueError(f"width must be in (0, 1], got {width}")
    if not 0.0 < request_quota <= 1.0:
        raise ValueError(f"request_quota must be in (0, 1], got {request_quota}")
    env = dict(os.environ if base is None else base)
    preload = str(interceptor_lib())
    env["LD_PRELOAD"] = ":".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    env["DILU_CB"] = cb_path
    env["DILU_REQUEST_QUOTA"] = f"{request_quota:.6f}"
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{width * 100.0:.4f}"
    return env


def emulated_gpu_env(env: dict[str, str], *, gpu_name: str, sms: int = 108, index: int = 0,
                     model: str | None = None, memory_bytes: int | None = None,
                     uuid_seed: str | None = None, context_bytes: int = 0) -> dict[str, str]:
    """Adds what runs a process on one emulated GPU (the fake driver first on LD_LIBRARY_PATH)
    to ``env`` and returns it (see interceptor/dilu_fake_gpu.h for each variable).

    gpu_name: the device timeline (processes naming it share one emulated GPU); sms: its SM
    count (the first process to open the GPU fixes it); index: its node-level index (so the
    driver's UUID matches NVML's); model, memory_bytes, uuid_seed: the node's configuration;
    context_bytes: device memory the process's CUDA context takes (0: not modelled; the emulated
    node uses ``models.CONTEXT_BYTES``). Raises NativeMissing when the fake driver is not built.
    """
    libdir = str(fake_driver_dir())
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["DILU_FAKE_GPU"] = gpu_name
    env["DILU_FAKE_GPU_SMS"] = str(int(sms))
    env["DILU_FAKE_GPU_COUNT"] = "1"
    env["DILU_FAKE_GPU_FIRST_INDEX"] = str(int(index))
    if model:
        env["DILU_FAKE_GPU_NAME"] = model
    if memory_bytes:
        env["DILU_FAKE_GPU_MEMORY_BYTES"] = str(int(memory_bytes))
    if uuid_seed:
        env["DILU_FAKE_GPU_UUID_SEED"] = uuid_seed
    if context_bytes:
        env["DILU_FAKE_CONTEXT_BYTES"] = str(int(context_bytes))
    else:
        env.pop("DILU_FAKE_CONTEXT_BYTES", None)
    return env


def instance_env(cb_path: str, *, gpu_name: str, width: float, request_quota: float,
                 sms: int = 108, base: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`interceptor_env` on one emulated GPU (:func:`emulated_gpu_env`): tests and benches.
    Raises ValueError for a width or quota outside (0, 1]."""
    env = interceptor_env(cb_path, width=width, request_quota=request_quota, base=base)
    return emulated_gpu_env(env, gpu_name=gpu_name, sms=sms)
