"""The horizontal scaler's view of its functions' vertical room, from GPU telemetry as the node
agents publish it: headroom and burst reach per function, stale GPUs left out."""
from __future__ import annotations

import pytest

from dilu.contracts.events import GpuTelemetry, InstanceTelemetry
from dilu.services.horizontal_scaler.service import HorizontalScaler


def gpu(index: int, *insts: tuple[str, str, float, float, float]) -> GpuTelemetry:
    return GpuTelemetry(node="n0", gpu=index, window_ms=100.0, instances=[
        InstanceTelemetry(instance_id=i, function=f, quota=q, request_quota=r, limit_quota=lim)
        for i, f, q, r, lim in insts])


async def test_room_is_headroom_and_reach_from_fresh_telemetry(monkeypatch):
    svc = HorizontalScaler()
    now = [100.0]
    monkeypatch.setattr(svc, "_now", lambda: now[0])
    await svc._on_telemetry(gpu(0, ("a", "f", 0.5, 0.5, 0.9), ("b", "g", 0.5, 0.5, 0.5)), None)
    await svc._on_telemetry(gpu(1, ("c", "h", 0.3, 0.3, 0.7)), None)
    headroom, reach = svc._room(now[0])
    assert headroom["f"] == 0.0 and reach["a"] == 0.0  # its GPU's requests sum to 1: sized at the request
    assert headroom["h"] == pytest.approx(0.4) and reach["c"] == 1.0
    now[0] += svc.telemetry_stale_s + 1
    await svc._on_telemetry(gpu(1, ("c", "h", 0.3, 0.3, 0.7)), None)
    headroom, reach = svc._room(now[0])
    assert set(headroom) == {"h"} and set(reach) == {"c"}  # GPU 0 went silent: no room claimed for f
