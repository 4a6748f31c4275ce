"""``dilu bench scheduler``: placement speed at scale, and packing quality on the paper's workloads.

Without ``--workload``: fill ``--nodes`` × ``--gpus-per-node`` GPUs with ``--instances`` synthetic
instances (seeded), then churn (retire one, place one), timing every placement; writes
``placements_per_second`` and ``placement_latency_ms_p99`` (HDR histogram).

With ``--workload FILE`` (a dilu-sim event list, see ``workloads/ATTRIBUTION.md``): replays the
start/delete events in file order through the placement policy and writes ``peak_active_gpus``,
``mean_active_gpus`` (time-weighted over the events' timestamps), ``lower_bound_peak`` (the largest
over time of max(⌈Σ SM requests⌉, ⌈Σ memory / GPU memory⌉, the number of live GPU slots needing
more than half a GPU's memory, since no two of those can share a GPU, and the GPUs of the widest
live training job)), ``max_limit_sum`` and
``allocation_fragmentation`` (time-weighted mean over active GPUs of 1 − Σ request quotas).
Multi-GPU training takes distinct GPUs of one node; an instance is never split.

The cluster is ``--nodes`` identical nodes here (the live scheduler builds it from the node
inventories instead). Memory is in GiB (2**30 bytes), the workload's memory figures included.
``--max-gpu-instances`` caps instances per GPU (the MPS client limit, 48; 0: no cap).
"""
from __future__ import annotations

import ast
import json
import math
import random
import time
from datetime import datetime
from pathlib import Path

import click
from hdrh.histogram import HdrHistogram

from dilu.services.common import files
from dilu.services.common.cliopts import Finite, writable_output, write_output
from dilu.services.common.interrupt import SignalExit

from .policy import Cluster, Demand, NoCapacity

from dilu.services.common.functions import GIB as GiB  # memory units, one truth
WORKLOADS_DIR = Path(__file__).parent / "workloads"


def workloads_epilog() -> str:
    """The bundled workloads (the paper's dilu-sim event lists) as a click epilog: their folder
    and file names in a ``\\b`` paragraph, which click prints as it is, so that no path is
    rewrapped, and broken, within a word."""
    names = sorted((p.name for p in WORKLOADS_DIR.glob("instances-*.txt")), key=lambda n: int(n[10:-4]))
    rows = ["  " + "  ".join(names[i:i + 3]) for i in range(0, len(names), 3)]
    return "\n".join(["The paper's scheduling workloads, for --workload, are bundled here:", "", "\b", f"  {WORKLOADS_DIR}/", *rows])


WORKLOAD_MAX_BYTES = 256 * files.MiB  # the paper's largest workload (3,200 instances) is 1 MB


class WorkloadError(ValueError):
    """A workload line that is not a valid event (the message names the line)."""


def parse_workload(path: str | Path) -> list[tuple[float, str, str, Demand]]:
    """Events as (time s, action, instance name, demand), one per non-blank line of the Dilu
    authors' format (a Python dict literal, read with ast.literal_eval: nothing is executed), in
    time order, each start of an instance not running and each delete of one that is. Raises
    WorkloadError naming the file and line and saying what is wrong, also for a binary,
    unreadable, non-regular, event-less or too large (over WORKLOAD_MAX_BYTES) file."""
    try:
        lines = files.read_bounded(path, WORKLOAD_MAX_BYTES).decode().splitlines()
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not a text file") from None
    except OSError as exc:  # missing, unreadable, not a regular file, over the limit
        raise WorkloadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    events = []
    running: set[str] = set()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = _event(line)
            _check_order(event, events[-1][0] if events else None, running)
        except (ValueError, TypeError) as exc:
            raise WorkloadError(f"{path}:{n}: {exc}") from None
        events.append(event)
    if not events:
        raise WorkloadError(f"{path}: no events (expected one dict per line with 'Time', 'Action' and 'Instance')")
    return events


def _check_order(event: tuple[float, str, str, Demand], last_t: float | None, running: set[str]) -> None:
    """An event must not go back in time, start an instance that is running or delete one that
    is not (``running``: the names started and not deleted so far, updated here). ValueError
    says which."""
    t, action, name, _ = event
    if last_t is not None and t < last_t:
        raise ValueError(f"its Time goes back {last_t - t:g} s: events must be in time order")
    if action == "start":
        if name in running:
            raise ValueError(f"instance {name!r} is started again while running")
        running.add(name)
    elif name not in running:
        raise ValueError(f"instance {name!r} is deleted but not running")
    else:
        running.discard(name)


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # the format's timestamps, local time, whole seconds
WORKLOAD_TYPES = ("inference", "training", "llm-inference")  # the format's kinds (workloads/ATTRIBUTION.md)
MAX_GPU_NUM = 64  # GPUs one workload instance may span (the bundled workloads use 1 and 4)


def _event(line: str) -> tuple[float, str, str, Demand]:
    """One workload line as an event; ValueError / TypeError say what is wrong with it."""
    try:
        e = ast.literal_eval(line)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError("not a dict literal of plain values") from None
    if not isinstance(e, dict) or not isinstance(e.get("Instance"), dict):
        raise ValueError("expected a dict with 'Time', 'Action' and an 'Instance' dict")
    inst = e["Instance"]
    missing = [k for k in ("Time", "Action") if k not in e] + \
        [k for k in ("service_name", "type", "gpu_num", "sm_requests", "sm_limits", "memory") if k not in inst]
    if missing:
        raise ValueError(f"missing {', '.join(map(repr, missing))}")
    try:
        t = datetime.strptime(str(e["Time"]), TIME_FORMAT).timestamp()
    except ValueError:  # strptime's own words name its format codes
        raise ValueError(f"Time must be like '2024-06-19 15:44:30', got {e['Time']!r}") from None
    action = e["Action"]
    if action not in ("start", "delete"):
        raise ValueError(f"unknown action {action!r} (start or delete)")
    gpus = inst["gpu_num"]
    if inst["type"] not in WORKLOAD_TYPES:
        raise ValueError(f"unknown type {inst['type']!r} ({', '.join(WORKLOAD_TYPES)})")
    for key in ("sm_requests", "sm_limits"):
        if isinstance(inst[key], bool) or not isinstance(inst[key], (int, float)):
            raise ValueError(f"{key} must be a number (a fraction of the GPU's SMs), got {inst[key]!r}")
    request, limit = float(inst["sm_requests"]), float(inst["sm_limits"])
    memory = inst["memory"] if isinstance(inst["memory"], list) else [inst["memory"]]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPU_NUM:
        raise ValueError(f"gpu_num must be a whole number of GPUs from 1 to {MAX_GPU_NUM}, got {gpus!r}")
    if gpus > 1 and inst["type"] != "training":  # an instance is never split; only training spans GPUs
        raise ValueError(f"gpu_num {gpus} for an instance of type {inst['type']!r}: only training spans several GPUs")
    if not isinstance(inst["service_name"], str) or not inst["service_name"].strip():
        raise ValueError(f"service_name must be a non-empty string, got {inst['service_name']!r}")
    if not (0 < request <= limit <= 1):
        raise ValueError(f"need 0 < sm_requests <= sm_limits <= 1, got {request} and {limit}")
    if not memory or not all(isinstance(m, (int, float)) and 0 <= m < 1e6 for m in memory):
        raise ValueError(f"memory must be a list of GB per GPU, got {inst['memory']!r}")
    if isinstance(inst["memory"], list) and len(memory) != gpus:
        raise ValueError(f"memory lists {len(memory)} GPUs for gpu_num {gpus}")
    kind = "training" if inst["type"] == "training" else "inference"  # an LLM is served as inference
    d = Demand(function=str(inst["service_name"]), request_quota=request, limit_quota=limit,
               memory_bytes=int(max(memory) * GiB), kind=kind, gpus=gpus if kind == "training" else 1)
    return t, action, str(inst["service_name"]), d


def _timer() -> HdrHistogram:
    """Latency histogram in ns, 1 ns .. 10 s, 3 significant digits."""
    return HdrHistogram(1, 10**10, 3)


def replay(path: str | Path, nodes: int = 1000, gpus_per_node: int = 4, gpu_memory_gib: float = 40,
           gamma: float = 1.5, max_gpu_instances: int = 0) -> dict:
    """Replay a dilu-sim workload; returns the figures named in the module docstring."""
    capacity = int(gpu_memory_gib * GiB)
    cluster = Cluster([f"node{i}" for i in range(nodes)], gpus_per_node, capacity, gamma=gamma,
                      max_gpu_instances=max_gpu_instances)
    hist = _timer()
    live_req = 0.0
    live_mem = 0
    live_big = 0
    bound = 0
    peak = 0
    max_lim = 0.0
    unplaced = 0
    area = frag_area = span = 0.0
    last_t: float | None = None
    events = parse_workload(path)
    for t, action, name, d in events:
        if last_t is not None and t > last_t:  # the state since last_t held until t
            dt = t - last_t
            area += cluster.active * dt
            frag_area += (cluster.active - live_req) * dt
            span += dt
        last_t = t
        if action == "start":  # parse_workload saw to it that the name is not running
            t0 = time.perf_counter_ns()
            try:
                gpus = cluster.choose(d)
            except NoCapacity:
                unplaced += 1
                continue
            cluster._apply(name, d, gpus)
            hist.record_value(max(1, time.perf_counter_ns() - t0))
            live_req += d.request_quota * d.gpus
            live_mem += d.memory_bytes * d.gpus
            live_big += d.gpus if d.memory_bytes > capacity / 2 else 0
            max_lim = max(max_lim, *(cluster.gpus[g].lim for g in gpus))
            bound = max(bound, d.gpus)  # a job on k GPUs needs k of them, whatever its quotas
        elif name in cluster.instances:  # else it was not placed (unplaced counts it)
            d, _ = cluster.remove(name)
            live_req -= d.request_quota * d.gpus
            live_mem -= d.memory_bytes * d.gpus
            live_big -= d.gpus if d.memory_bytes > capacity / 2 else 0
        peak = max(peak, cluster.active)
        bound = max(bound, math.ceil(live_req - 1e-6), math.ceil(live_mem / capacity - 1e-9), live_big)
    return {
        "workload": Path(path).name,
        "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu_memory_gib": gpu_memory_gib, "gamma": gamma,
        "max_gpu_instances": max_gpu_instances,
        "events": len(events),
        "peak_active_gpus": peak,
        "lower_bound_peak": bound,
        "peak_over_bound": peak / bound - 1 if bound else 0.0,
        "mean_active_gpus": area / span if span else float(cluster.active),
        "max_limit_sum": round(max_lim, 9),  # sums of 2-decimal quotas: drop float residue
        "allocation_fragmentation": frag_area / area if area else 0.0,
        "unplaced": unplaced,
        "placement_latency_ms_p99": hist.get_value_at_percentile(99) / 1e6,
        "violations": len(cluster.violations()),
    }


def synthetic(nodes: int = 1000, gpus_per_node: int = 4, instances: int = 10_000, churn: int = 2_000,
              gpu_memory_gib: float = 40, gamma: float = 1.5, seed: int = 0, max_gpu_instances: int = 0) -> dict:
    """Fill the cluster with ``instances`` seeded random instances, then ``churn`` retire+place pairs."""
    rng = random.Random(seed)
    cluster = Cluster([f"node{i}" for i in range(nodes)], gpus_per_node, int(gpu_memory_gib * GiB), gamma=gamma,
                      max_gpu_instances=max_gpu_instances)
    functions = [f"fn{i}" for i in range(max(1, instances // 50))]

    def demand() -> Demand:
        r = round(rng.uniform(0.05, 0.5), 2)
        training = rng.random() < 0.15
        return Demand(function=rng.choice(functions), request_quota=r,
                      limit_quota=min(1.0, round(r * rng.uniform(1.1, 1.6), 2)),
                      memory_bytes=int(rng.uniform(1, 12) * GiB), kind="training" if training else "inference",
                      gpus=rng.choice((1, 2, 4)) if training and rng.random() < 0.3 else 1,
                      peak_hour=rng.randrange(24))

    hist = _timer()
    ids: list[str] = []
    placed = unplaced = 0
    total_ns = 0
    for k in range(instances + churn):
        if k >= instances and ids:
            cluster.remove(ids.pop(rng.randrange(len(ids))))
        d, iid = demand(), f"i{k}"
        t0 = time.perf_counter_ns()
        try:
            cluster.place(iid, d)
        except NoCapacity:
            unplaced += 1
            continue
        dt = time.perf_counter_ns() - t0
        total_ns += dt
        hist.record_value(max(1, dt))
        ids.append(iid)
        placed += 1
    return {
        "nodes": nodes, "gpus_per_node": gpus_per_node, "instances": len(ids), "placements": placed,
        "unplaced": unplaced, "seed": seed,
        "placements_per_second": placed / (total_ns / 1e9) if total_ns else 0.0,
        "placement_latency_ms_p50": hist.get_value_at_percentile(50) / 1e6,
        "placement_latency_ms_p99": hist.get_value_at_percentile(99) / 1e6,
        "placement_latency_ms_max": hist.get_max_value() / 1e6,
        "active_gpus": cluster.active,
        "violations": len(cluster.violations()),
    }


@click.command("scheduler", epilog=workloads_epilog())
@click.option("--nodes", type=click.IntRange(min=1, max=100_000), default=1000, show_default=True,
              help="Nodes of the cluster, a count.")
@click.option("--gpus-per-node", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="GPUs of each node, a count.")
@click.option("--gpu-memory-gib", type=Finite(min=0, min_open=True, max=1024), default=40, show_default=True,
              help="Memory of each GPU in GiB (2**30 bytes; at most 1 TiB, far above any GPU's).")
@click.option("--max-gpu-instances", type=click.IntRange(min=0), default=0, show_default=True,
              help="Instances one GPU takes at most (MPS client limit, 48; 0: no cap).")
@click.option("--gamma", type=Finite(min=1), default=1.5, show_default=True, help="Cap on Σ limit quotas per GPU.")
@click.option("--instances", type=click.IntRange(min=0), default=10_000, show_default=True, help="Synthetic mode: instances to fill.")
@click.option("--churn", type=click.IntRange(min=0), default=2_000, show_default=True, help="Synthetic mode: retire+place pairs after filling.")
@click.option("--seed", type=int, default=0, show_default=True, help="Synthetic mode: seed of the random instances.")
@click.option("--workload", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Replay a dilu-sim event list instead (the bundled ones are listed below).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=writable_output,
              help="Write the figures here.")
def bench_scheduler(nodes, gpus_per_node, gpu_memory_gib, max_gpu_instances, gamma, instances, churn, seed, workload,
                    json_path) -> None:
    """Placement speed (synthetic) or packing quality against the lower bound (--workload).
    Ctrl-C or SIGTERM stops it with exit status 130 (143)."""
    ctx = click.get_current_context()
    synthetic_only = [f"--{n}" for n in ("instances", "churn", "seed")
                      if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if workload and synthetic_only:  # the workload's events say what is placed; these would be ignored
        raise click.UsageError(f"--workload replays its own events; {', '.join(synthetic_only)} "
                               f"{'is' if len(synthetic_only) == 1 else 'are'} for the synthetic mode only")
    with SignalExit():
        try:
            if workload:
                out = replay(workload, nodes, gpus_per_node, gpu_memory_gib, gamma, max_gpu_instances)
            else:
                out = synthetic(nodes, gpus_per_node, instances, churn, gpu_memory_gib, gamma, seed, max_gpu_instances)
        except WorkloadError as exc:  # bad input: the file given (exit 2, as dilu sim says it)
            raise click.BadParameter(str(exc), param_hint="'--workload'") from None
        except ValueError as exc:  # a cluster no GPU could exist in
            raise click.ClickException(str(exc)) from None
        text = json.dumps(out, indent=2)
        click.echo(text)
        if json_path:
            write_output(json_path, text + "\n")
