"""``dilu bench sim``: the simulator's speed at cluster scale. Default: 1000 nodes x 4 GPUs x
8 hours of the bundled Azure Functions 2019 trace (every function of the span), 10 % of the GPUs
running training jobs, policy dilu. Prints (and with ``--json`` writes) ``events``,
``events_per_s``, ``wall_s`` (the simulation, without building the plan and profiles),
``prepare_s``, ``peak_rss_bytes`` (the process's peak resident set, from getrusage), the run's
size (requests, functions, GPUs, ``hours`` simulated: fewer than asked when the trace ends
first, which a line on stderr says) and its headline figures. Goal: ``wall_s`` < 300 on 2 cores."""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import click

from dilu.services.common.cliopts import Finite, writable_output, write_output
from dilu.services.common.interrupt import SignalExit
from dilu.services.common.policies import POLICIES


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def run_bench(nodes: int = 1000, gpus_per_node: int = 4, hours: float = 8.0, functions: int | str = "all",
              policy: str = "dilu", seed: int = 1, training_jobs: float = 0.1, trace_dir: str | None = None) -> dict:
    """Simulate once and measure it; returns the figures of the module docstring."""
    from .run import SimConfig, Simulation, prepare

    cfg = SimConfig(trace_dir=trace_dir, functions=functions, hours=hours, nodes=nodes, gpus_per_node=gpus_per_node,
                    seed=seed, training_jobs=training_jobs)
    t0 = time.perf_counter()
    work = prepare(cfg)
    prepared = time.perf_counter() - t0
    rep, facts = Simulation(cfg, policy, work).run()
    t = rep.totals
    return {
        "bench": "sim", "policy": policy, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpus": cfg.gpus,
        "hours": round(work.plan.duration_s * cfg.speedup / 3600.0, 6),  # what the trace held of those asked
        "functions": len(work.plan.functions), "training_jobs": len(work.specs) - len(work.plan.functions),
        "requests": len(work.plan.invocations), "seed": seed,
        "events": facts.events, "wall_s": facts.compute_s,
        "events_per_s": round(facts.events / facts.compute_s, 1) if facts.compute_s else None,
        "prepare_s": round(prepared, 3), "peak_rss_bytes": peak_rss_bytes(),
        "peak_active_gpus": facts.peak_active_gpus, "slo_violation_rate": t.slo_violation_rate,
        "cold_start_requests": t.cold_start_requests, "active_gpu_seconds": t.active_gpu_seconds,
    }


@click.command("sim")
@click.option("--nodes", type=click.IntRange(1, 100_000), default=1000, show_default=True,
              help="simulated nodes, a count")
@click.option("--gpus-per-node", type=click.IntRange(1, 64), default=4, show_default=True,
              help="simulated GPUs (A100 40 GB) per node, a count")
@click.option("--hours", type=Finite(min=0, min_open=True, max=24 * 14), default=8.0, show_default=True,
              help="hours of trace replayed, in simulated (trace) time, not wall time")
@click.option("--functions", default="all", show_default=True, help="K busiest functions of the span, or 'all'")
@click.option("--policy", type=click.Choice(list(POLICIES)), default="dilu", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--training-jobs", type=Finite(0, 1), default=0.1, show_default=True,
              help="fraction of the GPUs running a training job")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=writable_output, help="write the figures here")
def bench_sim(nodes, gpus_per_node, hours, functions, policy, seed, training_jobs, json_path):
    """Simulator speed: events/s, wall seconds and peak memory of a cluster-scale run (goal: 1000 x 4 GPUs x 8 h < 5 min).
    Ctrl-C or SIGTERM stops it with exit status 130 (143)."""
    with SignalExit():  # first: the imports below take a moment
        from dilu.loadgen.trace import TraceError

        if functions != "all":
            try:
                functions = int(functions)
            except ValueError:
                raise click.BadParameter(f"expected a count or 'all', got {functions!r}",
                                         param_hint="--functions") from None
            if functions < 1:
                raise click.BadParameter(f"need at least 1 function, got {functions}", param_hint="--functions")
        try:
            result = run_bench(nodes, gpus_per_node, hours, functions, policy, seed, training_jobs)
        except (TraceError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        if result["hours"] < hours * (1 - 1e-6):
            click.echo(f"--hours {hours:g}: the trace has only {result['hours']:g} hours from its start; "
                       f"simulated those", err=True)
        text = json.dumps(result, indent=2)
        if json_path:
            write_output(json_path, text + "\n")
        click.echo(text)
