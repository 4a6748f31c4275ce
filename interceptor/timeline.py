"""Reads an emulated GPU's virtual device timeline (written by the fake driver, fake_driver.c).

Every process that runs on the emulated GPU ``name`` shares ``/dev/shm/dilu-gpu-<name>``: a
header and a ring of completed kernels, each with the process id, width and its start and end on
the virtual device clock (CLOCK_MONOTONIC ns, the same clock as ``time.monotonic_ns()``). Shares
computed here are therefore the device's own, independent of how the CPU scheduled the callers.

Definitions (DESIGN.md section 2): busy share = fraction of a window during which at least one of
a process's kernels is on the device; SM-time share = busy share x width.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
GPU_MAGIC = 0x3155504745464C44
GPU_VERSION = 4
_HEADER = struct.Struct("<QIIQQQQQ")  # magic, version, sms, ring_offset, ring_cap, rec_size, head, sim_now
RECORD = np.dtype([("seq", "<u8"), ("pid", "<u4"), ("width_ppm", "<u4"), ("ctx", "<u8"),
                   ("stream", "<u8"), ("start_ns", "<u8"), ("end_ns", "<u8"), ("func", "<u8")])


class TimelineError(RuntimeError):
    """The emulated GPU segment is missing or not of the expected layout."""


@dataclass(frozen=True, slots=True)
class KernelRecord:
    """One completed kernel: pid, context and stream handles (process-local), start/end in ns on
    the virtual device clock, width as a fraction 0..1 of the SMs."""

    pid: int
    ctx: int
    stream: int
    start_ns: int
    end_ns: int
    width: float


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """sms: SM count reported; kernels: kernels recorded so far; now_ns: the virtual clock."""

    sms: int
    kernels: int
    now_ns: int


def gpu_path(gpu_name: str) -> Path:
    """Path of the shared segment of the emulated GPU ``gpu_name``."""
    return SHM_DIR / f"dilu-gpu-{gpu_name}"


def _map(gpu_name: str) -> tuple[mmap.mmap, tuple]:
    path = gpu_path(gpu_name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise TimelineError(f"emulated GPU {gpu_name!r} has no segment at {path}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise TimelineError(f"{path}: too small ({size} bytes)")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    hdr = _HEADER.unpack_from(mm, 0)
    if hdr[0] != GPU_MAGIC or hdr[1] != GPU_VERSION or hdr[5] != RECORD.itemsize:
        mm.close()
        raise TimelineError(f"{path}: not an emulated GPU of layout {GPU_VERSION}")
    return mm, hdr


def info(gpu_name: str) -> GpuInfo:
    """SM count, kernels recorded and virtual clock of an emulated GPU. Raises TimelineError."""
    mm, hdr = _map(gpu_name)
    mm.close()
    return GpuInfo(sms=hdr[2], kernels=hdr[6], now_ns=hdr[7])


def read_array(gpu_name: str) -> np.ndarray:
    """The completed kernels still in the ring, oldest first, as a structured array (RECORD).

    The ring keeps the last 2**19 kernels; records being overwritten are left out.
    Raises TimelineError when the GPU segment is missing or foreign.
    """
    mm, hdr = _map(gpu_name)
    try:
        ring_offset, cap, head = hdr[3], hdr[4], hdr[6]
        n = min(head, cap)
        ring = np.frombuffer(mm, dtype=RECORD, count=cap, offset=ring_offset)
        index = np.arange(head - n, head, dtype=np.uint64)
        recs = ring[(index % np.uint64(cap)).astype(np.int64)].copy()
        del ring
    finally:
        mm.close()
    return recs[recs["seq"] == index + np.uint64(1)]


def read(gpu_name: str) -> list[KernelRecord]:
    """The completed kernels still in the ring, oldest first (see read_array)."""
    return [KernelRecord(int(r["pid"]), int(r["ctx"]), int(r["stream"]), int(r["start_ns"]),
                         int(r["end_ns"]), r["width_ppm"] / 1e6) for r in read_array(gpu_name)]


def _as_array(records) -> np.ndarray:
    if isinstance(records, np.ndarray):
        return records
    out = np.zeros(len(records), dtype=RECORD)
    for i, r in enumerate(records):
        out[i] = (i + 1, r.pid, round(r.width * 1e6), r.ctx, r.stream, r.start_ns, r.end_ns, 0)
    return out


def busy_ns(records, pid: int | None, t0: int, t1: int) -> int:
    """ns of [t0, t1) during which at least one kernel of ``pid`` (None: any process) was on
    the device (the union of its kernels' intervals, clipped to the window)."""
    a = _as_array(records)
    if pid is not None:
        a = a[a["pid"] == pid]
    if len(a) == 0 or t1 <= t0:
        return 0
    s = np.clip(a["start_ns"].astype(np.int64), t0, t1)
    e = np.clip(a["end_ns"].astype(np.int64), t0, t1)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    cum = np.maximum.accumulate(e)
    prev = np.concatenate(([np.int64(t0)], cum[:-1]))
    return int(np.maximum(0, cum - np.maximum(s, prev)).sum())


def busy_share(records, pid: int | None, t0: int, t1: int) -> float:
    """Busy share 0..1 of ``pid`` over [t0, t1) (ns on the device clock)."""
    return busy_ns(records, pid, t0, t1) / (t1 - t0) if t1 > t0 else 0.0


def _union(a: np.ndarray, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
    """Merged busy intervals (starts, ends) of the kernels in ``a``, clipped to [t0, t1)."""
    s = np.clip(a["start_ns"].astype(np.int64), t0, t1)
    e = np.clip(a["end_ns"].astype(np.int64), t0, t1)
    keep = e > s
    s, e = s[keep], e[keep]
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], np.maximum.accumulate(e[order])
    new = np.concatenate(([True], s[1:] > e[:-1]))
    starts = s[new]
    ends = np.maximum.reduceat(e, np.flatnonzero(new))
    return starts, ends


def sm_time_shares(records, t0: int, t1: int) -> dict[int, float]:
    """SM-time share 0..1 of every process over [t0, t1): the fraction of all SMs x time it got.

    While a process is busy alone (or the widths busy at once sum to W <= 1) it holds its width w,
    so this is busy share x width (DESIGN.md section 2). While the widths busy at once sum to
    W > 1 the SMs are shared and each gets w / W (the fake driver's contention model, DESIGN.md
    section 7), so the shares of all processes never sum above 1.
    """
    a = _as_array(records)
    if t1 <= t0 or len(a) == 0:
        return {}
    unions: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
    for pid in np.unique(a["pid"]):
        mine = a[a["pid"] == pid]
        starts, ends = _union(mine, t0, t1)
        unions[int(pid)] = (starts, ends, float(mine["width_ppm"][-1]) / 1e6)
    points = np.unique(np.concatenate([np.concatenate((u[0], u[1])) for u in unions.values()]
                                      + [np.array([t0, t1], dtype=np.int64)]))
    seg = np.diff(points).astype(np.float64)
    busy_of: dict[int, np.ndarray] = {}
    total_w = np.zeros(len(seg))
    for pid, (starts, ends, w) in unions.items():
        delta = np.zeros(len(points), dtype=np.int64)
        np.add.at(delta, np.searchsorted(points, starts), 1)
        np.add.at(delta, np.searchsorted(points, ends), -1)
        on = np.cumsum(delta)[:-1] > 0
        busy_of[pid] = on
        total_w += on * w
    scale = 1.0 / np.maximum(1.0, total_w)
    return {pid: float((seg * on * unions[pid][2] * scale).sum()) / (t1 - t0)
            for pid, on in busy_of.items()}


def sm_time_share(records, pid: int, t0: int, t1: int) -> float:
    """SM-time share of ``pid`` over [t0, t1) (see sm_time_shares); 0.0 if it ran nothing."""
    return sm_time_shares(records, t0, t1).get(pid, 0.0)


def window_shares(records, pid: int, t0: int, t1: int, window_ns: int) -> list[float]:
    """Busy shares of ``pid`` in consecutive windows of window_ns from t0 up to t1."""
    a = _as_array(records)
    a = a[a["pid"] == pid]
    return [busy_share(a, pid, w, w + window_ns) for w in range(t0, t1 - window_ns + 1, window_ns)]


def kernels_completed(records, pid: int, t0: int, t1: int) -> int:
    """Kernels of ``pid`` that ended within [t0, t1)."""
    a = _as_array(records)
    e = a["end_ns"][a["pid"] == pid].astype(np.int64)
    return int(((e >= t0) & (e < t1)).sum())


def pids(records) -> list[int]:
    """Process ids present, in order of first kernel."""
    a = _as_array(records)
    _, first = np.unique(a["pid"], return_index=True)
    return [int(a["pid"][i]) for i in sorted(first)]


def span(records, pid: int | None = None) -> tuple[int, int]:
    """(first start, last end) in ns of ``pid``'s kernels (None: all). Raises ValueError if none."""
    a = _as_array(records)
    if pid is not None:
        a = a[a["pid"] == pid]
    if len(a) == 0:
        raise ValueError(f"no kernels for pid {pid}")
    return int(a["start_ns"].min()), int(a["end_ns"].max())


def unlink_gpu(gpu_name: str) -> bool:
    """Removes the emulated GPU's segment (processes still mapped keep it); True if it existed."""
    try:
        os.unlink(gpu_path(gpu_name))
        return True
    except FileNotFoundError:
        return False
