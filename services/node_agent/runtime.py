"""What an instance runs, and one interface over it (the instance process is :mod:`.instance`).

Three sources of a function's code, one adapter each (:class:`FunctionRuntime`):

- ``emulated``: on an emulated GPU the platform's emulated handler stands in for the user's code
  (user code cannot run on the fake driver): it replays the spec's ``model`` on the driver, timed
  by the measured surfaces (:mod:`.handlers.emulated`);
- ``class``: the user's class named by ``entry`` (``module:Name``, :mod:`dilu.client.functions`),
  imported from the function's code bundle (``dilu-code``) put first on ``sys.path``;
- ``handler``: the older handler module (``load(ctx)``/``predict(model, batch)``, :mod:`.handlers`).

:func:`choose` decides which (pure); :func:`open_runtime` fetches and loads it; every failure to
load is a :class:`LoadError` whose message is one line naming the function and the reason. Each
adapter also says whether its code can be parked (weights to host memory and back, so an idle
instance frees its GPU memory and returns in a copy, not a cold start): ``parkable``, ``park``,
``resume``.
Also here, free of NATS so they can be tested alone: :func:`run_generate` (one batch of an ``llm``
function, step by step, each chunk handed on as it comes), :func:`train_loop` (a training job's
iterations until told to stop) and :class:`StatsWindow` (an instance's FunctionStats period).
"""
from __future__ import annotations

import asyncio
import importlib
import math
import random
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Literal

from dilu.contracts import events as ev
from dilu.services.common import bundle, functions

from .handlers import KIND_METHODS, FunctionContext, load_module

EMULATED_HANDLER = "dilu.services.node_agent.handlers.emulated"

Source = Literal["emulated", "class", "handler"]
Chunk = bytes | None


class LoadError(RuntimeError):
    """A function that cannot be loaded on this instance; ``str()`` is one line naming the
    function and the reason (the instance logs it and exits non-zero)."""

    def __init__(self, function: str, reason: str) -> None:
        self.function = function
        self.reason = " ".join(str(reason).split())  # one line, whatever the cause printed
        super().__init__(f"function {function!r} cannot load: {self.reason}")


@dataclass(frozen=True)
class Plan:
    """What an instance will run (the result of :func:`choose`).

    ``source``: see the module doc; ``target``: the handler module's dotted path, or the class
    entry ``module:Name``; ``code``: the bundle key to fetch (``class`` only; empty: the module
    is importable as it is); ``kind``: inference | llm | training; ``model``: the emulation model
    (may be empty); ``max_batch``: the spec's (0 without a spec); ``cold_start_ms``: the spec's
    emulated load time (0: the model's default); ``config``: the spec's ``[config]``.
    """

    function: str
    source: Source
    target: str
    kind: str = "inference"
    model: str = ""
    code: str = ""
    max_batch: int = 0
    cold_start_ms: float = 0.0
    config: dict[str, str] = field(default_factory=dict)


def parse_entry(function: str, entry: str) -> tuple[str, str]:
    """Split ``module:Name`` into its parts; LoadError when it is not of that form."""
    module, sep, name = entry.partition(":")
    if not sep or not module or not name or ":" in name or not all(p.isidentifier() for p in name.split(".")):
        raise LoadError(function, f"entry {entry!r} is not of the form module:Class")
    return module, name


def choose(spec: ev.FunctionSpec | None, *, function: str, device: str, model: str = "",
           handler: str = EMULATED_HANDLER) -> Plan:
    """Decide what an instance of ``function`` runs on ``device`` (``emulated``, ``cpu``, ``cuda``).

    - no spec (an older caller; the function is not in ``dilu-functions``): the command line's
      ``handler`` and ``model`` as they are (``model`` ``"none"`` reads as empty), kind inference;
    - ``device == "emulated"``: the emulated handler with ``spec.model``;
    - ``spec.entry`` set: the user's class (from bundle ``spec.code``);
    - otherwise ``spec.handler``, the handler module.

    Raises LoadError when the spec cannot run on this device (the rule of
    :func:`dilu.services.common.functions.runs_on`) or its entry is malformed. Pure.
    """
    if spec is None:
        model = "" if model == "none" else model
        source: Source = "emulated" if handler == EMULATED_HANDLER else "handler"
        return Plan(function=function, source=source, target=handler, model=model)
    reason = functions.runs_on(spec, "nvml" if device == "cuda" else device)
    if reason:
        raise LoadError(function, reason)
    common = dict(function=function, kind=spec.kind, model=spec.model, max_batch=spec.max_batch,
                  cold_start_ms=spec.cold_start_ms, config=dict(spec.config))
    if device == "emulated":
        return Plan(source="emulated", target=EMULATED_HANDLER, **common)
    if spec.entry:
        parse_entry(function, spec.entry)
        return Plan(source="class", target=spec.entry, code=spec.code, **common)
    return Plan(source="handler", target=spec.handler, **common)


def context_for(plan: Plan, *, instance_id: str, batch_size: int, width: float, device: str) -> FunctionContext:
    """The context handed to the function's code. ``batch_size`` is the instance's largest batch,
    except for training, whose iterations take a batch of the spec's ``max_batch``."""
    if plan.kind == "training" and plan.max_batch > 0:
        batch_size = plan.max_batch
    return FunctionContext(instance_id=instance_id, function=plan.function, model=plan.model,
                           batch_size=batch_size, width=width, device=device, kind=plan.kind,
                           config=dict(plan.config))


# ------------------------------------------------------------------------------------- adapters


class WrongKind(TypeError):
    """A function was asked for work of another kind (e.g. ``train_step`` of an inference class)."""


class NotParkable(RuntimeError):
    """``park`` or ``resume`` of a runtime whose code cannot move its weights off the device and
    back (a class or handler module without both ``park`` and ``resume``)."""


class FunctionRuntime:
    """One loaded function, whatever its source. Every method blocks (call it in a worker thread)
    and raises what the function's code raises.

    - ``predict(batch: list[bytes]) -> list[bytes]``: inference, one output per input;
    - ``generate(batch) -> Iterator[list[bytes | None]]``: llm, one chunk per request per step;
    - ``train_step() -> None``: training, one iteration;
    - ``close()``: release what the code holds (errors are the caller's to log);
    - ``park()`` / ``resume()``: move the weights to host memory, freeing the device memory, and
      back (parking an idle instance live: a resume costs a copy, not a cold start). Only when
      :attr:`parkable`; otherwise they raise :class:`NotParkable`.

    Loading checks that the code has the method its kind needs (:class:`LoadError` otherwise);
    calling a method of another kind raises :class:`WrongKind` naming it.
    """

    kind: str = "inference"
    description: str = ""

    @property
    def parkable(self) -> bool:
        """Whether the loaded code can move its weights off the device and back."""
        return False

    def predict(self, batch: list[bytes]) -> list[bytes]:
        raise WrongKind(f"{self.description} has no predict")

    def generate(self, batch: list[bytes]) -> Iterator[list[Chunk]]:
        raise WrongKind(f"{self.description} has no generate")

    def train_step(self) -> None:
        raise WrongKind(f"{self.description} has no train_step")

    def close(self) -> None:
        pass

    def park(self) -> None:
        """Move the weights to host memory and free their device memory (blocking). Raises
        NotParkable when not :attr:`parkable`, else what the code raises."""
        raise NotParkable(f"{self.description} cannot park: it has no park and resume")

    def resume(self) -> None:
        """Copy the parked weights back to the device (blocking). Raises NotParkable when not
        :attr:`parkable`, else what the code raises (e.g. out of device memory)."""
        raise NotParkable(f"{self.description} cannot resume: it has no park and resume")


def _has_methods(obj: object, *names: str) -> bool:
    return all(callable(getattr(obj, name, None)) for name in names)


class ClassRuntime(FunctionRuntime):
    """The user's class instance ``obj`` (built with its FunctionContext)."""

    def __init__(self, obj: object, kind: str, entry: str) -> None:
        self.obj, self.kind, self.description = obj, kind, f"class {entry}"

    def predict(self, batch: list[bytes]) -> list[bytes]:
        if not callable(getattr(self.obj, "predict", None)):
            return super().predict(batch)
        return list(self.obj.predict(batch))

    def generate(self, batch: list[bytes]) -> Iterator[list[Chunk]]:
        if not callable(getattr(self.obj, "generate", None)):
            return super().generate(batch)
        return iter(self.obj.generate(batch))

    def train_step(self) -> None:
        if not callable(getattr(self.obj, "train_step", None)):
            return super().train_step()
        self.obj.train_step()

    def close(self) -> None:
        if callable(getattr(self.obj, "close", None)):
            self.obj.close()

    @property
    def parkable(self) -> bool:
        """The class has both ``park()`` and ``resume()`` (one alone could not come back)."""
        return _has_methods(self.obj, "park", "resume")

    def park(self) -> None:
        if not self.parkable:
            return super().park()
        self.obj.park()

    def resume(self) -> None:
        if not self.parkable:
            return super().resume()
        self.obj.resume()


class HandlerRuntime(FunctionRuntime):
    """A handler module (``load``/``predict``, optional ``generate``/``train_step``/``close``/
    ``park``/``resume`` taking the loaded model first) and the model its ``load`` returned."""

    def __init__(self, module: ModuleType, state: object, kind: str) -> None:
        self.module, self.state, self.kind = module, state, kind
        self.description = f"handler {module.__name__}"

    def _fn(self, name: str):
        fn = getattr(self.module, name, None)
        return fn if callable(fn) else None

    def predict(self, batch: list[bytes]) -> list[bytes]:
        fn = self._fn("predict")
        return list(fn(self.state, batch)) if fn else super().predict(batch)

    def generate(self, batch: list[bytes]) -> Iterator[list[Chunk]]:
        fn = self._fn("generate")
        return iter(fn(self.state, batch)) if fn else super().generate(batch)

    def train_step(self) -> None:
        fn = self._fn("train_step")
        if fn is None:
            return super().train_step()
        fn(self.state)

    def close(self) -> None:
        fn = self._fn("close")
        if fn is not None:
            fn(self.state)

    @property
    def parkable(self) -> bool:
        """The module has both ``park(model)`` and ``resume(model)``."""
        return _has_methods(self.module, "park", "resume")

    def park(self) -> None:
        if not self.parkable:
            return super().park()
        self.module.park(self.state)

    def resume(self) -> None:
        if not self.parkable:
            return super().resume()
        self.module.resume(self.state)


class EmulatedRuntime(HandlerRuntime):
    """The emulated handler (:mod:`.handlers.emulated`) replaying ``plan.model``. Always
    parkable: parking frees the weights' device memory, resuming allocates it again and takes
    the weight copy's time (:func:`.handlers.emulated.resume`)."""

    @property
    def parkable(self) -> bool:
        return True


def _import_class(plan: Plan, code_dir: Path | None) -> type:
    module_name, name = parse_entry(plan.function, plan.target)
    if code_dir is not None:
        sys.path.insert(0, str(code_dir))  # the function's own modules win over same-named others
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise LoadError(plan.function, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise LoadError(plan.function, f"module {module_name!r} has no {name!r}")
    if not isinstance(obj, type):
        raise LoadError(plan.function, f"{plan.target!r} is not a class")
    method = KIND_METHODS[plan.kind]
    if not callable(getattr(obj, method, None)):
        raise LoadError(plan.function, f"class {plan.target!r} has no {method} method (kind {plan.kind})")
    return obj


def build(plan: Plan, ctx: FunctionContext, code_dir: Path | None = None) -> FunctionRuntime:
    """Import and load the function's code (blocking: the cold start's load step).

    ``code_dir``: the unpacked bundle of a ``class`` plan, put first on ``sys.path``.
    Raises LoadError (import error, missing class or method for the kind, the code's own load
    failing: its exception is named in the reason).
    """
    try:
        if plan.source == "class":
            cls = _import_class(plan, code_dir)
            return ClassRuntime(cls(ctx), plan.kind, plan.target)
        if plan.source == "emulated":
            from .handlers import emulated

            model = emulated.load(ctx, cold_start_ms=plan.cold_start_ms)
            return EmulatedRuntime(emulated, model, plan.kind)
        try:
            module = load_module(plan.target, plan.kind)
        except ValueError as exc:
            raise LoadError(plan.function, str(exc)) from None
        return HandlerRuntime(module, module.load(ctx), plan.kind)
    except LoadError:
        raise
    except Exception as exc:
        what = plan.target if plan.source != "emulated" else f"emulated model {plan.model!r}"
        raise LoadError(plan.function, f"loading {what} failed: {type(exc).__name__}: {exc}") from None


async def open_runtime(js, plan: Plan, ctx: FunctionContext) -> FunctionRuntime:
    """Fetch the plan's code bundle (if any) from ``dilu-code`` and :func:`build` it in a worker
    thread. Raises LoadError (a missing or corrupt bundle included)."""
    code_dir = None
    if plan.source == "class" and plan.code:
        try:
            code_dir = await bundle.fetch(js, plan.code)
        except bundle.BundleError as exc:
            raise LoadError(plan.function, str(exc)) from None
        except Exception as exc:  # NATS errors while fetching
            raise LoadError(plan.function, f"fetching code bundle {plan.code!r} failed: {type(exc).__name__}: {exc}") from None
    return await asyncio.to_thread(build, plan, ctx, code_dir)


# ----------------------------------------------------------------------------- llm and training

OnChunk = Callable[[int, bytes], Awaitable[None]]
_DONE = object()


async def run_generate(rt: FunctionRuntime, payloads: list[bytes], on_chunk: OnChunk,
                       stop: Callable[[], bool] = lambda: False) -> list[bytes | Exception]:
    """Run ``rt.generate(payloads)`` step by step in a worker thread, awaiting
    ``on_chunk(index, chunk)`` for each chunk as its step comes (so chunks of one request reach
    ``on_chunk`` in order); returns each request's output, its chunks joined.

    A request whose chunk is neither bytes nor None fails alone (TypeError; it gets no more
    chunks). If ``generate`` raises, or yields a step whose length is not the batch's, every
    request still without a result gets that error. ``stop()`` is asked before each step: once
    it is true (every caller of the batch withdrew) the generator is closed, no step more runs,
    and every request without a result gets :class:`Withdrawn`. Never raises for the function's
    errors.
    """
    n = len(payloads)
    outputs: list[list[bytes]] = [[] for _ in range(n)]
    failed: list[Exception | None] = [None] * n
    try:
        steps = await asyncio.to_thread(rt.generate, payloads)
        while True:
            if stop():
                await asyncio.to_thread(_close, steps)
                raise Withdrawn("every caller of the batch withdrew its request")
            step = await asyncio.to_thread(next, steps, _DONE)
            if step is _DONE:
                break
            step = list(step)
            if len(step) != n:
                raise ValueError(f"generate yielded a step of {len(step)} chunks for {n} requests")
            for i, chunk in enumerate(step):
                if chunk is None or failed[i] is not None:
                    continue
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    failed[i] = TypeError(f"generate yielded a {type(chunk).__name__} chunk, expected bytes or None")
                    continue
                chunk = bytes(chunk)
                outputs[i].append(chunk)
                await on_chunk(i, chunk)
    except Exception as exc:  # the batch's requests that have no result yet fail with it
        failed = [f if f is not None else exc for f in failed]
    return [failed[i] if failed[i] is not None else b"".join(outputs[i]) for i in range(n)]


class Withdrawn(Exception):
    """An llm batch stopped because every caller withdrew its request (never sent to anyone)."""


def _close(steps: Iterator) -> None:
    """Close a generator (its ``finally`` blocks run: the function frees what the batch held);
    a plain iterator has nothing to close."""
    close = getattr(steps, "close", None)
    if callable(close):
        close()


async def train_loop(rt: FunctionRuntime, stop: asyncio.Event, on_iteration: Callable[[], None] = lambda: None) -> int:
    """Call ``rt.train_step()`` (in a worker thread) until ``stop`` is set; the step in progress
    when it is set finishes first (drain). Calls ``on_iteration()`` after each step; returns the
    number of steps done. Raises what ``train_step`` raises."""
    done = 0
    while not stop.is_set():
        await asyncio.to_thread(rt.train_step)
        done += 1
        on_iteration()
    return done


# -------------------------------------------------------------------------------------- stats


class _Reservoir:
    """A uniform sample of at most ``cap`` of the values added (Vitter's algorithm R), so a busy
    period's latencies stay representative within the size bound of one FunctionStats."""

    def __init__(self, cap: int, rng: random.Random) -> None:
        self.cap, self.rng = cap, rng
        self.values: list[float] = []
        self.seen = 0

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.cap:
            self.values.append(value)
            return
        j = self.rng.randrange(self.seen)
        if j < self.cap:
            self.values[j] = value

    def take(self) -> list[float]:
        values, self.values, self.seen = self.values, [], 0
        return values


class StatsWindow:
    """One instance's counters over a FunctionStats period (about 1 s): requests answered ok and
    with an error, cold starts, latencies (ms, from each request's scheduled send time), ttft and
    tpot per streamed request (ms), training iterations. Counts are exact; each list keeps a
    uniform sample of at most ``max_values`` (``events.STATS_MAX_LATENCIES``). Not thread-safe:
    record from the event loop."""

    def __init__(self, function: str, instance_id: str, node: str = "", *, start_ns: int,
                 max_values: int = ev.STATS_MAX_LATENCIES, rng: random.Random | None = None) -> None:
        self.function, self.instance_id, self.node = function, instance_id, node
        rng = rng or random.Random()
        self.latency, self.ttft, self.tpot = (_Reservoir(max_values, rng) for _ in range(3))
        self.ok = self.errors = self.cold_starts = self.iterations = 0
        self.since_ns = start_ns

    @staticmethod
    def _ms(value: float) -> float:
        """A duration in ms fit to publish: finite and >= 0 (clocks of two hosts may disagree)."""
        return max(0.0, value) if math.isfinite(value) else 0.0

    def request(self, *, ok: bool, latency_ms: float, cold_start: bool = False) -> None:
        """One answered request."""
        if ok:
            self.ok += 1
        else:
            self.errors += 1
        self.cold_starts += bool(cold_start)
        self.latency.add(self._ms(latency_ms))

    def stream(self, *, ttft_ms: float, tpot_ms: float | None) -> None:
        """One streamed request's time to first token and mean time per output token (None with
        a single chunk: no inter-token time)."""
        self.ttft.add(self._ms(ttft_ms))
        if tpot_ms is not None:
            self.tpot.add(self._ms(tpot_ms))

    def iteration(self, n: int = 1) -> None:
        """``n`` training iterations done."""
        self.iterations += n

    @property
    def empty(self) -> bool:
        return not (self.ok or self.errors or self.iterations or self.ttft.seen)

    def take(self, now_ns: int) -> ev.FunctionStats | None:
        """The period since the last take as a FunctionStats (and a new period), or None when
        nothing happened in it (nothing is published for an idle instance)."""
        if self.empty:
            self.since_ns = now_ns
            return None
        stats = ev.FunctionStats(
            function=self.function, instance_id=self.instance_id, node=self.node, ok=self.ok,
            errors=self.errors, cold_starts=self.cold_starts, latency_ms=self.latency.take(),
            ttft_ms=self.ttft.take(), tpot_ms=self.tpot.take(), iterations=self.iterations,
            period_ms=max(0.0, (now_ns - self.since_ns) / 1e6), ts_ns=now_ns)
        self.ok = self.errors = self.cold_starts = self.iterations = 0
        self.since_ns = now_ns
        return stats
