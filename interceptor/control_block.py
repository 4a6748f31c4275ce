"""The Python side of an instance's control block (DESIGN.md section 6).

The node agent creates one block per instance (``ControlBlock.create``), writes grants
(``write_grant``) and heartbeats, and samples the interceptor's telemetry (``snapshot``). The
instance's runtime reports request-level counters (``set_runtime``). The layout is
interceptor/dilu_cb_layout.h, read verbatim by the cffi cdef; atomics, seqlocks and futex
wake-ups go through the C helpers of dilu_cb.h compiled in cffi API mode.

Quotas and widths are fractions 0..1 here and parts per million in the block. Memory is in bytes
everywhere: the instance's reservation (``memory_limit_bytes``, written at creation) and what the
interceptor counts against it.

A writer killed mid-write (its seqlock left odd) never hangs a reader: ``snapshot`` waits it out for
a bounded time (``DILU_SEQ_GIVE_UP_NS``, dilu_cb.h), then returns the last consistent snapshot
marked ``torn`` (to be treated as stale) and counts it (``ControlBlock.torn_reads``, Prometheus
``dilu_cb_torn_reads_total``); the next write repairs the sequence.
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass, replace

from prometheus_client import Counter

from dilu.interceptor.native import cffi_module

PPM = 1_000_000

TORN_READS = Counter("dilu_cb_torn_reads", "Control block snapshots that gave up on a writer killed "
                     "mid-write (sequence held odd) and answered the last consistent values", ["group"])


class ControlBlockError(RuntimeError):
    """The file is not a usable control block (missing, too small, wrong magic/version/size)."""


@dataclass(frozen=True, slots=True)
class CbSnapshot:
    """One consistent reading of a block (grant group and telemetry group each seqlock-consistent).

    Counters are cumulative since the interceptor started: launches, throttled (launches that
    waited), busy_us (GPU-busy µs charged), wait_us (µs spent waiting for tokens), cycles.
    last_cycle_us / baseline_cycle_us: kernel-launch cycle spans (µs). tokens_us: token balance.
    quota, request_quota, width: fractions 0..1 (quota = the grant in the block; applied_quota =
    the rate the interceptor enforces). applied_epoch / grant_epoch: the interceptor has applied
    the latest grant when equal. applied_ns / last_launch_ns / heartbeat_ns: CLOCK_MONOTONIC ns.
    pid: the metered process (0 before its first launch). stale: the interceptor sees the agent's
    heartbeat as stale. ready, requests, latency_us_ewma, queue_depth: the instance runtime's fields.
    memory_limit_bytes: the reservation the agent wrote (0: none; the interceptor then applies
    DILU_MEMORY_LIMIT_BYTES, if set). memory_used_bytes: device memory the instance's processes hold
    through the allocations the interceptor counted; memory_peak_bytes: the most it has held;
    oom_refusals: allocations refused with CUDA_ERROR_OUT_OF_MEMORY because they would have gone
    past the reservation (the driver's own refusals are not counted). All in bytes but the last.
    torn: the block held a group's sequence odd past the bound (its writer killed mid-write), so
    this is the last consistent reading (the torn one's own values when there was none before):
    treat it as stale. torn_grant_reads: the interceptor's grant reads that gave up the same way
    (it then runs at the request quota). grant_torn: the interceptor is running at the request
    quota for that reason now.
    """

    instance_id: str
    launches: int
    throttled: int
    busy_us: int
    wait_us: int
    cycles: int
    last_cycle_us: int
    baseline_cycle_us: int
    tokens_us: int
    quota: float
    request_quota: float
    width: float
    applied_quota: float
    applied_epoch: int
    applied_ns: int
    grant_epoch: int
    pid: int
    samples: int
    stale: bool
    last_launch_ns: int
    heartbeat_ns: int
    ready: bool
    requests: int
    latency_us_ewma: int
    queue_depth: int
    memory_limit_bytes: int = 0
    memory_used_bytes: int = 0
    memory_peak_bytes: int = 0
    oom_refusals: int = 0
    torn: bool = False
    torn_grant_reads: int = 0
    grant_torn: bool = False


def _ppm(fraction: float, name: str) -> int:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{name} must be a fraction in [0, 1], got {fraction!r}")
    return round(fraction * PPM)


class ControlBlock:
    """A mapped control block. Use ``create`` (agent) or ``open`` (readers); ``close`` unmaps."""

    def __init__(self, path: str, mm: mmap.mmap):
        mod = cffi_module()
        self._ffi, self._lib = mod.ffi, mod.lib
        self.path = path
        self._mm = mm
        self._cb = self._ffi.from_buffer("struct dilu_cb *", mm)
        self._out = self._ffi.new("struct dilu_cb *")  # kept: it remembers a dead writer's sequence
        self._last_good: CbSnapshot | None = None
        self.torn_reads = 0  # snapshots that gave up on a writer killed mid-write

    @staticmethod
    def size() -> int:
        """sizeof(struct dilu_cb) in bytes."""
        return cffi_module().ffi.sizeof("struct dilu_cb")

    @classmethod
    def create(cls, path: str, instance_id: str, request_quota: float, width: float,
               stale_after_ms: float = 500, memory_limit_bytes: int = 0) -> "ControlBlock":
        """Creates (or recreates) the block at ``path`` (e.g. /dev/shm/dilu-cb-<id>), mode 0600.

        request_quota, width: fractions 0..1 (the initial grant is the request quota).
        stale_after_ms: heartbeat age after which the interceptor marks the agent stale.
        memory_limit_bytes: the instance's device-memory reservation in bytes; past it the
        interceptor refuses allocations with CUDA_ERROR_OUT_OF_MEMORY (0: no limit).
        Raises ValueError for out-of-range fractions or memory limit, OSError when the file cannot
        be made.
        """
        req, wid = _ppm(request_quota, "request_quota"), _ppm(width, "width")
        if wid == 0:
            raise ValueError("width must be > 0")
        if isinstance(memory_limit_bytes, bool) or not isinstance(memory_limit_bytes, int) \
                or not 0 <= memory_limit_bytes < 2**64:
            raise ValueError(f"memory_limit_bytes must be an integer number of bytes >= 0, "
                             f"got {memory_limit_bytes!r}")
        if len(instance_id.encode()) >= 64:
            raise ValueError("instance_id must be shorter than 64 bytes")
        size = cls.size()
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        block = cls(path, mm)
        block._lib.dilu_cb_init(block._cb, instance_id.encode(), req, wid,
                                int(stale_after_ms * 1e6), memory_limit_bytes)
        os.replace(tmp, path)  # an opener sees either no file or a complete block
        return block

    @classmethod
    def open(cls, path: str) -> "ControlBlock":
        """Maps an existing block read-write. Raises ControlBlockError when it is not valid."""
        mod = cffi_module()
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise ControlBlockError(f"{path}: no such control block") from exc
        try:
            size = os.fstat(fd).st_size
            need = mod.ffi.sizeof("struct dilu_cb")
            if size < need:
                raise ControlBlockError(f"{path}: {size} bytes, a control block has {need}")
            mm = mmap.mmap(fd, need, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        block = cls(path, mm)
        cb = block._cb
        magic, version, got = int(cb.magic), int(cb.layout_version), int(cb.size)
        if magic != mod.lib.DILU_CB_MAGIC:
            block.close()
            raise ControlBlockError(f"{path}: bad magic {magic:#x}")
        if version != mod.lib.DILU_CB_LAYOUT_VERSION or got != need:
            block.close()
            raise ControlBlockError(
                f"{path}: layout version {version} size {got}, expected "
                f"{mod.lib.DILU_CB_LAYOUT_VERSION} size {need}")
        return block

    def _live(self):
        if self._cb is None:  # a NULL block would crash the C helpers
            raise ControlBlockError(f"{self.path}: control block is closed")
        return self._cb

    def write_grant(self, quota: float) -> int:
        """Publishes a new quota (fraction 0..1) and wakes throttled launches; returns the epoch.
        Raises ValueError for a quota outside [0, 1], ControlBlockError once closed."""
        q = _ppm(quota, "quota")
        return int(self._lib.dilu_cb_write_grant(self._live(), q))

    def heartbeat(self) -> None:
        """Marks the agent alive (the interceptor treats an old heartbeat as stale)."""
        self._lib.dilu_cb_heartbeat(self._live())

    def set_runtime(self, ready: bool, requests: int, latency_us_ewma: int, queue_depth: int) -> None:
        """Writes the instance runtime's fields (one writer: the instance process)."""
        self._lib.dilu_cb_set_runtime(self._live(), int(bool(ready)), int(requests),
                                      int(latency_us_ewma), int(queue_depth))

    def snapshot(self) -> CbSnapshot:
        """A consistent copy of the block's grant, telemetry and runtime fields.

        Never blocks longer than the seqlock bound (``DILU_SEQ_GIVE_UP_NS``, 5 ms; at once while
        the same dead writer's sequence stays odd). When a group's writer held its sequence odd
        that long (killed mid-write), returns the last consistent snapshot with ``torn=True`` and
        counts it in ``torn_reads``. Raises ControlBlockError once closed."""
        o = self._out
        self._lib.dilu_cb_snapshot(self._live(), o)
        torn = [g for g, seq in (("grant", o.grant_seq), ("telemetry", o.t_seq)) if seq & 1]
        snap = self._decode(o)
        if not torn:
            self._last_good = snap
            return snap
        self.torn_reads += 1
        for group in torn:
            TORN_READS.labels(group).inc()
        return replace(self._last_good or snap, torn=True)

    def _decode(self, o) -> CbSnapshot:
        return CbSnapshot(
            instance_id=self._ffi.string(o.instance_id).decode(errors="replace"),
            launches=o.t_launches, throttled=o.t_throttled, busy_us=o.t_busy_us,
            wait_us=o.t_wait_us, cycles=o.t_cycles, last_cycle_us=o.t_last_cycle_us,
            baseline_cycle_us=o.t_baseline_cycle_us, tokens_us=o.t_tokens_us,
            quota=o.quota_ppm / PPM, request_quota=o.request_ppm / PPM, width=o.width_ppm / PPM,
            applied_quota=o.t_quota_ppm / PPM, applied_epoch=o.t_applied_epoch,
            applied_ns=o.t_applied_ns, grant_epoch=o.grant_epoch, pid=o.t_pid,
            samples=o.t_samples, stale=bool(o.t_flags & self._lib.DILU_CB_FLAG_STALE), last_launch_ns=o.t_last_launch_ns,
            heartbeat_ns=o.agent_heartbeat_ns, ready=bool(o.r_ready), requests=o.r_requests,
            latency_us_ewma=o.r_latency_us_ewma, queue_depth=o.r_queue_depth,
            memory_limit_bytes=o.mem_limit_bytes, memory_used_bytes=o.t_mem_used_bytes,
            memory_peak_bytes=o.t_mem_peak_bytes, oom_refusals=o.t_oom_refusals,
            torn_grant_reads=o.t_torn_grant_reads, grant_torn=bool(o.t_flags & self._lib.DILU_CB_FLAG_TORN_GRANT))

    def wait_applied(self, epoch: int, timeout_ms: float) -> bool:
        """Polls (1 ms steps) until the interceptor applied ``epoch``; True if it did in time."""
        deadline = self._lib.dilu_now_ns() + int(timeout_ms * 1e6)
        while self._lib.dilu_now_ns() < deadline:
            if self.snapshot().applied_epoch >= epoch:
                return True
            time.sleep(0.001)
        return self.snapshot().applied_epoch >= epoch

    def close(self) -> None:
        """Unmaps the block (the file stays; see unlink)."""
        if self._mm is None:
            return
        self._ffi.release(self._cb)
        self._cb = None
        self._mm.close()
        self._mm = None

    def unlink(self) -> None:
        """Removes the block's file (mapped processes keep their mapping)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "ControlBlock":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
