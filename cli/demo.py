"""``dilu demo`` and ``dilu compare``: the whole platform on a real trace.

One run: start nats-server and the five services (one OS process each), deploy the K busiest
functions of the replayed trace span (each with a model chosen by a seeded rule), let the
profiler profile them through the node agent's emulated GPUs, replay the trace open loop through
NATS (JetStream work queue), then report SLO violations, goodput, cold starts, fragmentation,
GPU cost and the mechanism counters (DESIGN.md section 8) and stop everything.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import click
import uvloop
from rich.console import Console

from dilu.client.errors import DiluError, exit_code
from dilu.loadgen import arrivals, assign, generator, report, requestlog, trace
from dilu.loadgen import llm as llmtrace
from dilu.services.common import logging as dlog
from dilu.services.common.cliopts import PARK_AFTER_S_TYPE, Finite, ZeroOrAtLeast, optional_nats_urls, writable_dir, writable_output
from dilu.services.common import models
from dilu.services.common.bus import quiet_error_cb
from dilu.services.common.console import PROGRESS_EVERY_S, PipeConsole, count_of
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsconn import connect
from dilu.services.common.workqueue import ensure_stream

from dilu.services.node_agent.__main__ import parse_gpus
from dilu.services.node_agent.devices import EMULATED_DEFAULT_COUNT

from dilu.services.common.policies import DEFRAG_INTERVAL_MIN_S, DEFRAG_INTERVAL_S, PARK_AFTER_S, modes, policy_names
from dilu.services.common.digits import as_count

from .cluster import POLICIES, POLICY_HELP, Cluster
from .deploy import (WarmWatch, cluster_counters, cluster_facts, cpu_function_spec, deploy_all, function_spec, llm_spec, profile_all,
                     training_iterations, training_spec)
from .functions import Failed

DRAIN_GRACE_S = 20.0  # after the last send, how long answers may still arrive
WARM_UP_TIMEOUT_S = 30.0  # longest wait for the functions' initial instances before the replay (warm_up_limit_s)
REQUEST_TIMEOUT_MIN_S = 30.0  # a request unanswered this long (or 10 x its SLO) counts as timed out
REPORT_WIDTH = 100  # columns of the report in a file or pipe (COLUMNS overrides); the tables split to fit
REPORT_MIN_WIDTH = 40  # a narrower COLUMNS (0 prints nothing) is raised to it: a table's key column still fits


@dataclass
class RunOptions:
    """Options shared by demo and compare (see the click options for meanings and units)."""

    duration: float
    speedup: float
    seed: int
    trace_dir: str | None
    start_minute: int | None
    functions: int | str
    gpus: str
    nats_url: str | None
    log_dir: str | None
    training_jobs: int | None = None
    llm_share: float = 0.0
    park_after_s: float | None = None
    defrag_interval_s: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.defrag_interval_s and self.defrag_interval_s / self.speedup < DEFRAG_INTERVAL_MIN_S:
            # compressed like the windows; the scheduler refuses a shorter round (it would spin)
            raise click.BadParameter(f"{self.defrag_interval_s:g} trace s at --speedup {self.speedup:g} is a round every "
                                     f"{self.defrag_interval_s / self.speedup:g} s, below the scheduler's "
                                     f"{DEFRAG_INTERVAL_MIN_S:g} s", param_hint="--defrag-interval-s")
        if self.gpus != "cpu" and self.training_jobs is not None and self.training_jobs > int(self.gpus):
            # a job's limit (TRAINING_LIMIT) leaves a GPU no room for another's under γ: the
            # ones past one per GPU would never be placed, yet be reported at 0 iterations/s
            raise click.BadParameter(f"at most one training job per GPU: {self.training_jobs} on {self.gpus} GPUs",
                                     param_hint="--training-jobs")

    def training_count(self) -> int:
        """Training jobs to run beside the inference functions: ``--training-jobs``, else one per
        emulated GPU (none on a CPU node)."""
        if self.gpus == "cpu":
            return 0
        return int(self.gpus) if self.training_jobs is None else self.training_jobs


def _functions(value: str) -> int | str:
    if value == "all":
        return "all"
    try:
        k = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a count or 'all', got {value!r}") from None
    if k < 1:
        raise click.BadParameter(f"need at least 1 function, got {k}")
    return k


def _gpus(value: str) -> str:
    """The node agent's own ``--gpus`` rule, checked before anything starts."""
    n = parse_gpus(value)
    return "cpu" if n == 0 else str(n or EMULATED_DEFAULT_COUNT)


def run_options(f):
    """The options of a run, shared by ``demo`` and ``compare``."""
    opts = [
        click.option("--duration", type=Finite(min=1), default=120.0, show_default=True, help="wall-clock seconds of replay"),
        click.option("--speedup", type=Finite(min=arrivals.SPEEDUP_MIN, max=arrivals.SPEEDUP_MAX), default=10.0, show_default=True, help="trace seconds per wall second (arrivals only)"),
        click.option("--seed", type=click.IntRange(min=0), default=1, show_default=True, help="seed of the arrivals within each trace minute and of each function's model: the same seed, the same requests"),
        click.option("--trace", "trace_dir", type=click.Path(exists=True, file_okay=False), default=None, help="trace directory in the Azure Functions 2019 format (default: the bundled 100-function sample)"),
        click.option("--start-minute", type=int, default=None, help="trace minute to begin at (default: the first)"),
        click.option("--functions", type=str, default="16", show_default=True, callback=lambda c, p, v: _functions(v), help="K busiest functions of the span, or 'all'"),
        click.option("--gpus", default="4", show_default=True, callback=lambda c, p, v: _gpus(v), help="emulated A100 40 GB GPUs on the node (1..64; 'all': 4), or 'cpu'"),
        click.option("--nats-url", default=None, callback=optional_nats_urls, help="use a running NATS server instead of starting one"),
        click.option("--log-dir", default=None, type=click.Path(file_okay=False), callback=writable_dir, help="where the services' JSON logs go, with the replay's requests.jsonl (every request with the platform's times) and report.json, one directory per policy (default: a new temp dir for each policy's run, printed as it starts)"),
        click.option("--training-jobs", type=click.IntRange(min=0, max=64), default=None, help="training jobs collocated with the inference functions, at most one per GPU (default: one per GPU in dilu demo, none in dilu compare; 0: none)"),
        click.option("--park-after-s", type=PARK_AFTER_S_TYPE, default=None, help=f"park an idle function's instances after this many trace seconds within its keep-alive (their GPU share and device memory given back but for their CUDA context, weights kept in host memory, resumed in the time they take to copy back: 10 ms for ResNet152, 1.1 s for LLaMA2-7B), every policy; compressed by --speedup like the keep-alive; 0: never (default: as each policy does, dilu after {PARK_AFTER_S:g} s, the others never)"),
        click.option("--defrag-interval-s", type=ZeroOrAtLeast(DEFRAG_INTERVAL_MIN_S, 86_400), default=None, metavar="S", help=f"how often, in trace seconds, the scheduler of dilu and dilu-published moves instances off lightly used GPUs to empty them, compressed by --speedup like the keep-alive; 0: never (default: {DEFRAG_INTERVAL_S:g}, as they do live). The baselines never defragment, as in dilu sim"),
        click.option("--llm-share", type=Finite(min=0.0, max=1.0), default=0.0, show_default=True, help="also replay this fraction of the Azure LLM 2023 code trace's requests (real arrival times, prompt and output lengths) against an llm function on LLaMA2-7B; 0: none"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


LLM_FUNCTION = "llm-code"
LLM_MAX_NEW_TOKENS = 256  # the trace's longest outputs (1,899 tokens) would hold a GPU for minutes


def build_plan(opts: RunOptions, run_id: str):
    """The replay plan, each selected function's model (seeded rule in :mod:`loadgen.assign`) and,
    with ``--llm-share``, the LLM replay plan (the trace at its own speed: its arrivals are
    seconds apart already)."""
    tr = trace.read_trace(opts.trace_dir)
    plan = arrivals.plan_replay(tr, seed=opts.seed, duration_s=opts.duration, speedup=opts.speedup,
                                start_minute=opts.start_minute, functions=opts.functions, id_prefix=f"{run_id}-")
    capacity = assign.catalogue_capacity(models.latency_ms, models.default_slo_ms)
    chosen = assign.assign_models(plan.functions, opts.seed, opts.speedup, capacity)
    llm_plan = None
    if opts.llm_share > 0:
        llm_plan = llmtrace.plan_llm_replay(llmtrace.read_llm_trace(), function=LLM_FUNCTION, seed=opts.seed,
                                            duration_s=opts.duration, speedup=1.0, sample=opts.llm_share,
                                            max_new_tokens_cap=LLM_MAX_NEW_TOKENS, id_prefix=f"{run_id}-")
    return plan, chosen, llm_plan


def check_trace(trace_dir: str | None, start_minute: int | None = None) -> trace.Trace:
    """Before anything starts: the trace, read; a trace that cannot be read is a bad ``--trace``
    and a start minute outside it a bad ``--start-minute`` (click.BadParameter: exit 2, as
    ``dilu sim`` does)."""
    try:
        tr = trace.read_trace(trace_dir)
    except trace.TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace") from None
    try:
        arrivals.replay_s(tr, duration_s=1.0, speedup=1.0, start_minute=start_minute)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--start-minute") from None
    return tr


def check_span(plan, llm_plan, flag: str, asked: float, unit_s: float = 1.0) -> str | None:
    """Before anything starts: refuse a span that sends nothing (click.BadParameter naming
    ``flag``: exit 2, as ``dilu sim`` does; e.g. 5 s at --speedup 0.01 spans 0.05 trace s, over
    before the first arrival),
    and return the line to print when the trace ended before the length asked (None when it did
    not). ``flag`` and ``asked`` are the option and value that set the length, ``unit_s`` its unit
    in seconds (60: --minutes)."""
    unit = "s" if unit_s == 1.0 else "minutes"
    if not plan.invocations and not (llm_plan is not None and llm_plan.invocations):
        raise click.BadParameter(f"the span ({flag} {asked:g} at --speedup {plan.speedup:g}: "
                                 f"{plan.duration_s * plan.speedup:g} trace s from minute {plan.start_minute}) holds "
                                 f"no invocation: give more {flag}, a higher --speedup"
                                 + (" or another --start-minute" if flag == "--duration" else ""), param_hint=flag)
    if not plan.clipped:
        return None
    minutes = round(plan.duration_s * plan.speedup / 60)  # whole: a clipped span runs to the trace's end
    length = plan.duration_s / unit_s
    held = f"{length:,.0f}" if length >= 100 else f"{length:.3g}"
    return (f"{flag} {asked:g}: from minute {plan.start_minute} the trace holds only {held} {unit} at --speedup "
            f"{plan.speedup:g} (its last {minutes:,} minute{'s' * (minutes != 1)}); replaying those")


def _specs(opts: RunOptions, plan, chosen: dict[str, str], llm_plan) -> list:
    """What the run deploys: the replayed functions, the LLM function and the training jobs."""
    if opts.gpus == "cpu":  # a CPU node runs the real torch handler; there is no GPU to profile on
        return [cpu_function_spec(f.name, len(plan.functions)) for f in plan.functions]
    specs = [function_spec(f.name, chosen[f.name], peak_rps=f.peak_rps) for f in plan.functions]
    if llm_plan is not None and llm_plan.invocations:
        prompt = sum(i.prompt_tokens for i in llm_plan.invocations) / len(llm_plan.invocations)
        specs.append(llm_spec(LLM_FUNCTION, prompt))
    specs += [training_spec(f"train-{i}") for i in range(opts.training_count())]
    return specs


def _timeout_s(spec, inv) -> float:
    """How long a request may go unanswered before it counts as timed out: 10 x its objective
    (an llm reply's for its own output length), at least REQUEST_TIMEOUT_MIN_S."""
    objective_ms = spec.slo_ms
    if spec.kind == "llm" and isinstance(inv, llmtrace.LlmInvocation):
        objective_ms = spec.ttft_ms + inv.output_tokens * spec.tpot_ms
    return max(REQUEST_TIMEOUT_MIN_S, 10 * objective_ms / 1000.0)


def replay_args(speedup: float, policy: str, park_after_s: float | None = None,
                defrag_interval_s: float | None = None) -> dict[str, list[str]]:
    """Per service, the settings a replay at ``speedup`` adds to ``policy``'s: the horizontal
    scaler's windows (:func:`scaler_windows`) and parking delay (``park_after_s`` trace seconds,
    0: never; None: the policy's, :meth:`PolicyModes.park_after_s`), and the scheduler's
    defragmentation interval (``defrag_interval_s`` trace seconds for a policy that
    defragments, 0: never; None: the policy's; :meth:`PolicyModes.defrag_interval_s`), trace
    time compressed alike."""
    m = modes(policy)
    park = m.park_after_s(speedup) if park_after_s is None else park_after_s / speedup
    return {"horizontal_scaler": scaler_windows(speedup) + ["--park-after-s", f"{park:g}"],
            "scheduler": ["--defrag-interval-s", f"{m.defrag_interval_s(speedup, defrag_interval_s):g}"]}


def scaler_windows(speedup: float, keep_alive_s: float | None = None) -> list[str]:
    """Horizontal-scaler settings for a replay: the trace-time windows (stable window 60 s, the
    fallback keep-alive ``keep_alive_s``, by default the scaler's 10 min, Knative's scale-to-zero
    grace 30 s, idle-histogram bins of 1 min) divided by ``speedup``, since arrivals are
    compressed; at most doubling the ready instances per decision, since cold starts stay real
    time (seconds) and panic mode would otherwise launch the maximum while the first starts; and a
    scale-down delay of two stable windows, so a function hovering near one instance's capacity
    does not flap 1 -> 2 -> 1 and pay a cold start each time; and the target utilisation, named
    so that a ``DILU_TARGET_UTILIZATION`` in the caller's environment cannot make a live run
    differ from its simulated twin."""
    from dilu.services.horizontal_scaler.policy import HorizontalConfig as H

    keep = H.keep_alive_s if keep_alive_s is None else keep_alive_s
    return ["--stable-window-s", f"{max(1.0, 60.0 / speedup):g}", "--keep-alive-s", f"{keep / speedup:g}",
            "--scale-to-zero-grace-s", f"{H.scale_to_zero_grace_s / speedup:g}",
            "--idle-bin-s", f"{max(0.1, 60.0 / speedup):g}", "--max-scale-up-rate", "2",
            "--scale-down-delay-s", f"{max(1.0, 120.0 / speedup):g}",
            "--target-utilization", f"{H.target_utilization:g}"]


def horizontal_config(mode: str, speedup: float = 1.0, keep_alive_s: float | None = None,
                      park_after_s: float = 0.0):
    """The horizontal scaler's settings (a ``HorizontalConfig``) of a replay at ``speedup``: the
    :func:`scaler_windows` it is started with; ``keep_alive_s``: the fallback keep-alive in trace
    seconds (None: the scaler's default); ``park_after_s``: trace seconds before an idle
    function's instances are parked (0: never), compressed by ``speedup`` as the keep-alive is.
    The simulator builds its scaler's settings here too."""
    from dilu.services.horizontal_scaler.policy import HorizontalConfig

    args = scaler_windows(speedup, keep_alive_s)
    kw = {args[i].lstrip("-").replace("-", "_"): float(args[i + 1]) for i in range(0, len(args), 2)}
    return HorizontalConfig(mode=mode, park_after_s=park_after_s / speedup, **kw)


def warm_up_limit_s(mode: str, speedup: float, keep_alive_s: float | None = None) -> float:
    """The longest wait (s after the deploy) for the functions' initial instances before a
    replay under the horizontal ``mode`` at ``speedup``: WARM_UP_TIMEOUT_S, and at most the
    keep-alive a new function gets (:meth:`HorizontalPolicy.first_keep_alive_s`; Knative's 90
    trace s are 9 s at --speedup 10). That keep-alive runs from a function's first ready
    instance, so no function warmed before the replay is scaled in before it starts, however
    long one slow cold start takes. The simulator's replay starts within the same limit
    (``loadgen.sim.run.warm_up_ms``)."""
    from dilu.services.horizontal_scaler.policy import horizontal_policy

    first = horizontal_policy(horizontal_config(mode, speedup, keep_alive_s)).first_keep_alive_s()
    return min(WARM_UP_TIMEOUT_S, first)


def run_facts(facts: dict, training: dict | None = None) -> report.RunFacts:
    """The cluster's scraped counters (:func:`cluster_facts`) and the training jobs' iterations
    during the replay as the report's RunFacts."""
    per_fn = {fn: report.FunctionFacts(instance_launches=f.get("instance_launches", 0),
                                       quota_seconds=f.get("quota_seconds", 0.0))
              for fn, f in facts["per_function"].items()}
    return report.RunFacts(functions=per_fn, mechanism=report.Mechanism(**facts["mechanism"]),
                           training=training or {}, **facts["gpu"])


async def _replay(opts: RunOptions, cluster: Cluster, plan, chosen: dict[str, str], llm_plan, console: Console,
                  stop: asyncio.Event, *, during: Callable[[generator.OpenLoopGenerator], Awaitable] | None = None,
                  timeout_floor_s: float = REQUEST_TIMEOUT_MIN_S, drain_s: float = DRAIN_GRACE_S) -> Replay:
    """Deploy, replay. ``during(gen)`` runs beside the replay from its first send (its result is
    the Replay's ``during``); requests time out after :func:`_timeout_s`, at least
    ``timeout_floor_s``; answers may arrive until ``drain_s`` after the replay's planned end.
    Progress: a live bar on a terminal, else a :class:`ProgressLines` line every
    PROGRESS_EVERY_S seconds from the first deploy to the end of the drain."""
    lines = None if console.is_terminal or not opts.progress else ProgressLines(console)
    printer = None
    if lines is not None:
        async def refresh() -> None:
            lines.active_gpus = await asyncio.to_thread(active_gpus, cluster)
        printer = asyncio.create_task(lines.run(refresh))
    try:
        return await _replay_with(opts, cluster, plan, chosen, llm_plan, console, stop, lines, during=during,
                                  timeout_floor_s=timeout_floor_s, drain_s=drain_s)
    finally:
        if printer is not None:
            printer.cancel()
            await asyncio.gather(printer, return_exceptions=True)


async def _replay_with(opts: RunOptions, cluster: Cluster, plan, chosen: dict[str, str], llm_plan, console: Console,
                       stop: asyncio.Event, lines: ProgressLines | None, *,
                       during: Callable[[generator.OpenLoopGenerator], Awaitable] | None,
                       timeout_floor_s: float, drain_s: float) -> Replay:
    """:func:`_replay`'s work, reporting its phases and counts to ``lines`` (None: no lines)."""
    def phase(text: str) -> None:
        if lines is not None:
            lines.phase = text

    # two identities, as on a platform: the operator deploys, the caller only invokes
    op = await connect(cluster.nats_options("operator"), name="dilu-loadgen-operator", max_reconnect_attempts=-1,
                       error_cb=quiet_error_cb(dlog.get("loadgen"), cluster.url))
    try:
        nc = await connect(cluster.nats_options("caller"), name="dilu-loadgen", max_reconnect_attempts=-1,
                           error_cb=quiet_error_cb(dlog.get("loadgen"), cluster.url))
    except BaseException:
        await op.close()
        raise
    js = nc.jetstream()
    try:
        await ensure_stream(op.jetstream())
        specs = _specs(opts, plan, chosen, llm_plan)
        serving = [s for s in specs if s.kind != "training"]
        training = [s for s in specs if s.kind == "training"]
        console.print(f"[dim]deploying {len(serving)} functions"
                      + (f" and {len(training)} training jobs" if training else "")
                      + ("; the profiler measures them on the emulated GPUs" if opts.gpus != "cpu" else
                         " (torch CNN on the CPU node)") + "[/dim]")
        phase("profiling")
        if not await _unless_stopped(profile_all(op, [s for s in specs if s.profile is None]), stop):
            raise Interrupted("stopped while profiling: nothing was offered", signal_exit(stop))
        warm = await WarmWatch({s.name for s in specs}).start(op)
        phase("deploying")
        deployed_at = time.monotonic()  # the wait for the initial instances counts from here
        if not await _unless_stopped(deploy_all(op, specs), stop):
            raise Interrupted("stopped while deploying: nothing was offered", signal_exit(stop))
        # each function's initial instance (the horizontal scaler's initial scale) starts before
        # the replay, as on a platform where functions are deployed ahead of their traffic
        phase("starting the initial instances")
        limit_s = warm_up_limit_s(modes(cluster.policy).horizontal, opts.speedup)
        waiting = asyncio.ensure_future(warm.wait(max(0.0, limit_s - (time.monotonic() - deployed_at))))
        if not await _unless_stopped(waiting, stop):
            raise Interrupted("stopped while the initial instances started: nothing was offered", signal_exit(stop))
        cold = waiting.result()
        if cold:
            console.print(f"[yellow]{len(cold)} of {len(specs)} functions have no warm instance "
                          f"{limit_s:.1f} s after their deploy ({', '.join(sorted(cold))}); "
                          f"their first requests wait for the instances still starting[/yellow]")
        client = InvokeClient(nc, js)
        await client.start()
        by_name = {s.name: s for s in specs}
        gen: generator.OpenLoopGenerator

        async def invoke(inv) -> generator.Outcome:
            scheduled = gen.started_unix_ns + inv.scheduled_ns
            streamed = isinstance(inv, llmtrace.LlmInvocation)
            body = llmtrace.payload(inv) if streamed else inv.id.encode()
            if lines is not None:
                lines.sent += 1
            r = await client.invoke(inv.function, body, request_id=inv.id, scheduled_ns=scheduled,
                                    timeout_s=max(timeout_floor_s, _timeout_s(by_name[inv.function], inv)))
            if lines is not None and r.status == "ok":
                lines.completed += 1
            ttft, tpot = generator.token_times_ms(scheduled, r.chunks, r.first_chunk_ns, r.last_chunk_ns)
            timings = generator.Timings(instance=r.instance, enqueued_ns=r.enqueued_ns, started_ns=r.started_ns,
                                        replied_ns=r.replied_ns, batch=r.batch) if r.instance else None
            return generator.Outcome(status=r.status, cold_start=r.cold_start, detail=r.error,
                                     ttft_ms=ttft if streamed else None, tpot_ms=tpot if streamed else None,
                                     output_tokens=r.chunks, timings=timings)

        invocations = sorted([*plan.invocations, *(llm_plan.invocations if llm_plan else ())],
                             key=lambda i: (i.scheduled_ns, i.id))
        duration = max(plan.duration_s, llm_plan.duration_s if llm_plan else 0.0)
        gen = generator.OpenLoopGenerator(invoke, drain_timeout_s=drain_s, progress=opts.progress and lines is None,
                                          console=console)
        watcher = asyncio.create_task(_stop_on(stop, gen))
        before = await asyncio.to_thread(training_iterations, cluster)
        counters = await asyncio.to_thread(cluster_counters, cluster)  # the report counts from here
        beside = asyncio.ensure_future(during(gen)) if during is not None else None  # starts at gen.run's first await
        if lines is not None:
            lines.replay(len(invocations), duration)
        try:
            result = await gen.run(invocations, duration_s=duration)
            side = await beside if beside is not None else None
        finally:
            watcher.cancel()
            if beside is not None and not beside.done():
                beside.cancel()
        after = await asyncio.to_thread(training_iterations, cluster)
        trained = {s.name: report.TrainingFacts(iterations=int(after.get(s.name, 0) - before.get(s.name, 0)),
                                                seconds=result.wall_s) for s in training}
        await client.close()
        return Replay(result, specs, trained, client.stats, side, counters)
    finally:
        await nc.drain()
        await op.drain()


@dataclass
class Replay:
    """What :func:`_replay` saw: the generator's result, the deployed specs, the training jobs'
    facts, the caller's InvokeStats (duplicate and late replies), what ``during`` returned and
    the services' counters as the replay began (:func:`cluster_counters`: the report counts from
    there)."""

    result: generator.RunResult
    specs: list
    trained: dict
    stats: object
    during: object = None
    counters: dict | None = None


class Interrupted(RuntimeError):
    """Ctrl-C (or SIGTERM) before the replay began; ``code`` is the exit status to end with."""

    def __init__(self, message: str, code: int = 130) -> None:
        super().__init__(message)
        self.code = code


class ProgressLines:
    """Progress as one plain line every ``every_s`` seconds (s, > 0), for output that is not a
    terminal (a file, a pipe, CI), where a live bar would show nothing until the end.

    The run sets :attr:`phase` (and :meth:`replay` when the replay begins) and counts ``sent`` and
    ``completed`` requests; ``active_gpus`` is the number of GPUs with quota in force (None:
    unknown). ``clock`` (monotonic seconds) is injectable for tests. Raises ValueError when
    ``every_s`` is not positive.
    """

    def __init__(self, console: Console, *, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        self.console = console
        self.every_s = every_s
        self.clock = clock
        self.phase = "starting the services"
        self.planned = 0
        self.duration_s = 0.0
        self.sent = 0
        self.completed = 0
        self.active_gpus: int | None = None
        self._start = clock()
        self._replay_start: float | None = None
        self._next = self._start + every_s

    def replay(self, planned: int, duration_s: float) -> None:
        """The replay begins: ``planned`` requests over ``duration_s`` seconds."""
        self.phase, self.planned, self.duration_s = "replay", planned, duration_s
        self._replay_start = self.clock()

    def line(self) -> str:
        """The progress as one line: elapsed seconds, phase, requests sent and completed, active GPUs."""
        now = self.clock()
        phase = self.phase
        if self._replay_start is not None and now - self._replay_start > self.duration_s:
            phase = "replay done, waiting for answers:"
        text = f"[{now - self._start:,.0f} s] {phase}"
        if self._replay_start is not None:
            text += (f" {now - self._replay_start:,.0f} of {self.duration_s:,.0f} s: sent {self.sent:,} of "
                     f"{self.planned:,}, completed {self.completed:,}")
        if self.active_gpus is not None:
            text += f", active GPUs {self.active_gpus}"
        return text

    def tick(self) -> bool:
        """Print the line when its time has come (every ``every_s`` from the start, skipping
        periods missed); True when printed."""
        now = self.clock()
        if now < self._next:
            return False
        self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)
        self._next += self.every_s * (math.floor((now - self._next) / self.every_s) + 1)
        return True

    async def run(self, refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        """Print lines until cancelled; ``refresh()`` is awaited before each (e.g. to read the
        active GPUs), its failures ignored."""
        while True:
            await asyncio.sleep(max(0.0, self._next - self.clock()))
            if refresh is not None:
                try:
                    await refresh()
                except Exception:  # noqa: BLE001 - a progress line must never end the run
                    self.active_gpus = None
            self.tick()


def active_gpus(cluster: Cluster) -> int | None:
    """GPUs of the node with quota in force now (the node agent's ``dilu_gpu_quota_sum``), or None
    when its metrics cannot be read."""
    node = cluster.metrics("node_agent")
    if not node:
        return None
    return sum(1 for k, v in node.items() if k.startswith("dilu_gpu_quota_sum{") and v > 0)


async def _unless_stopped(work, stop: asyncio.Event) -> bool:
    """Await ``work`` unless ``stop`` is set first (then cancel it); True when it finished."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task in done:
        task.result()
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def _stop_on(stop: asyncio.Event, gen) -> None:
    await stop.wait()
    gen.stop()


async def run_once(opts: RunOptions, policy: str, console: Console, stop: asyncio.Event) -> dict:
    """One full run under ``policy``; returns the report as a JSON-ready dict."""
    run_id = uuid.uuid4().hex[:6]
    plan, chosen, llm_plan = build_plan(opts, run_id)
    short = check_span(plan, llm_plan, "--duration", opts.duration)
    created = None if opts.log_dir else Path(tempfile.mkdtemp(prefix="dilu-logs-"))
    log_dir = Path(opts.log_dir or created) / policy
    n = len(plan.functions)
    console.print(f"[bold]policy {policy}[/bold]: {n} function{'s' if n != 1 else ''} carrying "
                  f"{plan.share:.1%} of the span's {plan.span_invocations:,} invocations; logs in {log_dir}")
    if short:  # the report's duration_s is the span replayed, not the one asked
        console.print(f"[yellow]{short}[/yellow]", highlight=False)
    if isinstance(opts.functions, int) and n < opts.functions:
        console.print(f"[yellow]--functions {opts.functions}: the span has only {count_of(n, 'function')} "
                      f"with invocations; replaying those[/yellow]")
    log_dir.mkdir(parents=True, exist_ok=True)
    # the load generator's own log lines (e.g. each request NATS refused) go beside the services'
    dlog.configure("loadgen", stream=(log_dir / "loadgen.log").open("a", buffering=1))
    cluster = Cluster(log_dir=log_dir, policy=policy, gpus=opts.gpus, nats_url=opts.nats_url, auth=True,
                      extra_args=replay_args(opts.speedup, policy, opts.park_after_s, opts.defrag_interval_s))
    await _start(cluster, created)
    try:
        replay = await _replay(opts, cluster, plan, chosen, llm_plan, console, stop)
        result, specs, trained = replay.result, replay.specs, replay.trained
        facts = cluster_facts(cluster, since=replay.counters)
    finally:
        await asyncio.to_thread(cluster.stop)
    meta = {s.name: report.FunctionMeta(model=s.model, slo_ms=s.slo_ms, kind=s.kind, ttft_ms=s.ttft_ms or None,
                                        tpot_ms=s.tpot_ms or None) for s in specs}
    gpus = 0 if opts.gpus == "cpu" else int(opts.gpus)
    m = modes(policy)
    info = report.run_info(plan, result, policy=policy, gpus=gpus, llm_plan=llm_plan,
                           training_jobs=opts.training_count(),
                           park_after_s=m.park_after_s() if opts.park_after_s is None else opts.park_after_s,
                           defrag_interval_s=m.defrag_interval_s(every_s=opts.defrag_interval_s))
    rep = report.build_report(result.records, meta, run_facts(facts, trained), info)
    # beside the services' logs: every request with the platform's times, and the report they
    # make (what ``dilu calibrate`` reads)
    requestlog.write(log_dir / requestlog.FILENAME, result)
    report.write_report(rep, log_dir / requestlog.REPORT_FILENAME)
    return rep.to_dict()


async def _start(cluster: Cluster, created: Path | None) -> None:
    """Start ``cluster``; when it fails, remove ``created`` (a log directory the run made itself;
    None for the user's --log-dir, always kept) if nothing was logged into it: every file empty.
    Logs of services that said why they failed are kept."""
    try:
        await asyncio.to_thread(cluster.start)
    except BaseException:
        if created is not None and all(p.is_dir() or p.stat().st_size == 0 for p in created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)
        raise


def _run_or_explain(main):
    """Run the async ``main``; a user's mistake (bad trace, start minute, a service that would
    not start, functions never profiled) ends with its message, not a traceback."""
    try:
        return uvloop.run(main())
    except Interrupted as exc:  # stopped before anything was offered: nothing to report
        click.echo(f"Interrupted: {exc}", err=True)
        raise SystemExit(exc.code) from None
    except KeyboardInterrupt:  # Ctrl-C before the stop handler was in place
        click.echo("Interrupted", err=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except BrokenPipeError:  # the reader of the output left: the command line's 141, not a failure
        raise
    except DiluError as exc:  # NATS unreachable: the exit code every command gives it (5)
        raise Failed(str(exc), exit_code(exc)) from None
    except (trace.TraceError, ValueError, RuntimeError, TimeoutError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def make_console(**options) -> Console:
    """A terminal's own width; REPORT_WIDTH columns when writing to a file or pipe, unless
    COLUMNS says otherwise (the report's tables split to fit either); never under
    REPORT_MIN_WIDTH. ``options``: further keyword arguments of :class:`rich.console.Console`
    (e.g. ``highlight=False``). A closed stdout raises BrokenPipeError (:class:`PipeConsole`)."""
    columns = os.environ.get("COLUMNS", "").strip()
    given = as_count(columns) is not None  # rich's int() raised on '²', a digit to str.isdigit
    environ = os.environ if given or not columns else {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    console = PipeConsole(_environ=environ, **options)
    if not console.is_terminal and not given:
        console.width = REPORT_WIDTH
    console.width = max(console.width, REPORT_MIN_WIDTH)
    return console


def _install_stop(stop: asyncio.Event, console: Console) -> None:
    """On SIGINT or SIGTERM set ``stop`` (the run stops sending, drains and reports) and remember
    the first signal on it for :func:`signal_exit`."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            console.print(f"[yellow]{sig.name}: stopping: no new sends; waiting for answers, then shutting "
                          f"down[/yellow]")
            stop.signum = sig  # type: ignore[attr-defined]
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


def signal_exit(stop: asyncio.Event | None) -> int:
    """The exit status of a run stopped by a signal, as a shell reports it: 128 + the signal's
    number (130 for SIGINT, 143 for SIGTERM); 0 when no signal stopped it."""
    sig = getattr(stop, "signum", None)
    return 128 + int(sig) if sig is not None else 0


def _end(console: Console, stop: asyncio.Event | None) -> None:
    """After the report: exit with :func:`signal_exit`'s status when a signal stopped the run."""
    code = signal_exit(stop)
    if code:
        console.print(f"[yellow]interrupted ({stop.signum.name}): the report covers what ran before the stop; "
                      f"exit status {code}[/yellow]")
        raise SystemExit(code)


_HELP_LEGEND = report.legend_text(width=76)
DEMO_EPILOG = "Columns of the report (also printed under it):\n\n\b\n" + _HELP_LEGEND
COMPARE_EPILOG = ("Rows of the comparison (also printed under it). A column 'P / FIRST' per policy P after "
                  "the first gives P's figure / the first's (0.53x) or, for a rate, the difference P - FIRST in "
                  "percentage points (pp). Meanings:\n\n\b\n" + _HELP_LEGEND)


@click.command(epilog=DEMO_EPILOG)
@run_options
@click.option("--policy", type=click.Choice(list(POLICIES)), default="dilu", show_default=True,
              help=POLICY_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
              help="also write the report as JSON")
def demo(json_path, policy, **kw) -> None:
    """Run the whole platform on a real trace and print the report. Ctrl-C or SIGTERM stops
    sending, reports what was offered and exits with 130 or 143."""
    opts = RunOptions(**kw)
    check_trace(opts.trace_dir, opts.start_minute)
    console = make_console()
    held: dict[str, asyncio.Event] = {}

    async def main() -> dict:
        stop = held["stop"] = asyncio.Event()
        _install_stop(stop, console)
        return await run_once(opts, policy, console, stop)

    rep = _run_or_explain(main)
    report.render(report.Report.from_dict(rep), console)
    if json_path:
        Path(json_path).write_text(json.dumps(rep, indent=2))
        console.print(f"report written to {json_path}")
    _end(console, held.get("stop"))


@click.command(epilog=COMPARE_EPILOG)
@run_options
@click.option("--policies", default="dilu,horizontal-only", show_default=True, help=f"comma-separated, from: {', '.join(POLICIES)}")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
              help='also write the reports as JSON: {"policies": {name: report}}')
def compare(json_path, policies, **kw) -> None:
    """Run the same trace and seed under several policies back to back; print one table.
    Ctrl-C (or SIGTERM) stops the policy under way; the ones already finished, and the stopped
    one's replay so far, are still reported, and the exit status is 130 (143). No training
    jobs unless --training-jobs asks (the exclusive policy gives each a whole GPU)."""
    try:
        names = policy_names(policies)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--policies") from None
    opts = RunOptions(**kw)
    check_trace(opts.trace_dir, opts.start_minute)
    if opts.training_jobs is None:  # an exclusive GPU per instance leaves no room to collocate
        opts.training_jobs = 0
    console = make_console()

    held: dict[str, asyncio.Event] = {}

    async def main() -> dict:
        stop = held["stop"] = asyncio.Event()
        _install_stop(stop, console)
        out = {}
        for name in names:
            if stop.is_set():
                break
            try:
                out[name] = await run_once(opts, name, console, stop)
            except Interrupted:
                if not out:
                    raise
                console.print(f"[yellow]{name} stopped before its replay; reporting the policies that finished[/yellow]")
        return out

    results = _run_or_explain(main)
    report.render_compare({k: report.Report.from_dict(v) for k, v in results.items()}, console)
    if json_path:
        Path(json_path).write_text(json.dumps({"policies": results}, indent=2))
        console.print(f"comparison written to {json_path}")
    _end(console, held.get("stop"))

