"""Step c: resize latency. A worker (ResNet-50, batch 16, eager, fp16) runs under the interceptor
with a control block at quota 0.25, synchronising after every step and stamping its end
(CLOCK_MONOTONIC ns); this process writes grants 0.25 -> 1.0 -> 0.25 -> 1.0 ... while it runs
(``ControlBlock.write_grant``, from another process, as the node agent does) and measures for
each write:

- ``applied_us``: the block's applied time (t_applied_ns, stamped by the interceptor when it took
  the new epoch at the worker's next launch, or when a throttled launch woke on the epoch futex)
  minus the time just before the write;
- ``rate_change_ms``: time from the write until the step rate changed: the end of the first step
  after the write whose duration is past the geometric mean of the median step before (last
  second) and after (from 0.5 s after the write to the next one), and the next two steps as well;
  resolution one step (``step_ms_before`` / ``step_ms_after``); not timed when the rate changed
  by less than 1.3x (``rate_ratio``: new rate / old; 4 expected for 0.25 -> 1.0 when the GPU,
  not the host, bounds the step).
"""
from __future__ import annotations

import math
import sys
import time

from util import Worker, cb_path, control_block_class, gpu_env, interceptor_env, interceptor_lib, median, run_step, say

STEP = "resize"
PLAN = (0.25, 1.0, 0.25, 1.0, 0.25, 1.0, 0.25, 1.0)  # quota before the run, then each write
EVERY_S = 1.2  # between writes
BATCH = 16
MIN_RATIO = 1.3  # a change of the step rate smaller than this is not timed (noise)


def analyse(stamps: list[int], writes: list[dict]) -> list[dict]:
    """Fills each write's rate_change_ms / step_ms_before / step_ms_after from the step stamps."""
    steps = [(stamps[i], stamps[i] - stamps[i - 1]) for i in range(1, len(stamps))]  # (end ns, duration ns)
    for k, w in enumerate(writes):
        t_w = w["write_ns"]
        t_next = writes[k + 1]["write_ns"] if k + 1 < len(writes) else stamps[-1]
        before = median([d for end, d in steps if t_w - 1_000_000_000 <= end < t_w])
        after = median([d for end, d in steps if t_w + 500_000_000 <= end < t_next])
        if before is None or after is None:
            continue
        w["step_ms_before"], w["step_ms_after"] = round(before / 1e6, 3), round(after / 1e6, 3)
        w["rate_ratio"] = round(before / after, 3)  # new step rate / old
        if max(before, after) < MIN_RATIO * min(before, after):
            continue  # the rate did not change enough to time the change
        thr = math.sqrt(before * after)
        faster = after < before
        changed = [(end, d < thr if faster else d > thr) for end, d in steps if end > t_w]
        for i, (end, ok) in enumerate(changed):
            if ok and all(c for _, c in changed[i + 1:i + 3]):
                w["rate_change_ms"] = round((end - t_w) / 1e6, 3)
                break
    return writes


def body(result: dict) -> None:
    ControlBlock = control_block_class()
    lib = interceptor_lib()
    path = cb_path("resize")
    cb = ControlBlock.create(path, "gpucheck-resize", request_quota=PLAN[0], width=1.0, stale_after_ms=3_600_000)
    writes: list[dict] = []
    result.update(model="resnet50", batch=BATCH, mode="eager", writes=writes)
    try:
        with Worker("resize", "resnet50", BATCH, gpu_env(interceptor_env(lib, quota=PLAN[0], cb_path=path))) as w:
            w.cmd("serve 1.5", timeout_s=60)  # settle at the first quota
            run_s = EVERY_S * len(PLAN) + 0.3
            w.send(f"stamped {run_s}")
            t0 = time.monotonic() + 1.0  # the first write after a second at the initial quota
            for i, q in enumerate(PLAN[1:]):
                delay = t0 + i * EVERY_S - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                t_w = time.monotonic_ns()
                epoch = cb.write_grant(q)
                writes.append({"from": PLAN[i], "to": q, "write_ns": t_w, "epoch": epoch})
                applied = cb.wait_applied(epoch, timeout_ms=1000)
                snap = cb.snapshot()
                writes[-1]["applied_us"] = round((snap.applied_ns - t_w) / 1e3, 1) if applied else None
            stamps = w.reply(timeout_s=run_s + 60)["stamps_ns"]
    finally:
        cb.close()
        cb.unlink()
    analyse(stamps, writes)
    for x in writes:
        say(STEP, f"{x['from']} -> {x['to']}: applied after {x.get('applied_us')} us, rate changed after "
                  f"{x.get('rate_change_ms')} ms (step {x.get('step_ms_before')} -> {x.get('step_ms_after')} ms, "
                  f"rate x{x.get('rate_ratio')})")
    ups = [x for x in writes if x["to"] > x["from"]]
    summary = {}
    for name, group in (("up", ups), ("down", [x for x in writes if x["to"] < x["from"]])):
        applied = [x["applied_us"] for x in group if x.get("applied_us") is not None]
        changed = [x["rate_change_ms"] for x in group if x.get("rate_change_ms") is not None]
        summary[name] = {"writes": len(group), "applied_us_median": median(applied), "applied_us_max": max(applied, default=None),
                         "rate_change_ms_median": median(changed), "rate_change_ms_max": max(changed, default=None)}
    result["summary"] = summary
    say(STEP, f"0.25 -> 1.0: applied median {summary['up']['applied_us_median']} us, "
              f"rate change median {summary['up']['rate_change_ms_median']} ms (max {summary['up']['rate_change_ms_max']} ms)")
    for x in writes:
        x.pop("write_ns", None)
    result["ok"] = bool(ups) and all(x.get("applied_us") is not None for x in ups) \
        and all(x.get("rate_change_ms") is not None for x in ups)
    if not result["ok"]:
        result["error"] = "a 0.25 -> 1.0 grant was not applied, or the step rate did not change after it"


if __name__ == "__main__":
    sys.exit(run_step(STEP, body))
