"""``dilu sim``: the platform's policies on a simulated cluster of N nodes x G GPUs over a real
trace, in simulated time (:mod:`dilu.loadgen.sim`); or, with ``--workload``, the paper's
scheduling workloads through the placement policy.

Every option can also come from ``DILU_<FLAG>`` (``--nodes`` -> ``DILU_NODES``), as for every
command.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from dilu.loadgen.arrivals import SPEEDUP_MAX, SPEEDUP_MIN
from dilu.loadgen.sim.calibrate import MIN_BATCHES, MIN_STARTS
from dilu.loadgen.sim.crosscheck import DRAWS
from dilu.services.common import models
from dilu.services.common.cliopts import (PARK_AFTER_S_TYPE, Finite, ZeroOrAtLeast, flag_envvar, writable_dir,
                                         writable_output, write_output)
from dilu.services.common.console import count_of, output_failed
from dilu.services.common.interrupt import Interrupt, SignalExit
from dilu.services.common.policies import (DEFRAG_INTERVAL_MIN_S, DEFRAG_INTERVAL_S, PARK_AFTER_S, POLICIES,
                                           policy_names)
from dilu.services.horizontal_scaler.policy import HorizontalConfig
from dilu.services.scheduler.bench import workloads_epilog

_WORKLOAD_OPTIONS = ("workload", "nodes", "gpus_per_node", "json_path")  # what a --workload run reads


def _policies(_ctx, param, value: str) -> list[str]:
    try:
        return policy_names(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _functions(_ctx, param, value: str) -> int | str:
    if value == "all":
        return "all"
    try:
        k = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a count or 'all', got {value!r}", param=param) from None
    if k < 1:
        raise click.BadParameter(f"need at least 1 function, got {k}", param=param)
    return k


def _opt(*decls, **kw):
    """A click option whose variable is DILU_<FLAG>."""
    flag = next(d for d in decls if d.startswith("--"))
    return click.option(*decls, envvar=flag_envvar(flag, not kw.get("is_flag")), show_envvar=True, **kw)


@click.command("sim", epilog=workloads_epilog())
@_opt("--trace", "trace_dir", type=click.Path(exists=True, file_okay=False), default=None,
      help="trace directory in the Azure Functions 2019 format (default: the bundled 100-function sample)")
@_opt("--functions", default="16", show_default=True, callback=_functions, help="K busiest functions of the span, or 'all'")
@_opt("--hours", type=Finite(min=0, min_open=True, max=24 * 14), default=1.0, show_default=True,
      help="hours of trace replayed (simulated time)")
@_opt("--start-minute", type=click.IntRange(min=0), default=None,
      help="trace minute to begin at, one the trace holds (default: the trace's first)")
@_opt("--speedup", type=Finite(min=SPEEDUP_MIN, max=SPEEDUP_MAX), default=1.0, show_default=True,
      help="compress trace time as dilu demo --speedup does: the replay lasts hours / speedup and the "
           "horizontal windows shrink with it; cold starts do not (dilu demo's default is 10)")
@_opt("--nodes", type=click.IntRange(min=1, max=100_000), default=1, show_default=True,
      help="nodes simulated (a --workload run: 1000 unless given)")
@_opt("--gpus-per-node", type=click.IntRange(min=1, max=64), default=4, show_default=True, help="A100 40 GB GPUs per node")
@_opt("--policies", default="dilu,horizontal-only", show_default=True, callback=_policies,
      help=f"comma-separated, from: {', '.join(POLICIES)}")
@_opt("--seed", type=click.IntRange(min=0), default=1, show_default=True,
      help="seeds the arrivals within each trace minute and the models assigned to functions")
@_opt("--training-jobs", type=Finite(min=0, max=1), default=0.0, show_default=True,
      help="fraction of the GPUs running a training job (0.1: one GPU in ten)")
@_opt("--keep-alive-s", type=Finite(min=0, max=86_400), default=HorizontalConfig.keep_alive_s, show_default=True,
      help="fallback keep-alive of an idle function, trace seconds (the horizontal scaler's; dilu, dilu-published, "
           "static-mps and exclusive keep by the idle-time histogram once it is representative; horizontal-only "
           "scales to zero as Knative does and ignores it)")
@_opt("--park-after-s", type=PARK_AFTER_S_TYPE, default=None,
      help="park an idle function's instances after this many trace seconds, every policy (their GPU share "
           "and placement freed but for their CUDA context's memory, weights kept in host memory and copied back at "
           f"{models.RESUME_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s when a request comes); 0: never (default: as "
           f"each policy does live, dilu after {PARK_AFTER_S:g} s, the others never)")
@_opt("--defrag-interval-s", type=ZeroOrAtLeast(DEFRAG_INTERVAL_MIN_S, 86_400), default=None,
      help="how often the scheduler of dilu and dilu-published defragments (moves instances off lightly used "
           "GPUs, each drained once its replacement is ready), trace seconds; 0: never (default: "
           f"{DEFRAG_INTERVAL_S:g}, as they do live). The baselines never defragment, whatever this says")
@_opt("--process-start-ms", type=Finite(min=0, max=models.PROCESS_START_MAX_MS), default=None,
      help="an instance's process start before its weights load (a cold start is this plus the weights at "
           "4 GB/s); set it to what your node measures (the node agent logs cold_start_ms per instance; "
           f"dilu calibrate measures it) (default: the --overheads file's, else {models.PROCESS_START_MS:g})")
@_opt("--overheads", "overheads_path", type=click.Path(exists=True, dir_okay=False), default=None,
      help="add what a live node adds to each request and batch (and between batches) beyond the modelled GPU "
           "time, as measured by "
           "dilu calibrate --json (for a cross-check against the emulated node; default: nothing)")
@_opt("--overheads-seed", type=click.IntRange(min=0), default=None,
      help="seeds the draws of --overheads alone (default: --seed): the same requests meet other overheads, "
           "and the control loops (the horizontal tick, the telemetry, the defragmentation round) other "
           "phases, as a live rerun of the same plan does")
@_opt("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
      help='write {"policies": {name: report}, "sim": {...}} here (the format of dilu compare --json)')
@_opt("--plots", "plots_dir", type=click.Path(file_okay=False), default=None, callback=writable_dir,
      help="write PNG plots here (active GPUs, latency/SLO CDF, cold starts, fragmentation over time)")
@_opt("--workload", type=click.Path(exists=True, dir_okay=False), default=None,
      help="replay a dilu-sim scheduling workload (the bundled ones are listed below) through the placement "
           "policy instead of a trace (default size: 1000 nodes)")
def sim(trace_dir, functions, hours, start_minute, speedup, nodes, gpus_per_node, policies, seed, training_jobs,
        keep_alive_s, park_after_s, defrag_interval_s, process_start_ms, overheads_path, overheads_seed, json_path,
        plots_dir, workload) -> None:
    """Simulate the platform's policies over a real trace (deterministic per seed) and print the
    comparison table, as dilu compare does for live runs. In a simulated report, seconds are
    simulated seconds ("wall s" and goodput's denominator included), and the vertical reaction's
    delay is not modelled (a grant is decided at the vertical scaler's next tick, every 250 ms, or
    at a stretch, and takes effect at once, on a running batch's kernels not yet launched too). Ctrl-C
    or SIGTERM stops it: the policies already finished are still reported (and written), and it
    exits with 130 (143)."""
    with SignalExit() as stop:  # from the first import to the report's last line (its exit: 130, 143)
        from dilu.cli.demo import make_console

        console = make_console()  # the demo's width rule: 100 columns in a file or pipe unless COLUMNS says
        if workload:
            _replay_workload(console, workload, nodes, gpus_per_node, json_path)
            return
        _simulate(console, stop, trace_dir, functions, hours, nodes, gpus_per_node, seed, training_jobs,
                  start_minute, speedup, keep_alive_s, park_after_s, defrag_interval_s, process_start_ms,
                  overheads_path, overheads_seed, policies, json_path, plots_dir)


def _replay_workload(console, workload, nodes, gpus_per_node, json_path) -> None:
    """:func:`sim` with ``--workload``: the placement policy alone over a scheduling workload."""
    from dilu.loadgen.sim.workload import WorkloadError, simulate_workload

    ctx = click.get_current_context()
    unused = [p.opts[0] for p in ctx.command.params
              if p.name not in _WORKLOAD_OPTIONS and ctx.get_parameter_source(p.name).name == "COMMANDLINE"]
    if unused:
        raise click.UsageError(f"--workload replays the placement policy alone; {', '.join(unused)} "
                               f"{'does' if len(unused) == 1 else 'do'} not apply to it")
    if ctx.get_parameter_source("nodes").name == "DEFAULT":
        nodes = 1000
    try:
        out = simulate_workload(workload, nodes=nodes, gpus_per_node=gpus_per_node)
    except WorkloadError as exc:  # bad input: the file given (exit 2)
        raise click.BadParameter(str(exc), param_hint="--workload") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    _print_workload(out, console)
    if json_path:
        write_output(json_path, json.dumps({"sim": out}, indent=2) + "\n")
        console.print(f"written to {json_path}")


def _simulate(console, stop: SignalExit, trace_dir, functions, hours, nodes, gpus_per_node, seed, training_jobs, start_minute,
              speedup, keep_alive_s, park_after_s, defrag_interval_s, process_start_ms, overheads_path,
              overheads_seed, policies, json_path, plots_dir) -> None:
    """:func:`sim` after its workload branch: read the overheads, simulate, show. Stopped (``stop``),
    it reports the policies that finished and says so in ``stop``'s line."""
    from dilu.loadgen.sim.overheads import Overheads, OverheadsError
    from dilu.loadgen.sim.run import EmptySpan, Interrupted, SimConfig, simulate
    from dilu.loadgen.trace import TraceError

    if overheads_seed is not None and not overheads_path:
        raise click.UsageError("--overheads-seed (DILU_OVERHEADS_SEED) seeds the draws of --overheads "
                               "(DILU_OVERHEADS), which is not given")
    try:
        overheads = Overheads.read(overheads_path) if overheads_path else None
    except OverheadsError as exc:
        raise click.BadParameter(str(exc), param_hint="--overheads") from None
    by_starting: tuple[float, ...] = ()  # the file's process starts by launches in progress, unless one is given
    initial: tuple[float, ...] = ()  # and the file's of the deploy's launches
    if process_start_ms is None:
        process_start_ms = overheads.start_ms if overheads is not None else models.PROCESS_START_MS
        by_starting = overheads.process_start_by_starting_ms if overheads is not None else ()
        initial = overheads.process_start_initial_ms if overheads is not None else ()
    if overheads is not None:
        start = (f"process start {_by_starting(by_starting)}" if by_starting
                 else f"process start {process_start_ms:g} ms")
        if initial:
            start += f"; the deploy's launches up, by launch order, {_by_starting(initial)}"
        missing = [what for what, table in (("pickup", overheads.pickup_ms), ("dispatch", overheads.dispatch_ms))
                   if not table]
        if missing:  # a file of an older build
            start += f"; no {' or '.join(missing)} in the file: none drawn"
        if overheads.horizontal_tick_ms is not None:
            start += f"; horizontal tick {overheads.horizontal_tick_ms:g} ms"
        if overheads.loop_timings:
            start += (f"; the loop timing of {count_of(len(overheads.loop_timings), 'run', 'runs')}, replayed "
                      "if this deploy launches as many instances (sim.policies.P.loop_timing_replayed says; "
                      "else the phases are drawn)")
        console.print(f"[dim]with the overheads of {overheads_path} (drawn with seed "
                      f"{seed if overheads_seed is None else overheads_seed}); {start}[/dim]", highlight=False)

    _check_span(console, trace_dir, hours, start_minute, speedup)
    try:
        cfg = SimConfig(trace_dir=trace_dir, functions=functions, hours=hours, nodes=nodes, gpus_per_node=gpus_per_node,
                        seed=seed, training_jobs=training_jobs, start_minute=start_minute,
                        speedup=speedup, keep_alive_s=keep_alive_s, park_after_s=park_after_s,
                        defrag_interval_s=defrag_interval_s, process_start_ms=process_start_ms,
                        process_start_by_starting_ms=by_starting, process_start_initial_ms=initial,
                        overheads=overheads, overheads_seed=overheads_seed)
        out = simulate(cfg, policies, progress=lambda p: console.print(f"[dim]simulating policy {p}[/dim]"),
                       tick=lambda p, done, total: console.print(
                           f"[dim]{p}: {done:,.0f} of {total:,.0f} simulated s[/dim]", highlight=False))
    except BrokenPipeError:  # the reader of the output left: the command line's 141, not a failure
        raise
    except TraceError as exc:  # bad input: the trace given (exit 2)
        raise click.BadParameter(str(exc), param_hint="--trace") from None
    except EmptySpan as exc:  # the options ask for nothing to replay (exit 2)
        raise click.BadParameter(str(exc), param_hint="--hours") from None
    except OSError as exc:
        if output_failed(exc):  # the command line says it in one line
            raise
        raise click.ClickException(exc.strerror or str(exc)) from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except Interrupted as exc:
        done = list(exc.partial["policies"])
        stop.line = f"{exc}: {', '.join(done) + ' finished' if done else 'no policy finished'}"
        if done:
            exc.partial["sim"]["interrupted"] = {"during": exc.policy, "policies_asked": policies}
            _show(exc.partial, console, functions, json_path, plots_dir)
        raise Interrupt from None  # SignalExit: the line, and 128 + the signal (Ctrl-C's when none)
    _show(out, console, functions, json_path, plots_dir)


def _check_span(console, trace_dir, hours: float, start_minute: int | None, speedup: float) -> None:
    """Before anything is simulated: a --start-minute outside the trace is a bad option (exit 2),
    and --hours past the trace's end is said at once (the run simulates what the trace holds). A
    trace that cannot be read is left to the run, which says why."""
    from dilu.loadgen import arrivals
    from dilu.loadgen.trace import TraceError, read_trace

    try:
        tr = read_trace(trace_dir)
    except (TraceError, OSError, ValueError):
        return
    try:
        held_s = arrivals.replay_s(tr, duration_s=hours * 3600.0 / speedup, speedup=speedup, start_minute=start_minute)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--start-minute") from None
    span_h = held_s * speedup / 3600.0
    if span_h < hours * (1 - 1e-6):
        console.print(f"[yellow]--hours {hours:g}: the trace has only {span_h:g} hours from its start minute; "
                      f"simulating those[/yellow]", highlight=False)


def _parking_line(name: str, s: dict) -> str:
    """One policy's parking in words, from its ``sim`` facts (:class:`SimFacts`, counted to the end
    of the drain, where the report's parks and resumes stop at the replay's end): instances
    parked, resumed on the GPU they left, relaunched elsewhere (that GPU was full: a new instance,
    a cold start) and refused (no GPU had room: the instance stayed parked, as live), and the
    requests that waited for a resume."""
    refused = s["resumes_refused"] - s["relaunches"]
    waits = s["resume_waits"]
    return (f"{name}: {count_of(s['parks'], 'instance')} parked, {s['resumes']:,} resumed in place, {s['relaunches']:,} "
            f"relaunched elsewhere (their GPU full), {refused:,} refused (no GPU had room), to the end of the drain "
            f"(the table's parks and resumes stop at the replay's end); "
            f"{count_of(waits, 'request')} waited for a resume (no launch: not {'a cold-start request' if waits == 1 else 'cold-start requests'})")


def _show(out: dict, console, functions, json_path: str | None, plots_dir: str | None) -> None:
    """Print the comparison of ``out`` (:func:`simulate`'s output) and write its JSON and plots."""
    from dilu.loadgen import report

    if json_path:  # first: what was simulated is kept even when the reader of the output leaves
        write_output(json_path, dumps(out))
    first = next(iter(out["policies"].values()))
    if isinstance(functions, int) and first["run"]["functions"] < functions:
        console.print(f"[yellow]--functions {functions}: the span has only {count_of(first['run']['functions'], 'function')} "
                      f"with invocations; simulated those[/yellow]")
    asked = out["sim"]["config"].get("training_jobs") or 0
    if asked and not first["run"]["training_jobs"]:  # round(fraction x GPUs), as the live demo places them
        console.print(f"[yellow]--training-jobs {asked:g}: {asked:.0%} of {count_of(first['run']['gpus'], 'GPU')} "
                      f"rounds to no job; simulated none[/yellow]")
    report.render_compare({k: report.Report.from_dict(v) for k, v in out["policies"].items()}, console, simulated=True)
    for name, s in out["sim"]["policies"].items():
        console.print(f"{name}: {s['events']:,} events in {s['compute_s']:.1f} s of computing; peak {count_of(s['peak_active_gpus'], 'active GPU')}, "
                      f"largest Σ limits on a GPU {s['max_limit_sum']:.2f}")
        if s["parks"]:
            console.print(_parking_line(name, s))
        if s["migrations"]:
            console.print(f"{name}: {count_of(s['migrations'], 'instance')} moved by defragmentation, every "
                          f"{s['defrag_interval_s']:g} trace s (each relaunched on a fuller GPU, then drained)")
        if s["unplaced"]:
            console.print(f"{name}: {s['unplaced']:,} placements refused (no GPU had room for the instance)")
    if json_path:
        console.print(f"comparison written to {json_path}")
    if plots_dir:
        from dilu.loadgen.sim.plots import write_plots

        try:
            paths = write_plots(out, Path(plots_dir))
        except OSError as exc:
            raise click.ClickException(f"cannot write the plots into {plots_dir}: {exc.strerror or exc}") from None
        for p in paths:
            console.print(f"plot written to {p}")


def dumps(out: dict) -> str:
    """The JSON of a simulation (indented, keys in a fixed order: byte-identical per seed)."""
    return json.dumps(out, indent=2) + "\n"


# the figures of a scheduling workload's replay (services/scheduler/bench.py defines them), in words
_WORKLOAD_FIGURES = (
    ("events", "start and delete events replayed"),
    ("peak_active_gpus", "peak active GPUs"),
    ("lower_bound_peak", "fewest GPUs any placement needs at the peak"),
    ("mean_active_gpus", "mean active GPUs (time-weighted)"),
    ("max_limit_sum", "largest Σ limit quotas on one GPU (cap: γ)"),
    ("allocation_fragmentation", "allocation fragmentation (1 − Σ requests, mean, 0..1)"),
    ("unplaced", "instances no GPU had room for"),
    ("violations", "broken placement invariants"),
)


def _print_workload(out: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"Scheduling workload {out['workload']} on {out['nodes']} x {out['gpus_per_node']} GPUs")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("JSON key", style="dim")
    for k, label in _WORKLOAD_FIGURES:
        v = out[k]
        table.add_row(label, f"{v:.3f}" if isinstance(v, float) else f"{v:,}", k)
    console.print(table)
    if out["unplaced"]:
        console.print(f"[yellow]{count_of(out['unplaced'], 'instance')} found no GPU with room on {out['nodes']} x "
                      f"{out['gpus_per_node']} GPUs: the peaks and the lower bound count the placed ones "
                      f"only[/yellow]", highlight=False)


@click.command("calibrate")
@click.argument("log_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@_opt("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
      help="write the overheads here, for dilu sim --overheads")
@_opt("--min-batches", type=click.IntRange(min=1), default=MIN_BATCHES, show_default=True,
      help="leave out a function and batch size with fewer batches than this, live or simulated")
@_opt("--starts-from", "starts_from", multiple=True,
      type=click.Path(exists=True, file_okay=False, path_type=Path),
      help="measure the process starts of the launches after the deploy from these runs' log directories "
           "instead (repeat it; they may include LOG_DIRS): one run launches too few instances for them, where its "
           "way in and back, batch overhead, pickups, dispatches and deploy's launches are its own (README, At "
           "cluster scale); DILU_STARTS_FROM separates them with ':'")
def calibrate(log_dirs, json_path, min_batches, starts_from) -> None:
    """Measure what the live node adds beyond the simulator's model, from the log directories of
    live runs (each a policy's directory under dilu demo/compare --log-dir, holding
    requests.jsonl, report.json, node_agent.log, and horizontal_scaler.log and scheduler.log for
    the loop timing): the process start of an instance, the way in and back of a request, how
    much longer a batch's service takes than simulated on the run's own plan, the pickup between
    two batches of an instance while requests wait, the dispatch of a request to an idle
    instance, when the deploy's launches (every function's first instance, all at once) are up,
    by launch order, and when each run met its control loops (the horizontal scaler's tick, the
    first request and a defragmentation round after the deploy's tick; not measured without
    those logs). Prints them; --json writes them for dilu sim --overheads."""
    with SignalExit():  # a stop says "interrupted" and exits 130 / 143, as every long command
        from rich.table import Table

        from dilu.cli.demo import make_console
        from dilu.loadgen.sim import calibrate as cal
        from dilu.loadgen.trace import TraceError

        console = make_console()
        try:
            ov = cal.calibrate(list(log_dirs), min_batches, list(starts_from) or None)
        except OSError as exc:  # bad input, the log directories given (exit 2)
            raise click.BadParameter(f"cannot calibrate: cannot read {exc.filename or ''}: {exc.strerror or exc}",
                                     param_hint="LOG_DIRS") from None
        except cal.StartsFromError as exc:
            raise click.BadParameter(f"cannot calibrate: {exc}", param_hint="--starts-from") from None
        except (ValueError, TraceError) as exc:
            raise click.BadParameter(f"cannot calibrate: {exc}", param_hint="LOG_DIRS") from None
        table = Table(title="Overheads of the live node beyond the simulated GPU time (ms)")
        table.add_column("overhead")
        for q in ("p10", "p50", "p90", "p99", "max"):
            table.add_column(q, justify="right")
        for name, tab in (("way in + way back of a request", ov.transport_ms),
                          ("a batch's service beyond the simulated one", ov.batch_ms),
                          ("pickup of the next batch while requests wait", ov.pickup_ms),
                          ("dispatch of a request to an idle instance", ov.dispatch_ms)):
            if tab:
                table.add_row(name, *(f"{tab[k]:.1f}" for k in (10, 50, 90, 99, 100)))
        console.print(table)
        src = ov.source
        console.print(f"{src['transport_samples']:,} requests, {src['batch_samples']:,} batches, "
                      f"{src['pickup_samples']:,} pickups, {src['dispatch_samples']:,} dispatches; process start "
                      + (f"{ov.process_start_ms:g} ms (median of {count_of(src['process_start_samples'], 'launch', 'launches')})"
                         if ov.process_start_ms is not None else "not measured (no launch after the initial ones)"),
                      highlight=False)
        by_starting = (_by_starting(ov.process_start_by_starting_ms) if ov.process_start_by_starting_ms else
                       f"not measured (an entry needs {MIN_STARTS} launches after the initial ones)")
        console.print(f"process start (ms) with k other instances starting on the node, k: {by_starting}",
                      highlight=False)
        initial = (f"{_by_starting(ov.process_start_initial_ms)} "
                   f"({count_of(src['initial_process_start_samples'], 'launch', 'launches')})"
                   if ov.process_start_initial_ms else "not measured")
        console.print("the deploy's launches (every function's first instance, all at once; a later one starts "
                      f"beside more): ms from the first launch until the k-th one's process is up, k: {initial}",
                      highlight=False)
        tick = (f"{ov.horizontal_tick_ms:g} ms (over {count_of(src['horizontal_ticks'], 'tick', 'ticks')} between "
                "its decisions)" if ov.horizontal_tick_ms is not None else "not measured (no horizontal scaler's log, "
                "or too few decisions)")
        console.print(f"the horizontal scaler's tick: {tick}; after the deploy's tick (ms), the replay's start: "
                      + (", ".join(f"{t.first_request_ms:g}" for t in ov.loop_timings) or "not measured")
                      + "; a defragmentation round: "
                      + (", ".join("none logged" if t.defrag_ms is None else f"{t.defrag_ms:g}" for t in ov.loop_timings)
                         or "not measured"), highlight=False)
        if json_path:
            write_output(json_path, ov.to_json().decode())
            console.print(f"written to {json_path}")


def _by_starting(table: tuple[float, ...]) -> str:
    """A process start table for people: "0: 450 ms, 1: 600 ms, 2+: 900 ms" (the last also for more)."""
    last = len(table) - 1
    return ", ".join(f"{k}{'+' if k == last else ''}: {ms:g} ms" for k, ms in enumerate(table))


@click.command("crosscheck")
@click.argument("log_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@_opt("--draws", type=click.IntRange(min=1, max=1000), default=DRAWS, show_default=True,
      help="simulations of each run, drawing its overheads and loop phases with --overheads-seed 1, 2, ...")
@_opt("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
      help='also write {"tolerance", "draws", "rows": [{seed, policy, runs, figures: {figure: {live, sim, '
           'sim_runs, relative_difference, within_tolerance, standard_errors}}}]} here')
@_opt("--min-batches", type=click.IntRange(min=1), default=MIN_BATCHES, show_default=True,
      help="as dilu calibrate's")
def crosscheck(log_dirs, draws, json_path, min_batches) -> None:
    """Set live runs against their simulation: each run's log directory (a policy's, under dilu
    demo/compare --log-dir) is calibrated alone (its way in and back, batch overhead, pickups and
    dispatches, its deploy's launches and loop timing; the process starts of later launches from
    all LOG_DIRS, as dilu calibrate --starts-from) and simulated --draws times
    on its own plan and policy. Runs of one comparison (the same trace, start minute, seed,
    duration, speed-up, functions, GPUs, training jobs and parking and defragmentation settings,
    as dilu summarize asks) and policy form a row; for the SLO
    violation rate, cold-start requests, instance launches and active GPU·s it prints the live
    mean (lowest–highest), the simulated mean over every draw (lowest–highest), their difference
    relative to the live mean, and that difference in standard errors (SE: the live mean's and
    the simulated mean's, over each run's mean of its draws, combined as the square root of the
    sum of their squares; a standard error is the standard deviation over the square root of the
    number of runs). Agreement: within 15 % of the live mean. The JSON keys figures by these
    names; sim_runs holds each run's mean over its draws."""
    with SignalExit():
        from rich.table import Table

        from dilu.cli.demo import make_console
        from dilu.loadgen.sim import crosscheck as xc
        from dilu.loadgen.trace import TraceError

        console = make_console()
        try:
            rows = xc.crosscheck(list(log_dirs), draws, min_batches,
                                 progress=lambda d, done: console.print(
                                     f"[dim]calibrating and simulating {d}[/dim]" if not done else
                                     f"[dim]{d}: {done:,} of {count_of(draws, 'draw')}[/dim]", highlight=False),
                                 warn=lambda line: console.print(f"[yellow]{line}[/yellow]", highlight=False))
        except OSError as exc:
            if output_failed(exc):
                raise
            raise click.BadParameter(f"cannot cross-check: cannot read {exc.filename or ''}: {exc.strerror or exc}",
                                     param_hint="LOG_DIRS") from None
        except (ValueError, TraceError) as exc:
            raise click.BadParameter(f"cannot cross-check: {exc}", param_hint="LOG_DIRS") from None
        table = Table(title=f"Live runs and their simulation ({count_of(draws, 'draw')} of each run's overheads)")
        for name, justify in (("seed, policy", "left"), ("figure", "left"), ("live", "right"),
                              ("simulated", "right"), ("sim - live", "right"), ("SE", "right")):
            table.add_column(name, justify=justify, no_wrap=name != "seed, policy")
        for row in rows:
            label = f"{row.seed}, {row.policy}\n{count_of(len(row.runs), 'run')}"
            for name, f in row.figures.items():
                rate = name == "SLO violation rate"
                z = f.standard_errors
                table.add_row(label, "SLO violations %" if rate else name, _spread(f.live, rate),
                              _spread(f.sim, rate),
                              "–" if f.relative is None else f"{100 * f.relative:+.0f} %" + (" *" if f.within else ""),
                              "–" if z is None else f"{z:+.1f}")
                label = ""
            table.add_section()
        console.print(table)
        counts = ", ".join(f"{name} in {sum(r.figures[name].within for r in rows)}" for name in xc.FIGURES)
        console.print(f"*: the simulated mean is within {100 * xc.TOLERANCE:g} % of the live mean; of "
                      f"{count_of(len(rows), 'seed and policy row', 'seed and policy rows')}, "
                      f"within it: {counts}.", highlight=False)
        console.print("SE: the difference (sim - live) in standard errors of the two means together; beyond "
                      "±2, chance between runs alone would rarely make it (–: one live run, no standard error). "
                      "Each mean has its lowest–highest beside it.", highlight=False)
        if json_path:
            out = {"tolerance": xc.TOLERANCE, "draws": draws, "rows": [r.to_dict() for r in rows]}
            write_output(json_path, json.dumps(out, indent=2) + "\n")
            console.print(f"written to {json_path}")


def _spread(s, rate: bool) -> str:
    """A row's figure over runs for people: "1.2 (0.7–2.1)" (a rate, in %), "16.2 (7–22)" (a
    count or GPU·s: lowest and highest to the unit, so a mean of counts keeps its decimal)."""
    if rate:
        return f"{100 * s.mean:.1f} ({100 * s.low:.1f}–{100 * s.high:.1f})"
    if s.low != round(s.low):  # GPU·s: the mean to the unit too, never outside its range as printed
        return f"{s.mean:,.0f} ({s.low:,.0f}–{s.high:,.0f})"
    return f"{s.mean:,.1f} ({s.low:,.0f}–{s.high:,.0f})"
