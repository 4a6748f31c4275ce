"""Helpers and fixtures of the native tests: the interceptor and fake driver built from source, a fresh
emulated GPU per test, control blocks with a heartbeating stand-in for the node agent, and a
launcher for the C driver-API program under the interceptor.

Shares are always read from the emulated GPU's virtual timeline (dilu.interceptor.timeline).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field

import pytest

from dilu.interceptor import native, timeline
from dilu.interceptor.control_block import ControlBlock


@pytest.fixture(scope="session", autouse=True)
def built():
    native.build()


@pytest.fixture
def gpu():
    """A fresh emulated GPU name; its shared segment is removed afterwards."""
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    timeline.unlink_gpu(name)


@dataclass
class Agent:
    """Creates blocks and heartbeats them every 20 ms, like the node agent would."""

    blocks: list[ControlBlock] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def block(self, request_quota: float, width: float = 1.0, stale_after_ms: float = 500,
              heartbeat: bool = True) -> ControlBlock:
        path = f"/dev/shm/dilu-cb-test-{uuid.uuid4().hex[:12]}"
        cb = ControlBlock.create(path, os.path.basename(path), request_quota, width, stale_after_ms)
        cb.heartbeating = heartbeat
        self.blocks.append(cb)
        return cb

    def run(self) -> None:
        while not self.stop.wait(0.02):
            for cb in list(self.blocks):
                if cb.heartbeating and cb._mm is not None:
                    cb.heartbeat()


@pytest.fixture
def agent():
    a = Agent()
    t = threading.Thread(target=a.run, daemon=True)
    t.start()
    yield a
    a.stop.set()
    t.join()
    for cb in a.blocks:
        cb.close()
        cb.unlink()


def launch_env(cb_path: str, gpu: str, *, width: float = 1.0, request_quota: float = 1.0,
               sms: int = 108, **extra: str) -> dict[str, str]:
    env = native.instance_env(cb_path, gpu_name=gpu, width=width, request_quota=request_quota, sms=sms)
    env.update({k: str(v) for k, v in extra.items()})
    return env


spawn = native.spawn_launch


def finish(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """Waits for dilu_launch and returns its JSON summary (fails the test on a non-zero exit)."""
    return native.finish_launch(proc, timeout)


PYTHON = sys.executable
