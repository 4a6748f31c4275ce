"""A GPU worker that the gpu_check steps drive over stdin/stdout, possibly under the interceptor.

    python worker.py --model resnet50|bert_base|gpt2|none --batch N [--device cuda|cpu]

The model is the torch_models handler's (random weights, fp16 on cuda), fed one fixed batch.
``--device cpu`` (default: $GPU_CHECK_DEVICE, else cuda) is for trying the steps' plumbing on a
machine without a GPU: steps are timed on the host, ``graph`` runs eagerly, nothing is refused.
When it is ready the worker prints a reply, then answers one command per stdin line with one
reply line: ``@@ `` + a JSON object (``error`` when the command failed). Times are
CLOCK_MONOTONIC ns (``time.monotonic_ns``), comparable across the processes of one host.

    mode eager|graph   what a step is: one forward pass, or the replay of one captured as a CUDA graph
    calib N            GPU time of one step (ms): CUDA events around N back-to-back steps, after a sync
    measure S          steps for S seconds after GPU_CHECK_WARMUP_S (default 1.0) s of warm-up, synchronising every 5 steps:
                       iters, wall_s, items_per_s; with a control block (DILU_CB) also what the
                       interceptor metered in that window (busy_us, launches, throttled, wait_us)
    stamped S          one step + synchronize at a time for S seconds: the end time of each (ns)
    serve S            like measure without warm-up, counting failing steps instead of stopping:
                       steps, errors, steps per whole second, the first error
    alloc MIB          torch.empty of MIB MiB, kept alive: ok, or oom (bool) and alloc_error
    free               drops what alloc kept and empties torch's cache
    meminfo            torch.cuda.mem_get_info(): free_bytes, total_bytes as this process sees them
    snapshot           the control block's fields now (DILU_CB), or {} without one
    quit
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
# warm-up before each timed phase: 0.3 s left an eager BERT-base run without the interceptor at
# 57 % of the GPU (NVML) on an H200, its first phase still settling
WARMUP_S = float(os.environ.get("GPU_CHECK_WARMUP_S", "1.0"))

REPO = Path(__file__).resolve().parents[2]


def torch_models():
    """The handler module: the installed package's, else loaded from the checkout by path."""
    try:
        from dilu.services.node_agent.handlers import torch_models as tm
        return tm
    except ImportError:
        path = REPO / "services" / "node_agent" / "handlers" / "torch_models.py"
        spec = importlib.util.spec_from_file_location("dilu_torch_models", path)
        tm = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = tm  # dataclasses look their module up while the class is made
        spec.loader.exec_module(tm)
        return tm


def reply(**fields) -> None:
    sys.stdout.write("@@ " + json.dumps(fields, default=str) + "\n")
    sys.stdout.flush()


class Block:
    """The worker's own view of its control block (DILU_CB), for what the interceptor metered."""

    def __init__(self) -> None:
        self.cb = None
        path = os.environ.get("DILU_CB")
        if path:
            try:
                from dilu.interceptor.control_block import ControlBlock
                self.cb = ControlBlock.open(path)
            except Exception as exc:  # no binding: the figures are left out
                print(f"worker: control block {path} not readable: {exc}", file=sys.stderr)

    def snap(self) -> dict:
        if self.cb is None:
            return {}
        s = self.cb.snapshot()
        return {f: getattr(s, f) for f in s.__dataclass_fields__}


def sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Runner:
    def __init__(self, model: str, batch: int, device: str = "cuda") -> None:
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        self.batch = batch
        self.model = None
        self.step = None
        self.held: list[torch.Tensor] = []
        if model != "none":
            tm = torch_models()
            self.model = tm.build(model, device, batch)
            self.x = self.model.inputs([b"gpu-check %d" % i for i in range(batch)])
            self.net = self.model.net
            with torch.inference_mode():
                for _ in range(3):
                    self.net(self.x)
            sync()
            self.set_mode("eager")
        self.block = Block()

    def set_mode(self, mode: str) -> dict:
        if mode == "eager":
            def step():
                with torch.inference_mode():
                    self.net(self.x)
            self.step = step
            return {"mode": mode}
        if mode != "graph":
            raise ValueError(f"unknown mode {mode!r}")
        if not self.cuda:
            self.set_mode("eager")
            return {"mode": mode, "ran_as": "eager (no CUDA graphs on the cpu)"}
        # capture one forward pass; warm up on a side stream first, as torch's docs require
        with torch.inference_mode():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    self.net(self.x)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self.net(self.x)
        torch.cuda.synchronize()
        self.graph = graph
        self.step = graph.replay
        return {"mode": mode}

    def calib(self, n: int) -> dict:
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(n):
                self.step()
            return {"steps": n, "step_gpu_ms": (time.perf_counter() - t0) * 1000.0 / n}
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            self.step()
        end.record()
        end.synchronize()
        return {"steps": n, "step_gpu_ms": start.elapsed_time(end) / n}

    def measure(self, seconds: float) -> dict:
        t_end = time.perf_counter() + WARMUP_S
        while time.perf_counter() < t_end:
            self.step()
        sync()
        before = self.block.snap()
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(5):
                self.step()
            sync()
            iters += 5
        wall = time.perf_counter() - t0
        out = {"iters": iters, "wall_s": wall, "items_per_s": iters * self.batch / wall}
        after = self.block.snap()
        if before and after:
            out["metered"] = {k: after[k] - before[k] for k in ("busy_us", "launches", "throttled", "wait_us")}
            out["metered"]["applied_quota"] = after["applied_quota"]
        return out

    def stamped(self, seconds: float) -> dict:
        stamps = []
        t_end = time.monotonic_ns() + int(seconds * 1e9)
        while True:
            self.step()
            sync()
            now = time.monotonic_ns()
            stamps.append(now)
            if now >= t_end:
                break
        return {"stamps_ns": stamps}

    def serve(self, seconds: float) -> dict:
        steps = errors = 0
        first_error = ""
        per_second: list[int] = []
        t0 = time.monotonic()
        while (now := time.monotonic()) - t0 < seconds:
            second = int(now - t0)
            while len(per_second) <= second:
                per_second.append(0)
            try:
                self.step()
                sync()
                steps += 1
                per_second[second] += 1
            except Exception as exc:  # a neighbour's failure must not be ours: count it
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}".splitlines()[0]
        return {"steps": steps, "errors": errors, "per_second": per_second, "first_error": first_error,
                "t0_ns": int(t0 * 1e9)}

    def alloc(self, mib: int) -> dict:
        try:
            self.held.append(torch.empty(mib * 2**20, dtype=torch.uint8, device=self.dev))
            sync()
            return {"ok": True, "mib": mib, "held_mib": sum(t.numel() for t in self.held) // 2**20}
        except Exception as exc:  # torch.OutOfMemoryError is a RuntimeError
            return {"ok": False, "mib": mib, "oom": isinstance(exc, torch.cuda.OutOfMemoryError)
                    or "out of memory" in str(exc).lower(),
                    "alloc_error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}

    def free(self) -> dict:
        self.held.clear()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return {"ok": True}

    def meminfo(self) -> dict:
        if not self.cuda:
            return {"free_bytes": 0, "total_bytes": 0}
        free, total = torch.cuda.mem_get_info()
        return {"free_bytes": free, "total_bytes": total}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=os.environ.get("GPU_CHECK_DEVICE") or "cuda")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        runner = Runner(args.model, args.batch, args.device)
    except Exception as exc:
        reply(error=f"start-up failed: {type(exc).__name__}: {exc}".splitlines()[0])
        raise
    reply(ready=True, model=args.model, batch=args.batch, pid=os.getpid(), startup_s=time.perf_counter() - t0,
          device=torch.cuda.get_device_name(0) if runner.cuda else "cpu", torch=torch.__version__)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        cmd, arg = words[0], (words[1] if len(words) > 1 else "")
        try:
            if cmd == "quit":
                reply(bye=True)
                return 0
            if cmd == "mode":
                reply(**runner.set_mode(arg))
            elif cmd == "calib":
                reply(**runner.calib(int(arg or 20)))
            elif cmd == "measure":
                reply(**runner.measure(float(arg)))
            elif cmd == "stamped":
                reply(**runner.stamped(float(arg)))
            elif cmd == "serve":
                reply(**runner.serve(float(arg)))
            elif cmd == "alloc":
                reply(**runner.alloc(int(arg)))
            elif cmd == "free":
                reply(**runner.free())
            elif cmd == "meminfo":
                reply(**runner.meminfo())
            elif cmd == "snapshot":
                reply(**runner.block.snap())
            else:
                reply(error=f"unknown command {cmd!r}")
        except Exception as exc:
            reply(error=f"{cmd}: {type(exc).__name__}: {exc}".splitlines()[0][:500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
