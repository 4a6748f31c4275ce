"""Helpers shared by the steps of scripts/gpu_check.sh: labelled lines, result files, the GPU
worker process, NVML sampling. Standard library only (pynvml and dilu are imported where used).

Every step prints ``[step] ...`` lines and writes its result, a JSON object with at least ``ok``
(bool) and, when not ok, ``error`` (one line), to ``$GPU_CHECK_RESULTS/<step>.json``; summary.py
folds them into the one JSON summary.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "worker.py"
RESULTS = Path(os.environ.get("GPU_CHECK_RESULTS") or "/tmp/dilu-gpu-check/results")
LOGS = Path(os.environ.get("GPU_CHECK_LOGS") or "/tmp/dilu-gpu-check/logs")
TAG = os.environ.get("GPU_CHECK_TAG") or str(os.getpid())  # names this run's /dev/shm blocks
GPU_INDEX = int(os.environ.get("GPU_CHECK_GPU") or 0)  # NVML index = CUDA ordinal under PCI_BUS_ID order
REPLY = "@@ "  # prefix of the worker's reply lines (anything else on its stdout is ignored)


def say(step: str, text: str) -> None:
    """One labelled line on stdout."""
    print(f"[{step}] {text}", flush=True)


def save(step: str, result: dict) -> dict:
    """Writes ``result`` to ``$GPU_CHECK_RESULTS/<step>.json`` and returns it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{step}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def step_deadline(reserve_s: float = 0.0) -> float:
    """time.monotonic() by which the step should be done: its limit from the shell
    (GPU_CHECK_STEP_TIMEOUT_S, seconds from now; 600 when unset) minus ``reserve_s``."""
    return time.monotonic() + float(os.environ.get("GPU_CHECK_STEP_TIMEOUT_S", "600")) - reserve_s


def one_line(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` on one line; a message of several lines keeps its first and last."""
    lines = [x.strip() for x in f"{type(exc).__name__}: {exc}".splitlines() if x.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text[:limit]


def run_step(step: str, body: Callable[[dict], None]) -> int:
    """Runs ``body(result)``; ``body`` fills ``result`` (ok defaults to True). An exception marks
    the step failed with its one-line reason (traceback on stderr); the result is saved either
    way, partial figures included. Returns the exit code (0 ok, 1 failed)."""
    result: dict = {"ok": True}
    try:
        body(result)
    except BaseException as exc:  # KeyboardInterrupt/SystemExit too: the result is still saved
        result["ok"] = False
        result["error"] = one_line(exc)
        traceback.print_exc()
        say(step, f"FAILED: {result['error']}")
    save(step, result)
    return 0 if result.get("ok") else 1


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def last_line(path: Path) -> str:
    """The last non-empty line of a log (where a Python traceback names its exception)."""
    found = [x for x in tail(path, 40).splitlines() if x.strip()]
    return found[-1].strip() if found else "(nothing on stderr)"


def gpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a GPU worker: this process's, with CUDA_DEVICE_ORDER=PCI_BUS_ID (so
    CUDA's ordinals are NVML's indices), the GPU GPU_CHECK_GPU names when set (else the one the
    environment already chose, else the first), and no LD_PRELOAD unless ``extra`` sets one."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTHONUNBUFFERED": "1"})
    if os.environ.get("GPU_CHECK_GPU") or "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = str(GPU_INDEX)
    env.update(extra or {})
    return env


def interceptor_env(lib: str, *, quota: float, cb_path: str | None = None, width: float = 1.0) -> dict[str, str]:
    """Variables that put a worker under the interceptor ``lib``: its control block when given
    (else the fail-safe rate DILU_REQUEST_QUOTA alone), width 1 (no MPS)."""
    env = {"LD_PRELOAD": lib, "DILU_REQUEST_QUOTA": f"{quota:.6f}", "DILU_WIDTH": f"{width:.6f}"}
    if cb_path:
        env["DILU_CB"] = cb_path
    return env


class WorkerError(RuntimeError):
    """The worker died, timed out or answered an error; the message carries its stderr tail."""


class Worker:
    """A worker.py process driven over stdin/stdout (see worker.py for the commands).

    ``model``: resnet50 | bert_base | gpt2 | none; ``batch``: its batch size; ``env``: the full
    environment (see :func:`gpu_env`); stderr goes to ``LOGS/<name>.log``.
    """

    def __init__(self, name: str, model: str, batch: int, env: dict[str, str], ready_timeout_s: float = 120.0):
        LOGS.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = LOGS / f"worker-{name}.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-u", str(WORKER), "--model", model, "--batch", str(batch)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, env=env)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.reply(ready_timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._lines.put(line[len(REPLY):])
        self._lines.put(None)  # EOF

    def send(self, command: str) -> None:
        """Sends one command without waiting for its reply (see :meth:`reply`)."""
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"worker {self.name} is gone ({exc}): {last_line(self.log_path)}") from None

    def reply(self, timeout_s: float) -> dict:
        """The next reply; WorkerError on a timeout, an exit or a reply with ``error``."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerError(f"worker {self.name}: no reply within {timeout_s:.0f} s; last on its stderr: "
                              f"{last_line(self.log_path)}") from None
        if line is None:
            code = self.proc.wait()
            print(f"worker {self.name} stderr ({self.log_path}):\n{tail(self.log_path, 15)}", file=sys.stderr)
            raise WorkerError(f"worker {self.name} exited with code {code}: {last_line(self.log_path)}")
        out = json.loads(line)
        if "error" in out and not out.get("soft"):
            raise WorkerError(f"worker {self.name}: {out['error']}")
        return out

    def cmd(self, command: str, timeout_s: float = 60.0) -> dict:
        self.send(command)
        return self.reply(timeout_s)

    def close(self) -> None:
        """Asks the worker to quit, then terminates / kills it if it does not."""
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (WorkerError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class UtilSampler:
    """Samples NVML's GPU utilisation (fraction 0..1 of its sample period with a kernel running:
    the busy share of the whole GPU) every ``period_s`` in a thread. ``mean()`` averages the
    samples taken ``skip_s`` or more after start (NVML's period, up to 1 s, would otherwise mix
    in what ran before). None when NVML is not there."""

    def __init__(self, index: int = GPU_INDEX, period_s: float = 0.1, skip_s: float = 0.7) -> None:
        self.samples: list[float] = []
        self.skip_s, self.period_s = skip_s, period_s
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            self._nvml = None

    def __enter__(self) -> "UtilSampler":
        if self._nvml is not None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if time.monotonic() - self._t0 < self.skip_s:
                continue
            try:
                self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0)
            except Exception:
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 4) if self.samples else None


def interceptor_lib() -> str:
    """The interceptor library: $DILU_INTERCEPTOR_LIB (the shell sets it), else the project's
    build. Raises FileNotFoundError when there is none."""
    lib = os.environ.get("DILU_INTERCEPTOR_LIB") or str(REPO / "interceptor" / "build" / "libdilu_intercept.so")
    if not Path(lib).exists():
        raise FileNotFoundError(f"no interceptor library at {lib}")
    return lib


def control_block_class():
    """dilu.interceptor.control_block.ControlBlock, or raises ImportError saying why not."""
    try:
        from dilu.interceptor.control_block import ControlBlock
    except Exception as exc:
        raise ImportError(f"the control block binding is not available ({type(exc).__name__}: {exc})") from None
    return ControlBlock


def cb_path(name: str) -> str:
    return f"/dev/shm/dilu-gpucheck-{TAG}-{name}"


def median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
