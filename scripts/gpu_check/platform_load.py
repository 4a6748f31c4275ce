"""Step e: the platform on the real GPU.

Starts nats-server (JetStream, a free port) and the five services as ``dilu demo`` does
(cli.cluster.Cluster: ``python -m dilu.services.<name> --nats-url ... --metrics-port ...``), the node
agent on ``--device nvml --gpus 1`` (the node's first GPU by NVML index; the Cluster's ``--device
emulated`` is overridden through extra_args: the last value of an option wins). Deploys three functions served by
dilu.services.node_agent.handlers.torch_models (resnet50, bert_base, gpt2) with operator-given
profiles (request 0.3, limit 0.5, batch 8: three limits of 0.5 are the most one GPU takes under
the default oversubscription cap of 1.5), waits for their instances (InstanceReady), replays
open-loop Poisson load at a fixed rate per function for GPU_CHECK_LOAD_S seconds (default 60)
through the invocation path (InvokeClient: JetStream work queue, reply to an inbox), and reports
per function: offered / completed / failed / timed out / dropped, cold starts, and latency p50 /
p90 / p99 / max from an HDR histogram, from each request's scheduled send time (DESIGN.md
section 8); plus the node's inventory as the agent published it and the mechanism counters.

The profiler is pointed at a node that does not exist, so it runs no trial and publishes no
profile of its own: a catalogue model name (bert_base) would otherwise get a surface profile that
replaces the operator's.

    python platform_load.py                # the real GPU
    python platform_load.py --emulated     # self-test without a GPU: an emulated GPU, emulated models

Environment: GPU_CHECK_LOAD_S, GPU_CHECK_RATES (``fn=rps,...``, default resnet50=100,
bert_base=100,gpt2=20), GPU_CHECK_STEP_TIMEOUT_S (the step's limit; the replay is shortened to
fit it), GPU_CHECK_LOGS (service logs go to its ``platform/`` folder), GPU_CHECK_PIDS (a file that
gets the pid of each process group started, so the shell can end them if this step is killed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from util import LOGS, run_step, say, step_deadline

STEP = "platform"
HANDLER = "dilu.services.node_agent.handlers.torch_models"
REQUEST, LIMIT, BATCH = 0.3, 0.5, 8
MEMORY_BYTES = 6 * 2**30  # each instance's reservation: fp16 weights, activations, cuBLAS/cuDNN workspaces
DEFAULT_RATES = {"resnet50": 100.0, "bert_base": 100.0, "gpt2": 20.0}
SLO_MS = {"resnet50": 200.0, "bert_base": 200.0, "gpt2": 2000.0}
# operator's estimates at the request quota (the horizontal scaler sizes instances with them)
ESTIMATE = {"resnet50": (20.0, 400.0), "bert_base": (20.0, 400.0), "gpt2": (200.0, 40.0)}  # (latency ms, rps)
EMULATED_MODELS = {"resnet50": "resnet152", "bert_base": "bert_base", "gpt2": "gpt2_large"}
READY_WAIT_S = 150.0
REQUEST_TIMEOUT_S = 30.0
STOP_RESERVE_S = 45.0  # Cluster.stop: up to 28 s for the services, then nats-server


def parse_rates(text: str) -> dict[str, float]:
    """``fn=rps,...`` -> {fn: rps} over the three functions (others keep their default).
    Raises ValueError naming a bad entry."""
    rates = dict(DEFAULT_RATES)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in rates:
            raise ValueError(f"GPU_CHECK_RATES: unknown function {name!r} (known: {', '.join(rates)})")
        try:
            rates[name] = float(value)
        except ValueError:
            raise ValueError(f"GPU_CHECK_RATES: {part!r} is not fn=requests_per_second") from None
        if rates[name] < 0:
            raise ValueError(f"GPU_CHECK_RATES: negative rate in {part!r}")
    return rates


def arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Poisson arrival offsets (s) in [0, duration_s) at ``rate`` per second."""
    out, t = [], 0.0
    if rate <= 0:
        return out
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


def payload(rng: random.Random, fn: str) -> bytes:
    if fn == "gpt2":
        return json.dumps({"max_new_tokens": 16, "prompt": rng.getrandbits(64)}).encode()
    return rng.randbytes(32)


def specs_and_profiles(emulated: bool):
    from dilu.contracts import events as ev
    from dilu.services.common import models

    specs, given = [], {}
    for fn in DEFAULT_RATES:
        if emulated:
            model = EMULATED_MODELS[fn]
            spec = ev.FunctionSpec(name=fn, model=model, slo_ms=SLO_MS[fn] * 5, memory_bytes=models.memory_bytes(model),
                                   handler="dilu.services.node_agent.handlers.emulated", max_batch=BATCH, max_instances=1)
        else:
            spec = ev.FunctionSpec(name=fn, model=fn, slo_ms=SLO_MS[fn], memory_bytes=MEMORY_BYTES, handler=HANDLER,
                                   max_batch=BATCH, max_instances=1, cold_start_ms=5000.0)
        latency_ms, rps = ESTIMATE[fn]
        specs.append(spec)
        given[fn] = ev.Profile(function=fn, request_quota=REQUEST, limit_quota=LIMIT, batch_size=BATCH, burst_batch=BATCH,
                               latency_ms=latency_ms, throughput_rps=rps, limit_latency_ms=latency_ms,
                               limit_throughput_rps=rps * LIMIT / REQUEST, backend="operator")
    return specs, given


class FunctionStats:
    """Outcomes and an HDR histogram of latency (µs, from the scheduled send time) of one function."""

    def __init__(self, slo_ms: float) -> None:
        from hdrh.histogram import HdrHistogram

        self.hist = HdrHistogram(1, 3_600_000_000, 3)
        self.slo_ms = slo_ms
        self.counts: Counter = Counter()
        self.late = 0
        self.cold = 0
        self.first_error = ""

    def record(self, r, scheduled_ns: int) -> None:
        self.counts[r.status] += 1
        if r.status == "ok":
            lat_us = max(1, (r.done_ns - scheduled_ns) // 1000)
            self.hist.record_value(min(lat_us, 3_600_000_000))
            self.late += lat_us > self.slo_ms * 1000
            self.cold += bool(r.cold_start)
        elif not self.first_error:
            self.first_error = f"{r.status}: {r.error}"[:300]

    def report(self, rate: float) -> dict:
        c = self.counts
        offered = sum(c.values())
        h = self.hist
        lat = ({q: round(h.get_value_at_percentile(p) / 1000.0, 3) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
               if c["ok"] else {})
        if c["ok"]:
            lat["max"] = round(h.get_max_value() / 1000.0, 3)
        bad = self.late + c["dropped"] + c["error"] + c["timeout"]
        return {"rate_rps": rate, "offered": offered, "completed": c["ok"], "failed": c["error"], "timed_out": c["timeout"],
                "dropped": c["dropped"], "cold_starts": self.cold, "latency_ms": lat, "slo_ms": self.slo_ms,
                "slo_violation_rate": round(bad / offered, 5) if offered else None, "first_error": self.first_error}


async def replay(nc, js, rates: dict[str, float], duration_s: float, slo_ms: dict[str, float], seed: int = 1) -> dict:
    """Open-loop Poisson load for ``duration_s``; waits for every answer (or its timeout)."""
    from dilu.services.common.invoke import InvokeClient

    client = InvokeClient(nc, js)
    await client.start()
    rng = random.Random(seed)
    schedule = sorted((t, fn) for fn, r in rates.items() for t in arrivals(rng, r, duration_s))
    stats = {fn: FunctionStats(slo_ms[fn]) for fn in rates}
    behind: list[float] = []

    async def one(fn: str, i: int, scheduled_ns: int, body: bytes) -> None:
        r = await client.invoke(fn, body, request_id=f"{fn}-{i}", scheduled_ns=scheduled_ns, timeout_s=REQUEST_TIMEOUT_S)
        stats[fn].record(r, scheduled_ns)

    tasks = []
    t0, wall0 = time.monotonic(), time.time_ns()
    for i, (t, fn) in enumerate(schedule):
        delay = t0 + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            behind.append(-delay)
        tasks.append(asyncio.create_task(one(fn, i, wall0 + int(t * 1e9), payload(rng, fn))))
    sent_s = time.monotonic() - t0
    await asyncio.gather(*tasks)
    await client.close()
    return {"duration_s": duration_s, "send_s": round(sent_s, 2), "drain_s": round(time.monotonic() - t0 - sent_s, 2),
            "late_sends_over_10ms": sum(b > 0.01 for b in behind),
            "functions": {fn: stats[fn].report(rates[fn]) for fn in rates}}


async def drive(cluster, result: dict, args, deadline: float) -> None:
    import msgspec
    import nats

    from dilu.cli.deploy import cluster_facts, deploy_all
    from dilu.contracts import decode, subjects
    from dilu.contracts import events as ev
    from dilu.services.common.nodes import read_inventories
    from dilu.services.common.workqueue import ensure_consumer, ensure_stream

    nc = await nats.connect(cluster.url)
    js = nc.jetstream()
    await ensure_stream(js)
    specs, given = specs_and_profiles(args.emulated)
    for s in specs:
        await ensure_consumer(js, s.name)
    ready: dict[str, float] = {}
    placed: dict[str, dict] = {}
    all_ready = asyncio.Event()

    async def on_ready(msg) -> None:
        e = decode(msg.data, ev.InstanceReady)
        ready.setdefault(e.function, round(e.cold_start_ms, 1))
        if set(given) <= set(ready):
            all_ready.set()

    async def on_placed(msg) -> None:
        p = decode(msg.data, ev.PlacementDecided).placement
        placed[p.function] = {"instance": p.instance_id, "gpu": p.gpu, "request": p.request_quota, "limit": p.limit_quota,
                              "width": p.width, "batch": p.batch_size, "memory_gib": round(p.memory_bytes / 2**30, 2)}

    await nc.subscribe(f"{subjects.PREFIX}.instance.ready.*", cb=on_ready)
    await nc.subscribe(f"{subjects.PREFIX}.placement.decided.*", cb=on_placed)
    t_deploy = time.monotonic()
    await deploy_all(nc, [msgspec.structs.replace(s, profile=given[s.name]) for s in specs], timeout_s=30)
    say(STEP, f"deployed {', '.join(s.name for s in specs)} (request {REQUEST}, limit {LIMIT}, batch {BATCH}); "
              f"waiting for instances")
    wait_s = max(5.0, min(READY_WAIT_S, deadline - time.monotonic() - 30))
    try:
        await asyncio.wait_for(all_ready.wait(), timeout=wait_s)
    except asyncio.TimeoutError:
        pass
    result["ready_wait_s"] = round(time.monotonic() - t_deploy, 1)
    result["cold_start_ms"] = dict(ready)
    result["placements"] = placed
    cold = sorted(set(given) - set(ready))
    result["not_ready"] = cold
    for fn in given:
        say(STEP, f"{fn}: " + (f"ready, cold start {ready[fn]} ms" if fn in ready else "NOT ready")
                  + (f"; placed {placed[fn]}" if fn in placed else "; no placement seen"))
    if cold:
        say(STEP, "node agent log tail:\n" + cluster.log_tail("node_agent", 25))
    invs = await read_inventories(js)
    result["inventory"] = {name: msgspec.to_builtins(inv) for name, (inv, _) in invs.items()}
    for name, (inv, _) in invs.items():
        say(STEP, f"inventory {name}: device={inv.device} mps={inv.mps} driver={inv.driver_version} "
                  f"gpus={[(g.index, g.name, g.healthy) for g in inv.gpus]}")

    left = deadline - time.monotonic() - REQUEST_TIMEOUT_S - 10
    duration = min(args.duration, left)
    if duration < 5:
        raise TimeoutError(f"no time left for the load ({left:.0f} s)")
    if duration < args.duration:
        say(STEP, f"load shortened to {duration:.0f} s to fit the step's time limit")
    rates = args.rates
    say(STEP, f"replaying {duration:.0f} s of Poisson load: " + ", ".join(f"{fn} {r:g}/s" for fn, r in rates.items()))
    load = await replay(nc, js, rates, duration, {s.name: s.slo_ms for s in specs})
    result["load"] = load
    for fn, r in load["functions"].items():
        lat = r["latency_ms"]
        say(STEP, f"{fn:9} offered={r['offered']} completed={r['completed']} failed={r['failed']} timed_out={r['timed_out']} "
                  f"dropped={r['dropped']} cold={r['cold_starts']} p50={lat.get('p50')} ms p99={lat.get('p99')} ms "
                  f"max={lat.get('max')} ms slo_violations={r['slo_violation_rate']}"
                  + (f" first_error={r['first_error']!r}" if r["first_error"] else ""))
    result["mechanism"] = await asyncio.to_thread(cluster_facts, cluster)
    say(STEP, f"mechanism: {result['mechanism'].get('mechanism')}")
    await nc.drain()
    ok_fns = [fn for fn, r in load["functions"].items()
              if (r["offered"] or not rates[fn]) and r["failed"] == 0 and r["completed"] >= 0.99 * r["offered"]]
    result["ok"] = not cold and len(ok_fns) == len(load["functions"])
    if not result["ok"]:
        result["error"] = (f"instances not ready: {cold}" if cold else
                           f"functions with failures or under 99 % completed: "
                           f"{sorted(set(load['functions']) - set(ok_fns))}")


def disable_mps(folder: Path) -> None:
    """Puts a ``nvidia-cuda-mps-control`` that always fails first on PATH (for this process and the
    services it starts): the node agent then finds MPS unavailable and runs its instances
    time-sliced, with tokens alone."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "nvidia-cuda-mps-control"
    shim.write_text("#!/bin/sh\necho 'MPS left off by gpu_check: its client probe failed' >&2\nexit 1\n")
    shim.chmod(0o755)
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def body(result: dict, args) -> None:
    from dilu.cli.cluster import Cluster

    deadline = step_deadline(reserve_s=STOP_RESERVE_S)
    args.rates = parse_rates(os.environ.get("GPU_CHECK_RATES", ""))  # a bad value fails before anything starts
    log_dir = LOGS / "platform"
    extra = {
        # the profiler runs no trial: see the module docstring
        "profiler": ["--node", "gpu-check-no-trials", "--trial-timeout-s", "2"],
    }
    if args.emulated:
        cluster = Cluster(log_dir=log_dir, gpus="1", extra_args=extra)
    else:
        if os.environ.get("GPU_CHECK_NO_MPS") == "1":
            # the inventory step saw MPS start but its client fail: run time-sliced, tokens alone
            disable_mps(LOGS.parent / "no-mps")
            result["mps_disabled"] = "the inventory step's MPS client probe failed: instances run without MPS"
            say(STEP, result["mps_disabled"])
        extra["node_agent"] = ["--device", "nvml", "--mps-dir", str(LOGS.parent / "mps-agent")]
        # one GPU (NVML index 0): the three functions share it, their limits filling the cap of 1.5
        cluster = Cluster(log_dir=log_dir, gpus="1", extra_args=extra)
    result.update(emulated=args.emulated, log_dir=str(log_dir), request_quota=REQUEST, limit_quota=LIMIT, batch=BATCH)
    say(STEP, f"starting nats-server and the five services (logs in {log_dir})")
    try:
        cluster.start()
        pids = os.environ.get("GPU_CHECK_PIDS")
        if pids:  # each service and nats-server lead their own process group
            with open(pids, "a") as f:
                for svc in cluster.services.values():
                    f.write(f"{svc.proc.pid}\n")
                if cluster.nats and cluster.nats.proc:
                    f.write(f"{cluster.nats.proc.pid}\n")
        say(STEP, f"cluster up at {cluster.url}: " + ", ".join(cluster.services))
        asyncio.run(drive(cluster, result, args, deadline))
    finally:
        say(STEP, "stopping the cluster")
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulated", action="store_true", help="self-test on an emulated GPU with emulated models (no GPU needed)")
    ap.add_argument("--duration", type=float, default=float(os.environ.get("GPU_CHECK_LOAD_S", "60")),
                    help="seconds of load (default GPU_CHECK_LOAD_S or 60)")
    args = ap.parse_args()

    def on_term(signum, _frame):  # the shell's timeout: stop the cluster on the way out
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    return run_step(STEP, lambda result: body(result, args))


if __name__ == "__main__":
    sys.exit(main())
