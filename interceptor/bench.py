"""``dilu bench interceptor --json PATH``: the interceptor's figures on the emulated GPU.

Writes (all read from the device's own timeline or the interceptor's own clock, never sleeps):

- ``fast_path_overhead_ns``: time the interceptor adds per launch when tokens are available,
  least time per launch over interleaved runs with and without it (the median difference too) (``launch_ns_with``/``launch_ns_without``
  side by side). Measured against the fake driver's null launch (DILU_FAKE_NULL_LAUNCH), which
  costs a few ns, so the difference is the interceptor alone; ``overhead_ratio`` is with/without
  on that same null launch (a real driver's launch costs µs, so there the ratio is near 1).
- ``share_error_pct_max``: largest |achieved - granted| SM-time share in percentage points, over
  quotas 0.1..1.0 x kernel durations 20 µs..5 ms (``shares`` lists every cell).
- ``resize_latency_ms_p50`` / ``_p99``: from a grant written into the block to the interceptor
  applying it (the new rate is in effect from that moment; a throttled launch is woken by the
  grant's futex), over repeated grant changes while the process is throttled.
- ``fairness``: 4 processes on one emulated GPU, equal and unequal quotas: achieved SM-time
  shares, max error (pp) and Jain's index of achieved/quota.

Goals from issue 3: fast path <= 100 ns, share error <= 5 pp, resize p99 <= 5 ms.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import click
import numpy as np

from dilu.interceptor import native, timeline
from dilu.interceptor.control_block import ControlBlock
from dilu.services.common.cliopts import writable_output
from dilu.services.common.interrupt import SignalExit
from dilu.services.node_agent import segments

SEC = 1_000_000_000
QUOTAS = (0.1, 0.25, 0.5, 0.75, 1.0)
KERNELS_US = (20, 200, 1000, 5000)


def _block(request_quota: float, width: float = 1.0) -> ControlBlock:
    path = segments.control_block_path("bench", uuid.uuid4().hex[:12])
    return ControlBlock.create(path, os.path.basename(path), request_quota, width)


def _gpu(kind: str) -> str:
    """A fresh emulated GPU for one bench cell. Its segment, like the control blocks', carries
    this process's pid (segments.timeline_name), so what a bench killed midway leaves in
    /dev/shm is removed by the next node agent to start (segments.sweep_dead)."""
    return segments.timeline_name("bench", f"{kind}-{uuid.uuid4().hex[:8]}", 0)


def _run(env: dict[str, str], *args: str, timeout: float = 120) -> dict:
    return _finish(native.spawn_launch(env, *args), timeout)


_spawn = native.spawn_launch


def _finish(proc: subprocess.Popen, timeout: float = 120) -> dict:
    try:
        return native.finish_launch(proc, timeout)
    except native.LaunchFailed as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        _reap(proc)  # interrupted while waiting (Ctrl-C, SIGTERM): it would run on, orphaned


def _reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it still runs, and wait for it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def fast_path(rounds: int = 5, launches: int = 1_000_000) -> dict:
    """Interleaved runs of dilu_launch with and without the interceptor on a null launch."""
    gpu = _gpu("oh")
    cb = _block(1.0)
    try:
        with_env = native.instance_env(cb.path, gpu_name=gpu, width=1.0, request_quota=1.0)
        with_env["DILU_FAKE_NULL_LAUNCH"] = "1"
        without_env = dict(with_env)
        without_env.pop("LD_PRELOAD")
        args = ("-b", "-n", str(launches), "-k", "k_1")
        with_ns, without_ns = [], []
        for _ in range(rounds):
            without_ns.append(_run(without_env, *args)["ns_per_launch"])
            with_ns.append(_run(with_env, *args)["ns_per_launch"])
        metered = cb.snapshot().launches
    finally:
        cb.close()
        cb.unlink()
        timeline.unlink_gpu(gpu)
    # the least of each side: noise from other work on the host only ever adds time
    w, wo = min(with_ns), min(without_ns)
    return {"fast_path_overhead_ns": round(w - wo, 1), "overhead_ratio": round(w / wo, 3),
            "fast_path_overhead_ns_median": round(statistics.median(with_ns)
                                                  - statistics.median(without_ns), 1),
            "launch_ns_with": with_ns, "launch_ns_without": without_ns,
            "launches_metered": metered, "launches_per_run": launches}


def share_cell(quota: float, kernel_us: float, seconds: float) -> dict:
    """One process (width 1) at ``quota`` launching ``kernel_us`` kernels back to back."""
    gpu = _gpu("share")
    cb = _block(quota)
    # start-up transient: launches charged the default cost until the kernel's first timing
    # arrives, then repaid; skip 0.4 s plus 10 kernel periods (kernel / quota) of it
    skip_ns = 2 * SEC // 5 + int(10 * kernel_us * 1000 / quota)
    try:
        env = native.instance_env(cb.path, gpu_name=gpu, width=1.0, request_quota=quota)
        out = _run(env, "-k", f"k_{kernel_us:g}", "-t", f"{seconds + skip_ns / SEC:.3f}")
        recs = timeline.read_array(gpu)
        t0, t1 = timeline.span(recs, out["pid"])
        t0 += skip_ns
        achieved = timeline.sm_time_share(recs, out["pid"], t0, t1)
    finally:
        cb.close()
        cb.unlink()
        timeline.unlink_gpu(gpu)
    return {"quota": quota, "kernel_us": kernel_us, "achieved": round(achieved, 4),
            "error_pp": round(abs(achieved - quota) * 100, 2)}


def resize(changes: int = 40, gap_s: float = 0.03) -> dict:
    """Alternates the grant 0.2 <-> 0.8 under a throttled process; latency to applied."""
    gpu = _gpu("resize")
    cb = _block(0.2)
    lat_ms: list[float] = []
    proc = None
    try:
        env = native.instance_env(cb.path, gpu_name=gpu, width=1.0, request_quota=0.2)
        proc = _spawn(env, "-k", "k_500", "-t", str(changes * gap_s + 1.0))
        deadline = time.monotonic() + 10
        while cb.snapshot().launches == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        for i in range(changes):
            cb.heartbeat()
            t_write = time.monotonic_ns()
            epoch = cb.write_grant(0.8 if i % 2 == 0 else 0.2)
            if cb.wait_applied(epoch, timeout_ms=200):
                lat_ms.append((cb.snapshot().applied_ns - t_write) / 1e6)
            time.sleep(gap_s)
        _finish(proc)
    finally:
        if proc is not None:
            _reap(proc)  # a failure or a signal before _finish
        cb.close()
        cb.unlink()
        timeline.unlink_gpu(gpu)
    arr = np.array(lat_ms) if lat_ms else np.array([float("nan")])
    return {"resize_latency_ms_p50": round(float(np.percentile(arr, 50)), 3),
            "resize_latency_ms_p99": round(float(np.percentile(arr, 99)), 3),
            "resize_changes": changes, "resize_applied": len(lat_ms)}


def fairness(quotas: tuple[float, ...], seconds: float, kernel: str = "k_200") -> dict:
    """len(quotas) width-1 processes on one emulated GPU at once."""
    gpu = _gpu("fair")
    blocks = [_block(q) for q in quotas]
    procs: list[subprocess.Popen] = []
    try:
        for cb, q in zip(blocks, quotas):
            procs.append(_spawn(native.instance_env(cb.path, gpu_name=gpu, width=1.0, request_quota=q),
                                "-k", kernel, "-t", str(seconds)))
        outs = [_finish(p) for p in procs]
        recs = timeline.read_array(gpu)
        t0 = max(timeline.span(recs, o["pid"])[0] for o in outs) + SEC // 5
        t1 = min(timeline.span(recs, o["pid"])[1] for o in outs)
        got = timeline.sm_time_shares(recs, t0, t1)
    finally:
        for p in procs:  # those not finished yet when one failed or a signal came
            _reap(p)
        for cb in blocks:
            cb.close()
            cb.unlink()
        timeline.unlink_gpu(gpu)
    achieved = [got.get(o["pid"], 0.0) for o in outs]
    x = np.array(achieved) / np.array(quotas)
    return {"quotas": list(quotas), "achieved": [round(a, 4) for a in achieved],
            "max_error_pp": round(max(abs(a - q) for a, q in zip(achieved, quotas)) * 100, 2),
            "jain_index": round(float(x.sum() ** 2 / (len(x) * (x ** 2).sum())), 4)}


@click.command("interceptor")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              required=True, callback=writable_output, help="Where to write the figures (JSON).")
@click.option("--seconds", type=click.FloatRange(0.2, 60), default=1.2, show_default=True,
              help="Run length of each share cell and fairness run, in s.")
def bench_interceptor(json_path: Path, seconds: float) -> None:
    """Interceptor figures on the emulated GPU: fast-path overhead, share error over quotas x
    kernel durations, grant-to-enforcement latency and fairness across 4 processes. Ctrl-C or
    SIGTERM stops it (and the test processes it runs) with exit status 130 (143)."""
    with SignalExit():
        _bench_interceptor(json_path, seconds)


def _bench_interceptor(json_path: Path, seconds: float) -> None:
    """The body of :func:`bench_interceptor`."""
    native.build()
    started = time.monotonic()
    report: dict = {"emulated": True}
    click.echo("fast path ...")
    report.update(fast_path())
    click.echo("shares ...")
    cells = [share_cell(q, k, seconds) for q in QUOTAS for k in KERNELS_US]
    report["shares"] = cells
    report["share_error_pct_max"] = max(c["error_pp"] for c in cells)
    click.echo("resize ...")
    report.update(resize())
    click.echo("fairness ...")
    report["fairness"] = {"equal": fairness((0.25, 0.25, 0.25, 0.25), seconds * 1.5),
                          "unequal": fairness((0.1, 0.2, 0.3, 0.4), seconds * 1.5)}
    report["goals"] = {"fast_path_overhead_ns": 100, "share_error_pct_max": 5.0,
                       "resize_latency_ms_p99": 5.0}
    report["meets_goals"] = (report["fast_path_overhead_ns"] <= 100
                             and report["share_error_pct_max"] <= 5.0
                             and report["resize_latency_ms_p99"] <= 5.0)
    report["seconds"] = round(time.monotonic() - started, 1)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"fast path +{report['fast_path_overhead_ns']} ns/launch, share error max "
               f"{report['share_error_pct_max']} pp, resize p50/p99 "
               f"{report['resize_latency_ms_p50']}/{report['resize_latency_ms_p99']} ms, "
               f"fairness Jain {report['fairness']['equal']['jain_index']} / "
               f"{report['fairness']['unequal']['jain_index']} -> {json_path}")
