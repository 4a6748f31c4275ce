"""Step 'environment': what this machine is (Python, torch, CUDA, the GPU, the driver, MPS tools,
the compiler) and whether the project is importable. Never needs a GPU to run."""
from __future__ import annotations

import platform as host
import shutil
import subprocess
import sys

from util import run_step, say

STEP = "environment"


def _cmd(*args: str) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({type(exc).__name__})"
    return (out.stdout or out.stderr).strip()


def body(result: dict) -> None:
    result["python"] = sys.version.split()[0]
    result["executable"] = sys.executable
    result["host"] = host.node()
    result["nvidia_smi"] = _cmd("nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,compute_mode",
                                "--format=csv,noheader") if shutil.which("nvidia-smi") else "(no nvidia-smi)"
    result["mps_control"] = shutil.which("nvidia-cuda-mps-control") or ""
    result["cc"] = _cmd("cc", "--version").splitlines()[0] if shutil.which("cc") else "(no cc)"
    try:
        import torch

        result["torch"] = torch.__version__
        result["torch_cuda"] = torch.version.cuda
        result["cuda_available"] = torch.cuda.is_available()
        if result["cuda_available"]:
            result["device"] = torch.cuda.get_device_name(0)
            result["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:
        result["torch"] = f"not importable: {exc}"
        result["cuda_available"] = False
    try:
        import dilu.interceptor.native  # noqa: F401
        import dilu.services.node_agent.devices  # noqa: F401

        result["dilu_importable"] = True
    except Exception as exc:
        result["dilu_importable"] = f"no: {type(exc).__name__}: {exc}"
    for key in ("python", "torch", "torch_cuda", "cuda_available", "device", "capability", "nvidia_smi", "mps_control",
                "cc", "dilu_importable"):
        say(STEP, f"{key}: {result.get(key)}")
    result["ok"] = bool(result["cuda_available"]) and result["dilu_importable"] is True
    if not result["ok"]:
        result["error"] = "torch sees no CUDA GPU" if not result["cuda_available"] else str(result["dilu_importable"])


if __name__ == "__main__":
    sys.exit(run_step(STEP, body))
