"""The profiler service: the thin asyncio shell around :mod:`.policy` (DESIGN.md section 4.6).

- On ``dilu.v1.function.deployed.*`` (FunctionDeployed) it profiles the function in the background;
  on ``dilu.v1.profiler.profile`` (ProfileRequest -> ProfileReply) it profiles and answers.
- Trials go to the node agent: TrialRequest on ``dilu.v1.node.trial.<node>`` -> TrialReply
  (``backend="node"``), or are read from the model's recorded A100 surface (``backend="surface"``).
- Profiles are cached by (model, kind, SLO ms, max batch): a second deploy of the same model costs
  no trials. Each profile is stored in the JetStream KV bucket ``dilu-profiles`` (history 5, key =
  sanitised function name) and announced with ProfileReady on ``dilu.v1.profile.ready.<fn>``.
- The procedure (inference search, limit knee, the trial at the limit, the request as deployed:
  width = limit paced to the request, TrialRequest ``grant``) is one pure
  :class:`.policy.ProfileSearch`, the same one ``dilu profile`` and the simulator drive.
- Training functions have no measured training surface: their binary search runs on the model's
  largest-batch inference curve as a stand-in (documented in issue 4).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import tenacity
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter

from dilu.contracts import subjects
from dilu.contracts.events import (
    FunctionDeployed,
    FunctionSpec,
    Profile,
    ProfileReady,
    ProfileReply,
    ProfileRequest,
    TrialReply,
    TrialRequest,
)

from ..common.bus import Bus
from ..common.jsresources import PROFILES_KV_CONFIG, ensure_kv
from ..common.nodes import read_inventories, trial_node
from dilu.services.common import models
from .policy import (Measurement, NoFeasibleSetting, Trial, cache_key,
                     cpu_profile, given_profile, search_for)
from .surface import SurfaceBackend, model_surface

TRIALS = Counter("dilu_profiler_trials", "Measurements the profiler made", ["backend"])
PROFILES = Counter("dilu_profiler_profiles", "Profiles produced", ["source"])  # search | cache
FAILURES = Counter("dilu_profiler_failures", "Profiles that could not be produced", ["reason"])
for _label in ("node", "surface"):  # export 0 before the first trial, so dashboards see the series
    TRIALS.labels(_label)

PROFILE_HISTORY = PROFILES_KV_CONFIG.history


class TrialFailed(RuntimeError):
    """The node agent could not run a trial (no responder, timeout, or it answered ok=false)."""


NO_RESPONDER_WAIT_S = 10.0  # how long a node without a trial responder is asked again (s)


@dataclass
class NodeTrialBackend:
    """Runs each trial on ``node``'s emulated GPU through the node agent (request-reply).

    No responder on the node's trial subject is asked again for up to ``no_responder_wait_s``
    (an agent that is starting claims its name before it serves trials; one restarting or
    reconnecting has none for a moment); a timeout is not (the node is busy or stuck)."""

    bus: Bus
    node: str
    model: str
    repeats: int = 5
    timeout_s: float = 30.0
    trials: int = 0
    no_responder_wait_s: float = NO_RESPONDER_WAIT_S

    async def run(self, trial: Trial) -> Measurement:
        """Raises TrialFailed with the reason."""
        req = TrialRequest(model=self.model, batch=trial.batch, quota=trial.quota, repeats=self.repeats,
                           grant=trial.grant or 0.0)  # 0: unpaced (grant = width)
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(NoRespondersError), reraise=True,
            stop=tenacity.stop_after_delay(self.no_responder_wait_s),
            wait=tenacity.wait_exponential(multiplier=0.05, max=1.0))
        try:
            async for attempt in retrying:
                with attempt:
                    reply = await self.bus.request(subjects.node_trial(self.node), req, TrialReply,
                                                   timeout=self.timeout_s)
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError) as exc:
            raise TrialFailed(f"trial on {self.node} got no answer: {type(exc).__name__}") from None
        self.trials += 1
        TRIALS.labels("node").inc()
        if not reply.ok:
            raise TrialFailed(f"trial on {self.node} failed: {reply.error}")
        return Measurement(latency_ms=reply.latency_ms_p99, throughput_rps=reply.throughput_rps)


class _SurfaceAsync:
    """The recorded-surface backend behind the same async interface."""

    def __init__(self, model: str) -> None:
        self.inner = SurfaceBackend(model_surface(model))

    @property
    def trials(self) -> int:
        return self.inner.trials

    async def run(self, trial: Trial) -> Measurement:
        before = self.inner.trials
        m = self.inner.run(trial)
        TRIALS.labels("surface").inc(self.inner.trials - before)
        return m


class ProfilerService:
    """See the module docstring. ``backend``: ``node`` (through the node agent) or ``surface``;
    ``trial_timeout_s``: how long one trial's answer is awaited (s); ``no_responder_wait_s``: how
    long a node with no trial responder is asked again before the trial fails (s)."""

    name = "profiler"

    def __init__(self, node: str = "", backend: str = "node", repeats: int = 5,
                 trial_timeout_s: float = 30.0, no_responder_wait_s: float = NO_RESPONDER_WAIT_S) -> None:
        if backend not in ("node", "surface"):
            raise ValueError(f"backend must be 'node' or 'surface', got {backend!r}")
        self.node = node
        self.backend = backend
        self.repeats = repeats
        self.trial_timeout_s = trial_timeout_s
        self.no_responder_wait_s = no_responder_wait_s
        self.bus: Bus | None = None
        self.kv = None
        self.cache: dict[tuple, Profile] = {}
        self._told: dict[str, Profile] = {}  # function -> the profile last published for it (trials 0)
        self._locks: dict[tuple, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self.trials = 0
        self._ready = False

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        # an existing bucket is bound as it is, each differing setting warned about
        self.kv, _ = await ensure_kv(bus.js, PROFILES_KV_CONFIG, replicas=bus.options.replicas, log=bus.log)
        # a wildcard pattern, written out: subjects.function_deployed() would sanitise "*" away
        await bus.subscribe(f"{subjects.PREFIX}.function.deployed.*", FunctionDeployed, self._on_deployed)
        await bus.serve(subjects.PROFILER_PROFILE, ProfileRequest, self._on_request, concurrent=True)
        self._ready = True

    async def stop(self) -> None:
        """Searches still running are cancelled (a partial profile is never stored)."""
        self._ready = False
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------------ handlers

    async def _on_deployed(self, event: FunctionDeployed, _msg) -> None:
        # profiling takes many trials: run it aside so later deploys are not queued behind it
        task = asyncio.create_task(self._profile_logged(event.spec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _profile_logged(self, spec: FunctionSpec) -> None:
        try:
            await self.profile(spec)
        except Exception as exc:  # counted and logged; the service carries on
            self.bus.log.warning("profiling failed", function=spec.name, error=f"{type(exc).__name__}: {exc}")

    async def _on_request(self, req: ProfileRequest, _msg) -> ProfileReply:
        try:
            return ProfileReply(ok=True, profile=await self.profile(req.spec))
        except (KeyError, NoFeasibleSetting, TrialFailed, ValueError) as exc:
            return ProfileReply(ok=False, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ work

    async def profile(self, spec: FunctionSpec) -> Profile:
        """Profile ``spec`` (or reuse a cached profile of the same model, kind and SLO), store it
        in KV and publish ProfileReady. Raises KeyError (unknown model), NoFeasibleSetting,
        TrialFailed; each is counted in ``dilu_profiler_failures``."""
        key = cache_key(spec)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # concurrent deploys of one model share one search
            try:
                profile = await self._without_trials(spec)
                cached = self.cache.get(key)
                if profile is not None:
                    PROFILES.labels(profile.backend).inc()
                elif cached is not None:
                    profile = msgspec.structs.replace(cached, function=spec.name, trials=0)
                    PROFILES.labels("cache").inc()
                else:
                    profile = await self._search(spec)
                    self.cache[key] = profile
                    PROFILES.labels("search").inc()
            except Exception as exc:
                FAILURES.labels(type(exc).__name__).inc()
                raise
        # the bucket holds the Profile itself (JSON), one key per function, the last 5 kept
        await self.kv.put(subjects.token(spec.name), msgspec.json.encode(profile))
        await self.bus.publish(subjects.profile_ready(spec.name), ProfileReady(profile=profile))
        # a deploy asks for the profile, then its FunctionDeployed asks again (answered from the
        # cache): the same profile published twice is one "profile ready" line, not two
        told, self._told[spec.name] = self._told.get(spec.name), msgspec.structs.replace(profile, trials=0)
        same = told == self._told[spec.name]
        (self.bus.log.debug if same else self.bus.log.info)(
            "profile unchanged" if same else "profile ready", function=spec.name, request_quota=profile.request_quota,
            limit_quota=profile.limit_quota, batch=profile.batch_size, trials=profile.trials)
        return profile

    async def _without_trials(self, spec: FunctionSpec) -> Profile | None:
        """A profile that needs no search: the operator's (``spec.profile``), or, on a cluster
        of CPU nodes only (or a ``--node`` that is a CPU node: no GPU to trial on),
        :func:`cpu_profile`. Raises ValueError when the
        function can only be profiled on an emulated GPU's surface and it names none."""
        if spec.profile is not None:
            return given_profile(spec)
        if self.backend == "surface":
            return None
        found = {name: inv for name, (inv, _) in (await read_inventories(self.bus.js)).items()}
        if self.node:  # trials run on that node only: a CPU node has nothing to trial on
            found = {self.node: found[self.node]} if self.node in found else {}
        if found and trial_node(found) is None and all(inv.device == "cpu" for inv in found.values()):
            return cpu_profile(spec)
        if not spec.model:
            raise ValueError(f"{spec.name!r} cannot be profiled: trials run on an emulated GPU's surface and it names "
                             "no [emulation] model; give the operator's [profile] in its spec")
        models.spec(spec.model)  # KeyError: unknown model, naming the known ones
        return None

    async def _trial_node(self) -> str:
        """The node named by ``--node``, else one from the ``dilu-nodes`` inventory (see
        dilu.services.common.nodes.trial_node). Raises TrialFailed when no node has a GPU."""
        if self.node:
            return self.node
        found = await read_inventories(self.bus.js)
        node = trial_node({name: inv for name, (inv, _) in found.items()})
        if node is None:
            raise TrialFailed("no node with a healthy GPU in the dilu-nodes inventory to run profiling trials on")
        return node

    async def _search(self, spec: FunctionSpec) -> Profile:
        """Drive :class:`.policy.ProfileSearch` (the same procedure as ``dilu profile``) with
        trials on the node agent or the model's surface. Raises TrialFailed, NoFeasibleSetting,
        NoThroughput (ValueError)."""
        search = search_for(spec)
        if self.backend == "surface":
            backend = _SurfaceAsync(spec.model)
        else:
            backend = NodeTrialBackend(self.bus, await self._trial_node(), spec.model, self.repeats, self.trial_timeout_s,
                                       no_responder_wait_s=self.no_responder_wait_s)
        while (trial := search.next_trial()) is not None:
            search.record(trial, await backend.run(trial))
        result = search.result()
        self.trials += backend.trials
        name = "surface" if self.backend == "surface" else "emulated"
        return msgspec.structs.replace(result.to_profile(spec.name, name), trials=backend.trials)
