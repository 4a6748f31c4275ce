"""Paths of the native build and the environment that runs a process under the interceptor.

``build()`` compiles what is out of date (see dilu.interceptor.build). ``instance_env`` returns
the variables an instance process needs to run on an emulated GPU (the fake driver) with its
launches metered and throttled through its control block.
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


def build() -> None:
    """Builds the interceptor, fake driver, test program and cffi module when out of date.

    Raises dilu.interceptor.build.BuildError when the C compiler fails.
    """
    _build.build()


def interceptor_lib() -> Path:
    """Path of ``libdilu_intercept.so`` (the LD_PRELOAD library); builds it if missing."""
    path = BUILD_DIR / "libdilu_intercept.so"
    if not path.exists():
        build()
    return path


def fake_driver_dir() -> Path:
    """Folder holding the fake ``libcuda.so.1`` (put it first on LD_LIBRARY_PATH)."""
    path = BUILD_DIR / "fake"
    if not (path / "libcuda.so.1").exists():
        build()
    return path


def launch_program() -> Path:
    """Path of ``dilu_launch``, the small C driver-API program (see interceptor/tools/)."""
    path = BUILD_DIR / "bin" / "dilu_launch"
    if not path.exists():
        build()
    return path


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
        build()
        found = sorted(BUILD_DIR.glob("_dilu_cb*.so"))
    spec = importlib.util.spec_from_file_location("_dilu_cb", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def instance_env(cb_path: str, *, gpu_name: str, width: float, request_quota: float,
                 sms: int = 108, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process that runs under the interceptor on an emulated GPU.

    cb_path: the instance's control block file (created by the agent with ControlBlock.create).
    gpu_name: the emulated GPU (processes with the same name share one device timeline).
    width: fraction of SMs 0..1, passed as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (percent).
    request_quota: fraction 0..1, the rate the interceptor applies when the block is unusable.
    sms: SM count the emulated GPU reports (the first process to open the GPU fixes it).
    base: environment to extend (default: os.environ). Returns a new dict.
    Raises ValueError for a width or quota outside (0, 1].
    """
    if not 0.0 < width <= 1.0:
        raise ValueError(f"width must be in (0, 1], got {width}")
    if not 0.0 < request_quota <= 1.0:
        raise ValueError(f"request_quota must be in (0, 1], got {request_quota}")
    env = dict(os.environ if base is None else base)
    preload = str(interceptor_lib())
    libdir = str(fake_driver_dir())
    env["LD_PRELOAD"] = ":".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env["DILU_CB"] = cb_path
    env["DILU_REQUEST_QUOTA"] = f"{request_quota:.6f}"
    env["DILU_FAKE_GPU"] = gpu_name
    env["DILU_FAKE_GPU_SMS"] = str(int(sms))
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{width * 100.0:.4f}"
    return env
