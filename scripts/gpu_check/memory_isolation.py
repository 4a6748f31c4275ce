"""Step d: memory isolation. Two instances under the interceptor, each with its control block:

- the neighbour (ResNet-50, batch 16, eager, quota 0.5, reservation 8 GiB) serves steps
  back to back for the whole step and counts the steps that fail;
- the hog (no model, quota 0.5, reservation HOG_LIMIT_MIB = 2 GiB, ``memory_limit_bytes`` of
  ``ControlBlock.create``) meanwhile allocates 1 GiB (within its reservation), then 3 GiB more
  (past it: the interceptor should answer CUDA_ERROR_OUT_OF_MEMORY, which torch raises as an
  out-of-memory RuntimeError), then 512 MiB (within it again), then frees everything.

Reported: each allocation's outcome, what ``torch.cuda.mem_get_info`` shows the hog (the
reservation, if the interceptor reports it through cuMemGetInfo), the hog's block (memory used,
peak, refusals), and the neighbour's steps per second before, during and after, with its errors.
ok = the over-allocation got an OOM, the allocations within the reservation succeeded, and the
neighbour had no error.
"""
from __future__ import annotations

import sys
import time

from util import Worker, cb_path, control_block_class, gpu_env, interceptor_env, interceptor_lib, run_step, say

STEP = "memory"
HOG_LIMIT_MIB = 2048
NEIGHBOUR_LIMIT_MIB = 8192
SERVE_S = 8.0
PLAN = (("within", 1024), ("past", 3072), ("within", 512))  # MiB, against the 2 GiB reservation


def body(result: dict) -> None:
    ControlBlock = control_block_class()
    lib = interceptor_lib()
    paths = {"hog": cb_path("mem-hog"), "neighbour": cb_path("mem-neighbour")}
    blocks = {
        "hog": ControlBlock.create(paths["hog"], "gpucheck-hog", request_quota=0.5, width=1.0, stale_after_ms=3_600_000,
                                   memory_limit_bytes=HOG_LIMIT_MIB * 2**20),
        "neighbour": ControlBlock.create(paths["neighbour"], "gpucheck-neighbour", request_quota=0.5, width=1.0,
                                         stale_after_ms=3_600_000, memory_limit_bytes=NEIGHBOUR_LIMIT_MIB * 2**20),
    }
    result.update(hog_limit_mib=HOG_LIMIT_MIB, neighbour_limit_mib=NEIGHBOUR_LIMIT_MIB)
    try:
        with Worker("mem-hog", "none", 1, gpu_env(interceptor_env(lib, quota=0.5, cb_path=paths["hog"]))) as hog, \
             Worker("mem-neighbour", "resnet50", 16,
                    gpu_env(interceptor_env(lib, quota=0.5, cb_path=paths["neighbour"]))) as nb:
            hog.cmd("alloc 1", timeout_s=60)  # the CUDA context and torch's allocator exist now
            hog.cmd("free", timeout_s=60)
            t0 = time.monotonic()
            nb.send(f"serve {SERVE_S}")
            time.sleep(2.0)  # the neighbour's rate alone first
            hog_meminfo = hog.cmd("meminfo", timeout_s=30)
            allocs = []
            t_hog = time.monotonic() - t0
            for kind, mib in PLAN:
                a = {"against_reservation": kind, **hog.cmd(f"alloc {mib}", timeout_s=60)}
                allocs.append(a)
                say(STEP, f"hog alloc {mib} MiB: " + ("ok" if a["ok"] else f"refused, oom={a.get('oom')}: {a.get('alloc_error')}"))
            hog_meminfo_after = hog.cmd("meminfo", timeout_s=30)
            snap_held = blocks["hog"].snapshot()
            hog.cmd("free", timeout_s=60)
            t_hog_end = time.monotonic() - t0
            snap_freed = blocks["hog"].snapshot()
            served = nb.reply(timeout_s=SERVE_S + 60)
            snap_nb = blocks["neighbour"].snapshot()
    finally:
        for name, cb in blocks.items():
            cb.close()
            cb.unlink()
    within = [a for a in allocs if a["against_reservation"] == "within"]
    past = next(a for a in allocs if a["against_reservation"] == "past")
    result["hog"] = {
        "allocations": allocs,
        "mem_get_info_gib": {"free": round(hog_meminfo["free_bytes"] / 2**30, 3), "total": round(hog_meminfo["total_bytes"] / 2**30, 3)},
        "mem_get_info_holding_gib": {"free": round(hog_meminfo_after["free_bytes"] / 2**30, 3),
                                     "total": round(hog_meminfo_after["total_bytes"] / 2**30, 3)},
        "block_while_holding": {"memory_used_mib": snap_held.memory_used_bytes / 2**20, "memory_peak_mib": snap_held.memory_peak_bytes / 2**20,
                                "oom_refusals": snap_held.oom_refusals, "memory_limit_mib": snap_held.memory_limit_bytes / 2**20},
        "block_after_free": {"memory_used_mib": snap_freed.memory_used_bytes / 2**20, "oom_refusals": snap_freed.oom_refusals},
        "active_s": [round(t_hog, 2), round(t_hog_end, 2)],
    }
    per_s = served["per_second"]
    result["neighbour"] = {"steps": served["steps"], "errors": served["errors"], "first_error": served["first_error"],
                           "steps_per_second": per_s, "memory_used_mib": snap_nb.memory_used_bytes / 2**20,
                           "oom_refusals": snap_nb.oom_refusals}
    say(STEP, f"hog sees total={result['hog']['mem_get_info_gib']['total']} GiB free={result['hog']['mem_get_info_gib']['free']} GiB "
              f"(reservation {HOG_LIMIT_MIB / 1024:.0f} GiB); block: used {snap_held.memory_used_bytes / 2**20:.0f} MiB, "
              f"refusals {snap_held.oom_refusals}")
    say(STEP, f"neighbour: {served['steps']} steps, {served['errors']} errors, steps/s {per_s} "
              f"(hog active from {t_hog:.1f} s to {t_hog_end:.1f} s)")
    oom = not past["ok"] and bool(past.get("oom"))
    result["over_allocation_oom"] = oom
    result["within_reservation_ok"] = all(a["ok"] for a in within)
    result["neighbour_unaffected"] = served["errors"] == 0 and served["steps"] > 0
    result["ok"] = oom and result["within_reservation_ok"] and result["neighbour_unaffected"]
    say(STEP, f"over-allocation OOM: {oom}; within reservation ok: {result['within_reservation_ok']}; "
              f"neighbour kept serving: {result['neighbour_unaffected']}")
    if not result["ok"]:
        result["error"] = ("the allocation past the reservation was not refused" if not oom else
                           "an allocation within the reservation failed" if not result["within_reservation_ok"] else
                           f"the neighbour failed: {served['first_error']}")


if __name__ == "__main__":
    sys.exit(run_step(STEP, body))
