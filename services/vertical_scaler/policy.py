"""Vertical scaling policy: per-GPU quota grants from telemetry and kernel-cycle stretch (pure).

State and time go in, grants come out; nothing here reads a clock, sleeps or touches the network
(DESIGN.md section 3). Times are milliseconds on any monotonic clock the caller chooses; quotas are
fractions 0..1 of one GPU's SM-time (DESIGN.md section 2).

The rules, in order of strength:

1. **Floors are sacred.** A latency-sensitive or training instance is never granted less than its
   request quota; a best-effort instance never less than ``min(limit, be_floor)`` (> 0), so every
   instance makes progress in every window. Every grant is at least ``min_quota`` (> 0).
2. **Σ grants on a GPU ≤ 1**, including the grants that hysteresis leaves unsent (the effective
   set is checked, and withheld decreases are sent when needed). Limits may oversubscribe (Σ limits
   ≤ γ), grants never do. No grant exceeds the instance's limit quota.
3. **Pressure first.** A kernel-cycle stretch (``ratio ≥ stretch_ratio``) or SLO pressure
   (``latency_ms_recent > slo_pressure × slo_ms``) of a latency-sensitive instance raises it to its
   limit at once; the share comes from best-effort, then training (down to its request), then the
   extras of other latency-sensitive instances: allocation above the floors runs in the order
   pressured LS (to its limit) → best-effort (to its request) → LS → training → best-effort (their
   wants), so lower tiers absorb the shortfall, and best-effort goes below its request only for
   an instance under pressure.
4. **AIMD recovery.** On a pressure signal the ceilings of the GPU's training and best-effort
   instances are cut multiplicatively (× ``decrease_factor``, at most once per
   ``decrease_interval_ms``, like TCP's once per round trip); without pressure they recover
   additively (``recovery_per_s`` quota per second). Additive increase / multiplicative decrease
   converges to an efficient, fair share: Chiu & Jain, "Analysis of the increase and decrease
   algorithms for congestion avoidance in computer networks", Computer Networks and ISDN Systems
   17(1), 1989. A pressured instance stays at its limit for ``pressure_hold_ms`` after its last
   signal, then follows its demand again.
5. **Work conserving.** An instance that can use more (it waited for tokens, had a batch in hand
   at the sample (``queue_depth``), or used
   ≥ ``hungry_util`` of its grant) wants its limit (capped by its AIMD ceiling); one that cannot
   wants ``used × (1 + idle_margin)``, never under its floor, approached at most
   ``release_per_s`` quota per second. Share nobody can use is left unallocated by default,
   so ``limit − quota`` stays an honest measure of vertical headroom for the horizontal scaler.
   With ``park_idle`` it is parked on the latency-sensitive instances up to their limits instead:
   they run at MPS width = limit, and one held at its request serves a sudden request
   wide-but-paced, slower than its profile, until the next telemetry. Parking comes after every
   tier, so any want takes it back at the next grant, but only at the next grant: on replays
   (60 s, 16 functions) it sped up lightly loaded functions (seed 6: violations 0.5 % -> 0.0 %)
   and slowed a busy one reclaiming it (seed 2: 0.6 % -> 2.6 %, one more instance), so it is off
   by default.
6. **The window is not trusted to be whole.** An instance the policy knows that a telemetry window
   omits still holds the quota last granted to it: it is kept, *absent*, at that grant (counted in
   Σ and given first claim after the floors, never raised) until it has been missing for
   ``forget_after_ms``, then taken for retired and forgotten; one the node agent reports retired
   (:meth:`VerticalPolicy.on_retired`) is forgotten at once. An instance listed twice in one
   window is counted once (its first row; the rest are counted in ``duplicate_rows``).
7. **Hysteresis.** Only changes of at least ``hysteresis`` are sent (plus any change needed to
   restore a floor, a limit or Σ ≤ 1); decreases are listed before increases so that a node agent
   applying them in order never oversubscribes the GPU, even transiently.

Modes (``VerticalConfig.mode``), the knob a demo baseline selects:

- ``dilu``: the adaptive policy above.
- ``static``: every instance held at its request quota (horizontal-only baseline).
- ``static-limit``: every instance held at its limit quota, i.e. its fixed MPS width without token
  pacing (static-MPS baseline). Σ may exceed 1 here: spatial MPS sharing is what that baseline is.
- ``off``: no grants at all; instances run at the quota they were launched with (exclusive baseline).
- ``published``: :class:`PublishedVertical`, Dilu's vertical scaling as the paper describes it
  (fixed sample windows, AIMD on training only), the ``dilu-published`` baseline;
  :func:`vertical_policy` builds the class a mode names.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from dilu.contracts.events import InstanceTelemetry
from dilu.services.common.functions import BEST_EFFORT, LATENCY_SENSITIVE, STRETCH_RATIO, TRAINING, yields_share

Mode = Literal["dilu", "static", "static-limit", "off", "published"]
MODES: tuple[str, ...] = ("dilu", "static", "static-limit", "off", "published")
# Allocation above the floors, in order: a pressured latency-sensitive instance up to its limit;
# best-effort up to its request (guaranteed unless someone is under pressure); then the extras of
# latency-sensitive, training and best-effort instances up to what they want.
# Absent instances (omitted by the latest window) come first: they keep their last grant.
_ORDER = (("absent", "want"), ("pressured", "want"), (BEST_EFFORT, "request"),
          (LATENCY_SENSITIVE, "want"), (TRAINING, "want"), (BEST_EFFORT, "want"))
_EPS = 1e-9
# The modes that read each tuning knob of VerticalConfig (the others ignore it): a knob set for a
# mode that does not read it is a mistake the service refuses.
KNOB_MODES: dict[str, tuple[str, ...]] = {
    "pressure_hold_ms": ("dilu",), "recovery_per_s": ("dilu",), "release_per_s": ("dilu",),
    "park_idle": ("dilu",), "decrease_factor": ("dilu", "published"),
}


@dataclass(frozen=True)
class VerticalConfig:
    """Knobs of :class:`VerticalPolicy` (quotas are fractions 0..1; times are ms).

    Defaults: ``stretch_ratio`` 1.5, the node agent's detector's (``functions.STRETCH_RATIO``:
    the Dilu paper's kernel-cycle stretch); ``decrease_factor`` 0.5 and additive recovery are the classic AIMD constants (TCP
    Reno halves its window); ``recovery_per_s`` 0.5 re-grows a fully cut victim in about 2 s;
    ``release_per_s`` 0.5 lets an instance whose demand fell give its share back over about a
    second rather than at once (so bursty demand does not flap between limit and use);
    ``hysteresis`` 0.02 keeps telemetry noise (a few percent per window) from producing grants;
    ``forget_after_ms`` 2000 (8 windows of the node agent's 250 ms telemetry) is how long an
    instance omitted from telemetry keeps its grant before it is taken for retired.
    """

    mode: Mode = "dilu"
    hysteresis: float = 0.02
    stretch_ratio: float = STRETCH_RATIO
    slo_pressure: float = 0.9
    pressure_hold_ms: float = 500.0
    decrease_factor: float = 0.5
    decrease_interval_ms: float = 100.0
    recovery_per_s: float = 0.5
    release_per_s: float = 0.5
    be_floor: float = 0.05
    min_quota: float = 0.01
    hungry_util: float = 0.9
    idle_margin: float = 0.25
    settle_ms: float = 250.0
    park_idle: bool = False
    forget_after_ms: float = 2000.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"vertical mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not 0.0 < self.decrease_factor < 1.0:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor}")
        if not 0.0 < self.min_quota <= self.be_floor <= 1.0:
            raise ValueError("need 0 < min_quota <= be_floor <= 1")
        if self.park_idle and self.mode not in KNOB_MODES["park_idle"]:
            raise ValueError(f"park_idle (--park-idle) lends idle share, which only the dilu mode does, "
                             f"not {self.mode!r}")


@dataclass(frozen=True)
class Grant:
    """One quota change: set ``instance_id`` to ``quota`` (0..1) because of ``reason``."""

    instance_id: str
    quota: float
    reason: str


@dataclass
class _Instance:
    instance_id: str
    function: str
    priority: str
    request: float
    limit: float
    width: float
    granted: float  # the quota in effect as far as we know (last sent, or last reported)
    sent_ms: float = -math.inf  # when we last sent a grant for it
    used: float = 0.0  # SM-time share over the last window
    hungry: bool = False
    pressure_until_ms: float = -math.inf
    pressure_cause: str = ""
    ceiling: float = 1.0  # AIMD ceiling (training and best-effort only)
    absent_since_ms: float | None = None  # omitted from telemetry since then (still holds `granted`)
    stretched_at: int | None = None  # the GPU's window count at its last stretch (PublishedVertical)

    def tier(self, now_ms: float) -> str:
        if self.absent_since_ms is not None:
            return "absent"
        if self.priority == LATENCY_SENSITIVE and now_ms < self.pressure_until_ms:
            return "pressured"
        return self.priority

    def floor(self, cfg: VerticalConfig) -> float:
        if self.priority == BEST_EFFORT:
            return max(cfg.min_quota, min(self.limit, cfg.be_floor))
        return max(cfg.min_quota, self.request)


@dataclass
class _Gpu:
    instances: dict[str, _Instance] = field(default_factory=dict)
    last_ms: float | None = None
    dt_ms: float = 0.0  # time since the previous update of this GPU
    last_decrease_ms: float = -math.inf
    samples: int = 0  # telemetry windows received for this GPU
    quiet_since: int = 0  # PublishedVertical: the window of the last stretch here,
    increased_at: int = 0  # and of the last additive increase


def _check_share(name: str, value: float, instance_id: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"instance {instance_id!r}: {name} must be a fraction in [0, 1], got {value!r}")
    return float(value)


class VerticalPolicy:
    """Per-GPU grant computation for one node. Feed it telemetry and stretch events; send its grants.

    ``gpu`` keys are whatever identifies a GPU on the node (its index). Every method returns the
    grants to send now (possibly empty), decreases first. Malformed telemetry (a share outside
    [0, 1], NaN, an empty instance id) raises ValueError naming the field; the policy's state is
    left unchanged by a rejected message.
    """

    def __init__(self, config: VerticalConfig | None = None) -> None:
        self.config = config or VerticalConfig()
        self._gpus: dict[int, _Gpu] = {}
        self.duplicate_rows = 0  # telemetry rows ignored: their instance was already listed in the window
        self.omitted_rows = 0  # known instances missing from a window (kept at their grant)

    # ------------------------------------------------------------------ inputs

    def on_telemetry(self, gpu: int, now_ms: float, instances: Sequence[InstanceTelemetry]) -> list[Grant]:
        """One GPU's telemetry window, meant to list every instance on that GPU. Returns the grants
        to send.

        The window is not trusted to be whole: a known instance it omits keeps its last grant
        (counted in Σ, never raised; ``omitted_rows`` += 1) and is forgotten only once it has been
        missing for ``forget_after_ms``. A second row for the same instance id is ignored (the
        first one counts; ``duplicate_rows`` += 1). Raises ValueError for a malformed row (the
        state is left unchanged).
        """
        parsed: dict[str, InstanceTelemetry] = {}
        duplicates = 0
        for t in instances:
            self._validate(t)
            if t.instance_id in parsed:
                duplicates += 1
            else:
                parsed[t.instance_id] = t
        self.duplicate_rows += duplicates
        g = self._gpus.setdefault(gpu, _Gpu())
        g.samples += 1
        self._recover(g, now_ms)
        for t in parsed.values():
            inst = g.instances.get(t.instance_id)
            if inst is None:
                inst = g.instances[t.instance_id] = _Instance(
                    t.instance_id, t.function, t.priority, 0.0, 0.0, 1.0,
                    granted=t.quota if t.quota > 0 else t.request_quota)
            inst.absent_since_ms = None
            self._update(inst, t, now_ms)
        for iid in set(g.instances) - set(parsed):
            inst = g.instances[iid]
            if inst.absent_since_ms is None:
                inst.absent_since_ms = now_ms
            if now_ms - inst.absent_since_ms >= self.config.forget_after_ms:
                del g.instances[iid]  # missing long enough: retired
            else:
                self.omitted_rows += 1
        return self._rebalance(g, now_ms)

    def on_stretch(self, gpu: int, now_ms: float, instance_id: str, ratio: float) -> list[Grant]:
        """A kernel-cycle stretch of ``instance_id`` (cycle ``ratio`` x its baseline).

        A stretch under ``stretch_ratio``, of an instance not (yet) seen in telemetry, or of a
        training or best-effort instance changes nothing (they are the ones that yield).
        Raises ValueError for a non-finite or negative ratio.
        """
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"stretch ratio must be a finite number >= 0, got {ratio!r}")
        g = self._gpus.get(gpu)
        inst = g.instances.get(instance_id) if g else None
        if inst is None or ratio < self.config.stretch_ratio or inst.priority != LATENCY_SENSITIVE:
            return []
        self._recover(g, now_ms)
        self._pressure(g, inst, now_ms, f"stretch x{ratio:.2f}")
        return self._rebalance(g, now_ms)

    def on_retired(self, gpu: int, now_ms: float, instance_id: str) -> list[Grant]:
        """``instance_id``'s process on ``gpu`` has ended (the node agent's InstanceRetired, sent
        once the process is gone): its grant leaves Σ now and its share goes to the others at
        once, instead of after ``forget_after_ms`` of absence from telemetry (rule 6 is for a
        window that omits an instance nobody said was gone). An unknown instance or GPU changes
        nothing and returns no grant; if telemetry lists the id again, it is taken up anew.
        """
        g = self._gpus.get(gpu)
        if g is None or g.instances.pop(instance_id, None) is None:
            return []
        self._recover(g, now_ms)
        return self._rebalance(g, now_ms)

    def windows_to_settle(self, gpu: int) -> int:
        """Telemetry windows after which further quiet windows (nothing busy, queued or
        starting) change no grant on ``gpu``. 0 here: a quiet window releases idle share within
        about ``1 / release_per_s`` seconds whatever came before (see QUIET_WINDOWS in
        ``loadgen/sim/run.py``, which pauses a quiet GPU's telemetry)."""
        return 0

    def quotas(self, gpu: int) -> dict[str, float]:
        """The quota in effect per instance on ``gpu``, as the policy believes it."""
        g = self._gpus.get(gpu)
        return {i: inst.granted for i, inst in g.instances.items()} if g else {}

    # ------------------------------------------------------------------ state updates

    def _validate(self, t: InstanceTelemetry) -> InstanceTelemetry:
        if not t.instance_id:
            raise ValueError("instance telemetry without an instance_id")
        for name in ("quota", "request_quota", "limit_quota", "busy_share", "sm_time_share"):
            _check_share(name, getattr(t, name), t.instance_id)
        if not (math.isfinite(t.width) and 0.0 < t.width <= 1.0):
            raise ValueError(f"instance {t.instance_id!r}: width must be in (0, 1], got {t.width!r}")
        if t.wait_us < 0 or t.queue_depth < 0 or not math.isfinite(t.latency_ms_recent):
            raise ValueError(f"instance {t.instance_id!r}: negative wait/queue or non-finite latency")
        return t

    def _update(self, inst: _Instance, t: InstanceTelemetry, now_ms: float) -> None:
        cfg = self.config
        inst.function, inst.priority, inst.width = t.function, t.priority, t.width
        inst.request = t.request_quota
        inst.limit = max(t.limit_quota, t.request_quota, cfg.min_quota)
        # Telemetry reports the quota in effect; trust it unless our newer grant is still in flight.
        if t.quota > 0 and now_ms - inst.sent_ms > cfg.settle_ms:
            inst.granted = t.quota
        inst.used = t.sm_time_share
        inst.hungry = t.wait_us > 0 or t.queue_depth > 0 or inst.used >= cfg.hungry_util * inst.granted
        if inst.priority == LATENCY_SENSITIVE and t.slo_ms > 0 and t.latency_ms_recent > cfg.slo_pressure * t.slo_ms:
            self._pressure_of(inst, now_ms, f"slo {t.latency_ms_recent:.1f}/{t.slo_ms:.1f} ms")
        inst.ceiling = min(max(inst.ceiling, inst.floor(cfg)), inst.limit)

    def _pressure_of(self, inst: _Instance, now_ms: float, cause: str) -> None:
        inst.pressure_until_ms = now_ms + self.config.pressure_hold_ms
        inst.pressure_cause = cause

    def _pressure(self, g: _Gpu, inst: _Instance, now_ms: float, cause: str) -> None:
        self._pressure_of(inst, now_ms, cause)
        self._cut_victims(g, now_ms)

    def _cut_victims(self, g: _Gpu, now_ms: float) -> None:
        """Multiplicative decrease of the yielding instances' ceilings (once per interval)."""
        cfg = self.config
        if now_ms - g.last_decrease_ms < cfg.decrease_interval_ms:
            return
        g.last_decrease_ms = now_ms
        for v in g.instances.values():
            if yields_share(v.priority):
                v.ceiling = max(v.floor(cfg), min(v.ceiling, v.granted) * cfg.decrease_factor)

    def _recover(self, g: _Gpu, now_ms: float) -> None:
        """Additive increase of the yielding instances' ceilings since the last update."""
        # Recovery counts only time without pressure on the GPU: congestion still going on is no
        # reason to give the victims their share back.
        pressured_until = max((i.pressure_until_ms for i in g.instances.values()), default=-math.inf)
        start = max(g.last_ms, pressured_until) if g.last_ms is not None else now_ms
        if now_ms > start:
            step = self.config.recovery_per_s * (now_ms - start) / 1000.0
            for v in g.instances.values():
                if yields_share(v.priority):
                    v.ceiling = min(v.limit, v.ceiling + step)
        g.dt_ms = max(0.0, now_ms - g.last_ms) if g.last_ms is not None else 0.0
        g.last_ms = now_ms if g.last_ms is None else max(g.last_ms, now_ms)

    # ------------------------------------------------------------------ allocation

    def _want(self, inst: _Instance, now_ms: float, dt_ms: float) -> float:
        cfg = self.config
        floor = inst.floor(cfg)
        tier = inst.tier(now_ms)
        if tier == "absent":  # holds its last grant; we know nothing newer about its demand
            return min(max(inst.granted, floor), inst.limit)
        if tier == "pressured":
            return inst.limit
        cap = inst.limit if inst.priority == LATENCY_SENSITIVE else min(inst.limit, inst.ceiling)
        if inst.hungry:
            want = cap
        else:  # shrink toward use, but at most release_per_s: bursty demand does not flap
            want = max(inst.used * (1.0 + cfg.idle_margin), inst.granted - cfg.release_per_s * dt_ms / 1000.0)
        return min(max(want, floor), max(cap, floor))

    def allocate(self, gpu: int, now_ms: float) -> dict[str, float]:
        """The target quota of every instance on ``gpu`` now (before hysteresis). Σ ≤ 1 in every
        mode but ``static-limit``."""
        g = self._gpus.get(gpu)
        return self._allocate(g, now_ms) if g else {}

    def _allocate(self, g: _Gpu, now_ms: float) -> dict[str, float]:
        cfg, insts = self.config, list(g.instances.values())
        if cfg.mode == "static":
            return _fit({i.instance_id: max(cfg.min_quota, i.request) for i in insts})
        if cfg.mode == "static-limit":
            return {i.instance_id: i.limit for i in insts}
        alloc = _fit_floors({i.instance_id: i.floor(cfg) for i in insts},
                            {i.instance_id for i in insts if i.priority == BEST_EFFORT}, cfg.min_quota)
        remaining = max(0.0, 1.0 - sum(alloc.values()))
        want = {i.instance_id: self._want(i, now_ms, g.dt_ms) for i in insts}
        be_request = {i.instance_id: min(want[i.instance_id], max(i.floor(cfg), i.request)) for i in insts}
        for tier, cap in _ORDER:
            members = [i.instance_id for i in insts if i.tier(now_ms) == tier]
            wants = be_request if cap == "request" else want
            extra = {m: max(0.0, wants[m] - alloc[m]) for m in members}
            total = sum(extra.values())
            if total <= _EPS or remaining <= _EPS:
                continue
            share = min(1.0, remaining / total)  # proportional to unmet want within a tier
            for m, e in extra.items():
                alloc[m] += e * share
            remaining = max(0.0, remaining - total * share)
        if cfg.park_idle and remaining > _EPS:
            self._park(insts, alloc, remaining)
        return alloc

    @staticmethod
    def _park(insts: list[_Instance], alloc: dict[str, float], remaining: float) -> None:
        """Share nobody asked for goes to the latency-sensitive instances up to their limits,
        in proportion to their room. An instance runs at MPS width = its limit and is paced by
        tokens to its grant; a request arriving at an idle instance held at its request would run
        wide-but-paced, slower than the profile (measured at width = request) promised, for the
        telemetry period it takes the policy to react. Parked share is recomputed from what is
        left after every tier each time, so a hungry neighbour takes it back at the next grant."""
        room = {i.instance_id: max(0.0, i.limit - alloc[i.instance_id])
                for i in insts if i.priority == LATENCY_SENSITIVE}
        total = sum(room.values())
        if total > _EPS:
            share = min(1.0, remaining / total)
            for m, r in room.items():
                alloc[m] += r * share

    def _rebalance(self, g: _Gpu, now_ms: float) -> list[Grant]:
        if self.config.mode == "off" or not g.instances:
            return []
        target = self._allocate(g, now_ms)
        changes = self._select(g, target)
        grants = []
        for iid in sorted(changes, key=lambda i: (target[i] - g.instances[i].granted, i)):
            inst = g.instances[iid]
            grants.append(Grant(iid, target[iid], self._reason(g, inst, target[iid], now_ms)))
            inst.granted, inst.sent_ms = target[iid], now_ms
        return grants

    def _select(self, g: _Gpu, target: dict[str, float]) -> set[str]:
        """Changes worth sending: beyond hysteresis, restoring a bound, or needed for Σ ≤ 1."""
        cfg = self.config
        changes = set()
        for iid, inst in g.instances.items():
            cur, new = inst.granted, target[iid]
            out_of_bounds = cur < inst.floor(cfg) - _EPS or cur > inst.limit + _EPS
            if abs(new - cur) >= cfg.hysteresis - _EPS or (out_of_bounds and abs(new - cur) > _EPS):
                changes.add(iid)
        if cfg.mode == "static-limit":
            return changes
        effective = {i: (target[i] if i in changes else inst.granted) for i, inst in g.instances.items()}
        withheld = sorted((i for i in g.instances if i not in changes and target[i] < effective[i]),
                          key=lambda i: target[i] - effective[i])
        while sum(effective.values()) > 1.0 + _EPS and withheld:
            i = withheld.pop(0)  # largest withheld decrease first
            changes.add(i)
            effective[i] = target[i]
        return changes

    def _reason(self, g: _Gpu, inst: _Instance, new: float, now_ms: float) -> str:
        mode = self.config.mode
        if mode not in ("dilu", "published"):
            return mode
        up = new > inst.granted
        if inst.tier(now_ms) == "pressured" and up:
            return f"pressure: {inst.pressure_cause}"
        if up:
            return "demand" if inst.hungry else "floor"
        if any(i.tier(now_ms) == "pressured" for i in g.instances.values()):
            return "yield to pressure"
        return "release idle share"


class PublishedVertical(VerticalPolicy):
    """Dilu's vertical scaling as its paper describes it (Lv et al., "Dilu: Enabling GPU
    Resourcing-on-Demand for Serverless DL Serving via Introspective Elasticity", ASPLOS 2025):
    the ``dilu-published`` baseline beside :class:`VerticalPolicy`, whose rules 3 and 5 it
    replaces; floors, Σ ≤ 1, limits, an incomplete window, retirement and hysteresis (rules 1, 2,
    6 and 7) are the same. Windows are counted in telemetry samples (the node agent's 250 ms
    windows), not in time:

    - **Inference** runs at its request quota. A kernel-cycle stretch raises it to its limit at
      once; it returns to its request when a fixed window of ``inference_samples`` (20) samples
      has passed without another stretch. Stretch is the only signal (no SLO-latency pressure),
      and share nobody uses is not lent (no work conservation): an instance with a queue but no
      stretch stays at its request.
    - **Training** (and best-effort) follow AIMD: a stretch of a latency-sensitive neighbour
      halves their ceiling (``decrease_factor``, at most once per ``decrease_interval_ms``, never
      below their floor); every ``training_samples`` (40) samples without a stretch on the GPU
      add ``increase_step`` (0.1 quota) up to their limit. They run at their ceiling.

    Raises ValueError for windows < 1 or a step outside (0, 1].
    """

    def __init__(self, config: VerticalConfig | None = None, *, inference_samples: int = 20,
                 training_samples: int = 40, increase_step: float = 0.1) -> None:
        if inference_samples < 1 or training_samples < 1 or not 0.0 < increase_step <= 1.0:
            raise ValueError("need windows of at least 1 sample and an increase step in (0, 1]")
        super().__init__(config or VerticalConfig(mode="published"))
        self.inference_samples, self.training_samples = inference_samples, training_samples
        self.increase_step = increase_step

    def _pressure_of(self, inst: _Instance, now_ms: float, cause: str) -> None:
        """SLO latency is no signal here: only a kernel-cycle stretch (:meth:`_pressure`)."""

    def _pressure(self, g: _Gpu, inst: _Instance, now_ms: float, cause: str) -> None:
        inst.pressure_until_ms, inst.pressure_cause = math.inf, cause  # until its window ends
        inst.stretched_at = g.quiet_since = g.samples
        self._cut_victims(g, now_ms)

    def _recover(self, g: _Gpu, now_ms: float) -> None:
        """End the windows that have run out: inference back to its request, one additive step
        for training per full window of quiet samples."""
        for inst in g.instances.values():
            if inst.stretched_at is not None and g.samples - inst.stretched_at >= self.inference_samples:
                inst.stretched_at, inst.pressure_until_ms = None, -math.inf
        if g.samples - max(g.quiet_since, g.increased_at) >= self.training_samples:
            g.increased_at = g.samples
            for v in g.instances.values():
                if yields_share(v.priority):
                    v.ceiling = min(v.limit, v.ceiling + self.increase_step)

    def windows_to_settle(self, gpu: int) -> int:
        """Windows until the last raised inference instance returns to its request or, while a
        training instance's ceiling is under its limit, until its next additive step."""
        g = self._gpus.get(gpu)
        if g is None:
            return 0
        left = [self.inference_samples - (g.samples - i.stretched_at)
                for i in g.instances.values() if i.stretched_at is not None]
        if any(yields_share(i.priority) and i.ceiling < i.limit - _EPS for i in g.instances.values()):
            left.append(self.training_samples - (g.samples - max(g.quiet_since, g.increased_at)))
        return max(0, max(left, default=0))

    def _want(self, inst: _Instance, now_ms: float, dt_ms: float) -> float:
        floor = inst.floor(self.config)
        tier = inst.tier(now_ms)
        if tier == "absent":
            return min(max(inst.granted, floor), inst.limit)
        if tier == "pressured":
            return inst.limit
        if inst.priority == LATENCY_SENSITIVE:
            return floor
        return min(max(inst.ceiling, floor), max(inst.limit, floor))


def vertical_policy(config: VerticalConfig | None = None) -> VerticalPolicy:
    """The policy object ``config.mode`` names: :class:`PublishedVertical` for ``published``,
    else :class:`VerticalPolicy` in that mode (the service and ``dilu sim`` build it here)."""
    config = config or VerticalConfig()
    return PublishedVertical(config) if config.mode == "published" else VerticalPolicy(config)


def _fit_floors(floors: dict[str, float], best_effort: set[str], min_quota: float) -> dict[str, float]:
    """Floors that sum to at most 1: best-effort floors shrink first (to ``min_quota``), then all
    scale proportionally (only when the requests on a GPU were over-committed, which the scheduler
    forbids)."""
    excess = sum(floors.values()) - 1.0
    if excess > _EPS and best_effort:
        room = {i: floors[i] - min_quota for i in best_effort if floors[i] > min_quota}
        total = sum(room.values())
        if total > _EPS:
            take = min(1.0, excess / total)
            floors = {i: v - room.get(i, 0.0) * take for i, v in floors.items()}
    return _fit(floors)


def _fit(alloc: dict[str, float]) -> dict[str, float]:
    """Scale ``alloc`` down proportionally when it sums over 1 (only possible when the requests on a
    GPU were over-committed, which the scheduler forbids)."""
    total = sum(alloc.values())
    if total <= 1.0 + _EPS:
        return alloc
    return {k: v / total for k, v in alloc.items()}
