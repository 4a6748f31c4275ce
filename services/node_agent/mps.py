"""The MPS control daemon of a real GPU node: start it (or attach to one), make instances its
clients, and notice when an MPS server fails.

MPS (NVIDIA Multi-Process Service) lets the instances on one GPU run kernels side by side; each
client's SM ceiling (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = its width) and device-memory limit
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` = its reservation) are fixed when its context is created
(NVIDIA MPS documentation, sections 2.3 and 5.2); the interceptor's tokens resize its share within
that ceiling. The agent runs the daemon with its own pipe and log directories, so it never
disturbs another MPS user of the host.

Where MPS cannot start (no ``nvidia-cuda-mps-control``, a container without the IPC it needs, a
GPU in a compute mode that refuses it) the state is ``unavailable``: said once in the log and in
the node's inventory, and instances run time-sliced with tokens alone.

When an MPS server dies, every client of it fails at once. :func:`server_failed` is the rule that
tells that apart from one instance crashing; the agent then relaunches the clients without
counting it against their restart budget.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from pathlib import Path

from dilu.services.common import logging as dlog
from dilu.services.common.digits import as_count

CONTROL = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 10.0
# Crashes of instances on one GPU this close together, with the MPS server gone, are one failure.
FAILURE_WINDOW_S = 2.0


def server_failed(crash_times_s: list[float], now_s: float, servers_before: set[int], servers_now: set[int],
                  window_s: float = FAILURE_WINDOW_S) -> bool:
    """Whether the crashes of a GPU's instances (monotonic seconds) are an MPS server failure: a
    server process the daemon listed is gone and an instance of the GPU crashed within
    ``window_s`` of now. Pure."""
    lost = bool(servers_before - servers_now)
    return lost and any(now_s - t <= window_s for t in crash_times_s)


def pinned_mem_limit(memory_bytes: int) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for a client that sees one GPU (device 0), in MiB
    rounded up (the variable takes ``<ordinal>=<size>M``)."""
    return f"0={max(1, math.ceil(memory_bytes / 2**20))}M"


class Mps:
    """One node's MPS control daemon (module docstring). ``state``: on, unavailable, or off
    before :meth:`start`; ``reason``: why it is unavailable."""

    def __init__(self, root: Path, control: str = CONTROL) -> None:
        self.pipe_dir = root / "pipe"
        self.log_dir = root / "log"
        self.control = control
        self.state = "off"
        self.reason = ""
        self.started_here = False
        self.log = dlog.get("node_agent", component="mps")

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
                "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def query(self, command: str, timeout_s: float = 5.0) -> str | None:
        """Sends one command to the daemon (e.g. ``get_server_list``); its answer, or None when the
        daemon does not answer."""
        try:
            out = subprocess.run([self.control], input=command + "\n", env=self._env(), capture_output=True,
                                 text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    def servers(self) -> set[int]:
        """PIDs of the MPS servers the daemon runs now (empty when none or no daemon)."""
        out = self.query("get_server_list") or ""
        return {pid for tok in out.split() if (pid := as_count(tok)) is not None}

    def start(self) -> str:
        """Attach to a daemon already serving this pipe directory, or start one; returns the
        state. Never raises: a failure makes the state ``unavailable`` and is logged once."""
        if shutil.which(self.control) is None:
            return self._unavailable(f"{self.control} is not installed")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.query("get_server_list") is not None:
            self.state = "on"
            self.log.info("attached to the MPS control daemon", pipe_dir=str(self.pipe_dir))
            return self.state
        try:
            subprocess.run([self.control, "-d"], env=self._env(), check=True, capture_output=True, timeout=START_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return self._unavailable(f"{self.control} -d failed: {exc}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.query("get_server_list") is not None:
                self.state, self.started_here = "on", True
                self.log.info("MPS control daemon started", pipe_dir=str(self.pipe_dir), log_dir=str(self.log_dir))
                return self.state
            time.sleep(0.2)
        return self._unavailable(f"the MPS control daemon did not answer within {START_TIMEOUT_S:.0f} s "
                                 f"(see {self.log_dir}/control.log)")

    def _unavailable(self, reason: str) -> str:
        self.state, self.reason = "unavailable", reason
        self.log.warning("MPS unavailable: instances run time-sliced with tokens alone", reason=reason)
        return self.state

    def client_env(self, *, width: float, memory_bytes: int) -> dict[str, str]:
        """Variables that make a process a client of this daemon with SM ceiling ``width``
        (fraction 0..1) and a device-memory limit of ``memory_bytes`` (0: none). Empty when MPS is
        not on (the width is then passed to the interceptor alone)."""
        if self.state != "on":
            return {}
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
               "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{max(1.0, width * 100.0):.0f}"}
        if memory_bytes > 0:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = pinned_mem_limit(memory_bytes)
        return env

    def stop(self) -> None:
        """Quits the daemon if this agent started it (an attached one belongs to someone else)."""
        if self.started_here and self.state == "on":
            self.query("quit")
            self.started_here = False
