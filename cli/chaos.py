"""``dilu chaos``: the whole platform under trace load while its processes fail, or a soak.

A run starts the local cluster (:class:`Cluster`, as ``dilu demo`` does), deploys the replayed
functions, replays the trace open loop and, spread over the replay (:func:`chaos.schedule`),
injects each fault: kill -9 of each service and its restart (as ``Restart=on-failure`` would),
a nats-server crash and restart on the same store, kill -9 of a function instance, the node
agent stopped (SIGSTOP) for 5 s. Once the load is over the node agent is killed for good and
every instance must end with it. The report counts how every request ended (nothing lost, no
duplicate reaching the caller), each fault's recovery time and the largest sum of quotas in
force on a GPU. ``--soak`` replays without faults and reports the slope of every process's
own memory (private dirty pages outside shared-memory segments), descriptors and threads, and of
the node's shared-memory segments (count and allocated bytes).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import tempfile
import time
import uuid
from pathlib import Path

import click
import psutil
from rich.console import Console
from rich.table import Table

from dilu.loadgen import arrivals, chaos, report, requestlog, trace
from dilu.services.common import logging as dlog
from dilu.services.common.cliopts import Finite, writable_dir, writable_output, write_output
from dilu.services.common.workqueue import DEFAULT_ACK_WAIT_S
from dilu.services.node_agent import segments

from .cluster import NATS, Cluster
from .demo import (RunOptions, _end, _gpus, _install_stop, _replay, _run_or_explain, _start, build_plan, check_span,
                   check_trace, make_console, replay_args)

WHOLE_TIMEOUT_S = 90.0  # longest wait for every process to be running and ready after a fault
ORPHAN_WAIT_S = 10.0  # how long instances may outlive a node agent killed for good
NATS_DOWN_S = 1.0  # how long nats-server stays down before it is started again
# A request held by a killed instance is redelivered after the consumer's ack wait; give it that
# and 30 s more to be answered before it counts as timed out.
TIMEOUT_FLOOR_S = DEFAULT_ACK_WAIT_S + 30.0
INSTANCE_MODULE = "dilu.services.node_agent.instance"
QUOTA_SUM_MAX = "dilu_gpu_quota_sum_max"
MIN_MINUTES = 0.5  # the shortest load of any run; faults need longer (min_minutes)


def instances(cluster: Cluster) -> list[psutil.Process]:
    """The node agent's instance processes (empty when the agent is not running)."""
    svc = cluster.services.get("node_agent")
    if svc is None or svc.proc.poll() is not None:
        return []
    try:
        children = psutil.Process(svc.proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if _is_instance(p)]


def _is_instance(p: psutil.Process) -> bool:
    try:
        return INSTANCE_MODULE in p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _function_of(p: psutil.Process) -> str:
    cmd = p.cmdline()
    return cmd[cmd.index("--function") + 1] if "--function" in cmd else ""


def quota_sum_max(cluster: Cluster) -> float | None:
    """The largest sum of quotas the node agent has written on one GPU since it started (its
    ``dilu_gpu_quota_sum_max`` gauge); None when it does not export one."""
    values = [v for k, v in cluster.metrics("node_agent").items() if k.split("{", 1)[0] == QUOTA_SUM_MAX]
    return max(values) if values else None


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``procs`` to end; returns those still alive."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


class Injector:
    """Injects ``faults`` into ``cluster`` at their times (s after the replay's first send) and
    times each recovery. Blocking calls run in threads so the load generator keeps its schedule."""

    def __init__(self, cluster: Cluster, faults: list[chaos.Fault], seed: int, console: Console,
                 stop: asyncio.Event) -> None:
        self.cluster, self.faults, self.console, self.stop = cluster, faults, console, stop
        self.rng = random.Random(seed)
        self.quota_sums: list[float] = []
        self.orphans = 0  # instances that outlived a node agent killed for good

    async def run(self, gen) -> list[chaos.Fault]:
        for fault in self.faults:
            delay = (gen.started_unix_ns + fault.at_s * 1e9 - time.time_ns()) / 1e9
            if await self._stopped_within(delay):
                fault.detail = "not injected: the run was stopped"
                continue
            fault.started_ns = time.time_ns()
            try:
                await self._inject(fault)
            except Exception as exc:  # noqa: BLE001 - reported in the fault's line, the run goes on
                fault.detail = f"could not inject: {type(exc).__name__}: {exc}"
                continue
            fault.whole_ns = await asyncio.to_thread(self._wait_whole)
            self.console.print(f"[dim]{fault.at_s:7.1f} s  {fault.kind}: {fault.detail or 'injected'}"
                               f"{'' if fault.whole_ns else '; NOT whole again'}[/dim]")
        return self.faults

    async def _stopped_within(self, delay_s: float) -> bool:
        try:
            await asyncio.wait_for(self.stop.wait(), max(0.0, delay_s))
            return True
        except asyncio.TimeoutError:
            return False

    async def _inject(self, fault: chaos.Fault) -> None:
        c = self.cluster
        if fault.kind in chaos.SERVICE_KILLS:
            name = chaos.SERVICE_KILLS[fault.kind]
            if name == "node_agent":
                self.note_quota_sum()
                held = instances(c)
                await asyncio.to_thread(c.kill, name)
                alive = await asyncio.to_thread(wait_gone, held, ORPHAN_WAIT_S)
                fault.detail = f"{len(held)} instances ended with it, {len(alive)} outlived it"
            else:
                await asyncio.to_thread(c.kill, name)
            await asyncio.to_thread(c.restart, name)
        elif fault.kind == chaos.RESTART_NATS:
            await asyncio.to_thread(c.kill, NATS)
            await asyncio.sleep(NATS_DOWN_S)
            await asyncio.to_thread(c.restart, NATS)
        elif fault.kind == chaos.KILL_INSTANCE:
            running = instances(c)
            if not running:
                raise RuntimeError("no instance is running")
            victim = self.rng.choice(sorted(running, key=lambda p: p.pid))
            fault.function = _function_of(victim)
            victim.kill()
            fault.detail = f"killed an instance of {fault.function} (pid {victim.pid})"
        elif fault.kind == chaos.PAUSE_AGENT:
            c.kill("node_agent", signal.SIGSTOP)
            try:
                await asyncio.sleep(chaos.PAUSE_S)
            finally:
                c.kill("node_agent", signal.SIGCONT)
            fault.detail = f"stopped for {chaos.PAUSE_S:g} s"

    def _wait_whole(self) -> int:
        """Unix ns when every process of the cluster runs and is ready; 0 after WHOLE_TIMEOUT_S."""
        deadline = time.monotonic() + WHOLE_TIMEOUT_S
        names = [NATS, *self.cluster.services]
        while time.monotonic() < deadline:
            if all(self.cluster.ready(n) for n in names):
                return time.time_ns()
            time.sleep(0.05)
        return 0

    def note_quota_sum(self) -> None:
        """Keep the node agent's largest quota sum so far (read before it is killed: a restart resets it)."""
        value = quota_sum_max(self.cluster)
        if value is not None:
            self.quota_sums.append(value)

    def lose_agent(self) -> chaos.Fault:
        """Kill the node agent for good; every instance must end within ORPHAN_WAIT_S. Those
        that outlive it are counted in the detail and then killed, so nothing is left running."""
        fault = chaos.Fault(kind=chaos.LOSE_AGENT, at_s=0.0, started_ns=time.time_ns())
        self.note_quota_sum()
        held = instances(self.cluster)
        self.cluster.kill("node_agent")
        alive = wait_gone(held, ORPHAN_WAIT_S)
        for p in alive:
            p.kill()
        fault.detail = f"{len(held)} instances, {len(alive)} outlived the agent by {ORPHAN_WAIT_S:g} s"
        self.orphans = len(alive)
        return fault


class Sampler:
    """Reads the own memory (:func:`chaos.own_bytes`), open descriptors and threads of every
    process of the cluster (services and nats-server), and the count and allocated bytes of the
    node agent's shared-memory segments, every ``period_s`` for ``duration_s`` from the replay's
    first send. Segment pages are told apart from the processes': an emulated GPU's timeline
    fills (to its fixed size) with the kernels instances write, and its pages count as private
    to the agent once those instances have ended."""

    def __init__(self, cluster: Cluster, period_s: float, duration_s: float,
                 stop: asyncio.Event | None = None) -> None:
        self.cluster, self.period_s, self.duration_s = cluster, period_s, duration_s
        self.stop = stop or asyncio.Event()
        self.samples: list[chaos.Sample] = []

    async def run(self, gen) -> list[chaos.Sample]:
        """Sample every ``period_s`` until ``duration_s`` has passed or ``stop`` is set (the replay
        waits for this task, so a stop must end it at once)."""
        t0 = gen.started_unix_ns / 1e9
        while (elapsed := time.time() - t0) <= self.duration_s and not self.stop.is_set():
            self.samples.extend(await asyncio.to_thread(self.read, elapsed))
            try:
                await asyncio.wait_for(self.stop.wait(), self.period_s)
            except TimeoutError:
                pass
        return self.samples

    def read(self, t_s: float) -> list[chaos.Sample]:
        out = []
        procs = {name: svc.proc.pid for name, svc in self.cluster.services.items()}
        if self.cluster.nats and self.cluster.nats.proc:
            procs[NATS] = self.cluster.nats.proc.pid
        for name, pid in procs.items():
            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    own = chaos.own_bytes(p.memory_maps(grouped=True), str(segments.SHM_DIR))
                    out.append(chaos.Sample(process=name, t_s=t_s, private_bytes=own,
                                            fds=p.num_fds(), threads=p.num_threads()))
            except psutil.NoSuchProcess:
                continue
        agent = procs.get("node_agent")
        count = allocated = 0
        for e in segments.SHM_DIR.iterdir():
            if agent is None or segments.owner(e.name) != agent:
                continue
            try:
                allocated += e.stat().st_blocks * 512  # pages written so far: segments are sparse
            except FileNotFoundError:  # removed meanwhile (an instance retired)
                continue
            count += 1
        out.append(chaos.Sample(process="shm-segments", t_s=t_s, private_bytes=allocated, fds=count))
        return out


def min_minutes(kinds: list[str]) -> float:
    """The shortest ``--minutes`` for the faults ``kinds``: MIN_MINUTES, or the run that leaves
    room to schedule them (:func:`chaos.min_duration_s`; lose-node-agent comes after the load),
    rounded up to hundredths of a minute so that the figure named is one that runs."""
    scheduled = chaos.min_duration_s(len([k for k in kinds if k != chaos.LOSE_AGENT]))
    return max(MIN_MINUTES, math.ceil(scheduled / 60.0 * 100 - 1e-9) / 100)


def _faults(value: str) -> list[str]:
    if value == "all":
        return [*chaos.KINDS, chaos.LOSE_AGENT]
    kinds = [k.strip() for k in value.split(",")]
    if not all(kinds):
        raise click.BadParameter("an empty fault kind; for a run without faults use --soak")
    if len(set(kinds)) != len(kinds):
        raise click.BadParameter(f"a fault kind is named twice in {kinds}")
    if "all" in kinds:
        raise click.BadParameter(f"'all' stands alone (every kind, in order), not in a list: {value!r}")
    unknown = [k for k in kinds if k not in (*chaos.KINDS, chaos.LOSE_AGENT)]
    if unknown:
        raise click.BadParameter(f"unknown fault kinds {unknown}; choose from "
                                 f"{', '.join([*chaos.KINDS, chaos.LOSE_AGENT])} or 'all'")
    return kinds


async def run_chaos(opts: RunOptions, kinds: list[str], soak: bool, sample_s: float, console: Console,
                    stop: asyncio.Event) -> dict:
    """One chaos (or soak) run; returns the JSON-ready result (see the module docstring)."""
    run_id = uuid.uuid4().hex[:6]
    plan, chosen, llm_plan = build_plan(opts, run_id)
    short = check_span(plan, llm_plan, "--minutes", opts.duration / 60.0, unit_s=60.0)
    lose = chaos.LOSE_AGENT in kinds
    lead_s, tail_s = chaos.margins_s(plan.duration_s)
    faults = chaos.schedule([k for k in kinds if k != chaos.LOSE_AGENT], plan.duration_s, lead_s=lead_s, tail_s=tail_s)
    created = None if opts.log_dir else Path(tempfile.mkdtemp(prefix="dilu-chaos-"))
    log_dir = Path(opts.log_dir or created)
    log_dir.mkdir(parents=True, exist_ok=True)
    dlog.configure("loadgen", stream=(log_dir / "loadgen.log").open("a", buffering=1))
    console.print(f"[bold]{'soak' if soak else 'chaos'}[/bold]: {len(plan.functions)} functions, "
                  f"{len(plan.invocations)} requests over {plan.duration_s:.0f} s, "
                  f"{len(faults) + lose} faults; logs in {log_dir}")
    if short:  # chaos_cmd checked that the faults fit in what is replayed
        console.print(f"[yellow]{short}[/yellow]", highlight=False)
    cluster = Cluster(log_dir=log_dir, gpus=opts.gpus, nats_url=None, auth=True,
                      extra_args=replay_args(opts.speedup, Cluster.policy))
    injector = Injector(cluster, faults, opts.seed, console, stop)
    sampler = Sampler(cluster, sample_s, plan.duration_s, stop)
    await _start(cluster, created)
    lost_agent = None
    try:
        during = sampler.run if soak else injector.run
        replay = await _replay(opts, cluster, plan, chosen, llm_plan, console, stop, during=during,
                               timeout_floor_s=TIMEOUT_FLOOR_S, drain_s=TIMEOUT_FLOOR_S + 5.0)
        requestlog.write(log_dir / requestlog.FILENAME, replay.result)  # how each request ended, to look into
        injector.note_quota_sum()
        if lose:
            lost_agent = await asyncio.to_thread(injector.lose_agent)
    finally:
        await asyncio.to_thread(cluster.stop)
    out = summarise(replay, plan, injector, lost_agent, sampler if soak else None)
    # minutes replayed: fewer than asked where the trace ended first
    out["run"] = {"minutes": plan.duration_s / 60.0, "minutes_asked": opts.duration / 60.0, "seed": opts.seed,
                  "functions": len(plan.functions), "gpus": opts.gpus, "speedup": opts.speedup, "soak": soak,
                  "log_dir": str(log_dir)}
    return out


def summarise(replay, plan, injector: Injector, lost_agent: chaos.Fault | None, sampler: Sampler | None) -> dict:
    """The run's JSON: the tally, each fault with its recovery, orphans, quota sums, latency and
    SLO violations of the requests, and with a sampler the soak slopes."""
    result, faults = replay.result, injector.faults
    for f in faults:
        f.recovery_s = chaos.recovery_s(f, result.records, result.started_unix_ns)
    unexplained = chaos.timeouts_by_fault(faults, result.records, result.started_unix_ns)
    t = chaos.tally(result.records, offered=len(result.records), duplicate_replies=replay.stats.duplicate_replies)
    meta = {s.name: report.FunctionMeta(model=s.model, slo_ms=s.slo_ms, kind=s.kind) for s in replay.specs}
    totals = report.build_report(result.records, meta, report.RunFacts(), report.run_info(plan, result)).to_dict()["totals"]
    out = {
        "duration_s": round(result.wall_s, 3),
        **{f: getattr(t, f) for f in t.__struct_fields__},
        "timed_out_before_faults": unexplained,
        "late_replies": replay.stats.late_replies,
        "slo_violation_rate": totals["slo_violation_rate"],
        "latency_ms": totals["latency_ms"],
        "faults": [{"kind": f.kind, "at_s": f.at_s, "recovery_s": f.recovery_s, "timed_out": f.timed_out,
                    "function": f.function or None, "detail": f.detail} for f in faults],
        "grant_sum_max": max(injector.quota_sums) if injector.quota_sums else None,
    }
    if lost_agent is not None:
        out["faults"].append({"kind": lost_agent.kind, "at_s": round(result.wall_s, 3), "recovery_s": None,
                              "timed_out": 0, "function": None, "detail": lost_agent.detail})
        out["orphans"] = injector.orphans
    if sampler is not None:
        out["soak"] = {name: {f: getattr(s, f) for f in s.__struct_fields__}
                       for name, s in chaos.slopes(sampler.samples).items()}
    return out


def render(out: dict, console: Console) -> None:
    """Print the tally, the faults and (soak) the slopes as rich tables."""
    keys = ["offered", "completed", "failed", "dropped", "timed_out", "lost", "duplicates", "duplicates_to_caller"]
    t = Table(title="requests")
    for k in keys:
        t.add_column(k, justify="right")
    t.add_row(*(str(out[k]) for k in keys))
    console.print(t)
    lat = out["latency_ms"]
    console.print(f"SLO violations over the run {100 * out['slo_violation_rate']:.1f} %, latency p50/p99 "
                  f"{_latency(lat['p50'])} / {_latency(lat['p99'])}", highlight=False)
    if out["faults"]:
        ft = Table(title="faults")
        for col in ("at s", "kind", "recovery s", "timed out", "detail"):
            ft.add_column(col)
        for f in out["faults"]:
            rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.2f}"
            ft.add_row(f"{f['at_s']:.1f}", f["kind"], rec, str(f["timed_out"]), f["detail"])
        console.print(ft)
    if out.get("grant_sum_max") is not None:
        console.print(f"largest sum of quotas in force on one GPU: {out['grant_sum_max']:.3f}")
    if "soak" in out:
        st = Table(title="soak: slope per minute (after warm-up: over the last three quarters of the run; "
                         "shm-segments: count in fds, allocated bytes in own)")
        st.add_column("process", no_wrap=True, min_width=17)
        for col in ("samples", "own bytes/min", "after warm-up", "fds/min", "threads/min", "own first -> last MiB"):
            st.add_column(col, justify="right")
        for name, s in sorted(out["soak"].items()):
            settled = s["private_bytes_per_min_settled"]
            st.add_row(name, str(s["samples"]), f"{s['private_bytes_per_min']:,.0f}",
                       "–" if settled is None else f"{settled:,.0f}", f"{s['fds_per_min']:.2f}",
                       f"{s['threads_per_min']:.2f}",
                       f"{s['private_first_bytes'] / 2**20:.0f} -> {s['private_last_bytes'] / 2**20:.0f}")
        console.print(st)


def _latency(ms: float | None) -> str:
    """A latency for people: ms below a second, else s; '–' for none (no request completed)."""
    if ms is None:
        return "–"
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def _opt(*decls, **kw):
    """A click option whose DILU_<FLAG> variable (set by the command group: cliopts.flag_envvars)
    shows in --help."""
    return click.option(*decls, show_envvar=True, **kw)


def _check_length(tr: trace.Trace, minutes: float, speedup: float, kinds: list[str]) -> float:
    """The wall-clock seconds the run replays (``--minutes``, or less where the trace ends
    first: :func:`arrivals.replay_s`); click.UsageError, before anything starts, when that is
    too short for the faults ``kinds`` (:func:`min_minutes`), naming the highest --speedup that
    replays enough."""
    length_s = arrivals.replay_s(tr, duration_s=minutes * 60.0, speedup=speedup)
    shortest = min_minutes(kinds)
    if length_s < shortest * 60.0 - 1e-9:
        what = f"{len(kinds)} fault{'s' * (len(kinds) != 1)}" if kinds else "a run without faults"
        fastest = math.floor(length_s * speedup / (shortest * 60.0) * 100) / 100  # the trace's span, replayed long enough
        hint = f"; at most --speedup {fastest:g} replays that much" if fastest >= arrivals.SPEEDUP_MIN else ""
        raise click.UsageError(f"--minutes {minutes:g} at --speedup {speedup:g} replays only {length_s:.3g} s "
                               f"(the trace's {length_s * speedup / 60:,.0f} minutes): too short for {what} "
                               f"(at least {shortest:g} minutes){hint}")
    return length_s


@click.command()
@_opt("--minutes", type=Finite(), default=3.0, show_default=True,
      help=f"wall-clock minutes of load: at least {MIN_MINUTES:g}, and long enough for the faults "
           f"(all of them: {min_minutes(list(chaos.KINDS)):g}); shorter where the trace ends first (it says so)")
@_opt("--faults", "kinds", default="all", show_default=True, callback=lambda c, p, v: _faults(v),
      help=f"comma-separated fault kinds, in order, or 'all': {', '.join([*chaos.KINDS, chaos.LOSE_AGENT])}")
@_opt("--soak", is_flag=True, help="no faults: sample every process's own memory, descriptors and threads, and the shared-memory segments")
@_opt("--sample-s", type=Finite(min=0.5), default=10.0, show_default=True,
      help="soak sampling period, wall-clock seconds (at most a twelfth of the run)")
@_opt("--functions", type=click.IntRange(min=1), default=8, show_default=True, help="K busiest functions of the span")
@_opt("--gpus", default="4", show_default=True, callback=lambda c, p, v: _gpus(v),
      help="emulated A100 40 GB GPUs on the node (1..64; 'all': 4), or 'cpu' (a CPU node serving a torch CNN)")
@_opt("--speedup", type=Finite(min=arrivals.SPEEDUP_MIN, max=arrivals.SPEEDUP_MAX), default=10.0,
      show_default=True, help="trace seconds per wall-clock second (arrivals only)")
@_opt("--seed", type=click.IntRange(min=0), default=1, show_default=True,
      help="seed of the arrivals within each trace minute, the functions' models and the instance killed")
@_opt("--trace", "trace_dir", type=click.Path(exists=True, file_okay=False), default=None,
      help="trace directory in the Azure Functions 2019 format (default: the bundled 100-function sample)")
@_opt("--log-dir", default=None, type=click.Path(file_okay=False), callback=writable_dir,
      help="where the services' JSON logs go (default: a temp dir)")
@_opt("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
      help="also write the result as JSON (the tally, faults, SLO violations, latency; with --soak the slopes)")
def chaos_cmd(minutes, kinds, soak, sample_s, functions, gpus, speedup, seed, trace_dir, log_dir, json_path) -> None:
    """Replay a trace while the platform's processes fail; report how every request ended. Ctrl-C
    (or SIGTERM) stops the load, still reports what ran and exits with 130 (143)."""
    ctx = click.get_current_context()
    given = {n for n in ("kinds", "sample_s") if ctx.get_parameter_source(n).name != "DEFAULT"}
    if soak and "kinds" in given:
        raise click.UsageError("--soak runs without faults; --faults does not apply to it")
    if not soak and "sample_s" in given:
        raise click.UsageError("--sample-s is the soak's sampling period; it needs --soak")
    if soak:
        kinds = []
    if minutes < (shortest := min_minutes(kinds)):  # the one lower bound, known once --faults is
        what = f"{len(kinds)} fault{'s' * (len(kinds) != 1)}" if kinds else "a run without faults"
        raise click.BadParameter(f"{minutes:g} is too short for {what}: at least {shortest:g} minutes",
                                 param_hint=["--minutes"])
    length_s = _check_length(check_trace(trace_dir), minutes, speedup, kinds)
    opts = RunOptions(duration=minutes * 60.0, speedup=speedup, seed=seed, trace_dir=trace_dir, start_minute=None,
                      functions=functions, gpus=gpus, nats_url=None, log_dir=log_dir, training_jobs=0)
    console = make_console()
    if (every_s := min(sample_s, length_s / 12)) < sample_s:  # the slopes need a dozen samples
        console.print(f"--sample-s {sample_s:g} is more than a twelfth of this {length_s:,.0f}-s run: "
                      f"sampling every {every_s:.3g} s")
    held: dict[str, asyncio.Event] = {}

    async def main() -> dict:
        stop = held["stop"] = asyncio.Event()
        _install_stop(stop, console)
        return await run_chaos(opts, kinds, soak, every_s, console, stop)

    out = _run_or_explain(main)
    render(out, console)
    if json_path:
        write_output(json_path, json.dumps(out, indent=2))
        console.print(f"written to {json_path}")
    _end(console, held.get("stop"))
