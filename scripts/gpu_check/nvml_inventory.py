"""Step a: this node's GPUs as the node agent sees them (NVML + the CUDA driver, devices.open_device
("nvml")), and whether the MPS control daemon started (MPS may not start in a sandbox: its state
and reason are reported, not required).

    python nvml_inventory.py MPS_DIR
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from util import run_step, say

STEP = "inventory"
# one CUDA context through MPS: what every instance of the node does first
PROBE = ("import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); "
         "print('mps client ok', float(x.sum()))")


def probe_client(dev, gpu) -> dict:
    """Runs one torch process as an MPS client of the daemon, as the agent would (width 0.5, 1 GiB)."""
    env = dev.gpu_env(dict(os.environ), gpu, width=0.5, memory_bytes=2**30)
    env.pop("LD_PRELOAD", None)
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        return {"ok": False, "output": "timed out after 45 s"}
    text = (out.stdout + out.stderr).strip().splitlines()
    return {"ok": out.returncode == 0, "rc": out.returncode, "output": " | ".join(text[-3:])[:500]}


def body(result: dict) -> None:
    import msgspec

    from dilu.services.node_agent import devices, nvml

    mps_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dilu-gpu-check-mps")
    result["nvml_available"] = nvml.available()
    say(STEP, f"NVML (real driver) available: {result['nvml_available']}")
    dev = devices.open_device("nvml", node="gpu-check", gpus=None, mps_dir=mps_dir)
    try:
        result.update(device=dev.kind, driver_version=dev.driver_version, cuda_version=dev.cuda_version,
                      handler_device=dev.handler_device)
        say(STEP, f"device={dev.kind} driver={dev.driver_version} cuda={dev.cuda_version} gpus={len(dev.gpus)}")
        result["gpus"] = [msgspec.to_builtins(g) for g in dev.inventory()]
        for g in result["gpus"]:
            say(STEP, f"gpu {g['index']}: {g['name']} uuid={g['uuid']} memory={g['memory_bytes'] / 2**30:.1f} GiB "
                      f"sms={g['sms']} mig={g.get('mig')} compute_mode={g.get('compute_mode')} "
                      f"mps_client_limit={g['mps_client_limit']} healthy={g['healthy']} {g['health_reason']}".rstrip())
        mps = dev.mps
        result["mps"] = {"state": dev.mps_state, "reason": mps.reason if mps else "",
                         "started_here": bool(mps and mps.started_here),
                         "pipe_dir": str(mps.pipe_dir) if mps else ""}
        say(STEP, f"MPS: {result['mps']['state']}" + (f" ({result['mps']['reason']})" if result["mps"]["reason"] else ""))
        if mps is not None and mps.state == "on" and dev.gpus:
            result["mps"]["client_probe"] = probe_client(dev, dev.gpus[0])
            result["mps"]["servers"] = sorted(mps.servers())
            say(STEP, f"MPS client probe: {result['mps']['client_probe']}; servers {result['mps']['servers']}")
        sample = dev.sample(0) if dev.gpus else None
        result["nvml_sample_gpu0"] = msgspec.to_builtins(sample) if sample is not None else None
        if sample is not None:
            say(STEP, f"gpu 0 now: util={sample.utilization_gpu:.2f} memory used={sample.memory_used_bytes / 2**30:.2f} GiB "
                      f"power={sample.power_w:.0f} W temperature={sample.temperature_c:.0f} C "
                      f"throttle={','.join(sample.throttle_reasons) or '-'} processes={len(sample.processes)}")
        unhealthy = [g for g in result["gpus"] if not g["healthy"]]
        result["ok"] = bool(result["gpus"]) and not unhealthy
        if unhealthy:
            result["error"] = f"unhealthy GPUs: {[(g['index'], g['health_reason']) for g in unhealthy]}"
    finally:
        dev.close()  # quits the MPS daemon if this step started it


if __name__ == "__main__":
    sys.exit(run_step(STEP, body))
