"""Step b: achieved throughput and GPU share against quota, and the interceptor's fast-path overhead.

For ResNet-50 (batch 64, 224x224) and the BERT-base-sized encoder (batch 32 x 128 tokens), fp16,
each eagerly and as a CUDA graph: one run without the interceptor, then one process under it whose
quota is set to 1.0, 0.5 and 0.25 in turn through its control block (width 1: no MPS). Per phase
(GPU_CHECK_SECONDS seconds, default 2.0, after GPU_CHECK_WARMUP_S, default 1.0, of warm-up):

- items_per_s and ``vs_none``, the throughput ratio against the run without the interceptor;
- ``share_events``: busy share measured with CUDA events: steps done x one step's GPU time
  (events around back-to-back steps at quota 1.0, in the same process) / wall time;
- ``share_nvml``: NVML's utilisation of the GPU over the phase (device-side busy share);
- ``share_metered``: GPU-busy µs the interceptor charged / wall µs (its own accounting);
- each against the quota, which bounds the busy share at width 1.

Overhead at quota 1.0 against no interceptor: throughput in %, and per launch in ns (the extra
time per step divided by the launches per step the interceptor counted).

Without the control-block binding (the project did not install) each quota runs in its own
process with the fail-safe rate DILU_REQUEST_QUOTA, as the earlier version of this check did.
"""
from __future__ import annotations

import os
import sys
import time

from util import (UtilSampler, Worker, cb_path, control_block_class, gpu_env, interceptor_env, interceptor_lib,
                  one_line, run_step, say, step_deadline)

STEP = "throughput"
# GPU_CHECK_MODELS (e.g. "bert_base") runs only those
MODELS = tuple((m, b) for m, b in (("resnet50", 64), ("bert_base", 32))
               if m in (os.environ.get("GPU_CHECK_MODELS") or "resnet50,bert_base").split(","))
MODES = ("eager", "graph")
QUOTAS = (1.0, 0.5, 0.25)
SECONDS = float(os.environ.get("GPU_CHECK_SECONDS", "2.0"))
CALIB_STEPS = 20


def phase(w: Worker, seconds: float, step_gpu_ms: float, batch: int) -> dict:
    with UtilSampler() as util:
        m = w.cmd(f"measure {seconds}", timeout_s=seconds + 60)
    row = {"items_per_s": round(m["items_per_s"], 2), "iters": m["iters"], "wall_s": round(m["wall_s"], 3),
           "share_events": round(m["iters"] * step_gpu_ms / (m["wall_s"] * 1000.0), 4), "share_nvml": util.mean()}
    metered = m.get("metered")
    if metered:
        wall_us = m["wall_s"] * 1e6
        row["share_metered"] = round(metered["busy_us"] / wall_us, 4)
        row["launches_per_iter"] = round(metered["launches"] / max(1, m["iters"]), 2)
        row["throttled_frac"] = round(metered["throttled"] / max(1, metered["launches"]), 4)
        row["applied_quota"] = metered["applied_quota"]
    return row


def show(model: str, mode: str, quota, row: dict) -> None:
    parts = [f"{model:9} {mode:5} quota={quota!s:5}", f"items/s={row['items_per_s']:9.1f}"]
    if "vs_none" in row:
        parts.append(f"vs_none={row['vs_none']:.3f}")
    for key in ("share_events", "share_nvml", "share_metered"):
        if row.get(key) is not None:
            parts.append(f"{key}={row[key]:.3f}")
    say(STEP, " ".join(parts))


def baseline(model: str, batch: int, deadline: float) -> dict:
    """{mode: row} without the interceptor."""
    out = {}
    with Worker(f"{model}-none", model, batch, gpu_env()) as w:
        for mode in MODES:
            if time.monotonic() > deadline:
                break
            w.cmd(f"mode {mode}", timeout_s=120)
            gpu_ms = w.cmd(f"calib {CALIB_STEPS}", timeout_s=120)["step_gpu_ms"]
            row = phase(w, SECONDS, gpu_ms, batch)
            row["step_gpu_ms"] = round(gpu_ms, 4)
            out[mode] = row
            show(model, mode, "none", row)
    return out


def intercepted_block(model: str, batch: int, lib: str, deadline: float) -> dict:
    """{(mode, quota): row}: one process, quotas written into its control block."""
    ControlBlock = control_block_class()
    path = cb_path(f"tp-{model}")
    cb = ControlBlock.create(path, f"gpucheck-{model}", request_quota=1.0, width=1.0, stale_after_ms=3_600_000)
    out = {}
    try:
        with Worker(f"{model}-cb", model, batch, gpu_env(interceptor_env(lib, quota=1.0, cb_path=path))) as w:
            for mode in MODES:
                cb.write_grant(1.0)
                w.cmd(f"mode {mode}", timeout_s=120)
                gpu_ms = w.cmd(f"calib {CALIB_STEPS}", timeout_s=120)["step_gpu_ms"]
                for q in QUOTAS:
                    if time.monotonic() > deadline:
                        return out
                    cb.write_grant(q)
                    row = phase(w, SECONDS, gpu_ms, batch)
                    row["step_gpu_ms"] = round(gpu_ms, 4)
                    out[(mode, q)] = row
    finally:
        cb.close()
        cb.unlink()
    return out


def intercepted_env(model: str, batch: int, lib: str, deadline: float) -> dict:
    """{(mode, quota): row}: one process per quota, the fail-safe DILU_REQUEST_QUOTA."""
    out = {}
    for q in QUOTAS:
        if time.monotonic() > deadline:
            break
        with Worker(f"{model}-q{q}", model, batch, gpu_env(interceptor_env(lib, quota=q))) as w:
            for mode in MODES:
                w.cmd(f"mode {mode}", timeout_s=120)
                gpu_ms = w.cmd(f"calib {CALIB_STEPS}", timeout_s=120)["step_gpu_ms"]
                row = phase(w, SECONDS, gpu_ms, batch)
                row["step_gpu_ms"] = round(gpu_ms, 4)
                out[(mode, q)] = row
    return out


def overheads(base: dict, inter: dict) -> dict:
    """Per mode: throughput overhead (%) and time per launch (ns) at quota 1.0 vs no interceptor."""
    out = {}
    for mode, b in base.items():
        r = inter.get((mode, 1.0))
        if not r:
            continue
        o = {"throughput_pct": round(100.0 * (1.0 - r["items_per_s"] / b["items_per_s"]), 3)}
        lpi = r.get("launches_per_iter")
        if lpi:
            t_none, t_one = b["wall_s"] / b["iters"], r["wall_s"] / r["iters"]
            o["per_launch_ns"] = round((t_one - t_none) / lpi * 1e9, 1)
            o["launches_per_iter"] = lpi
        out[mode] = o
    return out


def body(result: dict) -> None:
    deadline = step_deadline(reserve_s=15)
    lib = interceptor_lib()
    try:
        control_block_class()
        how = "control block"
    except ImportError as exc:
        how = "DILU_REQUEST_QUOTA per process"
        result["note"] = str(exc)
    result.update(seconds_per_phase=SECONDS, quota_via=how, rows=[], overhead={}, errors={})
    say(STEP, f"{SECONDS} s per phase; quota set through the {how}")
    for model, batch in MODELS:
        base, inter = {}, {}
        try:
            base = baseline(model, batch, deadline)
            inter = (intercepted_block if how == "control block" else intercepted_env)(model, batch, lib, deadline)
        except Exception as exc:  # one model's failure is reported; the other still runs
            result["errors"][model] = one_line(exc, 400)
            say(STEP, f"{model} FAILED: {result['errors'][model]}")
        for mode, row in base.items():
            result["rows"].append({"model": model, "batch": batch, "mode": mode, "quota": None, **row})
        for (mode, q), row in inter.items():
            if mode in base:
                row["vs_none"] = round(row["items_per_s"] / base[mode]["items_per_s"], 4)
            show(model, mode, q, row)
            result["rows"].append({"model": model, "batch": batch, "mode": mode, "quota": q, **row})
        ov = overheads(base, inter)
        if ov:
            result["overhead"][model] = ov
            for mode, o in ov.items():
                say(STEP, f"overhead at quota 1.0, {model} {mode}: {o['throughput_pct']:+.2f} % throughput"
                          + (f", {o['per_launch_ns']:+.0f} ns per launch ({o['launches_per_iter']} launches/step)"
                             if "per_launch_ns" in o else ""))
    expected = len(MODELS) * len(MODES) * (1 + len(QUOTAS))
    if len(result["rows"]) < expected and not result["errors"]:
        result["note"] = f"{expected - len(result['rows'])} of {expected} measurements skipped: the step's time ran out"
        say(STEP, result["note"])
    result["ok"] = not result["errors"] and bool(result["rows"])
    if result["errors"]:
        result["error"] = "; ".join(f"{m}: {e}" for m, e in result["errors"].items())


if __name__ == "__main__":
    sys.exit(run_step(STEP, body))
