"""Deploying functions onto a running cluster and reading its mechanism counters back."""
from __future__ import annotations

import asyncio

from dilu.client import admin
from dilu.client.errors import DeployError
from dilu.contracts import decode, encode, subjects
from dilu.contracts import events as ev
from dilu.services.common import models
from dilu.services.common.functions import request_slo_ms
from dilu.services.node_agent.handlers import emulated

from .cluster import Cluster

PROFILE_TIMEOUT_S = 150.0


BATCHES = (1, 2, 4, 8, 16, 32)


def fillable_batch(peak_rps: float | None, slo_ms: float) -> int:
    """The largest batch the function's load can fill while a request still meets its SLO:
    arrivals in half the SLO at twice the peak minute's mean rate (bursts inside a minute),
    rounded up to the batch grid (1..32). A bigger batch never fills in time, so profiling it
    would size the quota for load that never comes. Unknown load: 32."""
    if peak_rps is None:
        return BATCHES[-1]
    need = 2 * peak_rps * slo_ms / 2 / 1000.0
    return next((b for b in BATCHES if b >= need), BATCHES[-1])


def function_spec(name: str, model: str, *, peak_rps: float | None = None, handler: str = "",
                  max_instances: int = 8) -> ev.FunctionSpec:
    """A deployable spec for an emulated model with the catalogue's defaults (SLO 5 x batch-1
    latency on a full GPU, memory and cold start from :mod:`models`); ``peak_rps`` (requests/s)
    bounds the batch size (:func:`fillable_batch`)."""
    slo_ms = models.default_slo_ms(model)
    return ev.FunctionSpec(
        name=name, model=model, kind="inference", slo_ms=slo_ms,
        memory_bytes=models.memory_bytes(model), cold_start_ms=models.cold_start_ms(model),
        handler=handler or "dilu.services.node_agent.handlers.emulated", max_instances=max_instances,
        max_batch=fillable_batch(peak_rps, slo_ms),
    )


CPU_HANDLER = "dilu.services.node_agent.handlers.torch_cnn"
CPU_SLO_MS = 2000.0  # a small CNN on one CPU thread: ~10 ms a batch, plus queueing on 2 cores


def cpu_function_spec(name: str, functions: int = 1) -> ev.FunctionSpec:
    """A function for a CPU node (``--gpus cpu``): the real torch CNN handler, with the
    operator's profile (:func:`operator_profile`: a CPU node has no GPU to profile on)."""
    return ev.FunctionSpec(name=name, slo_ms=CPU_SLO_MS, memory_bytes=2**28, handler=CPU_HANDLER, max_batch=4,
                           max_instances=2, profile=operator_profile(name, functions))


def operator_profile(name: str, functions: int) -> ev.Profile:
    """The node shared evenly by ``functions`` functions."""
    share = max(0.01, int(10_000 / max(1, functions)) / 10_000)  # rounded down: n shares fit in 1
    return ev.Profile(function=name, request_quota=share, limit_quota=share, batch_size=4, backend="operator")


class WarmWatch:
    """Counts the functions that have had an instance ready since it started (subscribe before
    deploying, so no InstanceReady is missed)."""

    def __init__(self, names: set[str]) -> None:
        self.wanted, self.warm = set(names), set()
        self._changed = asyncio.Event()
        self._sub = None

    async def start(self, nc) -> "WarmWatch":
        async def on_ready(msg) -> None:
            try:
                fn = decode(msg.data, ev.InstanceReady).function
            except Exception:  # the agent's own malformed-event counters cover this
                return
            if fn in self.wanted:
                self.warm.add(fn)
                self._changed.set()

        self._sub = await nc.subscribe(f"{subjects.PREFIX}.instance.ready.*", cb=on_ready)
        return self

    async def wait(self, timeout_s: float) -> set[str]:
        """Wait until every function is warm or ``timeout_s`` passed; returns those still cold
        (e.g. ones no GPU could take). Unsubscribes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while not self.wanted <= self.warm and (left := deadline - loop.time()) > 0:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    break
        finally:
            if self._sub is not None:
                await self._sub.unsubscribe()
        return self.wanted - self.warm


async def profile_all(nc, specs: list[ev.FunctionSpec], timeout_s: float = PROFILE_TIMEOUT_S) -> dict[str, ev.Profile]:
    """Profile every spec through the profiler's request-reply endpoint, concurrently, before
    deploying them (so that their initial instances start together, not as each profile lands).

    Raises TimeoutError naming the functions without an answer (and why: a timeout, no
    profiler responding), RuntimeError with the profiler's reasons for those it could not profile.
    """
    async def one(spec: ev.FunctionSpec) -> ev.ProfileReply:
        msg = await nc.request(subjects.PROFILER_PROFILE, encode(ev.ProfileRequest(spec=spec)), timeout=timeout_s)
        return decode(msg.data, ev.ProfileReply)

    replies = await asyncio.gather(*(one(s) for s in specs), return_exceptions=True)
    late = sorted(f"{s.name} ({type(r).__name__})" for s, r in zip(specs, replies) if isinstance(r, Exception))
    if late:
        raise TimeoutError(f"no profile within {timeout_s:.0f} s for: {', '.join(late)}")
    failed = [f"{s.name}: {r.error}" for s, r in zip(specs, replies) if not r.ok or r.profile is None]
    if failed:
        raise RuntimeError("profiling failed for " + "; ".join(failed))
    return {s.name: r.profile for s, r in zip(specs, replies)}


async def deploy_all(nc, specs: list[ev.FunctionSpec], timeout_s: float = PROFILE_TIMEOUT_S) -> dict[str, ev.Profile]:
    """Deploy every spec the way ``dilu deploy`` does (:func:`dilu.client.admin.deploy`: admission,
    profile, queue, KV ``dilu-functions``, FunctionDeployed), all at once and without waiting for
    instances. Profile them first (:func:`profile_all`) so that the profiler answers here from its
    cache and the initial instances start together.

    Raises DeployError naming each function that failed and why.
    """
    results = await asyncio.gather(*(admin.deploy(nc, s, timeout_s=timeout_s, wait_ready_s=0) for s in specs),
                                   return_exceptions=True)
    failed = [f"{s.name}: {r}" for s, r in zip(specs, results) if isinstance(r, BaseException)]
    if failed:
        raise DeployError("deploy failed for " + "; ".join(failed))
    return {s.name: r.profile for s, r in zip(specs, results)}


# A demo training job soaks what inference leaves idle: a small guaranteed share, a limit that
# keeps it to one job per GPU (two limits of TRAINING_LIMIT exceed the scheduler's gamma of 1.5)
# and leaves 0.7 of that budget to the inference functions packed beside it.
TRAINING_MODEL = "resnet152"
TRAINING_REQUEST = 0.1
TRAINING_LIMIT = 0.8
TRAINING_BATCH = 32


def training_spec(name: str) -> ev.FunctionSpec:
    """A training job on an emulated GPU (ResNet152 iterations at batch 32, timed by its surface),
    priority ``training``, one instance for the whole run, with the operator's profile."""
    return ev.FunctionSpec(
        name=name, model=TRAINING_MODEL, kind="training", priority="training", max_batch=TRAINING_BATCH,
        memory_bytes=models.memory_bytes(TRAINING_MODEL), cold_start_ms=models.cold_start_ms(TRAINING_MODEL),
        min_instances=1, max_instances=1,
        profile=ev.Profile(function=name, request_quota=TRAINING_REQUEST, limit_quota=TRAINING_LIMIT,
                           batch_size=TRAINING_BATCH, backend="operator"))


LLM_MODEL = "llama2"


def llm_spec(name: str, prompt_tokens: float, *, max_batch: int = 8) -> ev.FunctionSpec:
    """An ``llm`` function on the emulated LLaMA2-7B surface. Objectives, the catalogue's rule
    (``DEFAULT_SLO_FACTOR`` x the unloaded full-GPU figure): time per output token 5 x one decode
    step at batch 1; time to first token 5 x (the prefill of a ``prompt_tokens`` prompt + one step)."""
    step_ms = models.step_latency_ms(LLM_MODEL, 1, 1.0)
    tpot = models.DEFAULT_SLO_FACTOR * step_ms
    ttft = models.DEFAULT_SLO_FACTOR * (emulated.prefill_ms(LLM_MODEL, max(1, round(prompt_tokens)), 1.0) + step_ms)
    return ev.FunctionSpec(
        name=name, model=LLM_MODEL, kind="llm", ttft_ms=round(ttft, 1), tpot_ms=round(tpot, 1),
        slo_ms=round(request_slo_ms("llm", ttft_ms=ttft, tpot_ms=tpot), 1), max_batch=max_batch,
        memory_bytes=models.memory_bytes(LLM_MODEL), cold_start_ms=models.cold_start_ms(LLM_MODEL), max_instances=4)


def training_iterations(cluster: Cluster) -> dict[str, float]:
    """Training iterations per function so far, from the node agent's
    ``dilu_training_iterations_total`` (reported by the instances)."""
    return _by_label(cluster.metrics("node_agent"), "dilu_training_iterations", "function")


def _sum(metrics: dict[str, float], name: str, where: dict[str, str] | None = None) -> float:
    """Sum of a counter over all its label sets (``name_total`` samples); with ``where``, over
    those whose labels include each ``label: value`` of it only."""
    total = 0.0
    for key, value in metrics.items():
        base = key.split("{", 1)[0]
        if base == f"{name}_total" and (not where or where.items() <= _labels(key).items()):
            total += value
    return total


def _labels(key: str) -> dict[str, str]:
    """The labels of a scraped sample's key (``name{a=1,b=2}``); {} when it has none."""
    if "{" not in key or key.endswith("{}"):
        return {}
    return dict(kv.split("=", 1) for kv in key[key.index("{") + 1 : -1].split(","))


def _by_label(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.split("{", 1)[0] != f"{name}_total":
            continue
        labels = _labels(key)
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


_GPU_COUNTERS = ("dilu_active_gpu_seconds", "dilu_allocation_frag_gpu_seconds", "dilu_idle_frag_gpu_seconds")
# Mechanism field -> (service, counter, labels a sample must have to count; None: all samples).
# resumes: in place only, over every function; a relaunched one is a scale-out (dilu_scale_outs
# counts it), a refused one stays parked (report.Mechanism).
_MECHANISM_COUNTERS: dict[str, tuple[str, str, dict[str, str] | None]] = {
    "profiler_trials": ("profiler", "dilu_profiler_trials", None),
    "grant_changes": ("node_agent", "dilu_grant_changes", None),
    "token_wait_ms": ("node_agent", "dilu_token_wait_ms", None),
    "scale_outs": ("horizontal_scaler", "dilu_scale_outs", None),
    "retirements": ("horizontal_scaler", "dilu_retirements", None),
    "scale_to_zero": ("horizontal_scaler", "dilu_scale_to_zero", None),
    "parks": ("horizontal_scaler", "dilu_parks", None),
    "resumes": ("horizontal_scaler", "dilu_resumes", {"outcome": "resumed"}),
    "migrations": ("scheduler", "dilu_scheduler_migrations", None),
}


def cluster_counters(cluster: Cluster) -> dict:
    """The services' counters as they stand now, scraped from their /metrics (totals since each
    service started): ``{"gpu": {counter: GPU·s}, "quota_seconds": {fn: s}, "instance_launches":
    {fn: n}, "mechanism": {field: n}, "reaction_ms": (p50, p99)}``; :func:`cluster_facts` turns
    two of them into the figures of the span between."""
    node = cluster.metrics("node_agent")
    scraped = {"node_agent": node, "profiler": cluster.metrics("profiler"),
               "horizontal_scaler": cluster.metrics("horizontal_scaler"), "scheduler": cluster.metrics("scheduler")}
    return {
        "gpu": {name: _sum(node, name) for name in _GPU_COUNTERS},
        "quota_seconds": _by_label(node, "dilu_quota_seconds", "function"),
        "instance_launches": _by_label(node, "dilu_instance_launches", "function"),
        "mechanism": {field: _sum(scraped[svc], name, where)
                      for field, (svc, name, where) in _MECHANISM_COUNTERS.items()},
        "reaction_ms": (node.get("dilu_vertical_reaction_ms{quantile=0.5}", 0.0),
                        node.get("dilu_vertical_reaction_ms{quantile=0.99}", 0.0)),
    }


def cluster_facts(cluster: Cluster, since: dict | None = None) -> dict:
    """GPU-side figures and mechanism counters, scraped from the services' /metrics.

    ``since``: a :func:`cluster_counters` taken earlier on the same cluster; the time integrals
    (active GPU·s, the fragmentations, quota·s) then cover only the time after it: a replay's
    own GPU·s, not those of the profiling trials and of the initial instances' warm-up before
    it, as ``dilu sim`` integrates from the replay's start. Counts of events (launches, trials,
    grants, scale-outs) stay the whole run's, as the simulator's do, and so do the vertical
    reaction quantiles (a summary cannot be differenced).

    Returns ``{"gpu": {...}, "per_function": {fn: {...}}, "mechanism": {...}}`` with the fields
    DESIGN.md section 8 defines (fragmentations as time-weighted means over active GPUs).
    """
    now = cluster_counters(cluster)
    then = since or {"gpu": {}, "quota_seconds": {}}

    def delta(kind: str) -> dict[str, float]:
        return {k: v - then[kind].get(k, 0.0) for k, v in now[kind].items()}

    gpu_s = delta("gpu")
    active = gpu_s["dilu_active_gpu_seconds"]
    gpu = {
        "active_gpu_seconds": active,
        "allocation_fragmentation": gpu_s["dilu_allocation_frag_gpu_seconds"] / active if active else 0.0,
        "idle_fragmentation": gpu_s["dilu_idle_frag_gpu_seconds"] / active if active else 0.0,
    }
    per_function: dict[str, dict] = {}
    for fn, q in delta("quota_seconds").items():
        per_function.setdefault(fn, {})["quota_seconds"] = q
    for fn, n in now["instance_launches"].items():
        per_function.setdefault(fn, {})["instance_launches"] = int(n)
    mechanism = {field: (round(v, 3) if field == "token_wait_ms" else int(v)) for field, v in now["mechanism"].items()}
    mechanism["vertical_reaction_ms_p50"], mechanism["vertical_reaction_ms_p99"] = now["reaction_ms"]
    return {"gpu": gpu, "per_function": per_function, "mechanism": mechanism}
