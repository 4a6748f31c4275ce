"""The Python side of the control block (cffi over dilu_cb.h) and the timeline helpers."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dilu.interceptor import native, timeline
from dilu.interceptor.control_block import ControlBlock, ControlBlockError

pytestmark = pytest.mark.native


@pytest.fixture
def cb_path(tmp_path):
    return str(tmp_path / "cb")


def test_create_open_grant_runtime_round_trip(cb_path):
    cb = ControlBlock.create(cb_path, "fn-a-1", request_quota=0.25, width=0.5, stale_after_ms=200)
    other = ControlBlock.open(cb_path)
    snap = other.snapshot()
    assert (snap.instance_id, snap.quota, snap.request_quota, snap.width) == ("fn-a-1", 0.25, 0.25, 0.5)
    assert snap.grant_epoch == 0 and snap.launches == 0 and not snap.ready
    assert cb.write_grant(0.4) == 1
    assert cb.write_grant(0.1) == 2
    other.set_runtime(ready=True, requests=7, latency_us_ewma=1500, queue_depth=3)
    snap = cb.snapshot()
    assert (snap.quota, snap.grant_epoch) == (0.1, 2)
    assert (snap.ready, snap.requests, snap.latency_us_ewma, snap.queue_depth) == (True, 7, 1500, 3)
    other.close()
    cb.close()
    cb.unlink()


def test_write_grant_wakes_a_futex_waiter(cb_path):
    cb = ControlBlock.create(cb_path, "w", request_quota=0.5, width=1.0)
    mod = native.cffi_module()
    woke = {}

    def waiter():
        t0 = time.monotonic()
        woke["rc"] = mod.lib.dilu_futex_wait(mod.ffi.addressof(cb._cb, "grant_epoch"), 0, 5_000_000_000)
        woke["s"] = time.monotonic() - t0

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    cb.write_grant(0.7)
    t.join(timeout=5)
    assert woke["rc"] == 0 and woke["s"] < 4.0  # woken by the grant, not by the 5 s timeout
    cb.close()


@pytest.mark.parametrize("content,message", [
    (b"", "bytes, a control block has"),
    (b"x" * 4096, "bad magic"),
])
def test_open_rejects_what_is_not_a_block(cb_path, content, message):
    with open(cb_path, "wb") as f:
        f.write(content)
    with pytest.raises(ControlBlockError, match=message):
        ControlBlock.open(cb_path)


def test_open_rejects_a_missing_block(tmp_path):
    with pytest.raises(ControlBlockError, match="no such control block"):
        ControlBlock.open(str(tmp_path / "missing"))


def test_open_rejects_another_layout_version(cb_path):
    ControlBlock.create(cb_path, "v", 0.5, 1.0).close()
    with open(cb_path, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(ControlBlockError, match="layout version 99"):
        ControlBlock.open(cb_path)


@pytest.mark.parametrize("kwargs", [
    {"request_quota": 1.5, "width": 1.0}, {"request_quota": 0.5, "width": 0.0},
    {"request_quota": -0.1, "width": 1.0},
])
def test_create_rejects_bad_fractions(cb_path, kwargs):
    with pytest.raises(ValueError):
        ControlBlock.create(cb_path, "bad", **kwargs)


def test_grant_out_of_range_is_rejected(cb_path):
    cb = ControlBlock.create(cb_path, "g", 0.5, 1.0)
    with pytest.raises(ValueError):
        cb.write_grant(1.2)
    assert cb.snapshot().grant_epoch == 0
    cb.close()


def test_instance_env_points_at_the_built_pieces():
    env = native.instance_env("/dev/shm/dilu-cb-x", gpu_name="g0", width=0.5, request_quota=0.3,
                              sms=80, base={})
    assert env["LD_PRELOAD"].endswith("libdilu_intercept.so")
    assert env["LD_LIBRARY_PATH"] == str(native.fake_driver_dir())
    assert (native.fake_driver_dir() / "libcuda.so.1").exists()
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50.0000"
    assert (env["DILU_CB"], env["DILU_FAKE_GPU"], env["DILU_FAKE_GPU_SMS"]) == ("/dev/shm/dilu-cb-x", "g0", "80")
    with pytest.raises(ValueError):
        native.instance_env("/x", gpu_name="g", width=0.0, request_quota=0.3)


def _records(rows):
    a = np.zeros(len(rows), dtype=timeline.RECORD)
    for i, (pid, width, start, end) in enumerate(rows):
        a[i] = (i + 1, pid, int(width * 1e6), 0, 0, start, end, 0)
    return a


def test_busy_share_is_the_union_of_a_process_kernels():
    recs = _records([(1, 1.0, 0, 100), (1, 1.0, 50, 150), (1, 1.0, 300, 400), (2, 1.0, 0, 400)])
    assert timeline.busy_ns(recs, 1, 0, 400) == 250
    assert timeline.busy_share(recs, 1, 100, 350) == pytest.approx(100 / 250)
    assert timeline.kernels_completed(recs, 1, 0, 200) == 2


def test_sm_time_share_splits_oversubscribed_time():
    # two width-1 processes overlapping for 50 ns share the SMs then: 25 ns each
    recs = _records([(1, 1.0, 0, 100), (2, 1.0, 50, 150), (3, 0.5, 200, 300)])
    got = timeline.sm_time_shares(recs, 0, 400)
    assert got[1] == pytest.approx(75 / 400)
    assert got[2] == pytest.approx(75 / 400)
    assert got[3] == pytest.approx(50 / 400)  # alone at width 0.5: busy x width
    assert sum(got.values()) <= 1.0


def test_timeline_of_a_missing_gpu_is_a_clear_error():
    with pytest.raises(timeline.TimelineError, match="has no segment"):
        timeline.read("no-such-gpu-anywhere")


def test_a_closed_block_raises_instead_of_crashing(cb_path):
    cb = ControlBlock.create(cb_path, "c", 0.5, 1.0)
    cb.close()
    with pytest.raises(ControlBlockError, match="closed"):
        cb.snapshot()
    with pytest.raises(ControlBlockError, match="closed"):
        cb.write_grant(0.5)
